"""DMS decoding (kvpop.dms): a cache whose memory follows its peak occupancy, not the sequence length.

Per (layer, row, KV head) the cache holds exactly what the DMS mask still shows to the next query: the sinks, the
tokens of the last ``window`` positions, and the older tokens their gates kept. Heads keep different numbers of
tokens, so a layer's buffer is ``[B, Hkv, capacity, D]`` with free slots (position -1) that new tokens reuse. The
capacity is the next power of two of the most tokens any (row, head) of the layer has held after a call: it grows,
by doubling, only when a head needs more, so the bytes are less than twice the peak occupancy whatever the length.
``nbytes()`` itemises them; :func:`cache_stats` reports the mean and the maximum retained tokens per (layer, head).

Decoding token ``p``: its gate decides token ``p - 1`` (still cached: it is in the window); the evicted tokens that
leave the window now (``t <= p - window``) free their slots; ``p`` takes a free slot; the query attends to every
filled slot. A chunk of several tokens (prefill, chunked prefill) runs as one masked attention over "slots + chunk"
with DMS's eviction positions, then is compressed back to what its last query sees. Both give exactly the visibility
of the one-pass mask. The buffer grows with Python-side checks, so this cache is neither compiled nor CUDA-graphed.

**Capped DMS** (``cap`` of the policy, :func:`kvpop.dms.capped_eviction_positions`): the buffer is ``cap`` slots from
the first token (the reservation, whatever the sequence), each slot keeps its token's decision logit, and when a
token enters the long-range part (leaves the window) while ``cap - sink - window`` kept tokens are already there, the
one of the highest logit (ties: the older) is dropped — one per step, as one token enters per step. A chunk ranks its
candidates by the same rule (the cached tokens hold every token still retained: evicted ones never return).
"""
from __future__ import annotations

import torch

from kvpop.attention import CHUNK_BACKEND, retention_attention, slot_attention
from kvpop.cache import LAYER_TYPES, KVpopLayer, _put
from kvpop.budget import Budget
from kvpop.dms import NEVER, NO_DECISION, capped_keep_priority, decision_logits, retained_counts
from kvpop.retention import eviction_positions as ranked_eviction_positions
from kvpop.policies.base import LayerView
from kvpop.retention import retained


def _scatter_slots(values: torch.Tensor, slot: torch.Tensor, slots: int, fill) -> torch.Tensor:
    """Place candidates ``[B, H, N(, D)]`` into ``slots`` (+1 spare for the dropped) by ``slot [B, H, N]``."""
    shape = (*values.shape[:2], slots + 1, *values.shape[3:])
    out = torch.full(shape, fill, dtype=values.dtype, device=values.device)
    index = slot if values.dim() == 3 else slot[..., None].expand_as(values)
    return out.scatter(2, index, values)[:, :, :slots]


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class DMSLayer(KVpopLayer):
    """One layer of a :class:`kvpop.KVpopCache` under the DMS policy (the cache picks this layer class)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, hkv, _, dim = key_states.shape
        device = key_states.device
        self.device = device
        self.keys = key_states.new_zeros(bsz, hkv, 0, dim)
        self.values = value_states.new_zeros(bsz, hkv, 0, value_states.shape[-1])
        self.slot_pos = torch.full((bsz, hkv, 0), -1, dtype=torch.long, device=device)  # -1: free
        self.slot_evict = torch.zeros(bsz, hkv, 0, dtype=torch.bool, device=device)  # decided: leaves with the window
        # capped DMS: each slot's decision logit z (the cap ranks by -z); nothing without a cap
        self.slot_logit = torch.zeros(bsz, hkv, 0, device=device) if self.policy.cap else None
        self.seen = torch.zeros(bsz, dtype=torch.long, device=device)  # real tokens per row
        self.retained_sum = torch.zeros(bsz, hkv, dtype=torch.long, device=device)  # Σ over queries of held tokens
        self.retained_max = torch.zeros(bsz, hkv, dtype=torch.long, device=device)
        self.queries = torch.zeros(bsz, dtype=torch.long, device=device)
        self.scorer_state = None
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    def _batch_tensors(self):
        return ["keys", "values", "slot_pos", "slot_evict", "seen", "retained_sum", "retained_max", "queries"] \
            + (["slot_logit"] if self.slot_logit is not None else [])

    def nbytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"kv": 0, "metadata": 0, "scorer_state": 0}
        meta = [getattr(self, name) for name in self._batch_tensors()[2:]]
        return {"kv": self.keys.nbytes + self.values.nbytes, "metadata": sum(t.nbytes for t in meta),
                "scorer_state": 0}

    def stats(self) -> dict[str, torch.Tensor]:
        """Retained tokens per KV head over every query seen (all rows): ``{"mean": [Hkv], "max": [Hkv]}``."""
        if not self.is_initialized:
            raise ValueError("the DMS cache has served no query yet: decode or prefill through it first")
        queries = self.queries.sum().clamp(min=1)
        return {"mean": self.retained_sum.sum(0).double() / queries, "max": self.retained_max.amax(0)}

    def attend(self, module, query, key_new, value_new, valid_cols, scale) -> torch.Tensor:
        if self.policy.relaxed:
            raise ValueError("the DMS cache runs hard decisions: decode with kvpop.set_policy(model, 'dms', budget) "
                             "(relaxed=False), the relaxed form is for training forwards")
        bsz, _, chunk, _ = query.shape
        valid = (torch.ones(bsz, chunk, dtype=torch.bool, device=query.device) if valid_cols is None
                 else valid_cols[:, -chunk:].to(device=query.device, dtype=torch.bool))
        self.columns += chunk
        gates = self.policy.gate_logits(LayerView(self.layer_idx, module, self.runtime))  # [B, Hkv, C]
        if chunk > 1:
            return self._chunk(query, key_new, value_new, gates, valid, scale)
        return self._step(query, key_new[:, :, 0], value_new[:, :, 0], gates[..., 0], valid[:, 0], scale)

    def _decide_previous(self, gate: torch.Tensor, deciding: torch.Tensor) -> None:
        """The gate ``[B, Hkv]`` of token ``seen`` decides token ``seen - 1`` in the rows ``deciding [B]``."""
        previous = self.seen - 1
        decided = (deciding & (previous >= self.budget.sink))[:, None]
        z = gate - self.policy.threshold
        evict = decided & (z > 0)
        slot = (self.slot_pos == previous[:, None, None]) & (self.slot_pos >= 0)
        self.slot_evict |= slot & evict[..., None]
        if self.slot_logit is not None:
            self.slot_logit = torch.where(slot & decided[..., None], z[..., None].to(self.slot_logit.dtype),
                                          self.slot_logit)

    def _capacity_for(self, needed: int) -> int:
        """Slots per (row, head) once some holds ``needed``: grown to the next power of two only when full; under a
        cap, the cap at once (what a serving engine reserves)."""
        if self.policy.cap:
            return self.policy.cap
        return self.capacity if needed <= self.capacity else _next_power_of_two(needed)

    def _drop_over_cap(self, position: torch.Tensor, valid: torch.Tensor) -> None:
        """Capped DMS, at query ``position [B]`` (rows ``valid [B]``): where more than ``cap - sink - window`` kept
        tokens are past the window, free the one of the highest decision logit (ties: the older)."""
        b = self.budget
        eligible = (self.slot_pos >= b.sink) & (self.slot_pos <= (position - b.window)[:, None, None]) \
            & ~self.slot_evict
        over = (eligible.sum(-1) > self.policy.cap - b.sink - b.window) & valid[:, None]
        if not bool(over.any()):
            return
        logit = torch.where(eligible, self.slot_logit, float("-inf"))
        worst = eligible & (logit == logit.amax(-1, keepdim=True))
        oldest = torch.where(worst, self.slot_pos, torch.iinfo(torch.long).max).argmin(-1, keepdim=True)
        drop = torch.zeros_like(eligible).scatter(-1, oldest, True) & over[..., None]
        self.slot_pos.masked_fill_(drop, -1)

    def _reserve(self, needed: int) -> None:
        extra = self._capacity_for(needed) - self.capacity
        if extra == 0:
            return
        self.keys = torch.cat([self.keys, self.keys.new_zeros(*self.keys.shape[:2], extra, self.keys.shape[3])], 2)
        self.values = torch.cat([self.values, self.values.new_zeros(*self.values.shape[:2], extra,
                                                                    self.values.shape[3])], 2)
        self.slot_pos = torch.cat([self.slot_pos, self.slot_pos.new_full((*self.slot_pos.shape[:2], extra), -1)], 2)
        self.slot_evict = torch.cat([self.slot_evict, self.slot_evict.new_zeros(*self.slot_evict.shape[:2], extra)], 2)
        if self.slot_logit is not None:
            self.slot_logit = torch.cat([self.slot_logit, self.slot_logit.new_zeros(*self.slot_logit.shape[:2],
                                                                                    extra)], 2)

    def _record(self, counts: torch.Tensor, valid: torch.Tensor) -> None:
        """Accumulate the retained tokens ``counts [B, Hkv, Q]`` of the real queries ``valid [B, Q]``."""
        counts = torch.where(valid[:, None, :], counts, 0)
        self.retained_sum += counts.sum(-1)
        self.retained_max = torch.maximum(self.retained_max, counts.amax(-1))
        self.queries += valid.sum(-1)

    def _step(self, query, key, value, gate, valid, scale):
        bsz, hkv, _ = key.shape
        position = self.seen.clone()
        self._decide_previous(gate, valid)
        leaving = self.slot_evict & (self.slot_pos <= (position - self.budget.window)[:, None, None]) \
            & valid[:, None, None]
        self.slot_pos.masked_fill_(leaving, -1)
        self.slot_evict &= ~leaving
        if self.slot_logit is not None:
            self._drop_over_cap(position, valid)
        held = (self.slot_pos >= 0).sum(-1) + 1  # after the new token
        self._reserve(int(torch.where(valid[:, None], held, 0).max()))
        target = (self.slot_pos < 0).long().argmax(-1)  # the first free slot
        where = valid[:, None].expand(bsz, hkv)
        _put(self.keys, target, where, key)
        _put(self.values, target, where, value)
        _put(self.slot_pos, target, where, position[:, None].expand(bsz, hkv))
        _put(self.slot_evict, target, where, torch.zeros(bsz, hkv, dtype=torch.bool, device=key.device))
        if self.slot_logit is not None:
            _put(self.slot_logit, target, where, torch.full((bsz, hkv), NO_DECISION, device=key.device))
        self.seen += valid.long()
        filled = self.slot_pos >= 0
        self._record(filled.sum(-1)[..., None], valid[:, None])
        out, _ = slot_attention(query, self.keys, self.values, filled, scale=scale)
        return torch.where(valid[:, None, None, None], torch.nan_to_num(out), 0.0)

    def _chunk(self, query, key_new, value_new, gates, valid, scale):
        bsz, hkv, chunk, _ = key_new.shape
        arange = torch.arange(chunk, device=key_new.device)
        leading = (valid.long().cumsum(-1) == 0).sum(-1)
        count = valid.sum(-1)
        if not torch.equal(valid, (arange >= leading[:, None]) & (arange < (leading + count)[:, None])) \
                or bool(((self.seen > 0) & (count < chunk)).any()):
            raise ValueError("the DMS cache takes left padding only, in the first chunk")
        new_pos = self.seen[:, None] + arange - leading[:, None]  # [B, C]; padding negative
        self._decide_previous(gates[..., 0], self.seen > 0)
        decisions = decision_logits(gates, new_pos[:, None, :], valid[:, None, :], sink=self.budget.sink,
                                    threshold=self.policy.threshold)
        # candidates: every slot (free ones invalid) and the chunk
        cand_pos = torch.cat([self.slot_pos, new_pos[:, None, :].expand(bsz, hkv, chunk)], -1)
        cand_valid = torch.cat([self.slot_pos >= 0, valid[:, None, :].expand(bsz, hkv, chunk)], -1)
        cand_evict = torch.cat([self.slot_evict, decisions > 0], -1)
        evict_pos = torch.where(cand_evict, cand_pos + self.budget.window, NEVER)
        if self.slot_logit is not None:
            cand_logit = torch.cat([self.slot_logit, decisions.to(self.slot_logit.dtype)], -1)
            evict_pos = torch.minimum(evict_pos, self._capped(cand_pos, cand_valid, cand_evict, cand_logit))
        cand_k = torch.cat([self.keys, key_new.to(self.keys.dtype)], 2)
        cand_v = torch.cat([self.values, value_new.to(self.values.dtype)], 2)
        out = retention_attention(query, cand_k, cand_v, q_pos=new_pos, kv_pos=cand_pos, kv_evict=evict_pos,
                                  kv_valid=cand_valid, budget=self.budget, scale=scale, backend=CHUNK_BACKEND)
        self._record(retained_counts(new_pos[:, None, :], cand_pos, evict_pos, cand_valid), valid)
        # compress: keep what the chunk's last query sees, in the first slots
        last = (self.seen + count - 1)[:, None, None]
        keep = cand_valid & retained(last, cand_pos, evict_pos, self.budget)
        slots = self._capacity_for(int(keep.sum(-1).max()))
        slot = torch.where(keep, keep.long().cumsum(-1) - 1, slots)  # dropped: a spare slot that is cut off
        self.keys = _scatter_slots(cand_k, slot, slots, 0.0)
        self.values = _scatter_slots(cand_v, slot, slots, 0.0)
        self.slot_pos = _scatter_slots(cand_pos, slot, slots, -1)
        self.slot_evict = _scatter_slots(cand_evict, slot, slots, False)
        if self.slot_logit is not None:
            self.slot_logit = _scatter_slots(cand_logit, slot, slots, 0.0)
        self.seen += count
        return out

    def _capped(self, cand_pos, cand_valid, cand_evict, cand_logit) -> torch.Tensor:
        """The cap's eviction positions of a chunk's candidates (cached slots and new tokens), by METHOD §1's rule in
        position order: free slots and padding sit first and never compete."""
        b = self.budget
        pos = torch.where(cand_valid, cand_pos, -1)
        order = torch.sort(pos, dim=-1, stable=True).indices
        logit = torch.where(cand_evict, float("inf"), cand_logit)  # an evicted token never holds a slot
        ranked = ranked_eviction_positions(capped_keep_priority(logit.gather(-1, order)),
                                           Budget(b.sink, b.window, self.policy.cap - b.sink - b.window),
                                           positions=pos.gather(-1, order))
        return torch.empty_like(ranked).scatter_(-1, order, ranked)


def cache_stats(cache) -> dict[str, torch.Tensor]:
    """Per (layer, KV head) of a DMS :class:`kvpop.KVpopCache`: ``mean`` and ``max`` retained tokens over the
    queries it has served (what to match other policies' budgets on), and each layer's ``capacity`` in slots."""
    if not all(isinstance(layer, DMSLayer) for layer in cache.layers):
        raise ValueError("cache_stats reads a DMS cache: a KVpopCache of a model under the dms policy")
    per_layer = [layer.stats() for layer in cache.layers]
    return {"mean": torch.stack([s["mean"] for s in per_layer]), "max": torch.stack([s["max"] for s in per_layer]),
            "capacity": torch.tensor([layer.capacity for layer in cache.layers])}


LAYER_TYPES["dms"] = DMSLayer
