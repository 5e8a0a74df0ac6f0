"""The training objective of METHOD §3 as a function of tensors: ``L = KL_topK + β · L_ret``.

* ``L_ret`` is :func:`kvpop.losses.boundary_loss` of the student's priorities against the teacher's priorities over
  every layer × KV head, where the teacher's priority is its future-attention target plus the same recency term the
  student's policy ranks by (:func:`kvpop.retention.with_recency`, the one implementation both use); with
  ``extra_topks``, averaged with the same loss at those long-range sizes (:func:`kvpop.losses.retention_loss`,
  METHOD §3 "several budgets").
* ``KL_topK`` is :func:`kvpop.losses.topk_kl` against the teacher's top-K logits at the positions ``d >= B`` (the
  ones at which eviction has happened; before them the student's mask is the dense one).
* ``boundary_acc`` is the fraction of the teacher's keep/evict decisions the student reproduces.

The two trained baselines (issue 13) share the KL term and the positions it counts, and need no future-attention
targets: :class:`DMSObjective` is :func:`kvpop.dms.dms_loss` (the KL plus the one-sided keep-rate penalty of the
compression schedule) on a relaxed DMS forward; :class:`StreamingObjective` (StreamingLLM+) is the KL alone on a
forward under the sinks + window mask. :data:`METRICS` names what each ``train.policy``'s objective reports.

:func:`student_forward` runs the retrofitted student once under its own sparse mask and returns its logits and the
priorities it ranked by (with the gradient to the scorers); :meth:`Objective.for_model` takes the budget and the
recency term from the model's policy, so teacher and student cannot disagree on them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvpop.budget import Budget
from kvpop.dms import CompressionSchedule, dms_loss, retained_stats
from kvpop.losses import boundary_agreement, retention_decisions, retention_loss, topk_kl
from kvpop.names import METRICS, TRAIN_POLICIES  # re-exported (kvpop.names says why they live there)
from kvpop.retention import with_recency
from kvpop.retrofit import collect_priorities, runtime_of, soft_retention

WEIGHTS = (None, "margin", "mass")


def evicting(logits: torch.Tensor, budget: Budget, head_topk=None) -> torch.Tensor:
    """``[B, S]``: the positions ``d >= B`` at which eviction has happened (before them every policy's mask is the
    dense one, so the KL there teaches nothing about eviction); under per-head budgets ``head_topk`` (a
    ``[layers][kv_heads]`` grid) ``B`` is the smallest head's, where the first head evicts."""
    positions = torch.arange(logits.shape[1], device=logits.device)
    first = budget.total if head_topk is None else budget.sink + budget.window + min(min(row) for row in head_topk)
    return (positions >= first).expand(logits.shape[0], -1)


def student_forward(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [B, S, V], priorities [L, B, Hkv, S])`` of one masked forward of a retrofitted model; ``L`` are its
    evicting layers (all but a model's local layers, ``Runtime.evicting_layers``), as the teacher's targets."""
    with collect_priorities(model) as collected:
        logits = model(input_ids=input_ids, use_cache=False).logits
    layers = runtime_of(model).evicting_layers
    if sorted(collected) != list(layers) or not layers:
        raise ValueError(f"the forward collected priorities of layers {sorted(collected)}, not of the evicting layers "
                         f"{list(layers)}: train a static policy with scorers (policy='kvpop') on a model with global "
                         f"layers")
    return logits, torch.stack([collected[i] for i in layers]).float()


@dataclass(frozen=True)
class Objective:
    """``L = KL_topK + beta · L_ret`` for a budget and a recency term (METHOD §3); ``tau`` the pairwise temperature,
    ``weight`` ``None``, ``"margin"`` or ``"mass"`` (each term weighted by the teacher's ``|y[t_new] - y[t_bnd]|`` or
    ``|exp y[t_new] - exp y[t_bnd]|``: :func:`kvpop.losses.boundary_loss`); ``extra_topks`` more long-range sizes
    whose boundary losses ``L_ret`` averages with ``budget``'s (``boundary_acc`` stays ``budget``'s). ``head_topk``
    (per-head budgets, METHOD §7: long-range slots per (layer, KV head), the layers of the priorities' first dim):
    each head's boundary loss at its own cutoff, ``budget`` their uniform mean."""

    budget: Budget
    recency: float = 0.0
    beta: float = 1.0
    tau: float = 1.0
    weight: str | None = None
    extra_topks: tuple[int, ...] = ()
    head_topk: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if self.recency < 0 or self.beta < 0 or self.tau <= 0:
            raise ValueError(f"Objective needs recency >= 0, beta >= 0 and tau > 0; got recency={self.recency}, "
                             f"beta={self.beta}, tau={self.tau}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"Objective.weight must be one of {WEIGHTS}, got {self.weight!r}")
        if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in self.extra_topks):
            raise ValueError(f"Objective.extra_topks must be long-range sizes >= 1, got {self.extra_topks!r}")
        if self.head_topk is not None and self.extra_topks:
            raise ValueError("Objective: extra_topks are uniform budgets, not defined beside per-head budgets "
                             "(head_topk); train an allocation without them")

    @classmethod
    def for_model(cls, model: nn.Module, **options) -> "Objective":
        """The objective for a retrofitted model's policy: its budget and its recency term."""
        policy = runtime_of(model).policy
        if policy.budget is None:
            raise ValueError(f"the {policy.name} policy has no budget: retrofit with a budget to train")
        policy.require_one_pool("Objective.for_model")
        return cls(policy.budget, policy.recency, **{"head_topk": policy.head_topk, **options})

    def __call__(self, student: torch.Tensor, teacher_targets: torch.Tensor, logits: torch.Tensor,
                 topk_values: torch.Tensor, topk_indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """``student`` priorities and ``teacher_targets`` ``[..., S]`` (e.g. ``[L, B, Hkv, S]``), ``logits [B, S, V]``,
        the teacher's ``topk_values``/``topk_indices [B, S, K]``; returns ``loss``, ``ret_loss``, ``kl`` and
        ``boundary_acc`` (scalar tensors; ``loss`` carries the gradient)."""
        ranking = self.ranking(student, teacher_targets)
        kl = topk_kl(logits, topk_values.float(), topk_indices.long(),
                     mask=evicting(logits, self.budget, self.head_topk))
        return {"loss": kl + self.beta * ranking["ret_loss"], "kl": kl, **ranking}

    def row_topk(self, priorities: torch.Tensor) -> torch.Tensor | None:
        """``head_topk`` shaped for priorities ``[L, B, Hkv, S]`` (``[L, 1, Hkv]``), or ``None`` (uniform)."""
        if self.head_topk is None:
            return None
        grid = torch.tensor(self.head_topk, dtype=torch.long, device=priorities.device)
        if priorities.dim() != 4 or (priorities.shape[0], priorities.shape[2]) != tuple(grid.shape):
            raise ValueError(f"per-head budgets for {tuple(grid.shape)} (layers, KV heads) but priorities "
                             f"{tuple(priorities.shape)} (layers, batch, KV heads, S)")
        return grid[:, None, :]

    def ranking(self, student: torch.Tensor, teacher_targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ranking terms alone (no logits): ``ret_loss`` (with the gradient) and ``boundary_acc``."""
        teacher = with_recency(teacher_targets.float(), self.recency)
        topk = self.row_topk(teacher)
        decisions = retention_decisions(teacher, self.budget, self.extra_topks, topk)
        ret = retention_loss(student, teacher, self.budget, tau=self.tau, weight=self.weight, topks=self.extra_topks,
                             decisions=decisions, head_topk=topk)
        with torch.no_grad():
            accuracy = boundary_agreement(student.detach(), decisions[0])
        return {"ret_loss": ret, "boundary_acc": accuracy}


@dataclass(frozen=True)
class KLThroughMask:
    """The top-K KL of a frozen model's logits under its scorers' *relaxed* retention (METHOD §3, KL through the
    mask): the one-pass forward runs :func:`kvpop.retrofit.soft_retention` at ``tau``, so the KL's gradient reaches
    the scorers' priorities through the attention it gives each eligible token, weighted by ``weight`` beside the
    boundary loss. ``top_k``: the teacher logits it is measured on (the dense pass's, at the positions ``d >= B``).
    ``relative``: ``tau`` in units of each row's priority spread (:func:`kvpop.attention.soft_temperature`; the
    absolute form let the first GPU run lower the relaxed KL by inflating the spread, results README, eighteenth).
    ``recency``: the relaxed forward ranks by scorer + ``recency`` · t (the decay the scorer is evaluated with)
    instead of the policy's own term; the boundary loss keeps the policy's.

    The boundary loss trains every keep / evict decision alike; this term weighs them by what they cost the next-token
    distribution, which is what the evaluation measures (the decisions the boundary loss gets right on average are
    not the ones KL pays for: results README, fourteenth session)."""

    weight: float = 1.0
    tau: float = 1.0
    top_k: int = 64
    relative: bool = False
    recency: float | None = None

    def __post_init__(self):
        if not (self.weight > 0 and self.tau > 0) or not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise ValueError(f"KLThroughMask needs weight > 0, tau > 0 and top_k >= 1; got weight={self.weight}, "
                             f"tau={self.tau}, top_k={self.top_k!r}")
        if self.recency is not None and not (isinstance(self.recency, (int, float))
                                             and not isinstance(self.recency, bool)
                                             and 0 <= self.recency < float("inf")):
            raise ValueError(f"KLThroughMask needs recency >= 0 (or none: the policy's), got {self.recency!r}")

    @classmethod
    def from_options(cls, options: dict | None) -> "KLThroughMask | None":
        """``None`` for no options (``{}``); else the term, refusing unknown keys in one line."""
        if not options:
            return None
        unknown = set(options) - {"weight", "tau", "top_k", "relative", "recency"}
        if unknown:
            raise ValueError(f"KL-through-the-mask options are weight, tau, top_k, relative and recency; got "
                             f"{sorted(unknown)}")
        if not isinstance(options.get("relative", False), bool):
            raise ValueError(f"KL-through-the-mask option relative is true or false, got {options['relative']!r}")
        return cls(**options)

    def __call__(self, model: nn.Module, input_ids: torch.Tensor, topk_values: torch.Tensor,
                 topk_indices: torch.Tensor) -> torch.Tensor:
        """The KL (a scalar with the gradient to the scorers) of one relaxed forward of ``input_ids``."""
        policy = runtime_of(model).policy
        with soft_retention(model, self.tau, self.relative, self.recency):
            logits = model(input_ids=input_ids, use_cache=False).logits
        return topk_kl(logits, topk_values[..., :self.top_k].float(), topk_indices[..., :self.top_k].long(),
                       mask=evicting(logits, policy.budget, policy.head_topk))


@dataclass(frozen=True)
class DMSObjective:
    """DMS's loss (:func:`kvpop.dms.dms_loss`) for a ``Budget(sink, window, 0)``: the top-K KL at ``d >= sink +
    window`` plus ``keep_weight · max(0, keep_rate - schedule.keep_rate(step))``, on the relaxed per-layer decision
    logits of the same forward (:func:`student_forward` collects them)."""

    budget: Budget
    schedule: CompressionSchedule
    keep_weight: float = 1.0

    def __post_init__(self):
        if self.budget.topk != 0:
            raise ValueError(f"DMS has no fixed top-k slots: its budget is Budget(sink, window, 0), got {self.budget}")
        if not self.keep_weight >= 0:
            raise ValueError(f"DMSObjective.keep_weight must be >= 0, got {self.keep_weight}")

    def __call__(self, logits: torch.Tensor, decisions: torch.Tensor, topk_values: torch.Tensor,
                 topk_indices: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """``decisions [L, B, Hkv, S]``; returns ``loss``, ``kl``, ``keep_loss``, ``keep_rate`` (decided tokens kept,
        hard), ``target_keep_rate`` and ``retained_fraction`` (mean tokens each query sees / the dense mean)."""
        loss, metrics = dms_loss(logits, topk_values.float(), topk_indices.long(), list(decisions), step,
                                 self.schedule, mask=evicting(logits, self.budget), keep_weight=self.keep_weight)
        with torch.no_grad():
            retained = retained_stats(list(decisions.detach()), self.budget.window)["mean"].mean()
            dense = (logits.shape[1] + 1) / 2  # query d sees d + 1 tokens under the dense mask
        return {**metrics, "loss": loss, "retained_fraction": retained / dense}


@dataclass(frozen=True)
class StreamingObjective:
    """StreamingLLM+: the top-K KL at ``d >= B`` of the base model trained under the sinks + window mask."""

    budget: Budget

    def __call__(self, logits: torch.Tensor, topk_values: torch.Tensor,
                 topk_indices: torch.Tensor) -> dict[str, torch.Tensor]:
        kl = topk_kl(logits, topk_values.float(), topk_indices.long(), mask=evicting(logits, self.budget))
        return {"loss": kl, "kl": kl}
