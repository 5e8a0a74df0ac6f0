"""H2O: heavy hitters by attention accumulated since the token entered the cache, plus the recent window."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpop.policies.base import DynamicPolicy


@dataclass(frozen=True)
class H2O(DynamicPolicy):
    name: ClassVar[str] = "h2o"

    def observe(self, scores, probs):
        return scores + probs

    def observe_chunk(self, scores, probs):
        return scores + probs.sum(2)
