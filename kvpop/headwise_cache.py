"""The fixed cache under per-head budgets (METHOD §7): exactly ``Σ b`` slots, whatever the generated length.

**Layout.** A global layer whose KV heads hold different budgets is split into *parts*: the heads that share one
budget ``b`` form a :class:`kvpop.cache.KVpopLayer` of the uniform ``Budget(sink, window, b - sink - window)`` over
those heads only (``[B, heads, b, D]``). Every part holds exactly its heads' budget, so a layer holds ``Σ_g b_g``
slots per row and the model ``Σ_{l,g} b_{l,g} = L · Hkv · B`` — the uniform cache's bytes — with no padding to the
layer's largest head (one buffer per layer of the largest head's width would hold ``L · Hkv · max b``). A layer whose
heads all share one budget (every layer of a per-layer allocation) is a plain ``KVpopLayer`` at that budget
(:func:`layer_for`). A layer has at most ``Hkv`` parts.

**One ranking, several parts.** The policy's priorities (a scorer's recurrent step, the oracle's table, …) are computed
once per layer over all heads, exactly as the uniform cache computes them, and each part is handed its heads' slice
(:class:`HandedPriorities`, set per call). A part then runs the uniform cache's own code: a decoding step
(:func:`kvpop.cache.static_slot_step`) or a chunk (``KVpopLayer._chunk``: candidates, eviction positions at the part's
budget, attention, compression back into its slots). Its attention covers the query heads of its KV heads (each KV
head's group), and the outputs go back in query-head order. So every part is the uniform rule at its own budget, and
decode ≡ masked forward holds head by head (``tests/test_headwise.py``).

Not (yet) here: anchor slots (refused with per-head budgets, :class:`kvpop.policies.Policy`), dynamic and ragged
policies (no long-range slots to move), ``Runtime.compile_decode`` (a mixed layer's step runs eagerly; CUDA graphs
replay it like any step: :class:`kvpop.decode.GraphedDecoder` reads its parts' tensors).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.cache_utils import CacheLayerMixin

from kvpop.budget import Budget
from kvpop.cache import HEADWISE, LAYER_TYPES, KVMeter, KVpopLayer, static_slot_step
from kvpop.policies.base import LayerView, Policy, StaticPolicy


@dataclass(frozen=True)
class HandedPriorities(StaticPolicy):
    """A part's policy: the ranked priorities its layer computed for this call, its heads' slice (``given [B, heads,
    C]``, the tokens leaving the window). No recency term: they are ranked already."""

    given: torch.Tensor | None = None
    name: ClassVar[str] = "handed"

    def resume(self, layer, keys, values, valid, positions, state):
        if self.given is None:
            raise RuntimeError("a per-head cache part was called without its layer's priorities")
        return self.given, state

    def step(self, layer, key, value, valid, position, state):
        return self.resume(layer, key, value, valid, position, state)


def layer_for(runtime, layer_idx: int, policy: Policy, meter: KVMeter, dynamic_chunks: bool) -> CacheLayerMixin:
    """The cache layer of ``layer_idx`` under a policy with per-head budgets: a plain ``KVpopLayer`` at the layer's
    one budget when its heads share it (no split needed), else a :class:`HeadwiseLayer`."""
    topk = runtime.layer_topk(layer_idx, policy)
    if len(set(topk)) == 1:
        uniform = dataclasses.replace(policy, budget=Budget(policy.budget.sink, policy.budget.window, topk[0]),
                                      head_topk=None)
        return KVpopLayer(runtime, layer_idx, uniform, meter, dynamic_chunks)
    return HeadwiseLayer(runtime, layer_idx, policy, meter, dynamic_chunks)


class HeadwiseLayer(CacheLayerMixin):
    """One global layer whose KV heads hold different budgets: parts of equal budget (module docstring)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, runtime, layer_idx: int, policy: Policy, meter: KVMeter | None = None,
                 dynamic_chunks: bool = True):
        super().__init__()
        if policy.dynamic or policy.ragged or policy.anchors:
            raise ValueError(f"per-head budgets rank static priorities in one pool; {policy.name} does not")
        self.runtime, self.layer_idx, self.policy = runtime, layer_idx, policy
        self.budget = policy.budget  # the uniform budget of the same mean
        topk = torch.tensor(runtime.layer_topk(layer_idx, policy))
        self._meter = meter if meter is not None else KVMeter()
        self.parts: list[tuple[torch.Tensor, torch.Tensor, KVpopLayer]] = []  # (KV heads, query heads, part)
        group = runtime.num_heads // runtime.num_kv_heads
        for k in sorted(set(topk.tolist())):
            heads = (topk == k).nonzero().flatten()
            queries = (heads[:, None] * group + torch.arange(group)).flatten()
            part = KVpopLayer(runtime, layer_idx, HandedPriorities(Budget(policy.budget.sink, policy.budget.window,
                                                                          k)), self._meter, dynamic_chunks)
            self.parts.append((heads, queries, part))
        self.columns = 0

    @property
    def meter(self) -> KVMeter:
        return self._meter

    @meter.setter
    def meter(self, meter: KVMeter) -> None:  # KVpopCache.repeated gives a copy its own meter
        self._meter = meter
        for _, _, part in self.parts:
            part.meter = meter

    def __copy__(self):
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.parts = [(heads, queries, copy.copy(part)) for heads, queries, part in self.parts]
        return other

    # -- transformers' layer interface (as KVpopLayer's) -------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        device = key_states.device
        self.device = device
        for heads, _, part in self.parts:
            part.lazy_initialization(key_states[:, heads.to(device)], value_states[:, heads.to(device)])
        self.seen = torch.zeros(key_states.shape[0], dtype=torch.long, device=device)  # real tokens per row
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
        return ["seen"]

    def _index_batch(self, fn):
        if not self.is_initialized:
            return
        for _, _, part in self.parts:
            part._index_batch(fn)
        self.seen = fn(self.seen)
        if self.scorer_state is not None:
            self.scorer_state = {k: fn(v) for k, v in self.scorer_state.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(lambda x: x[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._index_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        for _, _, part in self.parts:
            part.reset()
        self.is_initialized = False
        self.columns = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a fixed-budget cache has evicted the past: it cannot be cropped (assisted "
                                  "decoding / rollback is not supported)")

    @property
    def full(self) -> bool:
        return all(part.full for _, _, part in self.parts)

    @full.setter
    def full(self, value: bool) -> None:  # GraphedDecoder restores the flags it saw before its warm-up
        for _, _, part in self.parts:
            part.full = value and part.full

    def _filled(self) -> bool:
        return all(part._filled() for _, _, part in self.parts)

    def nbytes(self) -> dict[str, int]:
        """K/V = Σ over the layer's heads of their budgets (× head_dim × 2 × dtype size × rows), metadata, state."""
        total = {"kv": 0, "metadata": 0, "scorer_state": 0}
        if not self.is_initialized:
            return total
        for _, _, part in self.parts:
            for key, value in part.nbytes().items():
                total[key] += value
        total["metadata"] += self.seen.nbytes
        total["scorer_state"] += sum(t.nbytes for t in (self.scorer_state or {}).values())
        return total

    # -- KVpop -------------------------------------------------------------------------------------------------

    def attend(self, module, query, key_new, value_new, valid_cols, scale) -> torch.Tensor:
        """The layer's priorities once, then each part at its budget; returns ``[B, C, Hq, D]``."""
        bsz, _, chunk, _ = query.shape
        valid = (torch.ones(bsz, chunk, dtype=torch.bool, device=query.device) if valid_cols is None
                 else valid_cols[:, -chunk:].to(device=query.device, dtype=torch.bool))
        self.columns += chunk
        layer = LayerView(self.layer_idx, module, self.runtime, query, scale)
        out = query.new_empty(bsz, chunk, query.shape[1], value_new.shape[-1])
        if chunk == 1:
            ranked = self._priorities(layer, key_new, value_new, valid, self.seen[:, None])
            s, w = self.budget.sink, self.budget.window
            for heads, queries, part in self._parts(query.device):
                out[:, :, queries] = static_slot_step(
                    part.keys, part.values, part.slot_pos, part.slot_prio, part.seen, query[:, queries],
                    key_new[:, heads, 0], value_new[:, heads, 0], ranked[:, heads, 0], valid[:, 0], s, w,
                    part.budget.topk, scale, part._filled())
            self.seen += valid[:, 0].long()
            return out
        arange = torch.arange(chunk, device=query.device)
        leading = (valid.long().cumsum(-1) == 0).sum(-1)
        count = valid.sum(-1)
        if not torch.equal(valid, (arange >= leading[:, None]) & (arange < (leading + count)[:, None])) \
                or bool(((self.seen > 0) & (count < chunk)).any()):
            raise ValueError("KVpop's cache takes left padding only, before a row's first token")
        ranked = self._priorities(layer, key_new, value_new, valid, self.seen[:, None] + arange - leading[:, None])
        for heads, queries, part in self._parts(query.device):
            part.policy = dataclasses.replace(part.policy, given=ranked[:, heads])
            try:
                out[:, :, queries] = part._chunk(layer, query[:, queries], key_new[:, heads], value_new[:, heads],
                                                 valid, scale)
            finally:
                part.policy = dataclasses.replace(part.policy, given=None)
        self.seen += count
        return out

    def _parts(self, device):
        for heads, queries, part in self.parts:
            yield heads.to(device), queries.to(device), part

    def _priorities(self, layer, keys, values, valid, positions) -> torch.Tensor:
        """Ranked priorities ``[B, Hkv, C]`` of the tokens leaving the window as the tokens at ``positions [B, C]``
        arrive (the policy's ``step`` for one, ``resume`` for a chunk), the scorer's state kept in place."""
        w = self.budget.window
        if keys.shape[2] == 1:
            raw, state = self.policy.step(layer, keys[:, :, 0], values[:, :, 0], valid[:, 0], positions[:, 0],
                                          self.scorer_state)
            raw = raw[..., None]
        else:
            raw, state = self.policy.resume(layer, keys, values, valid, positions[:, None, :], self.scorer_state)
        self._keep_state(state)
        return self.policy.ranked(raw.float(), (positions - w)[:, None, :])

    def _keep_state(self, state):
        """Adopt the scorer's new state by copying into the buffers already held (a replayed CUDA graph reads and
        writes the same memory), as ``KVpopLayer._keep_state``."""
        if self.scorer_state is None or state is None or state.keys() != self.scorer_state.keys():
            self.scorer_state = state
            return
        for name, tensor in state.items():
            if tensor is not self.scorer_state[name]:
                self.scorer_state[name].copy_(tensor)


LAYER_TYPES[HEADWISE] = layer_for
