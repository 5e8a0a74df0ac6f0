"""Percentile-bootstrap intervals over evaluation items, paired differences, and how many items a difference needs.

An *item* is the unit that is independent of the others: a held-out sequence (its per-position metrics averaged
first — positions inside one sequence are not independent), a task sample, or a generation prompt. Every statistic
here is a function of per-item values.

* **Interval of a mean.** Resample the ``n`` items with replacement; the 2.5 % and 97.5 % quantiles (inverted CDF:
  the smallest resampled value whose cumulative share reaches the level) of the resampled means are the 95 %
  interval. The estimate is the mean of the items themselves.
* **Paired difference** of two policies on the same items: the same resamples for both, i.e. the interval of the
  mean per-item difference. The items' shared difficulty cancels, so a paired interval is much narrower than the
  two separate intervals suggest. ``resolved`` when it excludes 0.
* **Ratio of means** (e.g. the fraction of the streaming → oracle KL gap a policy closes: ``mean(s - p) /
  mean(s - o)``): the ratio recomputed on each resample, so numerator and denominator stay paired.
* **One item** has no interval: its bounds are NaN and no difference over it is resolved (a bootstrap of one value
  would give the zero-width interval ``[x, x]``, which excludes 0 without any evidence).
* **Items needed** to resolve a difference ``Δ`` with per-item paired SD ``σ``: ``n ≈ (1.96 σ / |Δ|)²`` (the normal
  approximation of the interval's half-width ``1.96 σ / √n``).

Why the fast path is right: the counts of how often each item is drawn in one resample are exactly
``multinomial(n, 1/n)``, so a resample is a count vector and every resampled mean of every metric is one matrix
product ``counts @ values / n`` (:class:`Bootstrap`). When the distinct count vectors (``C(2n-1, n)``: 35 for 4 items,
6,435 for 8) are no more than the Monte Carlo draws asked for, they are enumerated with their multinomial
probabilities instead: the *exact* bootstrap distribution, cheaper and without Monte Carlo error.
``tests/test_stats.py`` holds both modes to a brute force over all ``n^n`` ordered resamples.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

LEVEL = 0.95
RESAMPLES = 4000
SEED = 0
Z95 = 1.959963984540054  # the normal quantile of 0.975


def as_items(values, what: str = "values") -> np.ndarray:
    """Per-item values as a 1-D float64 array; a clear error for empty input, NaN or infinities."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{what}: expected one value per item (a 1-D list), got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{what}: no items — an interval needs at least one evaluated item")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ValueError(f"{what}: items {bad[:5].tolist()} are NaN or infinite; drop those items (from every "
                         f"policy, to keep the comparison paired) before bootstrapping")
    return array


@dataclass(frozen=True)
class Interval:
    """A point estimate (on all items) with its percentile-bootstrap interval over ``n`` items."""

    estimate: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Difference(Interval):
    """A paired difference ``a - b`` with the per-item SD of ``a - b``."""

    sd: float = math.nan

    @property
    def resolved(self) -> bool:
        """The interval excludes 0."""
        return self.lo > 0 or self.hi < 0

    @property
    def items_needed(self) -> float:
        return items_needed(self.sd, self.estimate)

    def to_dict(self) -> dict:
        return {**asdict(self), "resolved": self.resolved, "items_needed": self.items_needed}


def items_needed(sd: float, difference: float, z: float = Z95) -> float:
    """``(z σ / |Δ|)²`` rounded up: items for a 95 % paired interval of half-width ``|Δ|`` (inf when Δ = 0)."""
    if not math.isfinite(sd) or not math.isfinite(difference):
        return math.nan
    if difference == 0:
        return math.inf if sd > 0 else math.nan
    return float(math.ceil((z * sd / abs(difference)) ** 2))


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Inverted-CDF quantile of a discrete distribution: the smallest value whose cumulative weight reaches ``q``."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    cumulative /= cumulative[-1]
    index = int(np.searchsorted(cumulative, q - 1e-12, side="left"))
    return float(values[order][min(index, len(order) - 1)])


def exact_count_vectors(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every distinct resample of ``n`` items as a count vector ``[C(2n-1, n), n]`` with its probability."""
    combos = np.array(list(itertools.combinations_with_replacement(range(n), n)), dtype=np.int64)
    counts = np.zeros((len(combos), n), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(len(combos)), n), combos.ravel()), 1)
    log_fact = np.array([math.lgamma(c + 1) for c in range(n + 1)])
    log_p = math.lgamma(n + 1) - log_fact[counts].sum(1) - n * math.log(n)
    return counts.astype(np.float64), np.exp(log_p)


class Bootstrap:
    """The resamples of ``n`` items, shared by every statistic computed from it (so all of them are paired).

    ``resamples`` Monte Carlo count vectors from ``seed``, or the exact distribution when it has no more distinct
    resamples than that (``exact=None``: decide so; ``True``/``False``: force).
    """

    def __init__(self, n: int, *, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL,
                 exact: bool | None = None):
        if n < 1:
            raise ValueError(f"a bootstrap needs at least one item, got n={n}")
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level}")
        if resamples < 1:
            raise ValueError(f"resamples must be >= 1, got {resamples}")
        self.n, self.level = n, level
        self.exact = math.comb(2 * n - 1, n) <= resamples if exact is None else exact
        if self.exact:
            self.counts, self.probs = exact_count_vectors(n)
        else:
            rng = np.random.default_rng(seed)
            self.counts = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)
            self.probs = np.full(resamples, 1.0 / resamples)

    def _check(self, values, what: str) -> np.ndarray:
        array = as_items(values, what)
        if array.size != self.n:
            raise ValueError(f"{what}: {array.size} items, but this bootstrap resamples {self.n}")
        return array

    def means(self, values) -> np.ndarray:
        """The mean of ``values`` on every resample."""
        return self.counts @ self._check(values, "values") / self.n

    def _bounds(self, resampled: np.ndarray) -> tuple[float, float]:
        if self.n < 2:  # one item has no spread to resample: no interval (NaN bounds), so nothing is resolved
            return math.nan, math.nan
        return _bounds_of(resampled, self.probs, self.level)

    def mean(self, values) -> Interval:
        array = self._check(values, "values")
        lo, hi = self._bounds(self.counts @ array / self.n)
        return Interval(float(array.mean()), lo, hi, self.n)

    def paired(self, a, b) -> Difference:
        """``mean(a - b)`` over the same items, with its interval and the per-item SD of ``a - b``."""
        diff = self._check(a, "a") - self._check(b, "b")
        lo, hi = self._bounds(self.counts @ diff / self.n)
        sd = float(diff.std(ddof=1)) if self.n > 1 else math.nan
        return Difference(float(diff.mean()), lo, hi, self.n, sd)

    def ratio(self, numerator, denominator) -> Interval:
        """``mean(numerator) / mean(denominator)`` over the same items (NaN estimate if the denominator's mean is 0).

        Resamples whose denominator mean is 0 are left out of the interval.
        """
        num, den = self._check(numerator, "numerator"), self._check(denominator, "denominator")
        if den.mean() == 0:
            return Interval(math.nan, math.nan, math.nan, self.n)
        draws = self.ratios(num, den)
        keep = ~np.isnan(draws)
        lo, hi = ((math.nan, math.nan) if self.n < 2 else  # one item: no interval (see _bounds)
                  _bounds_of(draws[keep], self.probs[keep], self.level))
        return Interval(float(num.mean() / den.mean()), lo, hi, self.n)

    def ratios(self, numerator, denominator) -> np.ndarray:
        """``mean(numerator) / mean(denominator)`` on every resample (NaN where its denominator mean is 0)."""
        top = self.counts @ self._check(numerator, "numerator")
        bottom = self.counts @ self._check(denominator, "denominator")
        return np.divide(top, bottom, out=np.full_like(top, np.nan), where=bottom != 0)


def _bounds_of(values: np.ndarray, weights: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    return weighted_quantile(values, weights, tail), weighted_quantile(values, weights, 1 - tail)


@lru_cache(maxsize=64)
def bootstrap_for(n: int, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> Bootstrap:
    """One shared :class:`Bootstrap` per item count (its resamples are fixed by ``seed``)."""
    return Bootstrap(n, resamples=resamples, seed=seed, level=level)


def mean_interval(values, **options) -> Interval:
    """95 % percentile-bootstrap interval of the mean of per-item ``values``."""
    return bootstrap_for(len(as_items(values)), **options).mean(values)


def paired_difference(a, b, **options) -> Difference:
    """Paired bootstrap of ``mean(a - b)``: ``a[i]`` and ``b[i]`` are two policies on the same item ``i``."""
    if len(as_items(a, "a")) != len(as_items(b, "b")):
        raise ValueError(f"paired items differ in number: {len(a)} vs {len(b)} (pair the same items)")
    return bootstrap_for(len(a), **options).paired(a, b)


def gap_closed(policy, baseline, ceiling, **options) -> Interval:
    """The fraction of the ``baseline`` → ``ceiling`` gap that ``policy`` closes, ``mean(baseline - policy) /
    mean(baseline - ceiling)``, per item paired (e.g. KL: streaming → oracle). 1 = at the ceiling, 0 = no better."""
    p, b, c = as_items(policy, "policy"), as_items(baseline, "baseline"), as_items(ceiling, "ceiling")
    if not len(p) == len(b) == len(c):
        raise ValueError(f"paired items differ in number: {len(p)}, {len(b)}, {len(c)}")
    return bootstrap_for(len(p), **options).ratio(b - p, b - c)
