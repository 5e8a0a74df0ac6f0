"""Eviction policies in one frame (same budget, same retention rule), one small dataclass per file."""
from __future__ import annotations

from kvpop.budget import Budget
from kvpop.policies.base import DynamicPolicy, LayerView, Policy, StaticPolicy
from kvpop.policies.dense import Dense
from kvpop.policies.dms import DMS
from kvpop.policies.h2o import H2O
from kvpop.policies.kvpop import KVpop
from kvpop.policies.oracle import Oracle
from kvpop.policies.random import RandomPriority
from kvpop.policies.streaming import Streaming
from kvpop.policies.tova import TOVA
from kvpop.policies.window_attention import WindowAttention

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Dense, Streaming, RandomPriority, Oracle, KVpop, TOVA,
                                                                H2O, DMS, WindowAttention)}
# the policies that can run under per-head budgets (METHOD §7): static rankings with long-range slots to move
ALLOCATABLE = tuple(name for name, cls in POLICIES.items()
                    if not cls.dynamic and not cls.ragged and name not in ("dense", "streaming"))


def build_policy(name: str, budget: Budget | None = None, **options) -> Policy:
    """``build_policy("streaming", Budget(4, 64, 188))`` → the policy at the same total budget.

    Streaming has no long-range slots, so its window takes them: ``Budget(sink, window + topk, 0)``.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    if name == "dense":
        return Dense()
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget")
    if name == "streaming":
        budget = Budget(budget.sink, budget.window + budget.topk, 0)
    return POLICIES[name](budget=budget, **options)


__all__ = ["ALLOCATABLE", "POLICIES", "build_policy", "Policy", "StaticPolicy", "DynamicPolicy", "LayerView", "Dense",
           "Streaming", "RandomPriority", "Oracle", "KVpop", "TOVA", "H2O", "DMS", "WindowAttention"]
