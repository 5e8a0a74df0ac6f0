"""Running a retrofitted model through its fixed cache: teacher-forced logits, for evaluation and the invariant."""
from __future__ import annotations

import torch

from kvpop.cache import CACHE_KWARG, KVpopCache


@torch.no_grad()
def teacher_forced_logits(model, input_ids: torch.Tensor, *, prefill: int = 0, chunk: int = 1,
                          attention_mask: torch.Tensor | None = None, graphed: bool = False) -> torch.Tensor:
    """Logits ``[B, S, V]`` of feeding ``input_ids`` through a fresh :class:`KVpopCache`.

    The first ``prefill`` tokens go in one call, the rest ``chunk`` tokens per call (``chunk=1``: decoding).
    For a static policy this must equal one masked forward (METHOD §5); dynamic policies (TOVA, H2O) only run here.
    ``graphed`` (CUDA, ``chunk=1``, no padding): the decoding steps replay one captured CUDA graph
    (:class:`GraphedDecoder`) instead of launching every layer's kernels from Python — what makes a dynamic
    policy's token-by-token pass over thousands of tokens affordable.
    """
    if graphed:
        return _graphed_logits(model, input_ids, max(prefill, 1), chunk, attention_mask)
    cache = KVpopCache(model)
    size = input_ids.shape[1]
    bounds = ([0, prefill] if prefill > 0 else [0]) + list(range(max(prefill, 0) + chunk, size, chunk)) + [size]
    bounds = sorted(set(b for b in bounds if 0 <= b <= size))
    logits = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        mask = None if attention_mask is None else attention_mask[:, :end]
        out = model(input_ids=input_ids[:, start:end], attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _graphed_logits(model, input_ids, prefill, chunk, attention_mask):
    if not input_ids.is_cuda or chunk != 1 or attention_mask is not None:
        raise ValueError("graphed teacher forcing needs CUDA inputs, chunk=1 and no padding mask")
    cache = KVpopCache(model)
    size = input_ids.shape[1]
    prefill = min(prefill, size)
    logits = [model(input_ids=input_ids[:, :prefill], use_cache=True, **{CACHE_KWARG: cache}).logits]
    if prefill < size:
        decoder = GraphedDecoder(model, cache)
        rows = torch.arange(len(input_ids), device=input_ids.device)[:, None]
        for pos in range(prefill, size):
            logits.append(decoder(input_ids[:, pos:pos + 1], torch.full_like(rows, pos)))
    return torch.cat(logits, dim=1)


def capture_graph(step, *, warmup: int = 2, restore=None):
    """``(graph, output)``: ``step()`` warmed up on a side stream (as capture requires), ``restore()`` to undo what
    the warm-up changed, then captured once; ``graph.replay()`` reruns it on the same memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if restore is not None:
        restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


class GraphedDecoder:
    """One decoding step of a retrofitted model, captured once and replayed as a CUDA graph.

    The fixed cache has static shapes and updates its buffers in place, so the whole step — every layer's eviction,
    scorer step and attention — replays without a Python launch per kernel. Each call is exactly one step: the
    warm-up that capture needs runs on a snapshot of the cache, which is then restored.
    """

    def __init__(self, model, cache: KVpopCache, *, warmup: int = 2):
        self.model, self.cache, self.warmup = model, cache, warmup
        self.graph = None

    def _tensors(self):
        for layer in self.cache.layers:
            for name in layer._batch_tensors():
                if getattr(layer, name, None) is not None:
                    yield getattr(layer, name)
            yield from (layer.scorer_state or {}).values()

    def _forward(self):
        return self.model(input_ids=self.ids, position_ids=self.pos, use_cache=True, **{CACHE_KWARG: self.cache}).logits

    def _capture(self):
        snapshot = [t.clone() for t in self._tensors()]
        columns = [layer.columns for layer in self.cache.layers]

        def restore():
            for tensor, saved in zip(self._tensors(), snapshot):
                tensor.copy_(saved)

        self.graph, self.logits = capture_graph(self._forward, warmup=self.warmup, restore=restore)
        for layer, count in zip(self.cache.layers, columns):
            layer.columns = count

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids`` ``[B, 1]`` → logits ``[B, 1, V]`` (a fresh tensor)."""
        if self.graph is None:
            self.ids, self.pos = input_ids.clone(), position_ids.clone()
            self._capture()
        self.ids.copy_(input_ids)
        self.pos.copy_(position_ids)
        self.graph.replay()
        for layer in self.cache.layers:
            layer.columns += 1
        return self.logits.clone()
