"""Scorers (METHOD §4): per-layer modules mapping each token's detached [k; v] to a static priority.

    scorer = build_scorer("mlstm", num_kv_heads=8, head_dim=128, window=128, qk_dim=32)
    same = build_scorer(**scorer.config_dict())  # configs round-trip through plain dicts
"""
from __future__ import annotations

from typing import Any

from kvpop.scorers.base import Scorer, ScorerConfig, State
from kvpop.scorers.mlp import MLPConfig, MLPScorer
from kvpop.scorers.mlstm import MLSTMConfig, MLSTMImmediateScorer, MLSTMScorer

SCORERS: dict[str, type[Scorer]] = {
    "mlp": MLPScorer,  # KVpop-mlp: stateless
    "mlstm": MLSTMScorer,  # KVpop default: delayed stateful
    "mlstm_immediate": MLSTMImmediateScorer,  # ablation: stateful, read at insertion
}


def build_scorer(name: str, num_kv_heads: int, head_dim: int, window: int, **overrides: Any) -> Scorer:
    """The scorer `name` for one layer; `overrides` are fields of its config dataclass."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known scorers: {sorted(SCORERS)}")
    cls = SCORERS[name]
    return cls(num_kv_heads, head_dim, window, cls.config_class.from_dict(overrides))


__all__ = ["SCORERS", "build_scorer", "Scorer", "ScorerConfig", "State", "MLPConfig", "MLPScorer", "MLSTMConfig",
           "MLSTMScorer", "MLSTMImmediateScorer"]
