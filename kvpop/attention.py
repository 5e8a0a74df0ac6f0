"""Attention under the retention rule (METHOD §5): FlexAttention driven by per-token tensors.

One primitive, :func:`retention_attention`, serves training, prefill and chunked prefill: queries at positions
``q_pos`` attend to keys at ``kv_pos`` (per KV head: a cache's slots hold different tokens per head) where
``retained(q_pos, kv_pos, kv_evict)`` and ``kv_valid`` hold. No S×S mask is ever stored: the mask is a
``mask_mod`` reading O(S) tensors, and the block structure is derived from them in O((S/128)²).

Unpadded whole sequences (training) have an alternative to the block-sparse S×S pass: a query block sees at most
``B + 127`` tokens, so :func:`compact_layout` gathers exactly those per (query block, KV head) and the attention
runs over ``S × L`` scores instead of ``S²/2`` (:func:`compact_retention_attention`, ``backend="compact"``). It is
opt-in: on an H200 at S = 16k its attention is half of causal, but the gather, its backward and the index lists
eat the gain (1.32× causal vs 1.41× for the masked pass) and the gathered keys cost ~1 GiB of activations per
layer; at S = 4096 on SmolLM2 it halved the pipeline's training throughput (launch-bound index work).

Decoding a single token over a fixed cache needs no mask at all beyond "slot is filled" (none once every slot is):
:func:`slot_attention`. Dynamic policies score the cache from the attention itself: :func:`explicit_attention`.
"""
from __future__ import annotations

import copy
import functools
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvpop.budget import Budget

BLOCK = 128  # FlexAttention's sparse block size
NEVER = torch.iinfo(torch.long).max // 4  # the eviction position of a token kept for good
# The backend of the calls whose shape changes call by call — a cache's chunks (prefill, a ragged cache's candidates),
# decoding steps through transformers' growing cache, targets of rows of any length: compiled FlexAttention builds one
# kernel per shape (seconds each on CUDA; an H200 evaluation once spent its whole session compiling one per decoding
# step), so they take SDPA over query blocks with an explicit mask — the same retention rule, held to the same
# reference by the tests. FlexAttention stays where shapes repeat: whole-sequence passes at a fixed S.
CHUNK_BACKEND = "chunked"


def raise_recompile_limits(limit: int = 512) -> None:
    """Raise dynamo's recompile limits to at least ``limit``: past them a compiled function silently runs eagerly,
    which for flex is its math path, materialising S×S (docs/ENVIRONMENT.md: FlexAttention). Compiling once per
    shape is intended here, so the limit must sit well above the shapes a process uses."""
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


@functools.cache
def _compiled_flex():
    raise_recompile_limits()  # one compiled kernel per shape and mask closure
    return torch.compile(flex_attention, dynamic=False)


def compile_errors() -> tuple[type[Exception], ...]:
    """What a ``torch.compile`` call raises when inductor cannot lower a graph (a compiler bug at some shapes)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return BackendCompilerFailed, InductorError


def compile_error_line(err: Exception) -> str:
    """A compile error as one warning-sized line: its type and the first 200 characters of its first line."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


_FLEX_SHAPES: set = set()
FLEX_SHAPES_WARNING = 32  # distinct compiled shapes in one process past which a caller is compiling per call
# shapes whose compiled flex failed: "flex" retries with FORCE_USE_FLEX_ATTENTION (the main kernel, not the
# short-query flex-decoding one an H100 failed to lower: fp32, head_dim 16, 90 queries); "eager" after that failed too
_FLEX_FALLBACK: dict[tuple, str] = {}


def flex(query, key, value, **kwargs):
    """Compiled FlexAttention on CUDA (one compiled callable per process); eager on CPU (small S only). Warns once
    when a process has compiled more than ``FLEX_SHAPES_WARNING`` shapes (see :data:`CHUNK_BACKEND`). A shape that
    inductor fails to lower is retried on the main flex kernel, then eagerly (its math path, exact but S×S in
    memory), each with one warning; the same result either way."""
    if not query.is_cuda:
        return flex_attention(query, key, value, **kwargs)
    shape = (tuple(query.shape), tuple(key.shape))
    _FLEX_SHAPES.add(shape)
    if len(_FLEX_SHAPES) == FLEX_SHAPES_WARNING + 1:
        warnings.warn(f"FlexAttention has been compiled for {len(_FLEX_SHAPES)} shapes in this process (one kernel "
                      f"each, seconds on CUDA): a caller whose shapes change per call should use the "
                      f"{CHUNK_BACKEND!r} backend", stacklevel=2)
    return _compiled_flex_or_fallback(shape, query, key, value, **kwargs)


def _compiled_flex_or_fallback(shape: tuple, query, key, value, **kwargs):
    """:func:`flex`'s compiled call and its fallbacks for a ``shape`` inductor fails to lower (any device: tests
    exercise it on CPU with a failing stand-in for the compiled callable)."""
    route = _FLEX_FALLBACK.get(shape)
    options = dict(kwargs.pop("kernel_options", None) or {})
    if route is None:
        try:
            return _compiled_flex()(query, key, value, kernel_options=options or None, **kwargs)
        except compile_errors() as err:
            route = _FLEX_FALLBACK[shape] = "eager" if "BACKEND" in options else "flex"
            _warn_flex_fallback(shape, err, route)
    if route == "flex":
        try:
            return _compiled_flex()(query, key, value, kernel_options={**options, "FORCE_USE_FLEX_ATTENTION": True},
                                    **kwargs)
        except compile_errors() as err:
            _FLEX_FALLBACK[shape] = "eager"
            _warn_flex_fallback(shape, err, "eager")
    return flex_attention(query, key, value, kernel_options=options or None, **kwargs)


def _warn_flex_fallback(shape: tuple, err: Exception, route: str) -> None:
    then = "the main flex kernel" if route == "flex" else "eager flex_attention (its math path)"
    warnings.warn(f"torch.compile of FlexAttention failed at query/key shapes {shape} ({compile_error_line(err)}); "
                  f"running {then} for them", RuntimeWarning, stacklevel=4)


def _contiguous_mask_mod(kv_evict, sink: int, window: int, group: int):
    """Unpadded whole sequences (training, precompute): positions are indices, one gather per score."""
    def mask_mod(b, h, q_idx, kv_idx):
        protected = (kv_idx < sink) | (kv_idx > q_idx - window) | (q_idx < kv_evict[b, h // group, kv_idx])
        return (kv_idx <= q_idx) & protected
    return mask_mod


def _retention_mask_mod(q_pos, kv_pos, kv_evict, kv_valid, sink: int, window: int, group: int):
    def mask_mod(b, h, q_idx, kv_idx):
        g = h // group
        d = q_pos[b, q_idx]
        t = kv_pos[b, g, kv_idx]
        protected = (t < sink) | (t > d - window) | (d < kv_evict[b, g, kv_idx])
        return kv_valid[b, g, kv_idx] & (t <= d) & protected
    return mask_mod


def _block_extent(values: torch.Tensor, fill, reduce: str) -> torch.Tensor:
    """Reduce ``[..., N]`` over blocks of ``BLOCK`` along the last dim (padding with ``fill``)."""
    n = values.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        values = F.pad(values, (0, pad), value=fill)
    blocks = values.unflatten(-1, (-1, BLOCK))
    return blocks.amax(-1) if reduce == "max" else blocks.amin(-1)


def retention_block_indices(q_pos, kv_pos, kv_evict, kv_valid, budget: Budget, num_heads: int):
    """The block structure of the retention mask, derived from the retention tensors themselves: ``(partial counts,
    partial indices, full counts, full indices)`` per (row, query head, query block), as ``BlockMask.from_kv_blocks``
    takes them. Tensor operations only (no host round trip), so a compiled caller can fuse them.

    Token ``t`` (not a sink) is visible to the queries ``t <= d < max(e[t], t + window)``; a sink to every
    ``d >= t``. So a KV block can matter to a query block only if its earliest token is not after the block's last
    query and its latest visibility end is after the block's first query; it is *full* (no mask_mod needed) when
    every token is valid, before the first query and visible past the last query.
    """
    bsz, hkv, _ = kv_pos.shape
    group = num_heads // hkv
    big = NEVER  # past any position
    vis_end = torch.where(kv_pos < budget.sink, big, torch.maximum(kv_evict, kv_pos + budget.window))
    vis_end = torch.where(kv_valid, vis_end, -big)
    start = torch.where(kv_valid, kv_pos, big)
    q_first = _block_extent(q_pos, big, "min")  # [B, nq]
    q_last = _block_extent(q_pos, -big, "max")
    kv_first = _block_extent(start, big, "min")  # [B, Hkv, nk]
    kv_last_start = _block_extent(torch.where(kv_valid, kv_pos, -big), -big, "max")
    kv_end_max = _block_extent(vis_end, -big, "max")
    kv_end_min = _block_extent(torch.where(kv_valid, vis_end, -big), -big, "min")
    all_valid = _block_extent((~kv_valid).long(), 1, "max") == 0
    qf, ql = q_first[:, None, :, None], q_last[:, None, :, None]
    any_visible = (kv_first[:, :, None, :] <= ql) & (kv_end_max[:, :, None, :] > qf)
    full = all_valid[:, :, None, :] & (kv_last_start[:, :, None, :] <= qf) & (kv_end_min[:, :, None, :] > ql)
    partial = any_visible & ~full
    partial, full = (x.repeat_interleave(group, dim=1) for x in (partial, full))  # per query head
    return (*_to_indices(partial), *_to_indices(full))


def retention_block_mask(q_pos, kv_pos, kv_evict, kv_valid, budget: Budget, num_heads: int,
                         contiguous: bool = False, indices=None) -> BlockMask:
    """A BlockMask whose block structure comes from the retention tensors themselves
    (:func:`retention_block_indices`; ``indices``: already computed). ``contiguous``: unpadded whole sequences,
    positions are indices (a cheaper mask_mod)."""
    group = num_heads // kv_pos.shape[1]
    if indices is None:
        indices = retention_block_indices(q_pos, kv_pos, kv_evict, kv_valid, budget, num_heads)
    if contiguous:
        mask_mod = _contiguous_mask_mod(kv_evict, budget.sink, budget.window, group)
    else:
        mask_mod = _retention_mask_mod(q_pos, kv_pos, kv_evict, kv_valid, budget.sink, budget.window, group)
    return BlockMask.from_kv_blocks(*indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(q_pos.shape[-1], kv_pos.shape[-1]))


@functools.lru_cache(maxsize=16)
def _causal_structure(size: int, device: str) -> BlockMask:
    """Every block on or below the diagonal, all partial (a retention mask leaves no block full in general)."""
    blocks = (size + BLOCK - 1) // BLOCK
    ids = torch.arange(blocks, device=device)
    causal = (ids[None, :] <= ids[:, None])[None, None]
    return BlockMask.from_kv_blocks(*_to_indices(causal), BLOCK_SIZE=BLOCK, mask_mod=None, seq_lengths=(size, size))


def _to_indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense block booleans ``[B, H, nq, nk]`` → (counts, indices with the selected blocks first)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


class SoftRetention(NamedTuple):
    """The relaxed retention of METHOD §3 (KL through the mask), a training form: every causal token stays visible and
    an eligible token ``t`` (``sink <= t <= d - window``) adds ``log sigmoid((ranked[t] - cutoffs[d]) / tau)`` to query
    ``d``'s score, the gradient flowing into ``ranked``. ``cutoffs`` (:func:`kvpop.retention.soft_cutoffs`, no
    gradient) separate the tokens the hard rule keeps from those it evicts, so as ``tau -> 0`` this is the hard mask.
    ``ranked`` and ``cutoffs`` are ``[B, Hkv, S]``; unpadded whole sequences only (positions are indices). ``tau`` a
    number or a tensor broadcastable to ``ranked`` (a temperature per row: :func:`soft_temperature`)."""

    ranked: torch.Tensor
    cutoffs: torch.Tensor
    tau: float | torch.Tensor

    def scaled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ranked / tau, cutoffs / tau)``: what the bias compares (a Python float inside a flex score_mod is traced
        as an unbacked symbol, so the division happens outside it)."""
        return self.ranked / self.tau, self.cutoffs / self.tau


def soft_temperature(ranked: torch.Tensor, tau: float, relative: bool) -> float | torch.Tensor:
    """The relaxation's temperature for ``ranked [B, Hkv, S]``: ``tau``, or with ``relative`` ``tau`` times each row's
    (detached) standard deviation — then scaling a scorer's output does not sharpen its gates, so a loss on the
    relaxed forward cannot be lowered by inflating the priorities' spread (which the absolute form invites: measured,
    results README, eighteenth session)."""
    if not relative:
        return tau
    return tau * ranked.detach().std(-1, keepdim=True).clamp(min=1e-6)


def _soft_bias(d, t, budget: Budget, ranked_t, cutoff_d):
    """``log sigmoid(p[t] / tau - c[d] / tau)`` (``SoftRetention.scaled``) where ``t`` is eligible for ``d``, else 0
    — one formula for the flex score_mod and the chunked mask. ``min(z, 0) - log1p(exp(-|z|))`` is log sigmoid
    without overflow, and exactly 0 (with no gradient) at ``c[d] = -inf``: the queries that evict nothing yet."""
    z = ranked_t - cutoff_d
    zero = torch.zeros_like(z)
    log_keep = torch.minimum(z, zero) - torch.log1p(torch.exp(-torch.abs(z)))
    return torch.where((t >= budget.sink) & (d - t >= budget.window), log_keep, zero)


def retention_attention(query, key, value, *, q_pos, kv_pos, kv_evict, kv_valid, budget: Budget,
                        scale: float, backend: str = "auto", log_keep: torch.Tensor | None = None,
                        soft: SoftRetention | None = None) -> torch.Tensor:
    """Masked attention; returns ``[B, C, Hq, D]`` (the layout transformers' attention functions return).

    ``query [B, Hq, C, D]``, ``key/value [B, Hkv, N, D]``; ``q_pos [B, C]``; ``kv_pos``, ``kv_evict``,
    ``kv_valid`` ``[B, Hkv, N]`` (broadcastable on the head dim). Queries that see nothing (padding) give 0.
    ``backend``: ``flex`` (compiled, block-sparse), ``compact`` (unpadded whole sequences only: per query block
    over its gathered keys, :func:`compact_retention_attention`) or ``chunked`` (CPU default: SDPA over blocks of
    queries, each with its own ``[rows × N]`` mask — FlexAttention has no backward on CPU). ``auto``: ``flex`` on
    CUDA, ``chunked`` elsewhere.

    ``log_keep [B, Hkv, N]`` (DMS training, ``kvpop.dms``): a relaxed eviction instead of a hard one. Token ``t``
    adds ``log_keep[t]`` (``log(1 - α_t)``) to the scores of the queries past its window (``t >= sink`` and
    ``d - t >= window``), gradients flowing into it; pass ``kv_evict`` "never" so that the mask is causal.

    ``soft`` (KVpop training with KL through the mask, :class:`SoftRetention`): the relaxed form of the retention
    rule; unpadded whole sequences, ``kv_evict`` "never", backends ``flex`` or ``chunked``.
    """
    if soft is not None and log_keep is not None:
        raise ValueError("retention_attention: log_keep (DMS) and soft (KVpop) are two relaxations; pass one")
    bsz, hq, _, _ = query.shape
    hkv = key.shape[1]
    shape = (bsz, hkv, key.shape[2])
    kv_pos, kv_evict, kv_valid = (x.expand(shape).contiguous() for x in (kv_pos, kv_evict, kv_valid))
    if soft is not None and not _whole_sequences(query, key, q_pos, kv_pos, kv_valid):
        raise ValueError("soft retention is a training form for unpadded whole sequences (q_pos == kv_pos == arange)")
    if backend == "auto":
        backend = "flex" if query.is_cuda else "chunked"
    if backend == "chunked":
        return _chunked_attention(query, key, value, q_pos, kv_pos, kv_evict, kv_valid, budget, scale,
                                  log_keep=log_keep, soft=soft)
    if backend not in ("flex", "compact"):
        raise ValueError(f"backend must be 'auto', 'flex', 'compact' or 'chunked', got {backend!r}")
    if (log_keep is not None or soft is not None) and backend == "compact":
        raise ValueError("the compact backend has no relaxed (log_keep, soft) form: use backend='flex' or 'chunked'")
    contiguous = _whole_sequences(query, key, q_pos, kv_pos, kv_valid)
    if backend == "compact":
        if not contiguous:
            raise ValueError("the compact backend serves unpadded whole sequences only (q_pos == kv_pos == arange)")
        return compact_retention_attention(query, key, value, kv_evict, budget, scale=scale)
    if contiguous:  # one causal block structure per shape, shared by every layer: only the mask_mod differs
        block_mask = copy.copy(_causal_structure(query.shape[2], str(query.device)))
        block_mask.mask_mod = _contiguous_mask_mod(kv_evict, budget.sink, budget.window, hq // hkv)
    else:  # padding / a cache's candidates: the structure comes from the tensors themselves
        block_mask = retention_block_mask(q_pos.contiguous(), kv_pos, kv_evict, kv_valid, budget, hq)
    score_mod = None if log_keep is None else _log_keep_score_mod(q_pos, kv_pos, log_keep.expand(shape), budget,
                                                                  hq // hkv)
    if soft is not None:
        score_mod = _soft_score_mod(soft, budget, hq // hkv)
    out = flex(query, key, value, block_mask=block_mask, score_mod=score_mod, scale=scale, enable_gqa=hq != hkv)
    return out.transpose(1, 2).contiguous()


def candidate_attention(query, key, value, *, q_pos, kv_pos, kv_evict, kv_valid, budget: Budget, scale: float,
                        backend: str, block_indices=None) -> torch.Tensor:
    """A cache chunk's one attention call: the chunk's queries over its candidates (the cached slots sorted by position,
    then the chunk), under the retention rule; returns ``[B, C, Hq, D]``. Shapes as :func:`retention_attention`, every
    retention tensor ``[B, Hkv, N]``. Unlike it, nothing here waits on the device (no test for whole sequences: a
    cache's candidates never are), so a chunk can be queued behind the previous one.

    ``backend``: ``flex`` (block-sparse FlexAttention, compiled on CUDA: one kernel per shape, so a caller uses it at
    a fixed chunk size; ``block_indices`` from :func:`retention_block_indices` if already computed) or ``chunked``
    (SDPA over query blocks with an explicit mask: any shape, and CPU)."""
    if backend == "chunked":
        return _chunked_attention(query, key, value, q_pos, kv_pos, kv_evict, kv_valid, budget, scale)
    if backend != "flex":
        raise ValueError(f"candidate_attention: backend must be 'flex' or 'chunked', got {backend!r}")
    hq, hkv = query.shape[1], key.shape[1]
    block_mask = retention_block_mask(q_pos, kv_pos, kv_evict, kv_valid, budget, hq, indices=block_indices)
    out = flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv)
    return out.transpose(1, 2).contiguous()


def _whole_sequences(query, key, q_pos, kv_pos, kv_valid) -> bool:
    """Unpadded whole sequences: the queries are the keys and every position is its index."""
    arange = torch.arange(q_pos.shape[-1], device=q_pos.device)
    return query.shape[2] == key.shape[2] and bool(kv_valid.all()) and bool((q_pos == arange).all()) \
        and bool((kv_pos == arange).all())


def _soft_score_mod(soft: SoftRetention, budget: Budget, group: int):
    """KVpop's relaxed retention (:class:`SoftRetention`) on whole sequences: positions are the indices."""
    ranked, cutoffs = soft.scaled()

    def score_mod(score, b, h, q_idx, kv_idx):
        g = h // group
        return score + _soft_bias(q_idx, kv_idx, budget, ranked[b, g, kv_idx], cutoffs[b, g, q_idx])
    return score_mod


def _log_keep_score_mod(q_pos, kv_pos, log_keep, budget: Budget, group: int):
    """DMS's relaxed eviction: ``log(1 - α_t)`` on the scores of the queries past token ``t``'s window."""
    def score_mod(score, b, h, q_idx, kv_idx):
        t = kv_pos[b, h // group, kv_idx]
        past = (t >= budget.sink) & (q_pos[b, q_idx] - t >= budget.window)
        return score + torch.where(past, log_keep[b, h // group, kv_idx], 0.0)
    return score_mod


# -----------------------------------------------------------------------------
# unpadded whole sequences: each query block attends to its own gathered keys


class CompactLayout(NamedTuple):
    """Per (sequence, query block, KV head) the ``L`` token slots it gathers, ``[B * blocks, Hkv, L]`` each."""

    index: torch.Tensor  # row of ``key.reshape(-1, D)`` gathered into the slot (an arbitrary one when empty)
    rows: torch.Tensor  # int32 ``first << 8 | end``: the block's query rows ``first <= r < end`` see the slot
    blocks: int


def compact_length(size: int, budget: Budget) -> int:
    """Slots per query block: the tokens before the block still retained at its first query (at most ``B - 1``:
    the first query itself is one of the ``B``), padded to whole blocks, then the block's own ``BLOCK`` tokens."""
    blocks = -(-size // BLOCK)
    return min(-(-(budget.total - 1) // BLOCK), blocks - 1) * BLOCK + BLOCK


def compact_layout(kv_evict: torch.Tensor, budget: Budget) -> CompactLayout | None:
    """Which tokens each query block needs, from ``kv_evict [B, Hkv, S]`` (positions = indices).

    Token ``t`` is visible to ``t <= d < end[t]`` (``end`` = ``max(e[t], t + window)``, past the sequence for a
    sink), so before block ``i`` it lives in the blocks ``t // BLOCK < i <= (end[t] - 1) // BLOCK``: a range.
    Those (block, token) pairs are enumerated token by token into a buffer of the static size
    ``blocks × past slots`` (searchsorted over the running sum of range lengths), then stably sorted by block:
    O(S·B/128 · log) time and memory, never ``S × S/128``. ``None`` if some block needs more past slots than the
    budget allows (eviction positions that keep more than ``budget``, e.g. a dense policy's).
    """
    bsz, hkv, size = kv_evict.shape
    device = kv_evict.device
    blocks = -(-size // BLOCK)
    past = compact_length(size, budget) - BLOCK
    pos = torch.arange(size, device=device)
    end = torch.where(pos < budget.sink, blocks * BLOCK, torch.maximum(kv_evict, pos + budget.window))
    end = end.reshape(-1, size).clamp(max=blocks * BLOCK)  # [R, S], R = B * Hkv
    rows_total = end.shape[0]
    own = pos // BLOCK
    lives = ((end - 1) // BLOCK - own).clamp(min=0)  # later blocks whose first query still sees the token
    change = torch.zeros(rows_total, blocks + 1, dtype=torch.long, device=device)
    change.scatter_add_(-1, (own + 1).expand_as(lives), (lives > 0).long())
    change.scatter_add_(-1, own + 1 + lives, -(lives > 0).long())
    counts = change.cumsum(-1)[:, :blocks]  # [R, blocks]: earlier tokens each block needs
    if int(counts.max()) > past:
        return None
    first_query = torch.arange(blocks, device=device) * BLOCK

    pairs = blocks * past
    ends = lives.cumsum(-1)
    slot = torch.arange(pairs, device=device).expand(rows_total, pairs).contiguous()
    token = torch.searchsorted(ends, slot, right=True)  # the token whose range holds the pair; S past the last
    real = token < size
    token = token.clamp(max=size - 1)
    block = own[token] + 1 + slot - (ends.gather(-1, token) - lives.gather(-1, token))
    block, order = torch.sort(torch.where(real, block, blocks), dim=-1, stable=True)  # block-major, tokens ascending
    token = token.gather(-1, order)
    block_start = counts.cumsum(-1) - counts
    target = block * past + slot - block_start.gather(-1, block.clamp(max=blocks - 1))
    past_index = torch.zeros(rows_total, pairs + 1, dtype=torch.long, device=device)
    past_index = past_index.scatter_(-1, torch.where(block < blocks, target, pairs), token)[:, :pairs]
    past_index = past_index.view(rows_total, blocks, past)
    past_end = end.gather(-1, past_index.flatten(1)).view_as(past_index) - first_query[:, None]
    filled = torch.arange(past, device=device) < counts[..., None]
    past_rows = torch.where(filled, past_end.clamp(max=BLOCK), 0)  # first row 0: every query is after the token

    own_index = first_query[:, None] + torch.arange(BLOCK, device=device)  # [blocks, BLOCK]
    in_sequence = own_index < size
    own_index = own_index.clamp(max=size - 1)
    own_end = (end[:, own_index] - first_query[:, None]).clamp(max=BLOCK)
    own_rows = torch.where(in_sequence, (torch.arange(BLOCK, device=device) << 8) | own_end, 0)

    index = torch.cat([past_index, own_index.expand(rows_total, blocks, BLOCK)], dim=-1)
    index = index + (torch.arange(rows_total, device=device) * size)[:, None, None]
    rows = torch.cat([past_rows, own_rows], dim=-1).to(torch.int32)
    per_block = lambda x: x.view(bsz, hkv, blocks, -1).transpose(1, 2).reshape(bsz * blocks, hkv, -1)  # noqa: E731
    return CompactLayout(per_block(index), per_block(rows), blocks)


def _sees(query_row, span):
    """Whether a block's query row sees a slot whose ``span`` is ``first << 8 | end`` (see :class:`CompactLayout`)."""
    return (query_row >= (span >> 8)) & (query_row < (span & 255))


def _compact_mask_mod(rows, group: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return _sees(q_idx, rows[b, h // group, kv_idx])
    return mask_mod


@functools.lru_cache(maxsize=16)
def _compact_structure(length: int, device: str) -> BlockMask:
    """One query block against ``length`` gathered keys, every KV block partial."""
    every = torch.ones(1, 1, 1, length // BLOCK, dtype=torch.bool, device=device)
    return BlockMask.from_kv_blocks(*_to_indices(every), BLOCK_SIZE=BLOCK, mask_mod=None,
                                    seq_lengths=(BLOCK, length))


def compact_retention_attention(query, key, value, kv_evict, budget: Budget, *, scale: float,
                                kernel: str = "auto") -> torch.Tensor:
    """Retention attention for unpadded whole sequences over per-query-block gathered keys; ``[B, S, Hq, D]``.

    ``query [B, Hq, S, D]``, ``key/value [B, Hkv, S, D]``, ``kv_evict [B, Hkv, S]``. ``kernel``: ``flex``
    (CUDA default) or ``sdpa`` (CPU default: an explicit ``[B·blocks, Hq, 128, L]`` mask, small S only, but with a
    backward). Gradients reach ``key``/``value`` through the gather (a scatter-add).
    """
    layout = compact_layout(kv_evict.expand(key.shape[:3]), budget)
    if layout is None:
        raise ValueError(f"the eviction positions keep more tokens than {budget} allows: use backend='flex'")
    if kernel == "auto":
        kernel = "flex" if query.is_cuda else "sdpa"
    return _compact_attention(query, key, value, layout, scale, kernel)


def _compact_attention(query, key, value, layout: CompactLayout, scale: float, kernel: str) -> torch.Tensor:
    bsz, hq, size, dim = query.shape
    group, blocks = hq // key.shape[1], layout.blocks
    queries = F.pad(query, (0, 0, 0, blocks * BLOCK - size)).view(bsz, hq, blocks, BLOCK, dim)
    queries = queries.transpose(1, 2).reshape(bsz * blocks, hq, BLOCK, dim)
    # one gather of [K | V] rows through an embedding lookup: its backward is a sorted segment sum, on an H200 at
    # 16k about twice as fast as index_select's atomic scatter-add (each token is gathered by many blocks)
    gathered = F.embedding(layout.index, torch.cat([key, value], dim=-1).reshape(-1, 2 * dim))
    keys, values = gathered[..., :dim], gathered[..., dim:]
    if kernel == "flex":
        block_mask = copy.copy(_compact_structure(layout.index.shape[-1], str(query.device)))
        block_mask.mask_mod = _compact_mask_mod(layout.rows, group)
        out = flex(queries, keys, values, block_mask=block_mask, scale=scale, enable_gqa=group > 1)
    elif kernel == "sdpa":
        row = torch.arange(BLOCK, device=query.device)[:, None]
        mask = _sees(row, layout.rows[:, :, None, :]).repeat_interleave(group, dim=1)
        sees = mask.any(-1, keepdim=True)  # rows past the sequence's end may see nothing
        out = F.scaled_dot_product_attention(queries, keys.repeat_interleave(group, dim=1),
                                             values.repeat_interleave(group, dim=1), attn_mask=mask | ~sees,
                                             scale=scale)
        out = torch.where(sees, out, 0.0)
    else:
        raise ValueError(f"kernel must be 'auto', 'flex' or 'sdpa', got {kernel!r}")
    out = out.view(bsz, blocks, hq, BLOCK, dim).transpose(2, 3).reshape(bsz, blocks * BLOCK, hq, dim)
    return out[:, :size]


def _chunked_attention(query, key, value, q_pos, kv_pos, kv_evict, kv_valid, budget, scale, budget_bytes=1 << 25,
                       log_keep=None, soft=None):
    from kvpop.retention import retained

    bsz, hq, q_len, _ = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    group = hq // hkv
    rows = max(1, min(q_len, budget_bytes // max(1, bsz * hq * kv_len)))
    ranked, cutoffs = soft.scaled() if soft is not None else (None, None)
    outs = []
    for start in range(0, q_len, rows):
        sl = slice(start, min(q_len, start + rows))
        d = q_pos[:, None, sl, None]
        mask = kv_valid[:, :, None, :] & retained(d, kv_pos[:, :, None, :], kv_evict[:, :, None, :], budget)
        mask = mask.repeat_interleave(group, dim=1)  # [B, Hq, rows, N]
        sees = mask.any(-1, keepdim=True)
        attn_mask = mask | ~sees
        t = kv_pos[:, :, None, :]
        bias = None  # the relaxed forms (see retention_attention) are float masks
        if log_keep is not None:  # DMS training: log(1 - α_t) past t's window
            bias = torch.where((t >= budget.sink) & (d - t >= budget.window), log_keep.expand(kv_pos.shape)[:, :, None],
                               0.0)
        if soft is not None:  # KVpop training, KL through the mask: the relaxed retention
            bias = _soft_bias(d, t, budget, ranked[:, :, None, :], cutoffs[:, :, sl, None])
        if bias is not None:
            attn_mask = torch.where(attn_mask, bias.repeat_interleave(group, dim=1), float("-inf")).to(query.dtype)
        out = F.scaled_dot_product_attention(query[:, :, sl], key.repeat_interleave(group, dim=1),
                                             value.repeat_interleave(group, dim=1), attn_mask=attn_mask,
                                             scale=scale)
        outs.append(torch.where(sees, out, 0.0))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def slot_attention(query, keys, values, filled, *, scale: float, return_probs: bool = False):
    """One query per row over a fixed cache: ``query [B, Hq, 1, D]``, ``keys [B, Hkv, slots, D]``,
    ``filled [B, Hkv, slots]`` (``None``: every slot is filled). Returns ``[B, 1, Hq, D]`` (and the attention
    probabilities ``[B, Hq, slots]``).

    Without probabilities this is SDPA with the query heads grouped onto their KV head (``enable_gqa``: the slots
    are read once, never expanded per query head); without a mask, on CUDA, it runs as a flash decoding kernel.
    """
    bsz, hq, _, dim = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    if return_probs:
        out, probs = explicit_attention(query, keys, values, None if filled is None else filled[:, :, None, :],
                                        scale=scale)
        return out, probs.reshape(bsz, hq, -1)
    mask = None if filled is None else filled.repeat_interleave(group, dim=1)[:, :, None, :]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    return out.transpose(1, 2), None


def explicit_attention(query, keys, values, mask, *, scale: float):
    """Attention with its probabilities, in float32 at least (what dynamic policies score the cache with).

    ``query [B, Hq, Q, D]``, ``keys/values [B, Hkv, N, D]``, ``mask [B, Hkv, Q, N]`` (``None``: all visible).
    Returns ``(output [B, Q, Hq, D], probabilities [B, Hkv, group, Q, N])``; a query that sees nothing gets zeros.
    """
    bsz, hq, q_len, dim = query.shape
    hkv = keys.shape[1]
    work = torch.promote_types(query.dtype, torch.float32)
    q = query.reshape(bsz, hkv, hq // hkv, q_len, dim).to(work)
    scores = torch.einsum("bhgqd,bhnd->bhgqn", q, keys.to(work)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))
    out = torch.einsum("bhgqn,bhnd->bhgqd", probs, values.to(work)).to(query.dtype)
    return out.reshape(bsz, hq, q_len, -1).transpose(1, 2), probs


# -----------------------------------------------------------------------------
# the attention function transformers calls (registered as "kvpop" by kvpop.retrofit)


def token_positions(valid_cols: torch.Tensor | None, batch: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid [B, N], positions [B, N])`` for the last ``length`` columns of a 2-D padding mask.

    Positions count real tokens only (left padding gets negative positions), so a padded row is retained exactly
    as it would be alone. Real tokens must be contiguous (left and/or right padding).
    """
    arange = torch.arange(length, device=device)
    if valid_cols is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device), arange.expand(batch, length)
    valid = valid_cols[:, -length:].to(device=device, dtype=torch.bool)
    leading = (valid.long().cumsum(-1) == 0).sum(-1, keepdim=True)
    count = valid.sum(-1, keepdim=True)
    if not torch.equal(valid, (arange >= leading) & (arange < leading + count)):
        raise ValueError("KVpop supports left or right padding only: each row's real tokens must be contiguous")
    return valid, arange - leading


def kvpop_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface entry point: the fixed cache's step, or the one-pass masked forward."""
    runtime = getattr(module, "kvpop_runtime", None)
    if runtime is None:
        raise RuntimeError("this attention module was not retrofitted: call kvpop.retrofit(model, budget, ...) first")
    check_layer_kwargs(module.layer_idx, runtime.layer_windows, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    valid_cols = attention_mask if (attention_mask is not None and attention_mask.dim() == 2) else None
    if attention_mask is not None and valid_cols is None:
        raise ValueError("KVpop builds its own masks: pass a 2-D padding mask (or none), not a 4-D attention mask")
    cache_layer = runtime.pending.pop(module.layer_idx, None)
    if cache_layer is not None:
        return cache_layer.attend(module, query, key, value, valid_cols, scale), None
    return sequence_attention(module, runtime, query, key, value, valid_cols, scale), None


# what a layer's own forward may pass that changes its attention, and KVpop's attention does not implement
UNSUPPORTED_KWARGS = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks (s_aux)"}


def check_layer_kwargs(layer_idx: int, windows, kwargs) -> None:
    """Refuse, in one line, what a layer's own forward asks of its attention beyond what was read from its config: a
    sliding window other than ``windows[layer_idx]`` (``kvpop.local_layers.layer_windows``), soft-capping, sinks."""
    for name, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"layer {layer_idx} asks for {what} ({name}), which KVpop's attention does not "
                             f"implement: it would change the model")
    own = windows[layer_idx] if windows else None
    if kwargs.get("sliding_window") != own:
        raise ValueError(f"layer {layer_idx} passes sliding_window={kwargs.get('sliding_window')!r} but its config "
                         f"reads as window {own!r} (kvpop.local_layers): an attention pattern KVpop cannot read")


def local_attention(query, key, value, window: int, *, scale: float, backend: str = "auto") -> torch.Tensor:
    """A local layer's own sliding-window attention over unpadded whole sequences (``[B, Hq, S, D]`` queries, keys
    ``[B, Hkv, S, D]``): query ``d`` sees ``d - window < t <= d``, transformers' sliding window. Returns
    ``[B, S, Hq, D]``. The retention rule with ``Budget(0, window, 0)``: a token leaves as it leaves the window."""
    bsz, _, size, _ = key.shape
    pos = torch.arange(size, device=key.device)
    return retention_attention(query, key, value, q_pos=pos.expand(bsz, size), kv_pos=pos.expand(bsz, 1, size),
                               kv_evict=torch.zeros(bsz, 1, size, dtype=torch.long, device=key.device),
                               kv_valid=torch.ones(bsz, 1, size, dtype=torch.bool, device=key.device),
                               budget=Budget(0, window, 0), scale=scale, backend=backend)


def sequence_attention(module, runtime, query, key, value, valid_cols, scale):
    """Queries are the last ``C`` of ``N`` tokens (``C == N`` in training / prefill). Static policies only. A local
    layer runs its own sliding window (``Runtime.layer_policy``), whatever the model's policy."""
    from kvpop.policies.base import LayerView

    policy = runtime.layer_policy(module.layer_idx)
    evicting = policy is runtime.policy  # a local layer has no scorer: nothing to collect or relax
    bsz, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    valid, positions = token_positions(valid_cols, bsz, kv_len, key.device)
    q_pos = positions[:, kv_len - q_len:]
    backend = "auto" if q_len == kv_len else CHUNK_BACKEND  # decoding through transformers' cache: a new N each step
    if policy.budget is None:  # dense: causal over real tokens
        evict = torch.full((bsz, 1, kv_len), NEVER, device=key.device)
        return retention_attention(query, key, value, q_pos=q_pos, kv_pos=positions[:, None], kv_evict=evict,
                                   kv_valid=valid[:, None], budget=Budget(0, 1, 0), scale=scale, backend=backend)
    if policy.dynamic:
        raise RuntimeError(f"the {policy.name} policy re-scores the cache every step: run it through the fixed "
                           "cache (model.generate, or kvpop.decode.teacher_forced_logits), not a one-pass forward")
    layer = LayerView(module.layer_idx, module, runtime, query, scale)
    if policy.ragged:  # DMS: one keep/evict decision per (token, KV head), no fixed budget (kvpop.policies.dms)
        if q_len != kv_len:
            raise ValueError("DMS runs one-pass over whole sequences (use_cache=False) or through its own cache")
        decisions = policy.eviction_logits(layer, valid, positions[:, None, :])
        if runtime.collected is not None and evicting:
            runtime.collected[module.layer_idx] = decisions
        evict, log_keep = policy.attention_inputs(decisions, positions[:, None, :])
        return retention_attention(query, key, value, q_pos=q_pos, kv_pos=positions[:, None], kv_evict=evict,
                                   kv_valid=valid[:, None], budget=policy.budget, scale=scale, log_keep=log_keep)
    raw = policy.sequence_priorities(layer, key, value, valid, positions[:, None, :])
    ranked = policy.ranked(raw, positions[:, None, :])
    if runtime.collected is not None and evicting:
        runtime.collected[module.layer_idx] = ranked
    topk = runtime.layer_topk(module.layer_idx, policy)  # per-head budgets (METHOD §7), else None
    topk = None if topk is None else torch.tensor(topk, device=key.device)
    if runtime.soft_tau is not None and evicting and policy.budget.topk > 0 \
            and module.layer_idx not in runtime.streaming_layers:
        return _soft_sequence_attention(query, key, value, ranked, policy, runtime.soft_tau, runtime.soft_relative,
                                        scale, q_pos, positions, valid, topk)
    evict = policy.evictions(raw, positions[:, None, :], topk)
    return retention_attention(query, key, value, q_pos=q_pos, kv_pos=positions[:, None], kv_evict=evict,
                               kv_valid=valid[:, None], budget=mask_budget(policy.budget, topk), scale=scale,
                               backend=backend)


def mask_budget(budget: Budget, topk: torch.Tensor | None) -> Budget:
    """The budget a mask is built with: the masks read only its sink and window (the ranking is in the eviction
    positions), and the compact backend bounds a block's gathered tokens by its total, so under per-head budgets
    ``topk [Hkv]`` it is the layer's largest."""
    return budget if topk is None else Budget(budget.sink, budget.window, int(topk.max()))


def _soft_sequence_attention(query, key, value, ranked, policy, tau: float, relative: bool, scale: float, q_pos,
                             positions, valid, topk=None):
    """The relaxed retention (:class:`SoftRetention`) of a static policy's ranked priorities, with the gradient into
    them: training only (``kvpop.retrofit.soft_retention``), on unpadded whole sequences, one top-k pool (per head
    with ``topk [Hkv]``: each head's cutoff at its own budget)."""
    from kvpop.retention import soft_cutoffs

    policy.require_one_pool("soft retention")
    ranked = ranked.float()
    soft = SoftRetention(ranked, soft_cutoffs(ranked.detach(), policy.budget, topk),
                         soft_temperature(ranked, tau, relative))
    return retention_attention(query, key, value, q_pos=q_pos, kv_pos=positions[:, None],
                               kv_evict=torch.full_like(ranked, NEVER, dtype=torch.long), kv_valid=valid[:, None],
                               budget=policy.budget, scale=scale, soft=soft)


def passthrough_mask(*args, attention_mask=None, **kwargs):
    """AttentionMaskInterface entry: hand the 2-D padding mask through; the attention builds the real mask."""
    return attention_mask
