"""KVpop-mlp (METHOD §4): a stateless per-KV-head MLP on token t's own features.

p[t] depends on token t alone. In decoding, step() still returns the priority of the token that leaves
the window (τ - window), so it keeps a ring buffer of the last `window` priorities.

State (per sequence): `p_ring` [Hkv, window] float32, `pos` int64 (the call counter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpop.scorers.base import (PerHeadMLP, Scorer, ScorerConfig, fp32_region, ring_append, ring_from_sequence,
                                ring_leaving, ring_swap)


@dataclass(frozen=True)
class MLPConfig(ScorerConfig):
    hidden: int = 64


class MLPScorer(Scorer):
    name = "mlp"
    config_class = MLPConfig

    def __init__(self, num_kv_heads: int, head_dim: int, window: int, config: MLPConfig = MLPConfig()):
        super().__init__(num_kv_heads, head_dim, window, config)
        self.mlp = PerHeadMLP(num_kv_heads, self.in_features, config.hidden)

    def forward(self, keys, values, valid=None, return_state=False):
        B, _, S, _ = keys.shape
        with fp32_region(keys.device):
            p = self.mlp(self.features(keys, values, valid))  # [B, H, S]
            p = self.with_head_recency(p, torch.arange(S, device=keys.device).expand(B, S))
        if not return_state:
            return p
        state = {"p_ring": ring_from_sequence(p, self.window),
                 "pos": torch.full((B,), S, dtype=torch.long, device=keys.device)}
        return p, state

    def init_state(self, batch_size, device):
        return {"p_ring": torch.zeros(batch_size, self.num_kv_heads, self.window, device=device),
                "pos": torch.zeros(batch_size, dtype=torch.long, device=device)}

    def step(self, key, value, state, valid=None):
        with fp32_region(key.device):
            x = self.features(key[:, :, None], value[:, :, None], None if valid is None else valid[:, None])
            p_new = self.with_head_recency(self.mlp(x)[:, :, 0], state["pos"])  # [B, H], token pos
        p_out, p_ring = ring_swap(state["p_ring"], state["pos"], p_new)
        return p_out, {"p_ring": p_ring, "pos": state["pos"] + 1}

    def resume(self, keys, values, state, valid=None):
        with fp32_region(keys.device):
            p_new = self.mlp(self.features(keys, values, valid))  # [B, H, C]
        pos = state["pos"]
        p_new = self.with_head_recency(p_new, pos[:, None] + torch.arange(keys.shape[2], device=keys.device))
        return ring_leaving(state["p_ring"], pos, p_new), {"p_ring": ring_append(state["p_ring"], pos, p_new),
                                                           "pos": pos + keys.shape[2]}
