"""pipelines.stats against a brute force over all n^n ordered resamples (n = 3, 4)."""
import itertools
import math

import numpy as np
import pytest

from pipelines import stats as S


def brute_force(n, statistic):
    """Every ordered resample of n items (n^n of them, equally likely): the statistic on each, in a plain loop."""
    return [statistic(list(idx)) for idx in itertools.product(range(n), repeat=n)]


def quantile_of(values, q):
    """Inverted-CDF quantile of equally likely values, from its definition."""
    ordered = sorted(values)
    k = math.ceil(q * len(ordered) - 1e-9)
    return ordered[max(k, 1) - 1]


def cdf(values, x):
    return sum(v <= x + 1e-12 for v in values) / len(values)


DATA = {3: [0.2, 0.9, 0.5], 4: [0.91, 0.88, 0.95, 0.90]}
OTHER = {3: [0.1, 0.7, 0.6], 4: [0.90, 0.86, 0.93, 0.90]}


@pytest.mark.parametrize("n", [3, 4])
def test_exact_mean_interval_equals_brute_force(n):
    values = DATA[n]
    dist = brute_force(n, lambda idx: sum(values[i] for i in idx) / n)
    got = S.Bootstrap(n, exact=True).mean(values)
    assert got.estimate == pytest.approx(sum(values) / n)
    assert got.lo == pytest.approx(quantile_of(dist, 0.025))
    assert got.hi == pytest.approx(quantile_of(dist, 0.975))
    boot = S.Bootstrap(n, exact=True)
    assert boot.probs.sum() == pytest.approx(1.0)
    assert float(boot.probs @ boot.means(values)) == pytest.approx(np.mean(dist))  # the whole distribution matches
    assert float(boot.probs @ boot.means(values) ** 2) == pytest.approx(np.mean(np.square(dist)))
    assert S.Bootstrap(n).exact  # chosen automatically: C(2n-1, n) distinct resamples are fewer than the default draws


@pytest.mark.parametrize("n", [3, 4])
def test_monte_carlo_matches_the_exact_distribution(n):
    values = DATA[n]
    dist = brute_force(n, lambda idx: sum(values[i] for i in idx) / n)
    boot = S.Bootstrap(n, resamples=100_000, seed=1, exact=False)
    got = boot.mean(values)
    means = boot.means(values)
    assert means.mean() == pytest.approx(np.mean(dist), abs=2e-3)
    assert means.std() == pytest.approx(np.std(dist), rel=0.02)
    # the Monte Carlo bounds sit where the exact CDF crosses the tails (within Monte Carlo error)
    assert cdf(dist, got.lo) >= 0.025 - 0.005 and cdf(dist, got.lo - 1e-9) <= 0.025 + 0.005
    assert cdf(dist, got.hi) >= 0.975 - 0.005 and cdf(dist, got.hi - 1e-9) <= 0.975 + 0.005


@pytest.mark.parametrize("n", [3, 4])
def test_paired_and_ratio_equal_brute_force(n):
    a, b = DATA[n], OTHER[n]
    diffs = brute_force(n, lambda idx: sum(a[i] - b[i] for i in idx) / n)
    got = S.Bootstrap(n, exact=True).paired(a, b)
    assert got.estimate == pytest.approx(np.mean(a) - np.mean(b))
    assert (got.lo, got.hi) == pytest.approx((quantile_of(diffs, 0.025), quantile_of(diffs, 0.975)))
    assert got.sd == pytest.approx(np.std(np.subtract(a, b), ddof=1))
    ratios = [r for r in brute_force(n, lambda idx: (sum(a[i] for i in idx) / sum(b[i] for i in idx)))]
    ratio = S.Bootstrap(n, exact=True).ratio(a, b)
    assert ratio.estimate == pytest.approx(np.mean(a) / np.mean(b))
    assert (ratio.lo, ratio.hi) == pytest.approx((quantile_of(ratios, 0.025), quantile_of(ratios, 0.975)))


def test_gap_closed_is_a_paired_ratio_of_means():
    rng = np.random.default_rng(0)
    oracle = rng.uniform(0.01, 0.03, 40)
    streaming = oracle + rng.uniform(0.05, 0.1, 40)
    policy = streaming - 0.6 * (streaming - oracle) + rng.normal(0, 0.002, 40)
    got = S.gap_closed(policy, streaming, oracle)
    assert got.estimate == pytest.approx((streaming.mean() - policy.mean()) / (streaming.mean() - oracle.mean()))
    assert got.lo < 0.6 < got.hi and got.hi - got.lo < 0.05
    assert math.isnan(S.gap_closed(policy, streaming, streaming).estimate)  # no gap to close


def test_paired_is_narrower_than_unpaired_on_correlated_items():
    """Items differ a lot in difficulty; policy b is a little worse than a on every item. Separate intervals overlap,
    the paired one excludes 0 — and the unpaired interval of the difference (independent resamples) does not."""
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0.80, 0.98, 32)
    a = difficulty + rng.normal(0, 0.002, 32)
    b = difficulty - 0.004 + rng.normal(0, 0.002, 32)
    ia, ib = S.mean_interval(a), S.mean_interval(b)
    assert ia.lo < ib.hi  # the marginal intervals overlap
    paired = S.paired_difference(a, b)
    assert paired.resolved and paired.lo > 0
    unpaired = (S.Bootstrap(32, seed=1).means(a) - S.Bootstrap(32, seed=2).means(b))
    lo, hi = np.quantile(unpaired, [0.025, 0.975])
    assert lo < 0 < hi
    assert (paired.hi - paired.lo) < (hi - lo) / 5
    needed = paired.items_needed
    assert needed == math.ceil((S.Z95 * np.std(a - b, ddof=1) / abs(np.mean(a - b))) ** 2)
    assert needed < 32  # it is resolved with 32, so fewer than 32 should be needed


def test_resolved_and_items_needed():
    unresolved = S.Difference(0.002, -0.001, 0.005, 8, 0.01)
    assert not unresolved.resolved and unresolved.items_needed == math.ceil((S.Z95 * 0.01 / 0.002) ** 2)
    assert S.Difference(-0.01, -0.02, -0.001, 8, 0.01).resolved
    assert S.items_needed(0.01, 0.0) == math.inf
    assert math.isnan(S.items_needed(math.nan, 0.01))
    assert S.Difference(0.0, 0.0, 0.0, 1).to_dict()["resolved"] is False


def test_same_seed_same_interval_and_constant_items():
    values = np.linspace(0.0, 1.0, 50)
    assert S.mean_interval(values) == S.mean_interval(values)
    const = S.mean_interval([0.5] * 20)
    assert (const.estimate, const.lo, const.hi) == (0.5, 0.5, 0.5)
    one = S.mean_interval([0.3])  # one item: no interval (a zero-width [0.3, 0.3] would claim certainty)
    assert one.estimate == 0.3 and one.n == 1 and math.isnan(one.lo) and math.isnan(one.hi)
    single = S.paired_difference([0.3], [0.1])
    assert math.isnan(single.sd) and not single.resolved and single.estimate == pytest.approx(0.2)
    assert math.isnan(S.gap_closed([0.1], [0.3], [0.0]).lo)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no items"):
        S.mean_interval([])
    with pytest.raises(ValueError, match="NaN or infinite"):
        S.mean_interval([0.1, math.nan, 0.2])
    with pytest.raises(ValueError, match="NaN or infinite"):
        S.paired_difference([0.1, 0.2], [0.1, math.inf])
    with pytest.raises(ValueError, match="differ in number"):
        S.paired_difference([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="1-D"):
        S.mean_interval([[0.1, 0.2]])
    with pytest.raises(ValueError, match="resamples 3"):
        S.Bootstrap(3).mean([0.1, 0.2])
    with pytest.raises(ValueError, match="at least one item"):
        S.Bootstrap(0)
