"""Running a retrofitted model through its fixed cache: bounded prefill, teacher-forced logits, graphed decoding."""
from __future__ import annotations

import torch

from kvpop.cache import CACHE_KWARG, KVpopCache, KVpopLayer


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each column's position under left padding: real tokens count from 0 (``cumsum(mask) - 1``, as ``generate``
    computes them), padding gets 0 (it is never attended to)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _forward(model, cache, input_ids, start: int, end: int, attention_mask=None, position_ids=None, **kwargs):
    """One call with columns ``start:end`` (the mask covers every column so far, as transformers expects).

    With a mask and no positions, positions count real tokens (:func:`padded_positions`): transformers would
    count columns, which shifts a padded row's RoPE by its padding. Attention is blind to that shift, but a
    scorer reads the rotated keys, so its priorities — and the retained set — would differ from the row alone's."""
    if position_ids is None and attention_mask is not None:
        position_ids = padded_positions(attention_mask[:, :end])
    return model(input_ids=input_ids[:, start:end], use_cache=True,
                 attention_mask=None if attention_mask is None else attention_mask[:, :end],
                 position_ids=None if position_ids is None else position_ids[:, start:end],
                 **{CACHE_KWARG: cache}, **kwargs)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, *, cache: KVpopCache | None = None, chunk: int | None = None,
            attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            graphed: bool | ChunkGraph = False) -> KVpopCache:
    """Bounded prefill (METHOD §5): the columns of ``input_ids`` the cache has not seen, at most ``chunk`` per call
    (default ``Runtime.prefill_chunk``), each compressed back into the ``B`` slots before the next; returns the
    cache. The cache's key/value memory peaks at every layer's ``B`` slots plus one layer's ``B + chunk``
    candidates (``cache.peak_kv_bytes``), whatever the prompt's length; for a static policy the result is the
    one-pass mask's for any chunk size, for a dynamic one see the chunk rule in :mod:`kvpop.cache`.

    Chunks are counted back from the last column (the first call takes the remainder), so that a left-padded row
    is cut where it would be cut alone. ``attention_mask`` / ``position_ids`` cover all of ``input_ids``' columns
    (left padding only); positions default to :func:`padded_positions` of the mask.

    ``graphed``: where the chunks can replay (:func:`graphable`: CUDA, no padding mask, every layer a static
    policy's fixed slots), the full chunks after the first replay one CUDA graph of the model's forward over a
    chunk (:class:`GraphedDecoder` at the chunk's width: its fused path never waits on the host, and every chunk
    has the same shapes) instead of launching each layer's kernels from Python; elsewhere the chunks run as
    without it. The graph is captured for this prefill (one warm-up chunk, restored, and the capture itself) — or,
    with a :class:`ChunkGraph` as ``graphed``, kept there and replayed by later prefills of the same shapes.
    """
    cache = cache if cache is not None else KVpopCache(model)
    chunk = chunk if chunk is not None else model.kvpop_runtime.prefill_chunk
    keep = {"logits_to_keep": 1} if getattr(model, "_supports_logits_to_keep", lambda: False)() else {}
    bounds = chunk_bounds(cache.get_seq_length(), input_ids.shape[1], chunk)
    cache.prefill_chunk = chunk  # the size at which its chunks take the fused path (kvpop.cache)
    spans = list(zip(bounds[:-1], bounds[1:]))
    replay = bool(graphed) and len(spans) > 2 and graphable(cache, input_ids, attention_mask)
    kept = graphed if isinstance(graphed, ChunkGraph) and replay else None
    for index, (start, end) in enumerate(spans):
        if not replay or index == 0:  # the first chunk (the remainder) also fills the cache's buffers
            _forward(model, cache, input_ids, start, end, attention_mask, position_ids, **keep)
            continue
        if index == 1:
            step = (kept.bind(model, cache, end - start, keep) if kept is not None
                    else GraphedDecoder(model, cache, warmup=1, **keep))
        positions = (torch.arange(start, end, device=input_ids.device).expand(len(input_ids), -1)
                     if position_ids is None else position_ids[:, start:end])
        step(input_ids[:, start:end], positions)
    if kept is not None:
        kept.unbind(cache)
    return cache


class ChunkGraph:
    """A prefill chunk's CUDA graph kept across prompts (:func:`prefill` ``graphed=ChunkGraph()``): the first
    prefill captures it, later ones of the same rows, chunk, policy and weights replay it without capturing again
    (what a server does once at start-up instead of once per prompt).

    A captured graph reads and writes fixed memory, so it replays on buffers of its own: a copy of the caller's
    cache made at capture (:meth:`bind`), into which each later prefill's cache is copied after its first chunk
    and from which it is copied back at the end (:meth:`unbind`) — the caller's cache is always the one filled, and
    a cache returned by an earlier prefill is never touched. Anything else the forward reads is baked into the
    graph, so the key holds the model's parameters' storage, the policy, the oracle's targets and whether the
    bookkeeping is compiled: changing any of them (``set_policy``, a new ``oracle_priorities`` block, reassigned
    weights) recaptures. Holds one cache's state and the graph's memory pool until :meth:`release` or garbage
    collection."""

    def __init__(self):
        self.key = self.cache = self.decoder = self.held = None

    def _key(self, model, cache, width: int, keep: dict) -> tuple:
        runtime = model.kvpop_runtime
        return (tuple(p.data_ptr() for p in model.parameters()), id(runtime.policy), id(runtime.oracle),
                runtime.compile_prefill, width, tuple(sorted(keep.items())),
                tuple((tuple(t.shape), t.dtype, t.device) for t in cache_tensors(cache)))

    def bind(self, model, cache: KVpopCache, width: int, keep: dict) -> GraphedDecoder:
        """The decoder that replays ``cache``'s next chunks of ``width`` columns, ``cache``'s state copied into its
        buffers (captured now if nothing matching is kept)."""
        key = self._key(model, cache, width, keep)
        if key == self.key:
            copy_cache_state(cache, self.cache)
        else:
            self.release()
            runtime = model.kvpop_runtime
            self.held = (runtime.policy, runtime.oracle)  # alive while keyed by their ids
            self.cache = cache.repeated(1)  # the graph's own buffers: a copy of the cache after its first chunk
            self.decoder, self.key = GraphedDecoder(model, self.cache, warmup=1, **keep), key
        return self.decoder

    def unbind(self, cache: KVpopCache) -> None:
        """Copy the replayed state back into ``cache`` (its counts of columns and its peak memory too)."""
        copy_cache_state(self.cache, cache)
        cache.meter.peak = max(cache.meter.peak, self.cache.meter.peak)

    def release(self) -> None:
        """Drop the graph and its buffers (their device memory returns to the caching allocator)."""
        self.key = self.cache = self.decoder = self.held = None


def cache_tensors(cache: KVpopCache):
    """Every tensor ``cache``'s layers hold, in a fixed order: slots, metadata, scorer state (per-head budgets: their
    parts' too)."""
    layers = list(cache.layers)
    while layers:
        layer = layers.pop(0)
        layers[:0] = [part for _, _, part in getattr(layer, "parts", ())]  # per-head budgets (headwise_cache)
        for name in layer._batch_tensors():
            if getattr(layer, name, None) is not None:
                yield getattr(layer, name)
        state = layer.scorer_state or {}
        yield from (state[name] for name in sorted(state))


def copy_cache_state(source: KVpopCache, target: KVpopCache) -> None:
    """``target`` takes ``source``'s state in place: every tensor (same shapes), the columns seen, the filled flags."""
    for want, have in zip(cache_tensors(source), cache_tensors(target), strict=True):
        have.copy_(want)
    for want, have in zip(source.layers, target.layers, strict=True):
        have.columns, have.full = want.columns, want.full


def graphable(cache: KVpopCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether :func:`prefill` can replay ``cache``'s chunks as one CUDA graph: CUDA inputs, no padding mask (its
    check waits on the host), every layer a static policy's fixed slots (a dynamic policy's chunk, per-head budgets
    and DMS run as they are)."""
    return (input_ids.is_cuda and attention_mask is None
            and all(type(layer) is KVpopLayer and not layer.policy.dynamic for layer in cache.layers))


def chunk_bounds(done: int, size: int, chunk: int) -> list[int]:
    """Where :func:`prefill` cuts columns ``done … size``: every ``chunk`` columns counted back from ``size``."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk must be an integer >= 1 (prompt columns per call), got {chunk!r}")
    return [done] + list(range(done + (size - done) % chunk or done + chunk, size + 1, chunk))


@torch.no_grad()
def teacher_forced_logits(model, input_ids: torch.Tensor, *, prefill: int = 0, chunk: int = 1,
                          attention_mask: torch.Tensor | None = None, graphed: bool = False) -> torch.Tensor:
    """Logits ``[B, S, V]`` of feeding ``input_ids`` through a fresh :class:`KVpopCache`.

    The first ``prefill`` tokens go in one call, the rest ``chunk`` tokens per call (``chunk=1``: decoding).
    ``attention_mask``: left padding; positions count real tokens, so every row gives its logits alone.
    For a static policy this must equal one masked forward (METHOD §5); dynamic policies (TOVA, H2O) only run here,
    token by token inside every call (``dynamic_chunks=False``), so their logits do not depend on the calls.
    ``graphed`` (CUDA, ``chunk=1``, no padding): the decoding steps replay one captured CUDA graph
    (:class:`GraphedDecoder`) instead of launching every layer's kernels from Python — what makes a dynamic
    policy's token-by-token pass over thousands of tokens affordable.
    """
    if graphed:
        return _graphed_logits(model, input_ids, max(prefill, 1), chunk, attention_mask)
    cache = KVpopCache(model, dynamic_chunks=False)
    size = input_ids.shape[1]
    bounds = ([0, prefill] if prefill > 0 else [0]) + list(range(max(prefill, 0) + chunk, size, chunk)) + [size]
    bounds = sorted(set(b for b in bounds if 0 <= b <= size))
    return torch.cat([_forward(model, cache, input_ids, start, end, attention_mask).logits
                      for start, end in zip(bounds[:-1], bounds[1:])], dim=1)


def _graphed_logits(model, input_ids, prefill, chunk, attention_mask):
    if not input_ids.is_cuda or chunk != 1 or attention_mask is not None:
        raise ValueError("graphed teacher forcing needs CUDA inputs, chunk=1 and no padding mask")
    cache = KVpopCache(model, dynamic_chunks=False)
    size = input_ids.shape[1]
    prefill = min(prefill, size)
    logits = [_forward(model, cache, input_ids, 0, prefill).logits]
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
    torch.cuda.empty_cache()  # the graph gets a private memory pool: give it back what the warm-up left cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


class GraphedDecoder:
    """One call of a retrofitted model over a fixed number of columns — a decoding step, or a prefill chunk
    (:func:`prefill`'s ``graphed``) — captured once and replayed as a CUDA graph.

    The fixed cache has static shapes and updates its buffers in place, so the whole call — every layer's eviction,
    scorer step and attention — replays without a Python launch per kernel. Each call is exactly one step (one
    chunk): the warm-up that capture needs runs on a snapshot of the cache, which is then restored.
    ``snapshot=False`` (serving benchmarks at the memory limit, where a second copy of the cache does not fit) skips
    the snapshot: the warm-up calls then stay in the cache as ``warmup`` extra calls before the first one's.
    ``logits_to_keep``: passed to the model (a prefill chunk needs its last column's logits only).
    """

    def __init__(self, model, cache: KVpopCache, *, warmup: int = 2, snapshot: bool = True,
                 logits_to_keep: int | None = None):
        self.model, self.cache, self.warmup, self.snapshot = model, cache, warmup, snapshot
        self.keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        self.graph = None

    def _forward(self):
        return self.model(input_ids=self.ids, position_ids=self.pos, use_cache=True, **{CACHE_KWARG: self.cache},
                          **self.keep).logits

    def _capture(self):
        saved = [t.clone() for t in cache_tensors(self.cache)] if self.snapshot else None
        width = self.ids.shape[1]
        columns = [layer.columns + (0 if self.snapshot else self.warmup * width) for layer in self.cache.layers]
        full = [layer.is_initialized and layer._filled() for layer in self.cache.layers]  # as the cache is now

        def restore():
            for tensor, copy in zip(cache_tensors(self.cache), saved or []):
                tensor.copy_(copy)
            for layer, flag in zip(self.cache.layers, full if self.snapshot else []):
                layer.full = flag

        self.graph, self.logits = capture_graph(self._forward, warmup=self.warmup, restore=restore)
        for layer, count in zip(self.cache.layers, columns):
            layer.columns = count

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids`` ``[B, W]`` (``W`` the same at every call) → logits ``[B, W, V]``
        (``[B, 1, V]`` with ``logits_to_keep=1``; a fresh tensor)."""
        if self.graph is None:
            self.ids, self.pos = input_ids.clone(), position_ids.clone()
            self._capture()
        elif input_ids.shape != self.ids.shape:
            raise ValueError(f"a captured call replays inputs of shape {tuple(self.ids.shape)} only, got "
                             f"{tuple(input_ids.shape)}")
        self.ids.copy_(input_ids)
        self.pos.copy_(position_ids)
        self.graph.replay()
        for layer in self.cache.layers:
            layer.columns += self.ids.shape[1]
        return self.logits.clone()
