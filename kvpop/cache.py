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

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop.attention import retention_attention, slot_attention
from kvpop.policies.base import LayerView, Policy
from kvpop.retention import eviction_positions, retained


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
        s, w, k = self.budget.sink, self.budget.window, self.budget.topk
        bsz, hkv, dim = key.shape
        pos = self.seen.clone()  # [B] position of the new token
        ring = torch.where(pos < s, pos, s + (pos - s) % w)  # its slot; also where token pos - w sits
        leaving = pos - w
        if self.policy.dynamic:
            prio = self.slot_score.gather(-1, ring[:, None, None].expand(bsz, hkv, 1))[..., 0]
        else:
            raw, state = self.policy.step(layer, key, value, valid, pos, self.scorer_state)
            self._keep_state(state)
            prio = self.policy.ranked(raw.float(), leaving[:, None])
        if k > 0:
            self._compete(ring, leaving, prio, valid & (leaving >= s))
        # the new token takes its slot (rows that are padding here keep everything as it was)
        self._write(ring[:, None].expand(bsz, hkv), valid[:, None].expand(bsz, hkv), key, value,
                    pos[:, None].expand(bsz, hkv), torch.full((bsz, hkv), float("-inf"), device=key.device),
                    torch.zeros(bsz, hkv, device=key.device))
        self.seen += valid.long()
        filled = self.slot_pos >= 0
        out, probs = slot_attention(query, self.keys, self.values, filled, scale=scale,
                                    return_probs=self.policy.dynamic)
        if self.policy.dynamic:
            group = probs.shape[1] // hkv
            received = probs.view(bsz, hkv, group, -1).amax(2)  # a token matters if any head of the group needs it
            scores = torch.where(filled, self.policy.observe(self.slot_score, received), 0.0)
            self.slot_score.copy_(torch.where(valid[:, None, None], scores, self.slot_score))
        return torch.where(valid[:, None, None, None], torch.nan_to_num(out), 0.0)

    def _compete(self, ring, leaving, prio, enters):
        """The token leaving the window (now in slot ``ring``) takes the weakest long-range slot if it beats it."""
        s, w = self.budget.sink, self.budget.window
        bsz, hkv, _ = self.slot_pos.shape
        region = slice(s + w, None)
        pos_r = self.slot_pos[..., region]
        prio_r = (self.slot_score if self.policy.dynamic else self.slot_prio)[..., region]
        empty = pos_r < 0
        has_empty = empty.any(-1)
        weakest_prio = prio_r.masked_fill(empty, float("inf")).amin(-1)
        is_weakest = (prio_r == weakest_prio[..., None]) & ~empty
        big = torch.iinfo(torch.long).max
        weakest = torch.where(is_weakest, pos_r, big).argmin(-1)  # among equal priorities the oldest goes
        target = torch.where(has_empty, empty.long().argmax(-1), weakest)
        accept = enters[:, None] & (has_empty | (prio >= weakest_prio))  # ties: the newer (leaving) token wins
        src = ring[:, None, None].expand(bsz, hkv, 1)
        moved_k = self.keys.gather(2, src[..., None].expand(-1, -1, -1, self.keys.shape[-1]))[:, :, 0]
        moved_v = self.values.gather(2, src[..., None].expand(-1, -1, -1, self.values.shape[-1]))[:, :, 0]
        score = self.slot_score.gather(-1, src)[..., 0] if self.policy.dynamic else None
        self._write(s + w + target, accept, moved_k, moved_v, leaving[:, None].expand(bsz, hkv), prio, score)

    def _keep_state(self, state):
        """Adopt the scorer's new state by copying into the buffers already held (a replayable CUDA graph needs
        every step to read and write the same memory)."""
        if self.scorer_state is None or state is None or state.keys() != self.scorer_state.keys():
            self.scorer_state = state
            return
        for name, tensor in state.items():
            if tensor is not self.scorer_state[name]:
                self.scorer_state[name].copy_(tensor)

    def _write(self, slot, where, key, value, pos, prio, score):
        """Per (row, head): put one token into ``slot [B, Hkv]`` where ``where [B, Hkv]`` holds (in place)."""
        idx = slot[..., None]

        def put(store, new):
            ix = idx[..., None].expand(-1, -1, -1, store.shape[-1]) if store.dim() == 4 else idx
            new = new[:, :, None] if store.dim() == 4 else new[..., None]
            old = store.gather(2, ix)
            mask = where[..., None, None] if store.dim() == 4 else where[..., None]
            store.scatter_(2, ix, torch.where(mask, new.to(store.dtype), old))

        put(self.keys, key)
        put(self.values, value)
        put(self.slot_pos, pos)
        put(self.slot_prio, prio)
        if self.slot_score is not None and score is not None:
            put(self.slot_score, score)

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
        super().__init__(layers=[KVpopLayer(runtime, i, policy) for i in range(runtime.num_layers)])

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``kv`` (= B × layers × Hkv × head_dim × 2 × dtype size × batch), metadata, scorer state."""
        total = {"kv": 0, "metadata": 0, "scorer_state": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                total[key] += value
        return total
