"""Running a retrofitted model through its fixed cache: teacher-forced logits, for evaluation and the invariant."""
from __future__ import annotations

import torch

from kvpop.cache import KVpopCache


@torch.no_grad()
def teacher_forced_logits(model, input_ids: torch.Tensor, *, prefill: int = 0, chunk: int = 1,
                          attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, S, V]`` of feeding ``input_ids`` through a fresh :class:`KVpopCache`.

    The first ``prefill`` tokens go in one call, the rest ``chunk`` tokens per call (``chunk=1``: decoding).
    For a static policy this must equal one masked forward (METHOD §5); dynamic policies (TOVA, H2O) only run here.
    """
    cache = KVpopCache(model)
    size = input_ids.shape[1]
    bounds = ([0, prefill] if prefill > 0 else [0]) + list(range(max(prefill, 0) + chunk, size, chunk)) + [size]
    bounds = sorted(set(b for b in bounds if 0 <= b <= size))
    logits = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        mask = None if attention_mask is None else attention_mask[:, :end]
        out = model(input_ids=input_ids[:, start:end], attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)
