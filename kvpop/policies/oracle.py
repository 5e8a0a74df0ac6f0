"""The oracle: the teacher's own future-attention targets (METHOD §2) as static priorities.

The ceiling for any static scorer. Targets come from outside (the precompute stage or
:func:`kvpop.targets.future_attention_targets`) through ``kvpop.oracle_priorities(model, targets)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.policies.base import StaticPolicy


@dataclass(frozen=True)
class Oracle(StaticPolicy):
    name: ClassVar[str] = "oracle"

    def priorities_at(self, layer, positions, num_kv_heads):
        table = layer.runtime.oracle
        if table is None:
            raise RuntimeError("the oracle policy needs the teacher's targets: wrap the call in "
                               "`with kvpop.oracle_priorities(model, targets):` (targets [global layers, B, Hkv, S])")
        per_layer = table[layer.runtime.evicting_layers.index(layer.layer_idx)]  # [B, Hkv, S]: global layers only
        if per_layer.shape[1] != num_kv_heads:
            raise ValueError(f"oracle targets have {per_layer.shape[1]} KV heads, the model {num_kv_heads}")
        index = positions.long().clamp(0, per_layer.shape[-1] - 1).expand(per_layer.shape[0], num_kv_heads, -1)
        prio = per_layer.to(positions.device).gather(-1, index)
        # a token without a target (-inf: no deciding query inside the sequence) is never eligible within it
        return torch.nan_to_num(prio.float(), neginf=-1e30)
