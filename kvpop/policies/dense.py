"""Full attention: the teacher, and the reference every other policy is compared with."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpop.policies.base import Policy


@dataclass(frozen=True)
class Dense(Policy):
    budget: None = None
    name: ClassVar[str] = "dense"
