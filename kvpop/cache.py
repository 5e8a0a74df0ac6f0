"""The fixed-budget cache (METHOD §5): exactly ``B = sink + window + topk`` slots per (layer, KV head, row).

Slot layout per (row, KV head)::

    [0, sink)                  sinks: token t < sink lives in slot t
    [sink, sink + window)      the protected window, a ring: token t >= sink lives in slot sink + (t - sink) % window
    [sink + window, B)         long-range slots: the best ``topk`` eligible tokens, min-priority replacement

Slots fill up in order (after ``n < B`` tokens, slots ``0 … n-1`` hold them) and a filled slot is only ever
replaced, so once a row has seen ``B`` tokens every slot holds one and attention needs no mask.

**Decoding** one token at position ``p``: the token ``p - window`` leaves the ring (its slot is the one token ``p``
takes), receives its priority now (METHOD §1), and replaces the weakest long-range slot if it beats it (ties: the
newer token wins); then the query attends to every filled slot.

**A chunk** of several tokens (prefill; ``generate`` feeds long prompts in chunks, :func:`kvpop.decode.prefill`) is
one attention over the *candidates* — every cached slot plus the chunk — then compressed back into the ``B`` slots.
The cache never holds more than its ``B`` slots per layer plus one layer's ``B + C`` candidates
(:class:`KVMeter` counts it): peak K/V memory is bounded by the chunk ``C``, not by the prompt.

* Static policies: the chunk's queries see the candidates under the retention rule, with the priorities of the
  tokens leaving the window inside the chunk computed for the whole chunk at once (``Policy.resume``: the mLSTM's
  chunkwise kernel, carrying its state from chunk to chunk); the result is exactly the one-pass mask, for any chunk
  sizes. Per layer and chunk: the scorer's resume, then :func:`prepare_static_chunk` (rank the leaving tokens, write
  the ring's priorities, gather the candidates sorted by position, one eviction position per candidate by the
  rule's prefix order statistics — every row and head at once), one attention call, and
  :func:`finish_static_chunk` (the next ``B`` slots: the candidates the chunk's last query retains). What the
  retention rule decides when is unchanged: a token is scored at the call that moves it out of the window (its
  position + ``window``), whether that call is in its own chunk or a later one; a ring token's priority is written to
  its slot at that call's chunk, before the candidates are gathered.
* **The fused path** (CUDA, chunks of the cache's ``prefill_chunk`` columns — one shape, so compiled once): the
  attention is block-sparse FlexAttention over the candidates, its block structure derived from the eviction
  positions (``kvpop.attention.retention_block_indices``), and nothing waits on the host (the padding check runs
  once per forward, not per layer). ``Runtime.compile_prefill`` also compiles the two bookkeeping functions. Other
  chunk sizes (a prompt's first, shorter chunk) and CPU take the any-shape path, SDPA over query blocks; every path
  gives the same retained sets.
* Dynamic policies (TOVA, H2O) — the chunk rule: (1) the cache as it stands at the chunk's first query ``p0``:
  the eligible cached tokens (``sink <= t <= p0 - window``) keep the ``topk`` best scores, the rest are evicted;
  (2) every query of the chunk attends to what remains plus the chunk, causally, with no eviction inside the
  chunk; (3) the scores take in the chunk's attention (``observe_chunk``: TOVA the last query's, H2O the sum);
  (4) evict down to ``B`` at the chunk's last query. A chunk of one token is exactly a decoding step. A longer
  chunk equals token-by-token decoding when nothing is evicted inside it, i.e. when the row's first ``p0 + C``
  tokens fit in ``B`` (a prompt of at most ``B`` tokens); beyond that its queries see tokens that token-by-token
  decoding would already have evicted, and its scores come from the chunk's queries at once.
  ``KVpopCache(model, dynamic_chunks=False)`` takes a multi-token call token by token instead (teacher forcing).

A model's local (sliding-window) layers hold a ring of their own window ``W`` instead (``Runtime.layer_policy``: a
streaming policy of ``Budget(0, W, 0)``), exactly what their base attention sees.

Memory is constant in the generated length: keys and values ``2 × B × Hkv × head_dim × dtype`` per global layer and
row (``2 × W × …`` per local layer),
plus per-slot metadata (int64 position, fp32 priority, fp32 attention score for dynamic policies) and the scorer's
O(window) state. ``KVpopCache.nbytes()`` itemises it.
"""
from __future__ import annotations

import copy
import functools
import warnings
from typing import NamedTuple

import torch
import transformers
from packaging.version import Version
from torch.utils._pytree import tree_leaves
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop.attention import (candidate_attention, compile_error_line, compile_errors, explicit_attention,
                             raise_recompile_limits, retention_block_indices, slot_attention)
from kvpop.policies.base import LayerView, Policy
from kvpop.retention import anchored_eviction_positions, ranks_newer_wins, retained

# transformers 5.24 renamed the `past_key_values` argument of forward/generate to `cache` (the old name warns until
# 5.40 / 6.0); 5.17 knows only the old one
CACHE_KWARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


class KVMeter:
    """Key/value bytes a cache holds: every layer's slots, plus the transient candidates (``B`` slots + the chunk)
    of the layer a chunk is going through. ``peak`` is the most it ever held."""

    def __init__(self):
        self.held = 0
        self.peak = 0

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


class Candidates(NamedTuple):
    """What a chunk competes over, per (row, KV head): the cached slots sorted by position, then the chunk."""

    pos: torch.Tensor  # [B, Hkv, N] int64 (empty slots and padding: negative)
    valid: torch.Tensor  # [B, Hkv, N] bool
    keys: torch.Tensor  # [B, Hkv, N, D]
    values: torch.Tensor
    prio: torch.Tensor | None  # static policies: ranked priority (-inf until the token leaves the window)
    score: torch.Tensor | None  # dynamic policies: attention received
    anchor: torch.Tensor | None = None  # anchor slots: what they rank by (-inf likewise)


class KVpopLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, runtime, layer_idx: int, policy: Policy, meter: KVMeter | None = None,
                 dynamic_chunks: bool = True):
        super().__init__()
        self.runtime, self.layer_idx, self.policy = runtime, layer_idx, policy
        self.budget = policy.budget
        self.meter = meter if meter is not None else KVMeter()
        self.dynamic_chunks = dynamic_chunks
        self.columns = 0  # input columns seen, padding included: what generate() counts positions with
        self.full = False  # every slot of every row filled (then decoding attends without a mask)
        self.prefill_chunk = runtime.prefill_chunk  # chunks of this many columns take the fused path (KVpopCache)

    # -- transformers' layer interface -------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, hkv, _, dim = key_states.shape
        slots, device = self.budget.total, key_states.device
        self.device = device
        self.keys = key_states.new_zeros(bsz, hkv, slots, dim)
        self.values = value_states.new_zeros(bsz, hkv, slots, value_states.shape[-1])
        self.meter.hold(self.keys.nbytes + self.values.nbytes)
        self.slot_pos = torch.full((bsz, hkv, slots), -1, dtype=torch.long, device=device)  # -1: empty
        self.slot_prio = torch.full((bsz, hkv, slots), float("-inf"), device=device)  # ranked priority
        # anchor slots: each token's priority with the anchors' recency term, beside the ranked one
        self.slot_anchor = self.slot_prio.clone() if self.policy.anchors else None
        self.slot_score = torch.zeros(bsz, hkv, slots, device=device) if self.policy.dynamic else None
        self.seen = torch.zeros(bsz, dtype=torch.long, device=device)  # real tokens per row
        self.scorer_state = None
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Defer to the attention call, which has the query and the padding mask: see :meth:`attend`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.runtime.pending[self.layer_idx] = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _batch_tensors(self):
        return ["keys", "values", "slot_pos", "slot_prio", "slot_anchor", "slot_score", "seen"]

    def _index_batch(self, fn):
        if not self.is_initialized:
            return
        self.meter.release(self.keys.nbytes + self.values.nbytes)
        for name in self._batch_tensors():
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if self.scorer_state is not None:
            self.scorer_state = {k: fn(v) for k, v in self.scorer_state.items()}
        self.meter.hold(self.keys.nbytes + self.values.nbytes)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(lambda x: x[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._index_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        if self.is_initialized:
            self.meter.release(self.keys.nbytes + self.values.nbytes)
        self.is_initialized = False
        self.keys = self.values = None
        self.columns = 0
        self.full = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a fixed-budget cache has evicted the past: it cannot be cropped (assisted "
                                  "decoding / rollback is not supported)")

    # -- KVpop -------------------------------------------------------------------------------------------------

    def nbytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"kv": 0, "metadata": 0, "scorer_state": 0}
        meta = [self.slot_pos, self.slot_prio, self.slot_anchor, self.slot_score, self.seen]
        state = self.scorer_state or {}
        return {"kv": self.keys.nbytes + self.values.nbytes,
                "metadata": sum(t.nbytes for t in meta if t is not None),
                "scorer_state": sum(t.nbytes for t in state.values())}

    def attend(self, module, query, key_new, value_new, valid_cols, scale) -> torch.Tensor:
        """Insert the new tokens, evict by the rule, attend; returns ``[B, C, Hq, D]``."""
        bsz, _, chunk, _ = query.shape
        valid = (torch.ones(bsz, chunk, dtype=torch.bool, device=query.device) if valid_cols is None
                 else valid_cols[:, -chunk:].to(device=query.device, dtype=torch.bool))
        self.columns += chunk
        layer = LayerView(self.layer_idx, module, self.runtime, query, scale)
        if chunk == 1:
            return self._step(layer, query, key_new[:, :, 0], value_new[:, :, 0], valid[:, 0], scale)
        if self.policy.dynamic and not self.dynamic_chunks:  # token by token, exactly as decoding would
            return torch.cat([self._step(layer, query[:, :, i:i + 1], key_new[:, :, i], value_new[:, :, i],
                                         valid[:, i], scale) for i in range(chunk)], dim=1)
        if valid_cols is not None:
            self._check_left_padding(valid_cols, valid)
        return self._chunk(layer, query, key_new, value_new, valid, scale)

    def _check_left_padding(self, valid_cols, valid) -> None:
        """Refuse padding anywhere but before a row's first token. Reading the answer waits for the device, so it is
        done once per forward: every layer of one forward gets the same mask and has seen the same tokens."""
        checked = self.runtime.checked_padding
        if checked is not None and checked[0] is valid_cols and checked[1] is self.meter:
            return
        arange = torch.arange(valid.shape[1], device=valid.device)
        leading = (valid.long().cumsum(-1) == 0).sum(-1)
        count = valid.sum(-1)
        if not torch.equal(valid, (arange >= leading[:, None]) & (arange < (leading + count)[:, None])):
            raise ValueError("KVpop's cache takes left padding only, before a row's first token")
        if bool(((self.seen > 0) & (count < valid.shape[1])).any()):
            raise ValueError("padding after a row's first token: KVpop's cache takes left padding only")
        self.runtime.checked_padding = (valid_cols, self.meter)  # held, so its id cannot be reused meanwhile

    def _filled(self) -> bool:
        """Whether every slot of every row holds a token (then, and forever after, attention needs no mask).
        Checked on the host until it holds; never while a CUDA graph is being captured. Never with anchor slots: where
        their two pools come to hold the same token, a slot empties again."""
        if self.policy.anchors:
            return False
        if not self.full and not (self.keys.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.full = bool((self.seen >= self.budget.total).all())
        return self.full

    # -- decoding: one token

    def _step(self, layer, query, key, value, valid, scale):
        full = self._filled()
        if self.policy.dynamic:
            return _dynamic_step(self, query, key, value, valid, scale, full)
        step = _compiled_static_step() if self.runtime.compile_decode else static_step
        out, state = step(self.policy, layer, self.keys, self.values, self.slot_pos, self.slot_prio, self.seen,
                          self.scorer_state, query, key, value, valid, self.budget.sink, self.budget.window,
                          self.budget.topk, scale, full, self.slot_anchor)
        if self.scorer_state is None:
            self.scorer_state = state
        return out

    # -- a chunk: candidates = slots + chunk, one attention, compression back into the slots

    def _fused(self, query, chunk: int) -> bool:
        """Whether this chunk takes the fused path: on CUDA, at the cache's fixed chunk size (``prefill_chunk``), so
        that every compiled piece sees one shape (a prompt's first, shorter chunk takes the any-shape path)."""
        return query.is_cuda and chunk == self.prefill_chunk

    def _chunk(self, layer, query, key_new, value_new, valid, scale):
        bsz, hkv, chunk, _ = key_new.shape
        new_pos, last, count = chunk_positions(self.seen, valid)
        if self.policy.dynamic:
            cand = gather_candidates(self.keys, self.values, self.slot_pos, self.slot_prio, None, self.slot_score,
                                     key_new, value_new, new_pos, valid, None)
            self.meter.hold(cand.keys.nbytes + cand.values.nbytes)
            out, keep, score = _dynamic_chunk(self.policy, query, cand, self.seen, new_pos, valid, last, scale)
            store_candidates(self.keys, self.values, self.slot_pos, self.slot_prio, None, self.slot_score,
                             cand._replace(score=score), keep, last, self.budget.sink, self.budget.window)
        else:
            raw, state = self.policy.resume(layer, key_new, value_new, valid, new_pos[:, None, :], self.scorer_state)
            self._keep_state(state)
            fused = self._fused(query, chunk)
            compiled = fused and self.runtime.compile_prefill
            prepare = _compiled(prepare_static_chunk) if compiled else prepare_static_chunk
            cand, evict, blocks = prepare(self.policy, self.keys, self.values, self.slot_pos, self.slot_prio,
                                          self.slot_anchor, raw, key_new, value_new, new_pos, valid,
                                          query.shape[1], checked=not fused, flex=fused)
            self.meter.hold(cand.keys.nbytes + cand.values.nbytes)
            out = candidate_attention(query, cand.keys, cand.values, q_pos=new_pos, kv_pos=cand.pos, kv_evict=evict,
                                      kv_valid=cand.valid, budget=self.budget, scale=scale,
                                      backend="flex" if fused else "chunked", block_indices=blocks)
            finish = _compiled(finish_static_chunk) if compiled else finish_static_chunk
            finish(self.keys, self.values, self.slot_pos, self.slot_prio, self.slot_anchor, cand, evict, last,
                   self.budget)
        self.meter.release(cand.keys.nbytes + cand.values.nbytes)
        self.seen += count
        return out

    def _keep_state(self, state):
        """Adopt the scorer's new state by copying into the buffers already held (a replayable CUDA graph needs
        every step to read and write the same memory)."""
        if self.scorer_state is None or state is None or state.keys() != self.scorer_state.keys():
            self.scorer_state = state
            return
        for name, tensor in state.items():
            if tensor is not self.scorer_state[name]:
                self.scorer_state[name].copy_(tensor)


# -----------------------------------------------------------------------------
# one chunk on the slot tensors (pure functions of tensors, nothing waits on the device: compilable, in place)


def chunk_positions(seen: torch.Tensor, valid: torch.Tensor):
    """``(positions [B, C] of the chunk's columns — left padding negative —, each row's last query [B, 1, 1], real
    tokens per row [B])`` for a chunk after ``seen [B]`` real tokens, ``valid [B, C]`` (left padding only)."""
    arange = torch.arange(valid.shape[1], device=valid.device)
    leading = (valid.long().cumsum(-1) == 0).sum(-1)
    count = valid.sum(-1)
    return seen[:, None] + arange - leading[:, None], (seen + count - 1)[:, None, None], count


def leaving_priorities(policy, raw, new_pos, slot_prio, slot_anchor, sink: int, window: int):
    """The chunk's call ``i`` makes token ``new_pos[i] - window`` leave the window, with raw priority ``raw[..., i]``
    (``Policy.resume``). For a token of the chunk its ranked priority is returned (``[B, Hkv, C]``, -inf for tokens
    still in the window at the chunk's end); for a token in the ring it is written to its slot (in place). Returns
    the ranked priorities and the anchors' (``None`` without anchor slots)."""
    bsz, hkv, chunk = raw.shape
    leaving = (new_pos - window)[:, None, :].expand(bsz, hkv, chunk)
    from_ring = leaving[..., :window]  # distinct ring slots: at most `window` consecutive positions
    slot = sink + (from_ring - sink) % window
    out = []
    for store, rank in ((slot_prio, policy.ranked), (slot_anchor, policy.anchor_ranked)):
        if store is None:
            out.append(None)
            continue
        prio = rank(raw.float(), leaving)
        new_prio = torch.full((bsz, hkv, chunk), float("-inf"), device=raw.device)
        new_prio[..., :max(chunk - window, 0)] = prio[..., window:]
        store.scatter_(-1, slot, torch.where(from_ring >= sink, prio[..., :window], store.gather(-1, slot)))
        out.append(new_prio)
    return tuple(out)


def gather_candidates(keys, values, slot_pos, slot_prio, slot_anchor, slot_score, key_new, value_new, new_pos, valid,
                      new_prio, new_anchor=None) -> Candidates:
    """What a chunk competes over: the cached slots sorted by position (empty ones first), then the chunk."""
    bsz, hkv, chunk, _ = key_new.shape
    slots = slot_pos.shape[-1]
    order = slot_pos.argsort(-1)
    pos = torch.cat([slot_pos.gather(-1, order), new_pos[:, None, :].expand(bsz, hkv, chunk)], -1)
    ok = torch.cat([pos[..., :slots] >= 0, valid[:, None, :].expand(bsz, hkv, chunk)], -1)
    keys, values = (torch.cat([cached.gather(2, order[..., None].expand(-1, -1, -1, cached.shape[-1])), new], 2)
                    for cached, new in ((keys, key_new), (values, value_new)))  # the only transient copy
    prio = None if new_prio is None else torch.cat([slot_prio.gather(-1, order), new_prio], -1)
    anchor = None if new_anchor is None else torch.cat([slot_anchor.gather(-1, order), new_anchor], -1)
    score = None if slot_score is None else torch.cat([slot_score.gather(-1, order),
                                                       slot_score.new_zeros(bsz, hkv, chunk)], -1)
    return Candidates(pos, ok, keys, values, prio, score, anchor)


def store_candidates(keys, values, slot_pos, slot_prio, slot_anchor, slot_score, cand: Candidates, keep, last,
                     sink: int, window: int) -> None:
    """Write the kept candidates into their slots, in place (sinks at their position, the window in its ring, the
    long-range ones in position order after it); slots nobody takes are left empty."""
    slots = slot_pos.shape[-1]
    long_range = keep & (cand.pos >= sink) & (cand.pos <= last - window)
    slot = torch.where(cand.pos < sink, cand.pos, sink + (cand.pos - sink) % window)
    slot = torch.where(long_range, sink + window + long_range.long().cumsum(-1) - 1, slot)
    slot = torch.where(keep, slot, slots)  # dropped: a spare slot past the end
    source = torch.full(slot.shape[:2] + (slots + 1,), -1, dtype=torch.long, device=slot.device)
    source = source.scatter_(-1, slot, torch.arange(slot.shape[-1], device=slot.device).expand_as(slot))
    source = source[..., :slots]
    empty = source < 0
    source = source.clamp(min=0)  # an empty slot holds some candidate's finite values, masked as empty
    for store, new in ((keys, cand.keys), (values, cand.values)):
        store.copy_(new.gather(2, source[..., None].expand(-1, -1, -1, store.shape[-1])))
    slot_pos.copy_(torch.where(empty, -1, cand.pos.gather(-1, source)))
    for store, prio in ((slot_prio, cand.prio), (slot_anchor, cand.anchor)):
        if prio is not None:
            store.copy_(torch.where(empty, float("-inf"), prio.gather(-1, source)))
    if cand.score is not None:
        slot_score.copy_(torch.where(empty, 0.0, cand.score.gather(-1, source)))


def prepare_static_chunk(policy, keys, values, slot_pos, slot_prio, slot_anchor, raw, key_new, value_new, new_pos,
                         valid, num_heads: int, *, checked: bool = True, flex: bool = False):
    """A static policy's chunk up to its attention: rank the leaving tokens (:func:`leaving_priorities`), gather the
    candidates, and give every candidate its eviction position under the rule (exact: the cache holds every token
    still retained at the chunk's first query, and evicted ones never return). Returns ``(candidates, eviction
    positions, FlexAttention block indices or None)``. ``checked=False`` skips the priorities' NaN test (a wait on
    the device); ``flex`` also derives the block structure, here where a compiled caller fuses it."""
    budget = policy.budget
    new_prio, new_anchor = leaving_priorities(policy, raw, new_pos, slot_prio, slot_anchor, budget.sink, budget.window)
    cand = gather_candidates(keys, values, slot_pos, slot_prio, slot_anchor, None, key_new, value_new, new_pos, valid,
                             new_prio, new_anchor)
    evict = anchored_eviction_positions(cand.prio, cand.anchor, budget, policy.anchors, cand.pos, check=checked)
    blocks = retention_block_indices(new_pos, cand.pos, evict, cand.valid, budget, num_heads) if flex else None
    return cand, evict, blocks


def finish_static_chunk(keys, values, slot_pos, slot_prio, slot_anchor, cand: Candidates, evict, last,
                        budget) -> None:
    """Compress the candidates back into the ``B`` slots: exactly those the chunk's last query retains."""
    keep = cand.valid & retained(last, cand.pos, evict, budget)
    store_candidates(keys, values, slot_pos, slot_prio, slot_anchor, None, cand, keep, last, budget.sink,
                     budget.window)


@functools.cache
def _compiled(fn):
    """``fn`` under ``torch.compile`` at static shapes (``Runtime.compile_prefill``: one chunk size, so one shape per
    batch size and budget). Shapes whose compilation fails (an inductor bug: an H100 hit one at chunk 8192 × 8 rows)
    run ``fn`` eagerly from then on, with a warning. Exact either way: the chunk's functions only write in place what
    they compute from their inputs, so a call that failed after a compiled part of it ran is redone by the eager one
    to the same state."""
    raise_recompile_limits()
    compiled = torch.compile(fn, dynamic=False)
    eager_shapes: set[tuple] = set()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        leaves = tree_leaves((args, kwargs))
        shapes = tuple(tuple(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor))
        if shapes not in eager_shapes:
            try:
                return compiled(*args, **kwargs)
            except compile_errors() as err:
                eager_shapes.add(shapes)
                warnings.warn(f"torch.compile failed for {fn.__name__} at these shapes ({compile_error_line(err)}); "
                              f"running it eagerly", RuntimeWarning, stacklevel=2)
        return fn(*args, **kwargs)

    return run


def _best(score: torch.Tensor, eligible: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` eligible entries with the highest (score, position), ties to the newer: entries are in position
    order, so after ranking ineligible ones lowest, the eligible among the ``topk`` highest ranks."""
    rank, _ = ranks_newer_wins(torch.where(eligible, score, float("-inf")))
    return eligible & (rank >= score.shape[-1] - topk)


def _dynamic_chunk(policy, query, cand: Candidates, first, new_pos, valid, last, scale, budget_bytes=1 << 25):
    """The chunk rule for dynamic policies (module docstring): returns (output ``[B, C, Hq, D]``, which candidates
    the cache keeps, their new scores)."""
    s, w, k = policy.budget.sink, policy.budget.window, policy.budget.topk
    bsz, hq, chunk, _ = query.shape
    slots = policy.budget.total
    cached = torch.arange(cand.pos.shape[-1], device=cand.pos.device) < slots
    before = cached & cand.valid & (cand.pos >= s) & (cand.pos <= first[:, None, None] - w)
    visible = cand.valid & ~(before & ~_best(cand.score, before, k))  # the cache as it stands at the first query
    score = cand.score
    rows = max(1, min(chunk, budget_bytes // max(1, 4 * bsz * hq * cand.pos.shape[-1])))
    outs = []
    for start in range(0, chunk, rows):  # query blocks: the probabilities of a block at a time
        sl = slice(start, min(chunk, start + rows))
        sees = visible[:, :, None, :] & (cand.pos[:, :, None, :] <= new_pos[:, None, sl, None]) \
            & valid[:, None, sl, None]
        out, probs = explicit_attention(query[:, :, sl], cand.keys, cand.values, sees, scale=scale)
        outs.append(out)
        observed = policy.observe_chunk(score, probs.amax(2))  # needed if any head of the group needs it
        score = torch.where(valid[:, sl].any(-1)[:, None, None], observed, score)
    after = visible & (cand.pos >= s) & (cand.pos <= last - w)
    keep = visible & ~(after & ~_best(score, after, k))
    return torch.cat(outs, dim=1), keep, score


# -----------------------------------------------------------------------------
# one decoding step on the slot tensors (pure functions of tensors: compilable, CUDA-graph friendly, in place)


def _put(store, slot, where, new):
    """Per (row, head): ``store[b, h, slot[b, h]] = new[b, h]`` where ``where[b, h]`` holds, in place."""
    idx = slot[..., None]
    if store.dim() == 4:
        idx, new, where = idx[..., None].expand(-1, -1, -1, store.shape[-1]), new[:, :, None], where[..., None, None]
    else:
        new, where = new[..., None], where[..., None]
    store.scatter_(2, idx, torch.where(where, new.to(store.dtype), store.gather(2, idx)))


def _compete(keys, values, slot_pos, slot_prio, slot_score, ring, leaving, prio, enters, sink, window):
    """The token leaving the window (now in slot ``ring``) takes the weakest long-range slot if it beats it.

    Weakest = lowest priority, the oldest among equals; a tie with the leaving token goes to it (the newer).
    ``slot_prio`` holds what is ranked (static priorities, or a dynamic policy's scores); ``slot_score`` (dynamic
    policies) travels with the token.
    """
    bsz, hkv, _ = slot_pos.shape
    pos_r = slot_pos[..., sink + window:]
    prio_r = slot_prio[..., sink + window:]
    empty = pos_r < 0
    has_empty = empty.any(-1)
    weakest_prio = prio_r.masked_fill(empty, float("inf")).amin(-1)
    is_weakest = (prio_r == weakest_prio[..., None]) & ~empty
    weakest = torch.where(is_weakest, pos_r, torch.iinfo(torch.long).max).argmin(-1)
    target = sink + window + torch.where(has_empty, empty.long().argmax(-1), weakest)
    accept = enters[:, None] & (has_empty | (prio >= weakest_prio))
    src = ring[:, None, None].expand(bsz, hkv, 1)
    moved_k = keys.gather(2, src[..., None].expand(-1, -1, -1, keys.shape[-1]))[:, :, 0]
    moved_v = values.gather(2, src[..., None].expand(-1, -1, -1, values.shape[-1]))[:, :, 0]
    _put(keys, target, accept, moved_k)
    _put(values, target, accept, moved_v)
    _put(slot_pos, target, accept, leaving[:, None].expand(bsz, hkv))
    if slot_score is not None:
        _put(slot_score, target, accept, slot_score.gather(-1, src)[..., 0])
    else:
        _put(slot_prio, target, accept, prio)


def _best_by(score, pos, ok, count: int):
    """Which entries are the ``count`` best ``ok`` ones by (score, position), ties to the newer, in any slot order."""
    if count == 0:
        return torch.zeros_like(ok)
    score = torch.where(ok, score, float("-inf"))
    by_pos = torch.where(ok, pos, -1).argsort(dim=-1, stable=True)  # not ok: the lowest of equal scores
    order = by_pos.gather(-1, score.gather(-1, by_pos).argsort(dim=-1, stable=True))  # ascending (score, position)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order))
    return ok & (rank >= order.shape[-1] - count)


def _compete_anchored(keys, values, slot_pos, slot_prio, slot_anchor, ring, leaving, prio, anchor, enters, sink,
                      window, topk, anchors):
    """:func:`_compete` with anchor slots: the long-range tokens and the leaving one compete in both pools (``topk -
    anchors`` by ``slot_prio``, ``anchors`` by ``slot_anchor``); whoever neither pool keeps leaves its slot empty,
    and the leaving token, if kept, takes the first slot not kept (there is one: at most ``topk`` of the ``topk + 1``
    are). Exact because each pool's best are among the tokens still cached (evicted ones never return)."""
    bsz, hkv, _ = slot_pos.shape
    lr = sink + window
    held = slot_pos[..., lr:] >= 0
    pos = torch.cat([slot_pos[..., lr:], leaving[:, None, None].expand(bsz, hkv, 1)], -1)  # [B, Hkv, topk + 1]
    ok = torch.cat([held, enters[:, None, None].expand(bsz, hkv, 1)], -1)
    keep = _best_by(torch.cat([slot_prio[..., lr:], prio[..., None]], -1), pos, ok, topk - anchors) | \
        _best_by(torch.cat([slot_anchor[..., lr:], anchor[..., None]], -1), pos, ok, anchors)
    kept_slots, takes = keep[..., :-1], keep[..., -1]
    gone = held & ~kept_slots
    for store, empty in ((slot_pos, -1), (slot_prio, float("-inf")), (slot_anchor, float("-inf"))):
        store[..., lr:] = torch.where(gone, empty, store[..., lr:])
    target = lr + (~kept_slots).long().argmax(-1)  # [B, Hkv]; used only where the leaving token is kept
    src = ring[:, None, None].expand(bsz, hkv, 1)
    _put(keys, target, takes, keys.gather(2, src[..., None].expand(-1, -1, -1, keys.shape[-1]))[:, :, 0])
    _put(values, target, takes, values.gather(2, src[..., None].expand(-1, -1, -1, values.shape[-1]))[:, :, 0])
    _put(slot_pos, target, takes, leaving[:, None].expand(bsz, hkv))
    _put(slot_prio, target, takes, prio)
    _put(slot_anchor, target, takes, anchor)


def _insert(keys, values, slot_pos, slot_prio, slot_score, seen, ring, key, value, valid, slot_anchor=None):
    """The new token takes its ring (or sink) slot; rows that are padding here keep everything as it was."""
    bsz, hkv, _ = key.shape
    where = valid[:, None].expand(bsz, hkv)
    slot = ring[:, None].expand(bsz, hkv)
    _put(keys, slot, where, key)
    _put(values, slot, where, value)
    _put(slot_pos, slot, where, seen[:, None].expand(bsz, hkv))
    for store in (slot_prio, slot_anchor):
        if store is not None:
            _put(store, slot, where, torch.full((bsz, hkv), float("-inf"), device=key.device))
    if slot_score is not None:
        _put(slot_score, slot, where, torch.zeros(bsz, hkv, device=key.device))
    seen += valid.long()


def static_slot_step(keys, values, slot_pos, slot_prio, seen, query, key, value, prio, valid, sink: int, window: int,
                     topk: int, scale: float, full: bool = False, slot_anchor=None, anchor=None, anchors: int = 0):
    """A static policy's decoding step: ``prio`` is the ranked priority of the token leaving the window.
    ``full``: every slot is filled, so the attention reads the slots without a mask. With ``anchors`` anchor slots
    (:func:`kvpop.retention.anchored_eviction_positions`) ``anchor`` is what they rank the leaving token by and
    ``slot_anchor`` what they rank the held ones by."""
    pos = seen.clone()
    ring = torch.where(pos < sink, pos, sink + (pos - sink) % window)  # the new token's slot = the leaving token's
    leaving = pos - window
    if anchors > 0:
        _compete_anchored(keys, values, slot_pos, slot_prio, slot_anchor, ring, leaving, prio, anchor,
                          valid & (leaving >= sink), sink, window, topk, anchors)
    elif topk > 0:
        _compete(keys, values, slot_pos, slot_prio, None, ring, leaving, prio, valid & (leaving >= sink), sink, window)
    _insert(keys, values, slot_pos, slot_prio, None, seen, ring, key, value, valid, slot_anchor)
    out, _ = slot_attention(query, keys, values, None if full else slot_pos >= 0, scale=scale)
    return torch.where(valid[:, None, None, None], torch.nan_to_num(out), 0.0)


def static_step(policy, layer, keys, values, slot_pos, slot_prio, seen, state, query, key, value, valid, sink: int,
                window: int, topk: int, scale: float, full: bool, slot_anchor=None):
    """One layer's whole decoding step for a static policy — scorer step, ranking, slot bookkeeping, attention — as
    one function, so that ``torch.compile`` fuses it (``Runtime.compile_decode``). A held scorer ``state`` is updated
    in place (a replayed CUDA graph reads and writes the same memory); returns ``(output, new state or None)``.
    ``slot_anchor``: the cache's anchor priorities when the policy has anchor slots."""
    raw, new_state = policy.step(layer, key, value, valid, seen, state)
    if state is not None:
        for name, tensor in new_state.items():
            state[name].copy_(tensor)
        new_state = None
    leaving = (seen - window)[:, None]
    prio = policy.ranked(raw.float(), leaving)
    anchor = policy.anchor_ranked(raw.float(), leaving) if policy.anchors else None
    out = static_slot_step(keys, values, slot_pos, slot_prio, seen, query, key, value, prio, valid, sink, window, topk,
                           scale, full, slot_anchor, anchor, policy.anchors)
    return out, new_state


def _dynamic_step(layer, query, key, value, valid, scale, full=False):
    """TOVA / H2O: the leaving token and the long-range slots compete on the attention they have received."""
    s, w, k = layer.budget.sink, layer.budget.window, layer.budget.topk
    bsz, hkv, _ = key.shape
    pos = layer.seen.clone()
    ring = torch.where(pos < s, pos, s + (pos - s) % w)
    leaving = pos - w
    prio = layer.slot_score.gather(-1, ring[:, None, None].expand(bsz, hkv, 1))[..., 0]
    if k > 0:
        _compete(layer.keys, layer.values, layer.slot_pos, layer.slot_score, layer.slot_score, ring, leaving, prio,
                 valid & (leaving >= s), s, w)
    _insert(layer.keys, layer.values, layer.slot_pos, layer.slot_prio, layer.slot_score, layer.seen, ring, key, value,
            valid)
    filled = layer.slot_pos >= 0
    out, probs = slot_attention(query, layer.keys, layer.values, None if full else filled, scale=scale,
                                return_probs=True)
    received = probs.view(bsz, hkv, probs.shape[1] // hkv, -1).amax(2)  # needed if any head of the group needs it
    scores = torch.where(filled, layer.policy.observe(layer.slot_score, received), 0.0)
    layer.slot_score.copy_(torch.where(valid[:, None, None], scores, layer.slot_score))
    return torch.where(valid[:, None, None, None], torch.nan_to_num(out), 0.0)


@functools.cache
def _compiled_static_step():
    return torch.compile(static_step)  # automatic dynamic shapes: a new batch size compiles once more, not per size


# Cache layer types of policies whose cache is not the fixed B slots, by policy name. The module defining one
# registers it (kvpop.dms_cache, imported by the package), so that this module never imports what builds on it.
LAYER_TYPES: dict[str, type[KVpopLayer]] = {}
HEADWISE = "headwise"  # the entry for a policy with per-head budgets, whatever its name (kvpop.headwise_cache)


class KVpopCache(Cache):
    """A transformers Cache of ``KVpopLayer``s; ``model.generate`` of a retrofitted model creates one itself."""

    def __init__(self, model, policy: Policy | None = None, *, dynamic_chunks: bool = True):
        """``dynamic_chunks=False``: a dynamic policy takes a multi-token call token by token, exactly as decoding
        (teacher forcing); by default a call is one chunk (bounded prefill; module docstring)."""
        runtime = getattr(model, "kvpop_runtime", None)
        if runtime is None:
            raise ValueError("KVpopCache needs a retrofitted model: call kvpop.retrofit(model, budget, ...) first")
        policy = policy or runtime.policy
        if policy.budget is None:
            raise ValueError("the dense policy has no budget: decode it with transformers' DynamicCache")
        self.policy = policy
        self.meter = KVMeter()
        layers = []
        for i in range(runtime.num_layers):
            own = runtime.layer_policy(i, policy)  # a local layer: a ring of its own window (kvpop.local_layers)
            layer_class = LAYER_TYPES.get(HEADWISE if own.head_topk is not None else own.name, KVpopLayer)
            if own.head_topk is not None and layer_class is KVpopLayer:
                raise ValueError("per-head budgets need kvpop.headwise_cache (import kvpop) to register their layer")
            if own.ragged and layer_class is KVpopLayer:
                raise ValueError(f"policy {own.name!r} keeps a ragged number of tokens per head, and no cache layer "
                                 f"type is registered for it in kvpop.cache.LAYER_TYPES")
            layers.append(layer_class(runtime, i, own, self.meter, dynamic_chunks))
        super().__init__(layers=layers)

    @property
    def prefill_chunk(self) -> int:
        """The chunk size at which a chunk takes the fused path on CUDA (FlexAttention and, with
        ``Runtime.compile_prefill``, the compiled bookkeeping; one shape, compiled once): ``Runtime.prefill_chunk``
        unless :func:`kvpop.decode.prefill` or ``generate`` feeds the prompt in chunks of another size. Chunks of any
        other size (a prompt's first, shorter one) take the any-shape path, with the same result."""
        return self.layers[0].prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int) -> None:
        for layer in self.layers:
            layer.prefill_chunk = chunk

    @property
    def peak_kv_bytes(self) -> int:
        """The most key/value bytes this cache has held at once: ``B`` slots per layer, plus one layer's ``B + C``
        candidates while a chunk of ``C`` tokens goes through (:class:`KVMeter`)."""
        return self.meter.peak

    def repeated(self, repeats: int) -> "KVpopCache":
        """A new cache whose rows are ``repeats`` copies of each of this cache's rows (this one is left as it is):
        one prefill, many continuations."""
        other = copy.copy(self)
        other.meter = KVMeter()
        other.layers = []
        for layer in self.layers:
            clone = copy.copy(layer)
            clone.meter = other.meter
            if clone.is_initialized:
                clone.meter.hold(clone.nbytes()["kv"])  # released again by the re-indexing
            clone.batch_repeat_interleave(repeats)
            other.layers.append(clone)
        return other

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``kv`` (= (B × global layers + Σ W over local layers) × Hkv × head_dim × 2 × dtype size ×
        batch; :func:`kv_slots`), metadata, scorer state."""
        total = {"kv": 0, "metadata": 0, "scorer_state": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                total[key] += value
        return total


def kv_slots(runtime, policy: Policy | None = None) -> int:
    """Slots per (row, KV head) over all layers once every slot is filled: ``B`` per global layer plus ``W`` per local
    layer (METHOD §5); K/V bytes = slots × Hkv × head_dim × 2 × dtype size × batch. Under per-head budgets ``B`` is
    their mean, which they sum to exactly (METHOD §7), so the bytes are exact there too."""
    return sum(runtime.layer_policy(i, policy).budget.total for i in range(runtime.num_layers))
