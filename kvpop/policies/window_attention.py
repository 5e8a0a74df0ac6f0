"""Window attention: a token's priority is the attention it received while it sat in the protected window.

For KV head ``g`` and token ``t``: ``p[t] = log max_{h in g} (1/w) Σ_{d = t}^{t + w - 1} P_loc[h, d, t]``, where
``P_loc[h, d, ·]`` is query ``d``'s softmax over the tokens every query always sees — the sinks and its own window
``d - w < t' <= d`` (METHOD §1). Those queries are exactly the ones ``t`` meets before it leaves the window at
``t + w``, where its priority is read, so the priority is static (METHOD §1's contract) and yet comes from observed
attention, like TOVA's and H2O's. Restricting the softmax to the always-visible tokens makes it independent of which
long-range tokens a query still sees: the one-pass forward computes it from the layer's own queries and keys in
parallel, and the cache from its queries step by step, with the same value. (Ours, not the original work's:
docs/METHOD.md §1.)

Both paths compute in float64 (exact products of bf16/fp32 inputs, sums whose order differs only at ~1e-16), so the
mask and the cache rank alike. The cache path keeps the sinks' and the window's keys and the window tokens' running
mass in the policy state: ``(s + w)`` keys per KV head beside the cache's ``B`` slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.policies.base import StaticPolicy

WORK = torch.float64
FLOOR = 1e-300  # log of a mass that underflowed: finite, below any real one


def _query(layer, length: int) -> tuple[torch.Tensor, float]:
    if layer.query is None or layer.scale is None:
        raise RuntimeError("the window_attention policy reads the layer's queries: run it through kvpop's attention")
    if layer.query.shape[2] != length:
        raise ValueError("the window_attention policy needs every token's query: run whole sequences in one forward "
                         "(use_cache=False) or through the KVpop cache, not through transformers' growing cache")
    return layer.query, layer.scale


def _group_log_mass(mass: torch.Tensor, num_kv_heads: int, window: int) -> torch.Tensor:
    """``[B, Hq, N]`` summed attention → ``[B, Hkv, N]`` log of the mean over the window, max over the group."""
    bsz, hq, n = mass.shape
    mean = mass.view(bsz, num_kv_heads, hq // num_kv_heads, n).amax(2) / window
    return mean.clamp_min(FLOOR).log().float()


def window_mass(query, keys, valid, positions, sink: int, window: int, *, scale: float,
                budget_bytes: int = 1 << 26) -> torch.Tensor:
    """``Σ_d P_loc[h, d, t]`` over the queries ``d`` whose window holds ``t`` (``t <= d < t + window``), ``[B, Hq,
    S]``. ``query [B, Hq, S, D]``, ``keys [B, Hkv, S, D]``, ``valid [B, S]``, ``positions [B, S]`` (padding: not
    valid). Query rows in blocks of ``rows``; unpadded rows (positions = indices) score each block against the keys
    it can see only — the sinks and ``[first row - window + 1, last row]`` — padded ones against every key."""
    bsz, hq, size, _ = query.shape
    group = hq // keys.shape[1]
    k = keys.to(WORK).repeat_interleave(group, dim=1)
    arange = torch.arange(size, device=query.device)
    banded = bool(valid.all()) and bool((positions == arange).all())
    span = lambda rows: (min(size, rows + window - 1 + sink) if banded else size)  # noqa: E731 keys per block
    rows = size
    while rows > 1 and 8 * bsz * hq * rows * span(rows) > budget_bytes:  # the largest blocks the budget holds
        rows = (rows + 1) // 2
    mass = torch.zeros(bsz, hq, size, dtype=WORK, device=query.device)
    for start in range(0, size, rows):
        sl = slice(start, min(size, start + rows))
        first = max(0, start - window + 1) if banded else 0
        cols = torch.cat([arange[:min(sink, first)], arange[first:sl.stop]]) if banded else arange
        t = positions[:, None, None, cols]
        d = positions[:, None, sl, None]
        seen = valid[:, None, sl, None] & valid[:, None, None, cols] & (t <= d)
        in_window = seen & (t > d - window)
        scores = torch.einsum("bhqd,bhkd->bhqk", query[:, :, sl].to(WORK), k[:, :, cols]) * scale
        probs = torch.nan_to_num(scores.masked_fill(~(in_window | (seen & (t < sink))), float("-inf")).softmax(-1))
        mass.index_add_(2, cols, (probs * in_window).sum(2))
    return mass


def window_attention_priorities(query, keys, valid, positions, budget, *, scale: float) -> torch.Tensor:
    """Priorities ``[B, Hkv, S]`` (float32, no grad) of whole sequences from their queries and keys (module docstring):
    ``query [B, Hq, S, D]``, ``keys [B, Hkv, S, D]``, ``valid``, ``positions`` ``[B, S]``."""
    with torch.no_grad():
        mass = window_mass(query, keys, valid, positions, budget.sink, budget.window, scale=scale)
        return _group_log_mass(mass, keys.shape[1], budget.window)


@dataclass(frozen=True)
class WindowAttention(StaticPolicy):
    name: ClassVar[str] = "window_attention"

    def sequence_priorities(self, layer, keys, values, valid, positions):
        query, scale = _query(layer, keys.shape[2])
        return window_attention_priorities(query, keys, valid, positions[:, 0], self.budget, scale=scale)

    def init_state(self, key: torch.Tensor, num_query_heads: int) -> dict[str, torch.Tensor]:
        """Slot ``i`` holds token ``i`` (a sink) or a window token in its ring slot, as the cache's first slots do."""
        bsz, hkv, dim = key.shape
        slots = self.budget.sink + self.budget.window
        return {"keys": key.new_zeros(bsz, hkv, slots, dim),
                "pos": torch.full((bsz, slots), -1, dtype=torch.long, device=key.device),
                "mass": torch.zeros(bsz, num_query_heads, slots, dtype=WORK, device=key.device)}

    def step(self, layer, key, value, valid, position, state):
        """Read the leaving token's mass, put the new token in its slot, add the query's local attention."""
        s, w = self.budget.sink, self.budget.window
        query, scale = _query(layer, 1)
        bsz, hkv, _ = key.shape
        if state is None:
            state = self.init_state(key, query.shape[1])
        slot = torch.where(position < s, position, s + (position - s) % w)  # = the leaving token's slot
        mass = state["mass"]
        leaving = _group_log_mass(mass.gather(-1, slot[:, None, None].expand(-1, mass.shape[1], 1)), hkv, w)[..., 0]
        put = valid[:, None] & (torch.arange(s + w, device=key.device) == slot[:, None])  # [B, slots]
        keys = torch.where(put[:, None, :, None], key[:, :, None, :].to(state["keys"].dtype), state["keys"])
        pos = torch.where(put, position[:, None], state["pos"])
        mass = torch.where(put[:, None, :], 0.0, mass)
        group = query.shape[1] // hkv
        scores = torch.einsum("bhd,bhkd->bhk", query[:, :, 0].to(WORK),
                              keys.to(WORK).repeat_interleave(group, dim=1)) * scale
        probs = torch.nan_to_num(scores.masked_fill((pos < 0)[:, None, :], float("-inf")).softmax(-1))
        in_window = (pos > (position - w)[:, None])[:, None, :]  # a sink's mass counts only while in the window
        mass = torch.where(valid[:, None, None], mass + probs * in_window, mass)
        return leaving, {"keys": keys, "pos": pos, "mass": mass}

    def resume(self, layer, keys, values, valid, positions, state):
        """A chunk at once: its queries score the state's tokens and the chunk's (each its sinks and window), in
        blocks of query rows; a token leaving the window at call ``i`` has, by then, exactly its window's queries in
        its mass (later queries do not see it in their window), so one pass gives every call's priority; each slot
        then keeps its latest token. Equal to the steps it replaces."""
        s, w = self.budget.sink, self.budget.window
        bsz, hkv, chunk, _ = keys.shape
        query, scale = _query(layer, chunk)
        hq = query.shape[1]
        if state is None:
            state = self.init_state(keys[:, :, 0], hq)
        new_pos = torch.where(valid, positions[:, 0], -1)  # [B, C]; padding: no token
        cand_pos = torch.cat([state["pos"], new_pos], -1)  # [B, N]
        cand_keys = torch.cat([state["keys"], keys.to(state["keys"].dtype)], 2).to(WORK)
        cand_keys = cand_keys.repeat_interleave(hq // hkv, dim=1)
        mass = torch.cat([state["mass"], state["mass"].new_zeros(bsz, hq, chunk)], -1)
        filled, n = cand_pos >= 0, cand_pos.shape[-1]
        rows = chunk
        while rows > 1 and 8 * bsz * hq * rows * n > (1 << 26):
            rows = (rows + 1) // 2
        t = cand_pos[:, None, None, :]
        for start in range(0, chunk, rows):
            sl = slice(start, min(chunk, start + rows))
            d = new_pos[:, None, sl, None]
            seen = filled[:, None, None, :] & valid[:, None, sl, None] & (t <= d)
            in_window = seen & (t > d - w)
            scores = torch.einsum("bhqd,bhkd->bhqk", query[:, :, sl].to(WORK), cand_keys) * scale
            probs = torch.nan_to_num(scores.masked_fill(~(in_window | (seen & (t < s))), float("-inf")).softmax(-1))
            mass = mass + (probs * in_window).sum(2)
        leaving = (positions[:, 0] - w)[:, :, None]  # [B, C, 1]: the token each call reads
        which = ((cand_pos[:, None, :] == leaving) & filled[:, None, :]).long().argmax(-1)  # [B, C]; 0 if none
        raw = _group_log_mass(mass.gather(-1, which[:, None, :].expand(-1, hq, -1)), hkv, w)
        slot = torch.where(cand_pos < s, cand_pos, s + (cand_pos - s) % w)
        slot = torch.where(filled, slot, s + w)  # empty candidates: a spare slot past the end
        latest = torch.full((bsz, s + w + 1), -1, dtype=torch.long, device=keys.device)
        latest = latest.scatter_reduce(-1, slot, torch.arange(n, device=keys.device).expand(bsz, n), "amax")
        latest = latest[:, :s + w]
        empty, latest = latest < 0, latest.clamp(min=0)
        keep_keys = torch.cat([state["keys"], keys.to(state["keys"].dtype)], 2)
        return raw, {"keys": torch.where(empty[:, None, :, None], 0.0, keep_keys.gather(
                         2, latest[:, None, :, None].expand(-1, hkv, -1, keep_keys.shape[-1]))).to(keep_keys.dtype),
                     "pos": torch.where(empty, -1, cand_pos.gather(-1, latest)),
                     "mass": torch.where(empty[:, None, :], 0.0,
                                         mass.gather(-1, latest[:, None, :].expand(-1, hq, -1)))}
