"""Future-attention targets (METHOD §2): what the teacher says each token is worth keeping.

For KV head ``g`` and window ``w``, token ``t`` gets ``y[g, t] = log max_{h in g} mean_{d >= t + w} P[h, d, t]``,
where ``P`` is the teacher's causal attention. We never form the S×S map: one *transposed* attention call per
layer, in which the keys play the queries and the teacher's queries play the keys, with a score modification that
subtracts each query's forward LSE. That call's own row log-sum-exp is ``log Σ_{d >= t+w} P[h, d, t]``.

``query_power`` β >= 1 replaces the mean over the deciding queries by the power mean
``(mean_d P[h, d, t]^β)^(1/β)``: the score modification becomes ``β (a - LSE)`` and the row LSE, less ``log N[t]``,
is divided by β, at the same cost. β = 1 is the mean (bit for bit: ×1 and /1 are exact); β → ∞ tends to the max
over the deciding queries, which keeps a token that only a few future queries need (a needle).

Backends: ``"flex"`` (FlexAttention; compiled on CUDA, eager on CPU where compiled flex cannot return the LSE),
``"chunked"`` (blocks of rows in plain torch: O(block × S) memory, the CPU default), and
:func:`future_attention_targets_dense`, an fp64 brute force for tests.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

from kvpop.attention import check_layer_kwargs, flex, local_attention
from kvpop.local_layers import layer_windows

GROUP_REDUCTIONS = ("max", "mean", "sum")


def check_query_power(power) -> float:
    """β of the power mean over the deciding queries (METHOD §2): a finite number >= 1 (1: the mean)."""
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not math.isfinite(power) or power < 1:
        raise ValueError(f"query_power must be a finite number >= 1 (1: the mean over the deciding queries, larger: "
                         f"closer to their max), got {power!r}")
    return float(power)


def _check(q: torch.Tensor, k: torch.Tensor, window: int) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q must be [B, Hq, S, D] and k [B, Hkv, S, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    b, hq, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, length or head dim")
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot be grouped over {hkv} KV heads")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    return b, hq, hkv, s, d


def _flex_with_lse(q, k, v, score_mod, block_mask, scale):
    """The row LSE of one FlexAttention call (the guarded compiled kernel on CUDA, eager on CPU)."""
    _, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    return aux.lse


@functools.lru_cache(maxsize=32)
def _future_block_mask(size: int, window: int, device: str):
    """Block structure of the transposed pass: row ``t`` sees columns ``d >= t + window``; one per shape."""
    def mask_mod(b, h, t, d):
        return d >= t + window
    return create_block_mask(mask_mod, None, None, size, size, device=device, _compile=device.startswith("cuda"))


@functools.lru_cache(maxsize=32)
def _causal_block_mask(size: int, device: str):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return create_block_mask(mask_mod, None, None, size, size, device=device, _compile=device.startswith("cuda"))


def _rows_per_chunk(size: int, heads: int, batch: int, budget_bytes: int = 1 << 27) -> int:
    return max(1, min(size, budget_bytes // max(1, 4 * size * heads * batch)))


def causal_lse(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """``LSE[b, h, d] = logsumexp_{t <= d} q[h, d]·k[g, t] * scale`` (float32), GQA by ``repeat_kv`` grouping."""
    b, hq, hkv, size, dim = _check(q, k, 1)
    scale = dim ** -0.5 if scale is None else scale
    backend = _resolve(backend, q)
    if backend == "flex":
        block_mask = _causal_block_mask(size, str(q.device))
        v = torch.zeros_like(q)
        return _flex_lse_gqa(q, k, v, None, block_mask, scale, hq // hkv).float()
    keys = k.float().repeat_interleave(hq // hkv, dim=1)
    out = torch.empty(b, hq, size, dtype=torch.float32, device=q.device)
    step = _rows_per_chunk(size, hq, b)
    pos = torch.arange(size, device=q.device)
    for start in range(0, size, step):
        rows = slice(start, min(size, start + step))
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), keys) * scale
        scores = scores.masked_fill(pos[None, :] > pos[rows, None], float("-inf"))
        out[:, :, rows] = scores.logsumexp(-1)
    return out


def _flex_lse_gqa(q, k, v, score_mod, block_mask, scale, group):
    """FlexAttention row LSE with ``k`` expanded to the query-head count (GQA by ``repeat_kv`` grouping)."""
    keys = k.repeat_interleave(group, dim=1) if group > 1 else k
    return _flex_with_lse(q, keys, v, score_mod, block_mask, scale)


def _resolve(backend: str, x: torch.Tensor) -> str:
    if backend == "auto":
        return "flex" if x.is_cuda else "chunked"
    if backend not in ("flex", "chunked"):
        raise ValueError(f"backend must be 'auto', 'flex' or 'chunked', got {backend!r}")
    return backend


def future_attention_targets(
    q: torch.Tensor,
    k: torch.Tensor,
    window: int,
    *,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    group_reduce: str = "max",
    query_power: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Targets ``y[B, Hkv, S]`` (float32; ``-inf`` where no query ``d >= t + window`` exists).

    ``q [B, Hq, S, D]`` and ``k [B, Hkv, S, D]`` exactly as attention sees them (after RoPE and norms); query head
    ``h`` reads KV head ``h // (Hq // Hkv)``. ``lse [B, Hq, S]`` is the forward pass's natural-log LSE (computed
    by a causal pass when omitted). ``group_reduce`` combines the mean attention of the group's query heads:
    ``max`` (METHOD default), ``mean`` or ``sum``. ``query_power`` β: each head's power mean
    ``(mean_d P^β)^(1/β)`` over the deciding queries instead of their mean (β = 1, the METHOD default).
    """
    b, hq, hkv, size, dim = _check(q, k, window)
    if group_reduce not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {group_reduce!r}")
    power = check_query_power(query_power)
    scale = dim ** -0.5 if scale is None else scale
    if lse is None:
        lse = causal_lse(q, k, scale=scale, backend=backend)
    if lse.shape != (b, hq, size):
        raise ValueError(f"lse must be [B, Hq, S] = {(b, hq, size)}, got {tuple(lse.shape)}")
    lse = lse.float()
    group = hq // hkv
    backend = _resolve(backend, q)
    if backend == "flex":
        # transposed: rows are the keys (expanded to the query heads), columns the teacher's queries
        keys_as_queries = k.repeat_interleave(group, dim=1) if group > 1 else k

        def subtract_forward_lse(score, bi, hi, t, d):  # flex has applied ``scale`` to q·k already
            return (score - lse[bi, hi, d]) * power

        block_mask = _future_block_mask(size, window, str(q.device))
        log_mass = None
        if q.is_cuda:  # only the LSE is wanted: a narrow dummy value makes the P·V half of the kernel ~free
            try:
                log_mass = _flex_with_lse(keys_as_queries, q, q.new_zeros(b, hq, size, 16), subtract_forward_lse,
                                          block_mask, scale).float()
            except Exception:  # a FlexAttention build without separate value head dims
                log_mass = None
        if log_mass is None:
            log_mass = _flex_with_lse(keys_as_queries, q, torch.zeros_like(q), subtract_forward_lse, block_mask,
                                      scale).float()
    else:
        log_mass = _future_log_mass_chunked(q, k, window, lse, scale, group, power)
    pos = torch.arange(size, device=q.device)
    count = size - (pos + window)  # N[t]: queries that decide the token's retention
    has_target = count > 0
    log_mean = (log_mass - torch.log(count.clamp(min=1).float())) / power
    log_mean = log_mean.view(b, hkv, group, size)
    if group_reduce == "max":
        y = log_mean.amax(2)
    else:
        y = log_mean.logsumexp(2) - (math.log(group) if group_reduce == "mean" else 0.0)
    return torch.where(has_target, y, torch.full_like(y, float("-inf")))


def _future_log_mass_chunked(q, k, window, lse, scale, group, power=1.0):
    """``log Σ_{d >= t + window} exp(power · (a[h, d, t] - LSE[h, d]))`` in row blocks of the transposed problem."""
    b, hq, size, _ = q.shape
    keys = k.float().repeat_interleave(group, dim=1)
    queries = q.float()
    out = torch.empty(b, hq, size, dtype=torch.float32, device=q.device)
    step = _rows_per_chunk(size, hq, b)
    pos = torch.arange(size, device=q.device)
    for start in range(0, size, step):
        rows = slice(start, min(size, start + step))
        scores = (torch.einsum("bhtd,bhqd->bhtq", keys[:, :, rows], queries) * scale - lse[:, :, None, :]) * power
        scores = scores.masked_fill(pos[None, :] < pos[rows, None] + window, float("-inf"))
        out[:, :, rows] = scores.logsumexp(-1)
    return out


def future_attention_targets_dense(q, k, window, *, scale=None, group_reduce="max", query_power=1.0
                                   ) -> torch.Tensor:
    """Brute-force fp64 reference: materialises ``P`` (S×S). For tests and small S only."""
    b, hq, hkv, size, dim = _check(q, k, window)
    power = check_query_power(query_power)
    scale = dim ** -0.5 if scale is None else scale
    group = hq // hkv
    keys = k.double().repeat_interleave(group, dim=1)
    a = torch.einsum("bhqd,bhkd->bhqk", q.double(), keys) * scale
    pos = torch.arange(size, device=q.device)
    a = a.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    prob = a.softmax(-1)  # [b, h, d, t]
    decides = pos[:, None] >= pos[None, :] + window  # query d decides token t
    count = (size - pos - window).clamp(min=1).double()
    deciding = prob * decides
    top = deciding.amax(-2, keepdim=True).clamp(min=1e-300)  # the power mean of P / max: no underflow at large β
    mean = top.squeeze(-2) * ((deciding / top).pow(power).sum(-2) / count).pow(1 / power)  # [b, h, t]
    mean = mean.view(b, hkv, group, size)
    m = {"max": mean.amax(2), "mean": mean.mean(2), "sum": mean.sum(2)}[group_reduce]
    y = m.log()
    return torch.where(size - pos - window > 0, y, torch.full_like(y, float("-inf"))).float()


# -----------------------------------------------------------------------------
# the teacher pass: one dense forward that also yields every global layer's targets and the top-K next-token logits

TEACHER_ATTN = "kvpop_teacher"
KEEPABLE = frozenset({"queries", "keys", "values"})


def causal_attention_with_lse(q, k, v, *, scale: float, backend: str = "auto"):
    """Dense causal attention ``[B, Hq, S, D]`` and its LSE ``[B, Hq, S]`` in one pass (never an S×S map on CUDA)."""
    b, hq, hkv, size, dim = _check(q, k, 1)
    group = hq // hkv
    if _resolve(backend, q) == "flex":
        block_mask = _causal_block_mask(size, str(q.device))
        out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=group > 1,
                        return_aux=AuxRequest(lse=True))
        return out, aux.lse.float()
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, size, dtype=torch.float32, device=q.device)
    step = _rows_per_chunk(size, hq, b)
    pos = torch.arange(size, device=q.device)
    for start in range(0, size, step):
        rows = slice(start, min(size, start + step))
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), keys.float()) * scale
        scores = scores.masked_fill(pos[None, :] > pos[rows, None], float("-inf"))
        lse[:, :, rows] = scores.logsumexp(-1)
        out[:, :, rows] = torch.einsum("bhqk,bhkd->bhqd", (scores - lse[:, :, rows, None]).exp(),
                                       values.float()).to(q.dtype)
    return out, lse


class _TeacherRecorder:
    def __init__(self, windows, group_reduce, backend, keep=(), query_power=1.0, layer_windows=()):
        self.windows, self.group_reduce, self.backend = tuple(windows), group_reduce, backend
        self.layer_windows = tuple(layer_windows)  # the model's own windows: None = a global layer
        self.query_power = query_power
        self.targets: dict[int, dict[int, torch.Tensor]] = {w: {} for w in self.windows}
        self.kept: dict[str, dict[int, torch.Tensor]] = {name: {} for name in keep}


def _teacher_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    recorder = getattr(module, "_kvpop_teacher_recorder", None)
    if recorder is None:
        raise RuntimeError("the kvpop_teacher attention runs only inside kvpop.targets.teacher_pass")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("the teacher pass takes unpadded fixed-length sequences (pack them)")
    if query.shape[2] != key.shape[2]:
        raise ValueError("the teacher pass is one full forward: no cache")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    check_layer_kwargs(module.layer_idx, recorder.layer_windows, kwargs)
    own = recorder.layer_windows[module.layer_idx]
    if own is not None:  # a local layer: the model's own sliding window, and no targets (KVpop never evicts there)
        return local_attention(query, key, value, own, scale=scale, backend=_resolve(recorder.backend, query)), None
    out, lse = causal_attention_with_lse(query, key, value, scale=scale, backend=recorder.backend)
    for window in recorder.windows:
        recorder.targets[window][module.layer_idx] = future_attention_targets(
            query, key, window, lse=lse, scale=scale, group_reduce=recorder.group_reduce,
            query_power=recorder.query_power, backend=recorder.backend)
    for name, tensor in (("queries", query), ("keys", key), ("values", value)):
        if name in recorder.kept:  # as attention sees them (after RoPE and norms): a scorer's inputs
            recorder.kept[name][module.layer_idx] = tensor
    return out.transpose(1, 2).contiguous(), None


def _register_teacher() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from kvpop.attention import passthrough_mask

    AttentionInterface.register(TEACHER_ATTN, _teacher_attention_forward)
    AttentionMaskInterface.register(TEACHER_ATTN, passthrough_mask)


@torch.no_grad()
def teacher_pass(model, input_ids: torch.Tensor, windows, *, top_k: int = 256, group_reduce: str = "max",
                 query_power: float = 1.0, backend: str = "auto", logits_chunk: int = 1024,
                 keep: tuple[str, ...] = ()) -> dict:
    """Run a frozen dense model once and return what training needs from it (METHOD §2, §3).

    Returns ``{"targets": {window: [layers, B, Hkv, S] float32}, "topk_values": [B, S, K] float32,
    "topk_indices": [B, S, K] int64}``. Targets come from the transposed pass with the forward's own LSE; the
    logits are projected ``logits_chunk`` positions at a time, so no ``[S, vocab]`` tensor is held for long S.
    ``top_k=0`` skips the logits (scorer-only training needs none). ``keep`` names any of ``"queries"``,
    ``"keys"``, ``"values"`` to return too: per layer, the ``[B, H, S, D]`` tensors attention saw (keys and values
    are a scorer's inputs). ``group_reduce`` and ``query_power``: :func:`future_attention_targets`'s.

    A model with local (sliding-window) layers (:mod:`kvpop.local_layers`) runs them with their own window, and
    ``layers`` (of the targets and the kept tensors) are its global layers only, in order — the layers that evict.
    """
    windows = sorted({int(w) for w in windows})
    if not windows or windows[0] < 1:
        raise ValueError(f"windows must be integers >= 1, got {windows}")
    if set(keep) - KEEPABLE:
        raise ValueError(f"keep may name {sorted(KEEPABLE)}, got {list(keep)}")
    query_power = check_query_power(query_power)  # before the forward: not from inside the first layer
    _register_teacher()
    attn_modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
                    and hasattr(m, "k_proj")]
    own_windows = layer_windows(model.config)
    recorder = _TeacherRecorder(windows, group_reduce, backend, keep, query_power, own_windows)
    previous = model.config._attn_implementation
    for module in attn_modules:
        module._kvpop_teacher_recorder = recorder
    model.config._attn_implementation = TEACHER_ATTN
    try:
        base = getattr(model, model.base_model_prefix)
        hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
    finally:
        model.config._attn_implementation = previous
        for module in attn_modules:
            del module._kvpop_teacher_recorder
    layers = [i for i, own in enumerate(own_windows) if own is None]  # kvpop.local_layers.evicting_layers
    out = {"targets": {w: torch.stack([recorder.targets[w][i] for i in layers]) for w in windows}}
    for name, per_layer in recorder.kept.items():
        out[name] = [per_layer[i] for i in layers]
    if top_k > 0:
        head = model.get_output_embeddings()
        cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)  # Gemma 2: as its forward does
        values, indices = [], []
        for start in range(0, hidden.shape[1], logits_chunk):
            logits = head(hidden[:, start:start + logits_chunk]).float()
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            top = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
            values.append(top.values)
            indices.append(top.indices)
        out["topk_values"], out["topk_indices"] = torch.cat(values, 1), torch.cat(indices, 1)
    return out
