"""Random static priorities: the floor any learned scorer must clear (the evaluation reports it next to the others)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.policies.base import StaticPolicy


@dataclass(frozen=True)
class RandomPriority(StaticPolicy):
    seed: int = 0
    name: ClassVar[str] = "random"

    def priorities_at(self, layer, positions, num_kv_heads):
        """A hash of (seed, layer, head, position): the same number in the forward and in the cache."""
        heads = torch.arange(num_kv_heads, device=positions.device)[None, :, None]
        key = (positions.long() * 1_000_003 + heads * 7_919 + layer.layer_idx * 104_729 + self.seed * 15_485_863)
        mixed = (key * 2_654_435_761) % 4_294_967_291
        return (mixed.float() / 4_294_967_291.0).expand(positions.shape[0], num_kv_heads, positions.shape[-1])
