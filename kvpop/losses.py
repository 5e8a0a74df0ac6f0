"""The training losses of METHOD §3: the boundary-aware retention loss and top-K distillation."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpop.budget import Budget
from kvpop.retention import prefix_kth_largest, ranks_newer_wins, row_topk, wavelet_kth_largest


@dataclass
class BoundaryDecisions:
    """The cache's decision at every query position ``d``, as the teacher makes it.

    Index ``j`` stands for the newly eligible token ``t_new = sink + j`` (query ``d = t_new + window``).
    ``valid`` marks positions with a real decision (``topk >= 1``, more than ``topk`` eligible tokens,
    ``d`` inside the sequence); there ``t_bnd`` is the teacher's weakest kept token when ``t_new`` is left out
    and ``keep`` whether the teacher keeps ``t_new`` (``z = +1``).
    """

    t_new: torch.Tensor  # [n] positions
    t_bnd: torch.Tensor  # [..., n] positions (meaningless where not valid)
    keep: torch.Tensor  # [..., n] bool
    valid: torch.Tensor  # [..., n] bool


def boundary_decisions(teacher: torch.Tensor, budget: Budget, topk: torch.Tensor | None = None) -> BoundaryDecisions:
    """Teacher cutoffs for every position in O(S log S) per row (order statistics over prefixes, not sorting).

    ``topk`` (a long tensor broadcastable to the leading dims, e.g. ``[L, 1, Hkv]`` for ``[L, B, Hkv, S]``): each
    row's own long-range slots (per-head budgets, METHOD §7), so each head is trained at its own cutoff; a row at
    ``topk = 0`` makes no decision."""
    size = teacher.shape[-1]
    s, w, k = budget.sink, budget.window, budget.topk
    n = max(size - s, 0)
    device = teacher.device
    t_new = torch.arange(s, s + n, device=device)
    lead = teacher.shape[:-1]
    k_rows = row_topk(topk, lead, device)
    if n == 0 or (k == 0 if k_rows is None else not bool((k_rows > 0).any())):
        empty = torch.zeros(*lead, n, dtype=torch.bool, device=device)
        return BoundaryDecisions(t_new, torch.zeros(*lead, n, dtype=torch.long, device=device), empty, empty)
    rank, order = ranks_newer_wins(teacher[..., s:])
    theta = prefix_kth_largest(rank, k if k_rows is None else k_rows.clamp(min=1))  # k-th best rank in [s, s + j]
    # the cutoff for t_new = s + j is the k-th best of [s, t_new - 1], i.e. theta[j - 1]
    cutoff_rank = torch.cat([torch.full_like(theta[..., :1], -1), theta[..., :-1]], dim=-1)
    valid = (cutoff_rank >= 0) & (t_new + w <= size - 1)
    if k_rows is not None:
        valid = valid & (k_rows[..., None] > 0)
    t_bnd = s + order.gather(-1, cutoff_rank.clamp(min=0))
    keep = rank > cutoff_rank
    return BoundaryDecisions(t_new, t_bnd, keep & valid, valid)


def boundary_decisions_at(teacher: torch.Tensor, budgets) -> list[BoundaryDecisions]:
    """:func:`boundary_decisions` at each of ``budgets`` (one sink and window, uniform ``topk`` each), equal to the
    calls one by one, from one ranking of the teacher and one wavelet descent over all the budgets' rows (each row its
    own ``k``): a training step's several budgets (``extra_topks``) cost about the ops of one. No value is read on the
    host: the ``k`` are the budgets' own ints."""
    budgets = list(budgets)
    if not budgets:
        return []
    s, w = budgets[0].sink, budgets[0].window
    if any((b.sink, b.window) != (s, w) for b in budgets):
        raise ValueError(f"boundary_decisions_at takes budgets of one sink and window, got {budgets}")
    size, lead, device = teacher.shape[-1], teacher.shape[:-1], teacher.device
    n = max(size - s, 0)
    live = [b.topk for b in budgets if b.topk > 0]
    if n == 0 or not live:
        return [boundary_decisions(teacher, b) for b in budgets]
    t_new = torch.arange(s, s + n, device=device)
    rank, order = ranks_newer_wins(teacher[..., s:])
    rows = rank.reshape(-1, n)
    count = len(live)
    # each budget's k filled on the device (a host tensor copied over would wait for the queue on CUDA)
    k_rows = torch.cat([torch.full((rows.shape[0], 1), k, dtype=torch.long, device=device) for k in live])
    theta = wavelet_kth_largest(rows.repeat(count, 1), k_rows).view(count, *lead, n)
    cutoff_rank = torch.cat([torch.full_like(theta[..., :1], -1), theta[..., :-1]], dim=-1)
    valid = (cutoff_rank >= 0) & (t_new + w <= size - 1)
    t_bnd = s + order.expand(count, *order.shape).gather(-1, cutoff_rank.clamp(min=0))
    keep = (rank > cutoff_rank) & valid
    found = iter(zip(t_bnd.unbind(0), keep.unbind(0), valid.unbind(0)))
    return [BoundaryDecisions(t_new, *next(found)) if b.topk > 0 else boundary_decisions(teacher, b)
            for b in budgets]


def boundary_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    budget: Budget,
    *,
    tau: float = 1.0,
    weight: torch.Tensor | str | None = None,
    decisions: BoundaryDecisions | None = None,
    balance: bool = False,
    topk: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over valid positions of ``ω · softplus(-z · (p[t_new] - p[t_bnd]) / τ)``.

    ``student``/``teacher``: priorities ``[..., S]`` (any leading dims: batch × heads × layers), the teacher's
    including the recency term the policy uses. ``weight``: ``None``, ``"margin"`` (``|y[t_new] - y[t_bnd]|`` of the
    teacher), ``"mass"`` (``|exp y[t_new] - exp y[t_bnd]|``: the future attention the decision moves, when ``y`` is
    a log-attention target without a recency term — what a wrong decision costs the attention output, where the
    plain mean counts every decision alike), or a tensor ``[..., S]`` indexed at ``t_new``. Returns 0 (with a graph,
    no NaN) when no position is valid. ``decisions`` may be passed to reuse the teacher cutoffs (they depend only on
    the teacher). ``balance`` multiplies ω by per-row class weights ``n / (2 n_keep)`` and ``n / (2 n_evict)``: the
    teacher keeps ``t_new`` only ~15-25 % of the time, so the plain mean is dominated by "evict" decisions (rows
    with one class only keep weight 1). ``topk``: per-row long-range slots (:func:`boundary_decisions`).
    """
    if student.shape != teacher.shape:
        raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} priorities differ in shape")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    dec = decisions if decisions is not None else boundary_decisions(teacher.detach(), budget, topk)
    # no `if not dec.valid.any()` here: it would wait for the device every call; invalid positions are masked below
    # and a loss without one is 0 / 1 (with a graph, no NaN)
    margin = boundary_margins(student, dec)
    z = dec.keep.to(student.dtype) * 2 - 1
    term = F.softplus(-z * margin / tau)
    if isinstance(weight, str):
        if weight not in ("margin", "mass"):
            raise ValueError(f"weight must be None, 'margin', 'mass' or a tensor, got {weight!r}")
        y = teacher.detach()
        omega = boundary_margins(y if weight == "margin" else y.exp(), dec).abs()
        term = term * torch.where(dec.valid, omega, 0.0)
    elif weight is not None:
        term = term * weight.gather(-1, dec.t_new.expand_as(dec.t_bnd))
    if balance:
        term = term * class_balance_weights(dec).to(term.dtype)
    term = torch.where(dec.valid, term, 0.0)
    return term.sum() / dec.valid.sum().clamp(min=1)


def class_balance_weights(decisions: BoundaryDecisions) -> torch.Tensor:
    """``[..., n]``: ``n / (2 n_keep)`` on keep decisions and ``n / (2 n_evict)`` on evict ones, per row, so each
    class carries half of the row's weight (both weights 1 in a row that lacks a class)."""
    count = decisions.valid.sum(-1, keepdim=True).double()
    keeps = decisions.keep.sum(-1, keepdim=True).double()
    evicts = count - keeps
    both = (keeps > 0) & (evicts > 0)
    w_keep = torch.where(both, count / (2 * keeps.clamp(min=1)), 1.0)
    w_evict = torch.where(both, count / (2 * evicts.clamp(min=1)), 1.0)
    return torch.where(decisions.keep, w_keep, w_evict)


def random_pair_loss(student: torch.Tensor, teacher: torch.Tensor, budget: Budget, *, pairs: int, tau: float = 1.0,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """A ranking loss over the whole eligible set: for every ``t_new`` (that has a target), ``pairs`` partners ``u``
    drawn uniformly from the older eligible tokens ``[sink, t_new - 1]``, with the pairwise logistic term of
    :func:`boundary_loss` and the teacher's order (newer wins ties). Mean over pairs; 0 (with a graph) if none.

    The boundary loss supervises one pair per query, at the budget's cutoff; these pairs teach the order of the
    rest, which the cutoff of every other budget (and of the next queries) depends on.
    """
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    size = teacher.shape[-1]
    s, w = budget.sink, budget.window
    t_new = torch.arange(s + 1, max(s + 1, size - w), device=teacher.device)  # has a target and an older token
    if t_new.numel() == 0:
        return student.sum() * 0.0
    draw = torch.rand(*teacher.shape[:-1], t_new.numel(), pairs, generator=generator,
                      device=generator.device if generator is not None else teacher.device)
    older = (draw.to(teacher.device) * (t_new - s)[:, None]).long() + s  # uniform in [s, t_new - 1]
    older = older.reshape(*teacher.shape[:-1], -1)
    newer = t_new.repeat_interleave(pairs).expand_as(older)
    t = teacher.detach()
    z = (t.gather(-1, newer) >= t.gather(-1, older)).to(student.dtype) * 2 - 1
    margin = student.gather(-1, newer) - student.gather(-1, older)
    return F.softplus(-z * margin / tau).mean()


RETENTION_OPTIONS = ("tau", "weight", "balance", "topks", "random_pairs")


def check_retention_options(options: dict) -> dict:
    """``options`` for :func:`retention_loss` as a config gives them (e.g. ``train.loss_options``), checked: unknown
    names and bad values are a ``ValueError`` that lists what is allowed."""
    unknown = sorted(set(options) - set(RETENTION_OPTIONS))
    if unknown:
        raise ValueError(f"unknown retention loss option(s) {unknown}; known: {list(RETENTION_OPTIONS)}")
    out = dict(options)
    if "tau" in out and not (isinstance(out["tau"], (int, float)) and out["tau"] > 0):
        raise ValueError(f"tau must be a number > 0, got {out['tau']!r}")
    if out.get("weight") not in (None, "none", "margin", "mass"):
        raise ValueError(f"weight must be none, margin or mass, got {out['weight']!r}")
    if out.get("weight") == "none":
        out["weight"] = None
    if "balance" in out and not isinstance(out["balance"], bool):
        raise ValueError(f"balance must be true or false, got {out['balance']!r}")
    topks = out.get("topks", [])
    if not isinstance(topks, (list, tuple)) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                                                       for k in topks):
        raise ValueError(f"topks must be a list of long-range sizes >= 1, got {topks!r}")
    pairs = out.get("random_pairs", 0)
    if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs < 0:
        raise ValueError(f"random_pairs must be an integer >= 0, got {pairs!r}")
    return out


def retention_budgets(budget: Budget, topks=()) -> list[Budget]:
    """``budget`` and, once each, the budgets of the same sink and window at every other long-range size in
    ``topks``: the budgets whose boundary losses :func:`retention_loss` averages."""
    extra = dict.fromkeys(int(k) for k in topks if int(k) != budget.topk)
    return [budget] + [Budget(budget.sink, budget.window, k) for k in extra]


def retention_decisions(teacher: torch.Tensor, budget: Budget, topks=(),
                        head_topk: torch.Tensor | None = None) -> list[BoundaryDecisions]:
    """The teacher's decisions at each of :func:`retention_budgets` (``budget``'s first): uniform budgets from one
    ranking and one wavelet descent (:func:`boundary_decisions_at`); per-head budgets (``head_topk``, no extra sizes)
    at ``budget`` alone."""
    teacher = teacher.detach()
    if head_topk is not None:
        return [boundary_decisions(teacher, budget, head_topk)]
    return boundary_decisions_at(teacher, retention_budgets(budget, topks))


def retention_loss(student: torch.Tensor, teacher: torch.Tensor, budget: Budget, *, tau: float = 1.0,
                   weight: str | None = None, balance: bool = False, topks=(), random_pairs: int = 0,
                   generator: torch.Generator | None = None,
                   decisions: list[BoundaryDecisions] | None = None,
                   head_topk: torch.Tensor | None = None) -> torch.Tensor:
    """The retention objective with its options: :func:`boundary_loss` at ``budget`` and at every extra long-range
    size in ``topks`` (same sink and window: the cache is evaluated at several budgets, and each ``k`` has its own
    cutoff), averaged; plus, with ``random_pairs``, :func:`random_pair_loss` as one more equal part. ``decisions``:
    the teacher's at each of :func:`retention_budgets` (:func:`retention_decisions`), where the caller has them
    already. ``head_topk``: per-head budgets (per-row long-range slots, :func:`boundary_decisions`) in place of
    ``budget.topk``; extra ``topks`` are not defined beside them (one clear error)."""
    if head_topk is not None and any(int(k) != budget.topk for k in topks):
        raise ValueError("extra long-range sizes (topks) are uniform budgets: they are not defined beside per-head "
                         "budgets; train an allocation without them")
    budgets = retention_budgets(budget, topks)
    if decisions is None:
        decisions = retention_decisions(teacher, budget, topks, head_topk)
    if len(decisions) != len(budgets):
        raise ValueError(f"decisions for {len(decisions)} budgets, but the loss has {len(budgets)}: {budgets}")
    parts = [boundary_loss(student, teacher, b, tau=tau, weight=weight, balance=balance, decisions=dec,
                           topk=head_topk if b == budget else None) for b, dec in zip(budgets, decisions, strict=True)]
    if random_pairs:
        parts.append(random_pair_loss(student, teacher, budget, pairs=random_pairs, tau=tau, generator=generator))
    return torch.stack(parts).mean()


def boundary_margins(priority: torch.Tensor, decisions: BoundaryDecisions) -> torch.Tensor:
    """``p[t_new] - p[t_bnd]`` at every decision ``[..., n]`` (meaningless where not valid)."""
    idx_new = decisions.t_new.expand_as(decisions.t_bnd)
    return priority.gather(-1, idx_new) - priority.gather(-1, decisions.t_bnd)


def student_keeps(priority: torch.Tensor, decisions: BoundaryDecisions) -> torch.Tensor:
    """``[..., n]`` bool: these priorities keep ``t_new`` over the teacher's boundary token (newer wins ties).

    ``p[t_new] >= p[t_bnd]`` rather than a difference: an infinite priority must not turn a tie into NaN.
    """
    idx_new = decisions.t_new.expand_as(decisions.t_bnd)
    return priority.gather(-1, idx_new) >= priority.gather(-1, decisions.t_bnd)


def boundary_agreement(student: torch.Tensor, decisions: BoundaryDecisions) -> torch.Tensor:
    """Fraction of the teacher's keep/evict decisions that the student's priorities reproduce pairwise.

    The student keeps ``t_new`` over the teacher's boundary token when ``p[t_new] >= p[t_bnd]`` (newer wins ties).
    """
    agree = (student_keeps(student, decisions) == decisions.keep) & decisions.valid
    return agree.sum() / decisions.valid.sum().clamp(min=1)


def topk_kl(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """KL(teacher ‖ student) on the teacher's top-K support, both renormalised there (METHOD §3).

    ``student_logits`` ``[..., V]``; ``teacher_topk_logits``/``indices`` ``[..., K]``; ``mask`` ``[...]`` selects the
    positions that count (padding, prompt). Returns the mean over counted positions.
    """
    if teacher_topk_logits.shape != teacher_topk_indices.shape:
        raise ValueError("teacher top-K logits and indices must have the same shape")
    if student_logits.shape[:-1] != teacher_topk_logits.shape[:-1]:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher top-K "
                         f"{tuple(teacher_topk_logits.shape)} disagree on the leading dims")
    student_k = student_logits.gather(-1, teacher_topk_indices.long()).float() / temperature  # gather first: no
    # float32 copy of the [..., V] logits
    log_q = student_k.log_softmax(-1)
    log_p = (teacher_topk_logits.float() / temperature).log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)
