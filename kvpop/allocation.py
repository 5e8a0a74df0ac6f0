"""Per-(layer, KV head) budgets allocated from the future-attention targets: which heads get the long-range slots.

Uniform KVpop gives every (layer, KV head) the same ``B = sink + window + topk``. An allocation keeps ``sink`` and
``window`` fixed for every head and moves the ``topk`` slots between heads: head ``i`` holds ``b_i`` tokens,
``sink + window <= b_i <= S``, and ``Σ_i b_i = L · Hkv · B`` exactly (the same total memory as the uniform budget).

**Utility of a slot.** Let ``v[t] = exp(y[g, t])`` be token ``t``'s target mass for KV head ``g`` (METHOD §2: the
mean attention the deciding queries pay it, ``0`` where ``y = -inf``). At query ``d`` the eligible tokens are
``sink <= t <= d - window`` (METHOD §1) and a head with ``k`` long-range slots keeps the ``k`` of them its ranking
prefers (static priorities: the retained set at ``d`` *is* the top ``k`` of the eligible prefix). Order the eligible
tokens by the ranking, best first, ties won by the newer token (:func:`kvpop.retention.ranks_newer_wins`); the
**k-th slot's mass at d** is ``v`` of the k-th token in that order, ``0`` if fewer than ``k`` are eligible. The
**marginal utility** of a head's k-th slot is its mean over the calibration queries: every sequence, and in each
the query positions ``d = S-1, S-1-stride, …`` down to ``sink + window`` (the first query with an eligible token).
``U_i(k) = Σ_{j <= k} gain_i(j)`` is then the mean target mass a head keeps with ``k`` slots.

* Ranked by the targets themselves (the teacher-ranked *oracle* retention, ``utility = "oracle"``), the k-th slot
  holds the k-th largest mass, so ``gain_i(k)`` is non-increasing in ``k`` at every query and so in the mean: each
  ``U_i`` is concave.
* Ranked by a scorer's priorities (``utility = "scorer"``), the k-th slot holds whatever the scorer ranks k-th, and
  ``U_i`` need not be concave.

**Solver.** Maximise ``Σ_i U_i(k_i)`` subject to ``Σ_i k_i = T`` and ``0 <= k_i <= S - sink - window``. For concave
``U_i`` greedy on marginal gains is exact: every feasible allocation is a choice of ``T`` gains that is a prefix of
each row, so its value is at most the sum of the ``T`` largest gains overall; when rows are non-increasing the ``T``
largest can be taken as prefixes, which is what greedy does, so it attains that bound. For non-concave ``U_i`` (a
scorer's ranking) we follow LU-KV (Tang et al. 2026, the marginal-utility solver behind kvpress' ``LUKVPress``):
replace each ``U_i`` by its least concave majorant (its upper hull, whose slopes are the non-increasing regression of
the gains: pool-adjacent-violators), then run greedy on the hull's slopes. That is optimal for the relaxed
(hull) objective and equals ``U_i`` at the hull's vertices; a head that stops inside a hull segment may keep less
than the hull promises, never more. On concave ``U_i`` the hull is ``U_i`` itself.

**Ties.** Gains are taken largest first, ties broken by slot index then head index (round robin): equal gains
everywhere give the uniform allocation, up to the remainder going to the first heads.

**Modes.** ``per_head``: every (layer, KV head) on its own. ``per_layer``: the heads of one layer share one budget
(a serving engine whose pools already differ by layer fits it): the layer's gain for one more slot per head is the
sum of its heads' gains, a unit costs ``Hkv`` slots, and ``Σ_l b_l = L · B``.

**The artifact.** :class:`Allocation` is a small JSON file (:data:`ALLOCATION_FILE`) saved beside a model: the
budgets per layer × KV head, mean ``B``, sink, window, ``S``, the mode, and how it was made (``provenance``: the
calibration data's digest, the base model's weights digest, the utility source, …). :func:`load_allocation` refuses,
in one :class:`AllocationError` line, a file whose budgets do not sum or leave ``[sink + window, S]``, or whose shape
(layers, KV heads) or base model differs from the model it is loaded for.

Torch only.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvpop.budget import Budget
from kvpop.files import atomic_write_text
from kvpop.retention import ranks_newer_wins

MODES = ("per_head", "per_layer")
UTILITY_SOURCES = ("oracle", "scorer")
ALLOCATION_FILE = "kvpop_allocation.json"
FORMAT_VERSION = 1
PROVENANCE_FIELDS = ("calibration_sha256", "weights_sha256", "utility")  # what every artifact must say


class AllocationError(ValueError):
    """An allocation that cannot be made or used as asked: the message says why and what to do."""


# ------------------------------------------------------------------------------------------------ utilities
def _check_scores(name: str, tensor: torch.Tensor, allow_neg_inf: bool) -> None:
    if not torch.is_tensor(tensor) or not tensor.is_floating_point() or tensor.dim() != 4:
        raise AllocationError(f"{name} must be a float tensor [sequences, layers, kv_heads, S], got "
                              f"{type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))}")
    if torch.isnan(tensor).any() or torch.isposinf(tensor).any():
        raise AllocationError(f"{name} holds NaN or +inf: the ranking (and so every slot's mass) would be undefined")
    if not allow_neg_inf and torch.isneginf(tensor).any():
        raise AllocationError(f"{name} holds -inf: a scorer's priorities must be finite")


def query_positions(seq_len: int, sink: int, window: int, stride: int = 1) -> list[int]:
    """The calibration queries of one sequence: ``S-1, S-1-stride, …`` while ``d >= sink + window``."""
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise AllocationError(f"query stride must be an integer >= 1, got {stride!r}")
    return list(range(seq_len - 1, sink + window - 1, -stride))


def slot_gain_sums(targets: torch.Tensor, sink: int, window: int, *, ranking: torch.Tensor | None = None,
                   query_stride: int = 1) -> tuple[torch.Tensor, int]:
    """``(sums [L, Hkv, S - sink - window] float64, queries)``: each slot's mass summed over the calibration queries.

    ``targets [N, L, Hkv, S]``: the stored ``y`` of N calibration sequences (``-inf`` where no query decides).
    ``ranking`` (same shape, finite): a scorer's priorities, ranked with the newer token winning ties; ``None`` ranks
    by the targets (the oracle). ``queries`` counts (sequence, query position) pairs, so sums from several batches
    add up and ``sums / queries`` is :func:`slot_gains`. The slot index ``j`` (0-based) is the ``(j+1)``-th slot.
    """
    _check_scores("targets", targets, allow_neg_inf=True)
    if ranking is not None:
        _check_scores("ranking", ranking, allow_neg_inf=False)
        if ranking.shape != targets.shape:
            raise AllocationError(f"ranking {tuple(ranking.shape)} must have the targets' shape "
                                  f"{tuple(targets.shape)}")
    n, layers, heads, size = targets.shape
    slots = size - sink - window
    if sink < 0 or window < 1 or slots < 1:
        raise AllocationError(f"sink {sink} >= 0, window {window} >= 1 and sink + window < S = {size} are needed "
                              f"for any long-range slot to allocate")
    mass = targets.double().exp()  # -inf -> 0: a token nobody attends to later is worth nothing
    sums = torch.zeros(layers, heads, slots, dtype=torch.float64, device=targets.device)
    positions = query_positions(size, sink, window, query_stride)
    for d in positions:
        eligible = d - window - sink + 1
        seg = mass[..., sink:sink + eligible]
        if ranking is None:
            ordered = seg.sort(-1, descending=True).values
        else:
            _, order = ranks_newer_wins(ranking[..., sink:sink + eligible])  # ascending by (priority, position)
            ordered = seg.gather(-1, order.flip(-1))
        sums[..., :eligible] += ordered.sum(0)
    return sums, n * len(positions)


def slot_gains(targets: torch.Tensor, sink: int, window: int, *, ranking: torch.Tensor | None = None,
               query_stride: int = 1) -> torch.Tensor:
    """``gain [L, Hkv, S - sink - window]`` float64: the marginal utility of each head's k-th long-range slot, the
    mean over the calibration queries of the k-th slot's mass (module docstring)."""
    sums, queries = slot_gain_sums(targets, sink, window, ranking=ranking, query_stride=query_stride)
    if queries == 0:
        raise AllocationError("no calibration queries: give at least one sequence")
    return sums / queries


# ------------------------------------------------------------------------------------------------ the solver
def concave_envelope(gains: torch.Tensor) -> torch.Tensor:
    """The slopes of the least concave majorant of ``U(k) = Σ_{j < k} gains[..., j]`` (``U(0) = 0``), row by row.

    Pool-adjacent-violators: the non-increasing regression of the gains (unit weights); a pooled block's slopes are one
    float, and consecutive blocks compare ``>=`` exactly, so greedy on the result takes prefixes. A non-increasing row
    comes back unchanged.
    """
    rows = gains.double().reshape(-1, gains.shape[-1])
    out = torch.empty_like(rows)
    for r, row in enumerate(rows.tolist()):
        sums: list[float] = []
        counts: list[int] = []
        for value in row:
            sums.append(value)
            counts.append(1)
            while len(sums) > 1 and sums[-2] / counts[-2] < sums[-1] / counts[-1]:
                total, count = sums.pop(), counts.pop()
                sums[-1] += total
                counts[-1] += count
        out[r] = torch.tensor([s / c for s, c in zip(sums, counts) for _ in range(c)], dtype=torch.float64)
    return out.reshape(gains.shape)


def greedy_counts(gains: torch.Tensor, total: int) -> torch.Tensor:
    """``counts [R]`` (long): how many of its slots each row gets, ``Σ counts = total``, ``0 <= counts <= K``.

    ``gains [R, K]``: the marginal utility of each row's slots. Greedy on the concave envelope's slopes
    (:func:`concave_envelope`): the ``total`` largest, ties by slot index then row (module docstring).
    """
    if gains.dim() != 2:
        raise AllocationError(f"gains must be [rows, slots], got {tuple(gains.shape)}")
    rows, slots = gains.shape
    if isinstance(total, bool) or not isinstance(total, int) or not 0 <= total <= rows * slots:
        raise AllocationError(f"{total!r} slots cannot be spread over {rows} rows of {slots}")
    slopes = concave_envelope(gains).T.reshape(-1)  # slot-major: a stable sort keeps (slot, row) order among ties
    chosen = torch.sort(slopes, descending=True, stable=True).indices[:total]
    return torch.bincount(chosen % rows, minlength=rows)


def allocate(gains: torch.Tensor, *, sink: int, window: int, mean_budget: int, mode: str = "per_head"
             ) -> torch.Tensor:
    """Budgets ``[L, Hkv]`` (long, tokens per head: ``sink + window + topk``) summing to ``L · Hkv · mean_budget``.

    ``gains [L, Hkv, S - sink - window]``: :func:`slot_gains` (S follows from its last dim). ``mode``: ``per_head``
    or ``per_layer`` (one budget per layer). ``mean_budget`` must be an integer in ``[sink + window, S]``.
    """
    if mode not in MODES:
        raise AllocationError(f"allocation mode must be one of {MODES}, got {mode!r}")
    if gains.dim() != 3:
        raise AllocationError(f"gains must be [layers, kv_heads, slots], got {tuple(gains.shape)}")
    layers, heads, slots = gains.shape
    floor, size = sink + window, sink + window + slots
    if isinstance(mean_budget, bool) or not isinstance(mean_budget, int) or not floor <= mean_budget <= size:
        raise AllocationError(f"mean budget {mean_budget!r} must be an integer in [sink + window, S] = "
                              f"[{floor}, {size}]")
    extra = mean_budget - floor
    if mode == "per_head":
        counts = greedy_counts(gains.reshape(layers * heads, slots), layers * heads * extra).reshape(layers, heads)
    else:
        counts = greedy_counts(gains.sum(1), layers * extra)[:, None].expand(layers, heads)
    return floor + counts


# ------------------------------------------------------------------------------------------------ the artifact
@dataclass(frozen=True)
class Allocation:
    """Budgets per (layer, KV head) and how they were made; checked on construction (:func:`check_budgets`)."""

    budgets: tuple[tuple[int, ...], ...]  # [L][Hkv] tokens per head, sink + window included
    mean_budget: int
    sink: int
    window: int
    seq_len: int
    mode: str
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_budgets(self.budgets, mean_budget=self.mean_budget, sink=self.sink, window=self.window,
                      seq_len=self.seq_len)
        if self.mode not in MODES:
            raise AllocationError(f"allocation mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "per_layer" and any(len(set(layer)) > 1 for layer in self.budgets):
            raise AllocationError("a per_layer allocation gives every head of a layer the same budget")
        missing = [name for name in PROVENANCE_FIELDS if not self.provenance.get(name)]
        if missing:
            raise AllocationError(f"an allocation must say how it was made: provenance lacks {missing}")
        if self.provenance["utility"] not in UTILITY_SOURCES:
            raise AllocationError(f"provenance utility must be one of {UTILITY_SOURCES}, got "
                                  f"{self.provenance['utility']!r}")

    @property
    def num_layers(self) -> int:
        return len(self.budgets)

    @property
    def num_kv_heads(self) -> int:
        return len(self.budgets[0])

    @property
    def peak_budget(self) -> int:
        return max(max(layer) for layer in self.budgets)

    def head_budget(self, layer: int, head: int) -> Budget:
        """The :class:`kvpop.budget.Budget` of one (layer, KV head): the shared sink and window, its own topk."""
        return Budget(self.sink, self.window, self.budgets[layer][head] - self.sink - self.window)

    @property
    def budget(self) -> Budget:
        """The uniform budget of the same total memory: the shared sink and window, ``topk`` the heads' mean."""
        return Budget(self.sink, self.window, self.mean_budget - self.sink - self.window)

    def head_topk(self) -> tuple[tuple[int, ...], ...]:
        """Long-range slots per (layer, KV head), as a policy carries them (``kvpop.policies.Policy.head_topk``)."""
        floor = self.sink + self.window
        return tuple(tuple(b - floor for b in layer) for layer in self.budgets)

    def check_budget(self, budget: Budget) -> None:
        """One :class:`AllocationError` line unless ``budget`` is this allocation's uniform budget (same sink, window
        and mean total): an allocation redistributes one budget's slots, it cannot stand for another's."""
        if budget != self.budget:
            raise AllocationError(f"the allocation redistributes {self.budget} (mean B {self.mean_budget}), not "
                                  f"{budget}: allocate at this budget, or run at the allocation's")

    def tensor(self) -> torch.Tensor:
        """Budgets as a long tensor ``[L, Hkv]``."""
        return torch.tensor(self.budgets, dtype=torch.long)

    def topk(self) -> torch.Tensor:
        """Long-range slots per head, ``[L, Hkv]``."""
        return self.tensor() - self.sink - self.window

    @classmethod
    def from_tensor(cls, budgets: torch.Tensor, **fields) -> "Allocation":
        return cls(budgets=tuple(tuple(int(b) for b in layer) for layer in budgets.tolist()), **fields)

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, "budgets": [list(layer) for layer in self.budgets],
                           "mean_budget": self.mean_budget, "sink": self.sink, "window": self.window,
                           "seq_len": self.seq_len, "mode": self.mode, "provenance": self.provenance}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Allocation":
        try:
            raw = json.loads(text)
            if raw.get("format_version") != FORMAT_VERSION:
                raise AllocationError(f"allocation format {raw.get('format_version')!r}, this version reads "
                                      f"{FORMAT_VERSION}: make the allocation again")
            return cls(budgets=tuple(tuple(layer) for layer in raw["budgets"]), mean_budget=raw["mean_budget"],
                       sink=raw["sink"], window=raw["window"], seq_len=raw["seq_len"], mode=raw["mode"],
                       provenance=dict(raw["provenance"]))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            if isinstance(err, AllocationError):
                raise
            raise AllocationError(f"not an allocation file ({type(err).__name__}: {err}): make the allocation "
                                  f"again") from None


def check_budgets(budgets, *, mean_budget: int, sink: int, window: int, seq_len: int) -> None:
    """One :class:`AllocationError` line unless ``budgets`` is a non-empty ``[L][Hkv]`` grid of integers in
    ``[sink + window, seq_len]`` summing to ``L · Hkv · mean_budget``."""
    for name, value in (("mean_budget", mean_budget), ("sink", sink), ("window", window), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise AllocationError(f"allocation {name} must be an integer, got {value!r}")
    if sink < 0 or window < 1 or sink + window > seq_len:
        raise AllocationError(f"sink {sink} >= 0, window {window} >= 1 and sink + window <= S = {seq_len} are "
                              f"needed")
    if (not isinstance(budgets, (list, tuple)) or not budgets
            or not all(isinstance(layer, (list, tuple)) and layer for layer in budgets)
            or len({len(layer) for layer in budgets}) != 1):
        raise AllocationError("allocation budgets must be a non-empty [layers][kv_heads] grid")
    floor = sink + window
    for l, layer in enumerate(budgets):
        for g, b in enumerate(layer):
            if isinstance(b, bool) or not isinstance(b, int):
                raise AllocationError(f"budget of layer {l} head {g} is {b!r}, not an integer")
            if b < floor:
                raise AllocationError(f"layer {l} head {g} has budget {b}, below sink + window = {floor}: every head "
                                      f"keeps its sinks and window")
            if b > seq_len:
                raise AllocationError(f"layer {l} head {g} has budget {b}, above S = {seq_len}")
    heads = len(budgets) * len(budgets[0])
    total = sum(sum(layer) for layer in budgets)
    if total != heads * mean_budget:
        raise AllocationError(f"budgets sum to {total}, not layers × kv_heads × mean budget = {heads} × "
                              f"{mean_budget} = {heads * mean_budget}: the allocation would change the total memory")


def save_allocation(folder: str | os.PathLike, allocation: Allocation) -> Path:
    """Write ``allocation`` into ``folder`` (a model folder) as :data:`ALLOCATION_FILE`, atomically."""
    path = Path(folder) / ALLOCATION_FILE
    atomic_write_text(path, allocation.to_json())
    return path


def load_allocation(folder: str | os.PathLike, *, num_layers: int, num_kv_heads: int,
                    weights_sha256: str | None = None) -> Allocation:
    """The allocation saved in ``folder``, refused (one :class:`AllocationError` line) unless it is made for a model
    of ``num_layers`` × ``num_kv_heads`` and, when ``weights_sha256`` is given, for that base model's weights."""
    path = Path(folder) / ALLOCATION_FILE
    try:
        text = path.read_text()
    except OSError:
        raise AllocationError(f"no allocation at {path}: run the allocate stage for this model first") from None
    try:
        allocation = Allocation.from_json(text)
    except AllocationError as err:
        raise AllocationError(f"{path}: {err}") from None
    shape, want = (allocation.num_layers, allocation.num_kv_heads), (num_layers, num_kv_heads)
    if shape != want:
        raise AllocationError(f"{path} is an allocation for {shape[0]} layers × {shape[1]} KV heads, this model has "
                              f"{want[0]} × {want[1]}: allocate for this model")
    made_for = allocation.provenance["weights_sha256"]
    if weights_sha256 is not None and made_for != weights_sha256:
        raise AllocationError(f"{path} was allocated for another base model (weights {str(made_for)[:12]}…, this "
                              f"one {weights_sha256[:12]}…): allocate for this model")
    return allocation


def kept_mass(gains: torch.Tensor, budgets: torch.Tensor, *, sink: int, window: int) -> float:
    """The mean over heads of ``U_i(b_i - sink - window)``: the mean long-range target mass each head keeps per
    calibration query under these budgets (``gains [L, Hkv, K]`` as :func:`slot_gains`, ``budgets [L, Hkv]``)."""
    counts = (budgets.to(torch.long) - sink - window).clamp(min=0, max=gains.shape[-1])
    cumulative = torch.nn.functional.pad(gains.double().cumsum(-1), (1, 0))  # U(0) = 0
    return float(cumulative.gather(-1, counts[..., None].to(gains.device)).mean())


def budget_summary(budgets: torch.Tensor) -> dict:
    """Mean, peak and floor of a budget grid: memory reported as mean and as peak per (layer, head)."""
    values = budgets.double()
    return {"mean": float(values.mean()), "peak": int(budgets.max()), "min": int(budgets.min()),
            "std": float(values.std(unbiased=False)) if values.numel() > 1 else 0.0,
            "layer_means": [float(x) for x in values.mean(1)]}


__all__ = ["ALLOCATION_FILE", "Allocation", "AllocationError", "MODES", "UTILITY_SOURCES", "allocate",
           "budget_summary", "check_budgets", "concave_envelope", "greedy_counts", "kept_mass", "load_allocation",
           "query_positions", "save_allocation", "slot_gain_sums", "slot_gains"]
