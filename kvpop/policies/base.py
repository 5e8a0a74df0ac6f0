"""What every eviction policy shares (METHOD §1): a budget, a recency term, and where priorities come from.

A *static* policy gives each token one priority, fixed when the token leaves the protected window, so the whole
sequence can run in one masked forward and the fixed cache reproduces it exactly. A *dynamic* policy (TOVA, H2O)
re-scores the cache from the attention it observes, so it runs step by step only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.budget import Budget
from kvpop.retention import anchored_eviction_positions, with_recency


@dataclass(frozen=True)
class LayerView:
    """What a policy may look at for one attention layer."""

    layer_idx: int
    module: torch.nn.Module  # the attention module (holds ``kvpop_scorer`` when retrofitted with one)
    runtime: object  # kvpop.retrofit.Runtime: shared per-model inputs (oracle priorities, …)
    query: torch.Tensor | None = None  # this call's queries [B, Hq, C, D] as attention sees them (window_attention)
    scale: float | None = None  # their softmax scale


@dataclass(frozen=True)
class Policy:
    budget: Budget | None
    recency: float = 0.0  # priority[t] = r[t] + recency * t (METHOD §3)
    # anchor slots (METHOD §1): this share of the topk slots keeps the best by r[t] + anchor_recency * t instead
    anchor_share: float = 0.0
    anchor_recency: float = 0.0

    name: ClassVar[str] = "policy"
    dynamic: ClassVar[bool] = False
    ragged: ClassVar[bool] = False  # per-token decisions, no fixed budget: its own mask and cache (DMS)

    def __post_init__(self):
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise ValueError(f"{self.name}: budget must be a kvpop.Budget or None, got {self.budget!r}")
        if self.recency < 0 or self.anchor_recency < 0:
            raise ValueError(f"{self.name}: recency and anchor_recency must be >= 0, got {self.recency}, "
                             f"{self.anchor_recency}")
        if not 0 <= self.anchor_share <= 1:
            raise ValueError(f"{self.name}: anchor_share is a share of the topk slots, in [0, 1]; got "
                             f"{self.anchor_share}")

    @property
    def anchors(self) -> int:
        """Long-range slots ranked apart: ``floor(anchor_share * topk)``; 0 for dynamic and ragged policies, which do
        not rank static priorities (the share carries over to them unused)."""
        if self.budget is None or self.dynamic or self.ragged:
            return 0
        return int(self.anchor_share * self.budget.topk)

    def ranked(self, priority: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Add the recency term: what the mask and the cache actually rank by."""
        return with_recency(priority, self.recency, positions)

    def anchor_ranked(self, priority: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the anchor slots rank by: the priority with their own recency term (METHOD §1)."""
        return with_recency(priority, self.anchor_recency, positions)

    def evictions(self, priority: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Eviction positions of the tokens at ``positions`` from their raw priorities, under this policy's rule: one
        pool of ``topk`` by :meth:`ranked`, or beside it the anchor slots by :meth:`anchor_ranked`."""
        ranked = self.ranked(priority, positions).detach().float()
        anchor = self.anchor_ranked(priority, positions).detach().float() if self.anchors else None
        return anchored_eviction_positions(ranked, anchor, self.budget, self.anchors, positions)

    def require_one_pool(self, what: str) -> None:
        """Training's losses decide one top-k pool (METHOD §3); anchor slots are an inference rule."""
        if self.anchors:
            raise ValueError(f"{what}: the policy has {self.anchors} anchor slots (anchor_share "
                             f"{self.anchor_share}), an inference rule the retention loss does not model: train with "
                             f"anchor_share 0 and set it for evaluation")


class StaticPolicy(Policy):
    """Priorities from the tokens themselves; the same in the one-pass forward and in the cache."""

    def sequence_priorities(self, layer: LayerView, keys, values, valid, positions) -> torch.Tensor:
        """Raw priorities ``[B, Hkv, S]`` for a whole sequence (may carry grad for training)."""
        return self.priorities_at(layer, positions, keys.shape[1])

    def resume(self, layer: LayerView, keys, values, valid, positions, state):
        """A chunk of new tokens at ``positions [B, 1, C]`` (from an empty cache: ``state=None``): ``(raw
        priorities [B, Hkv, C] of the tokens at positions - window, the ones leaving the window, new state)``."""
        return self.priorities_at(layer, positions - self.budget.window, keys.shape[1]), state

    def step(self, layer: LayerView, key, value, valid, position, state):
        """One new token at ``position [B]``: ``(raw priority of token position - window [B, Hkv], state)``."""
        window = self.budget.window
        return self.priorities_at(layer, (position - window)[:, None, None], key.shape[1])[..., 0], state

    def priorities_at(self, layer: LayerView, positions: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """Raw priorities of the tokens at ``positions`` (broadcastable ``[B, Hkv?, N]``) → ``[B, Hkv, N]``."""
        raise NotImplementedError


class DynamicPolicy(Policy):
    """Scores the cache's tokens from the attention they receive; only the step-by-step path."""

    dynamic: ClassVar[bool] = True

    def observe(self, scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """New per-slot scores from the old ones and this step's attention ``[B, Hkv, slots]``."""
        raise NotImplementedError

    def observe_chunk(self, scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``observe`` folded over a chunk's queries in order, ``probs [B, Hkv, queries, slots]``."""
        for query in range(probs.shape[2]):
            scores = self.observe(scores, probs[:, :, query])
        return scores
