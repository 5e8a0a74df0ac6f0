"""The fixed-budget cache (METHOD §5): exactly ``B = sink + window + topk`` slots per (layer, KV head, row).

Slot layout per (row, KV head)::

    [0, sink)                  sinks: token t < sink lives in slot t
    [sink, sink + window)      the protected window, a ring: token t >= sink lives in slot sink + (t - sink) % window
    [sink + window, B)         long-range slots: the best ``topk`` eligible tokens, min-priority replacement

Decoding one token at position ``p``: the token ``p - window`` leaves the ring (its slot is the one token ``p``
takes), receives its priority now (METHOD §1), and replaces the weakest long-range slot if it beats it (ties: the
newer token wins); then the query attends to every filled slot. A chunk of several tokens (prefill, chunked
prefill) runs as one masked attention over "slots + chunk" — every token that can still be retained — and is
then compressed back into the slots. Both give exactly the retained sets of the one-pass mask.

Memory is constant in the generated length: keys and values ``2 × B × Hkv × head_dim × dtype`` per layer and row,
plus per-slot metadata (int64 position, fp32 priority, fp32 attention score for dynamic policies) and the scorer's
O(window) state. ``KVpopCache.nbytes()`` itemises it.
"""
from __future__ import annotations

import functools

import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop.attention import retention_attention, slot_attention
from kvpop.policies.base import LayerView, Policy
from kvpop.retention import eviction_positions, retained

# transformers 5.24 renamed the `past_key_values` argument of forward/generate to `cache` (the old name warns until
# 5.40 / 6.0); 5.17 knows only the old one
CACHE_KWARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


class KVpopLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, runtime, layer_idx: int, policy: Policy):
        super().__init__()
        self.runtime, self.layer_idx, self.policy = runtime, layer_idx, policy
        self.budget = policy.budget
        self.columns = 0  # input columns seen, padding included: what generate() counts positions with

    # -- transformers' layer interface -------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, hkv, _, dim = key_states.shape
        slots, device = self.budget.total, key_states.device
        self.device = device
        self.keys = key_states.new_zeros(bsz, hkv, slots, dim)
        self.values = value_states.new_zeros(bsz, hkv, slots, value_states.shape[-1])
        self.slot_pos = torch.full((bsz, hkv, slots), -1, dtype=torch.long, device=device)  # -1: empty
        self.slot_prio = torch.full((bsz, hkv, slots), float("-inf"), device=device)  # ranked priority
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
        return ["keys", "values", "slot_pos", "slot_prio", "slot_score", "seen"]

    def _index_batch(self, fn):
        if not self.is_initialized:
            return
        for name in self._batch_tensors():
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if self.scorer_state is not None:
            self.scorer_state = {k: fn(v) for k, v in self.scorer_state.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(lambda x: x[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._index_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.columns = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a fixed-budget cache has evicted the past: it cannot be cropped (assisted "
                                  "decoding / rollback is not supported)")

    # -- KVpop -------------------------------------------------------------------------------------------------

    def nbytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"kv": 0, "metadata": 0, "scorer_state": 0}
        meta = [self.slot_pos, self.slot_prio, self.slot_score, self.seen]
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
        layer = LayerView(self.layer_idx, module, self.runtime)
        if chunk > 1 and not self.policy.dynamic:
            return self._chunk(layer, query, key_new, value_new, valid, scale)
        # one token at a time: decoding, and every input of a dynamic policy (its scores need each attention)
        outs = [self._step(layer, query[:, :, i:i + 1], key_new[:, :, i], value_new[:, :, i], valid[:, i], scale)
                for i in range(chunk)]
        return torch.cat(outs, dim=1)

    def _step(self, layer, query, key, value, valid, scale):
        if self.policy.dynamic:
            return _dynamic_step(self, query, key, value, valid, scale)
        w = self.budget.window
        raw, state = _policy_step(self.policy, self.runtime)(layer, key, value, valid, self.seen, self.scorer_state)
        self._keep_state(state)
        prio = self.policy.ranked(raw.float(), (self.seen - w)[:, None])
        step = _compiled_static_step() if self.runtime.compile_decode else static_slot_step
        return step(self.keys, self.values, self.slot_pos, self.slot_prio, self.seen, query, key, value, prio, valid,
                    self.budget.sink, w, self.budget.topk, scale)

    def _keep_state(self, state):
        """Adopt the scorer's new state by copying into the buffers already held (a replayable CUDA graph needs
        every step to read and write the same memory)."""
        if self.scorer_state is None or state is None or state.keys() != self.scorer_state.keys():
            self.scorer_state = state
            return
        for name, tensor in state.items():
            if tensor is not self.scorer_state[name]:
                self.scorer_state[name].copy_(tensor)

    def _chunk(self, layer, query, key_new, value_new, valid, scale):
        s, w = self.budget.sink, self.budget.window
        bsz, hkv, chunk, _ = key_new.shape
        device = key_new.device
        arange = torch.arange(chunk, device=device)
        leading = (valid.long().cumsum(-1) == 0).sum(-1)
        count = valid.sum(-1)
        if not torch.equal(valid, (arange >= leading[:, None]) & (arange < (leading + count)[:, None])):
            raise ValueError("KVpop's cache takes left padding only, in the first chunk")
        if bool(((self.seen > 0) & (leading > 0)).any()) or bool((count < chunk).any() & (self.seen > 0).any()):
            raise ValueError("padding after the first chunk: KVpop's cache takes left padding only")
        new_pos = self.seen[:, None] + arange - leading[:, None]  # [B, C]; padding negative
        new_prio = torch.full((bsz, hkv, chunk), float("-inf"), device=device)
        if bool((self.seen == 0).all()):  # prefill from empty: the whole chunk at once
            raw, state = self.policy.start(layer, key_new, value_new, valid, new_pos[:, None, :])
            self._keep_state(state)
            new_prio = self.policy.ranked(raw.float(), new_pos[:, None, :])
        else:  # a chunk after cached tokens: priorities as the tokens leave the window, one step each
            for i in range(chunk):
                raw, state = self.policy.step(layer, key_new[:, :, i], value_new[:, :, i], valid[:, i],
                                              new_pos[:, i], self.scorer_state)
                self._keep_state(state)
                leaving = new_pos[:, i] - w
                prio = self.policy.ranked(raw.float(), leaving[:, None])
                if i >= w:
                    new_prio[:, :, i - w] = prio
                else:  # the leaving token sits in the ring
                    slot = (s + (leaving - s) % w)[:, None, None].expand(bsz, hkv, 1)
                    cur = self.slot_prio.gather(-1, slot)
                    upd = torch.where((leaving >= s)[:, None, None], prio[..., None], cur)
                    self.slot_prio.scatter_(-1, slot, upd)
        # candidates: every cached slot (sorted by position) and the chunk
        order = self.slot_pos.argsort(-1)
        cand_pos = torch.cat([self.slot_pos.gather(-1, order), new_pos[:, None, :].expand(bsz, hkv, chunk)], -1)
        cand_prio = torch.cat([self.slot_prio.gather(-1, order), new_prio], -1)
        cand_valid = torch.cat([self.slot_pos.gather(-1, order) >= 0, valid[:, None, :].expand(bsz, hkv, chunk)], -1)
        gather4 = order[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        cand_k = torch.cat([self.keys.gather(2, gather4), key_new.to(self.keys.dtype)], 2)
        cand_v = torch.cat([self.values.gather(2, gather4), value_new.to(self.values.dtype)], 2)
        evict = eviction_positions(cand_prio, self.budget, positions=cand_pos)
        out = retention_attention(query, cand_k, cand_v, q_pos=new_pos, kv_pos=cand_pos, kv_evict=evict,
                                  kv_valid=cand_valid, budget=self.budget, scale=scale)
        # compress: keep what the last query of the chunk retains
        last = (self.seen + count - 1)[:, None, None]
        keep = cand_valid & retained(last, cand_pos, evict, self.budget)
        in_window = cand_pos > last - w
        is_sink = cand_pos < s
        long_range = keep & ~in_window & ~is_sink
        slot = torch.where(is_sink, cand_pos, s + (cand_pos - s) % w)
        slot = torch.where(long_range, s + w + long_range.long().cumsum(-1) - 1, slot)
        slots = self.budget.total
        slot = torch.where(keep, slot, slots)  # dropped tokens go to a spare slot that is cut off
        self.keys.copy_(_scatter_slots(cand_k, slot, slots, 0.0))
        self.values.copy_(_scatter_slots(cand_v, slot, slots, 0.0))
        self.slot_pos.copy_(_scatter_slots(cand_pos, slot, slots, -1))
        self.slot_prio.copy_(_scatter_slots(cand_prio, slot, slots, float("-inf")))
        self.seen += count
        return out


def _scatter_slots(values: torch.Tensor, slot: torch.Tensor, slots: int, fill) -> torch.Tensor:
    """Place candidates ``[B, H, N(, D)]`` into ``slots`` (+1 spare for the dropped) by ``slot [B, H, N]``."""
    shape = (*values.shape[:2], slots + 1, *values.shape[3:])
    out = torch.full(shape, fill, dtype=values.dtype, device=values.device)
    index = slot if values.dim() == 3 else slot[..., None].expand_as(values)
    return out.scatter(2, index, values)[:, :, :slots]


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


def _insert(keys, values, slot_pos, slot_prio, slot_score, seen, ring, key, value, valid):
    """The new token takes its ring (or sink) slot; rows that are padding here keep everything as it was."""
    bsz, hkv, _ = key.shape
    where = valid[:, None].expand(bsz, hkv)
    slot = ring[:, None].expand(bsz, hkv)
    _put(keys, slot, where, key)
    _put(values, slot, where, value)
    _put(slot_pos, slot, where, seen[:, None].expand(bsz, hkv))
    _put(slot_prio, slot, where, torch.full((bsz, hkv), float("-inf"), device=key.device))
    if slot_score is not None:
        _put(slot_score, slot, where, torch.zeros(bsz, hkv, device=key.device))
    seen += valid.long()


def static_slot_step(keys, values, slot_pos, slot_prio, seen, query, key, value, prio, valid, sink: int, window: int,
                     topk: int, scale: float):
    """A static policy's decoding step: ``prio`` is the ranked priority of the token leaving the window."""
    pos = seen.clone()
    ring = torch.where(pos < sink, pos, sink + (pos - sink) % window)  # the new token's slot = the leaving token's
    leaving = pos - window
    if topk > 0:
        _compete(keys, values, slot_pos, slot_prio, None, ring, leaving, prio, valid & (leaving >= sink), sink, window)
    _insert(keys, values, slot_pos, slot_prio, None, seen, ring, key, value, valid)
    out, _ = slot_attention(query, keys, values, slot_pos >= 0, scale=scale)
    return torch.where(valid[:, None, None, None], torch.nan_to_num(out), 0.0)


def _dynamic_step(layer, query, key, value, valid, scale):
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
    out, probs = slot_attention(query, layer.keys, layer.values, filled, scale=scale, return_probs=True)
    received = probs.view(bsz, hkv, probs.shape[1] // hkv, -1).amax(2)  # needed if any head of the group needs it
    scores = torch.where(filled, layer.policy.observe(layer.slot_score, received), 0.0)
    layer.slot_score.copy_(torch.where(valid[:, None, None], scores, layer.slot_score))
    return torch.where(valid[:, None, None, None], torch.nan_to_num(out), 0.0)


@functools.cache
def _compiled_static_step():
    return torch.compile(static_slot_step, dynamic=False)


def _policy_step(policy, runtime):
    """The policy's step; compiled (once per policy class) when the runtime asks for compiled decoding."""
    if not runtime.compile_decode:
        return policy.step
    return _compiled_policy_step(type(policy)).__get__(policy)


@functools.cache
def _compiled_policy_step(policy_cls):
    return torch.compile(policy_cls.step, dynamic=False)


# Cache layer types of policies whose cache is not the fixed B slots, by policy name. The module defining one
# registers it (kvpop.dms_cache, imported by the package), so that this module never imports what builds on it.
LAYER_TYPES: dict[str, type[KVpopLayer]] = {}


class KVpopCache(Cache):
    """A transformers Cache of ``KVpopLayer``s; ``model.generate`` of a retrofitted model creates one itself."""

    def __init__(self, model, policy: Policy | None = None):
        runtime = getattr(model, "kvpop_runtime", None)
        if runtime is None:
            raise ValueError("KVpopCache needs a retrofitted model: call kvpop.retrofit(model, budget, ...) first")
        policy = policy or runtime.policy
        if policy.budget is None:
            raise ValueError("the dense policy has no budget: decode it with transformers' DynamicCache")
        self.policy = policy
        layer_class = LAYER_TYPES.get(policy.name, KVpopLayer)
        if policy.ragged and layer_class is KVpopLayer:
            raise ValueError(f"policy {policy.name!r} keeps a ragged number of tokens per head, and no cache layer "
                             f"type is registered for it in kvpop.cache.LAYER_TYPES")
        super().__init__(layers=[layer_class(runtime, i, policy) for i in range(runtime.num_layers)])

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``kv`` (= B × layers × Hkv × head_dim × 2 × dtype size × batch), metadata, scorer state."""
        total = {"kv": 0, "metadata": 0, "scorer_state": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                total[key] += value
        return total
