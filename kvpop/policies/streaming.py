"""StreamingLLM: sinks plus a recent window, no long-range slots (``topk = 0``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.policies.base import StaticPolicy


@dataclass(frozen=True)
class Streaming(StaticPolicy):
    name: ClassVar[str] = "streaming"

    def __post_init__(self):
        super().__post_init__()
        if self.budget is None or self.budget.topk != 0:
            raise ValueError("streaming keeps no long-range tokens: use Budget(sink, total - sink, 0) "
                             "(kvpop.policies.build('streaming', budget) converts a budget for you)")

    def priorities_at(self, layer, positions, num_kv_heads):
        return torch.zeros(positions.shape[0], num_kv_heads, positions.shape[-1], device=positions.device)
