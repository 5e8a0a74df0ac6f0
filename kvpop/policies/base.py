"""What every eviction policy shares (METHOD §1): a budget, a recency term, and where priorities come from.

A *static* policy gives each token one priority, fixed when the token leaves the protected window, so the whole
sequence can run in one masked forward and the fixed cache reproduces it exactly. A *dynamic* policy (TOVA, H2O)
re-scores the cache from the attention it observes, so it runs step by step only.

**Per-head budgets** (METHOD §7): a static policy may carry ``head_topk``, the long-range slots of every (evicting
layer, KV head) in the order of the model's evicting layers (``Runtime.evicting_layers``), made from an allocation
(:class:`kvpop.allocation.Allocation`). Its ``budget`` is then the uniform budget of the same mean — sink and window
shared, ``topk`` the heads' mean — so that everything that reads only the sink, the window or the mean total is
unchanged; what ranks (the mask's eviction positions, the cache, the losses) reads each head's own ``topk``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpop.budget import Budget
from kvpop.retention import anchored_eviction_positions, eviction_positions, with_recency


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
    # per-head budgets (module docstring): long-range slots per (evicting layer, KV head); None: budget.topk everywhere
    head_topk: tuple[tuple[int, ...], ...] | None = None

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
        if self.head_topk is not None:
            self._check_head_topk()

    def _check_head_topk(self) -> None:
        grid = self.head_topk
        if self.budget is None or self.dynamic or self.ragged or self.name == "streaming":
            raise ValueError(f"{self.name}: per-head budgets move the long-range slots of a static ranking policy "
                             f"(kvpop, oracle, random, window_attention); {self.name} has none to move")
        if self.anchor_share:
            raise ValueError(f"{self.name}: anchor slots (anchor_share {self.anchor_share}) are not defined under "
                             f"per-head budgets: set anchor_share 0 with an allocation")
        if (not isinstance(grid, tuple) or not grid or not all(isinstance(row, tuple) and row for row in grid)
                or len({len(row) for row in grid}) != 1
                or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for row in grid for k in row)):
            raise ValueError(f"{self.name}: head_topk must be a non-empty [layers][kv_heads] grid of integers >= 0 "
                             f"(tuples), got {grid!r}")
        heads = len(grid) * len(grid[0])
        total = sum(sum(row) for row in grid)
        if total != heads * self.budget.topk:
            raise ValueError(f"{self.name}: per-head long-range slots sum to {total}, not layers × kv_heads × "
                             f"budget.topk = {heads} × {self.budget.topk}: the budget must be the allocation's mean")

    def layer_topk(self, ordinal: int) -> tuple[int, ...] | None:
        """Long-range slots per KV head of the ``ordinal``-th evicting layer, or ``None`` (uniform: ``budget.topk``)."""
        return None if self.head_topk is None else self.head_topk[ordinal]

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

    def evictions(self, priority: torch.Tensor, positions: torch.Tensor,
                  topk: torch.Tensor | None = None) -> torch.Tensor:
        """Eviction positions of the tokens at ``positions`` from their raw priorities, under this policy's rule: one
        pool of ``topk`` by :meth:`ranked`, or beside it the anchor slots by :meth:`anchor_ranked`. ``topk``: the
        layer's per-head long-range slots (``[Hkv]``, per-head budgets; no anchor slots then)."""
        ranked = self.ranked(priority, positions).detach().float()
        if topk is not None:
            return eviction_positions(ranked, self.budget, positions, topk=topk)
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
