"""TOVA: evict the long-range token the current query attends to least (per KV head: max over its group)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpop.policies.base import DynamicPolicy


@dataclass(frozen=True)
class TOVA(DynamicPolicy):
    name: ClassVar[str] = "tova"

    def observe(self, scores, probs):
        return probs

    def observe_chunk(self, scores, probs):
        return probs[:, :, -1]  # the chunk's last query decides
