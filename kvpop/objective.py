"""The training objective of METHOD §3 as a function of tensors: ``L = KL_topK + β · L_ret``.

* ``L_ret`` is :func:`kvpop.losses.boundary_loss` of the student's priorities against the teacher's priorities over
  every layer × KV head, where the teacher's priority is its future-attention target plus the same recency term the
  student's policy ranks by (:func:`kvpop.retention.with_recency`, the one implementation both use).
* ``KL_topK`` is :func:`kvpop.losses.topk_kl` against the teacher's top-K logits at the positions ``d >= B`` (the
  ones at which eviction has happened; before them the student's mask is the dense one).
* ``boundary_acc`` is the fraction of the teacher's keep/evict decisions the student reproduces.

:func:`student_forward` runs the retrofitted student once under its own sparse mask and returns its logits and the
priorities it ranked by (with the gradient to the scorers); :meth:`Objective.for_model` takes the budget and the
recency term from the model's policy, so teacher and student cannot disagree on them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvpop.budget import Budget
from kvpop.losses import boundary_agreement, boundary_decisions, boundary_loss, topk_kl
from kvpop.retention import with_recency
from kvpop.retrofit import collect_priorities, runtime_of

WEIGHTS = (None, "margin")


def student_forward(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [B, S, V], priorities [L, B, Hkv, S])`` of one masked forward of a retrofitted model."""
    with collect_priorities(model) as collected:
        logits = model(input_ids=input_ids, use_cache=False).logits
    if len(collected) != runtime_of(model).num_layers:
        raise ValueError(f"the forward collected priorities of {len(collected)} layers, not "
                         f"{runtime_of(model).num_layers}: train a static policy with scorers (policy='kvpop')")
    return logits, torch.stack([collected[i] for i in range(len(collected))]).float()


@dataclass(frozen=True)
class Objective:
    """``L = KL_topK + beta · L_ret`` for a budget and a recency term (METHOD §3); ``tau`` the pairwise temperature,
    ``weight`` ``None`` or ``"margin"`` (each term weighted by the teacher's ``|y[t_new] - y[t_bnd]|``)."""

    budget: Budget
    recency: float = 0.0
    beta: float = 1.0
    tau: float = 1.0
    weight: str | None = None

    def __post_init__(self):
        if self.recency < 0 or self.beta < 0 or self.tau <= 0:
            raise ValueError(f"Objective needs recency >= 0, beta >= 0 and tau > 0; got recency={self.recency}, "
                             f"beta={self.beta}, tau={self.tau}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"Objective.weight must be one of {WEIGHTS}, got {self.weight!r}")

    @classmethod
    def for_model(cls, model: nn.Module, **options) -> "Objective":
        """The objective for a retrofitted model's policy: its budget and its recency term."""
        policy = runtime_of(model).policy
        if policy.budget is None:
            raise ValueError(f"the {policy.name} policy has no budget: retrofit with a budget to train")
        return cls(policy.budget, policy.recency, **options)

    def __call__(self, student: torch.Tensor, teacher_targets: torch.Tensor, logits: torch.Tensor,
                 topk_values: torch.Tensor, topk_indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """``student`` priorities and ``teacher_targets`` ``[..., S]`` (e.g. ``[L, B, Hkv, S]``), ``logits [B, S, V]``,
        the teacher's ``topk_values``/``topk_indices [B, S, K]``; returns ``loss``, ``ret_loss``, ``kl`` and
        ``boundary_acc`` (scalar tensors; ``loss`` carries the gradient)."""
        teacher = with_recency(teacher_targets.float(), self.recency)
        decisions = boundary_decisions(teacher, self.budget)
        ret = boundary_loss(student, teacher, self.budget, tau=self.tau, weight=self.weight, decisions=decisions)
        positions = torch.arange(logits.shape[1], device=logits.device)
        evicting = (positions >= self.budget.total).expand(logits.shape[0], -1)
        kl = topk_kl(logits, topk_values.float(), topk_indices.long(), mask=evicting)
        with torch.no_grad():
            accuracy = boundary_agreement(student.detach(), decisions)
        return {"loss": kl + self.beta * ret, "ret_loss": ret, "kl": kl, "boundary_acc": accuracy}
