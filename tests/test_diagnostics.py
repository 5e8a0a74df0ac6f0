"""Scorer diagnostics against brute-force references: decisions, kept sets, rank correlation (ties, edge budgets)."""
import math
import random

import pytest
import torch

from kvpop import Budget
from kvpop.diagnostics import (REFERENCES, attention_under_eviction, auc, average_ranks, decision_metrics,
                               default_queries, diagnose, kept_long_range, spearman, summarize)
from kvpop.retention import eviction_positions, visible, with_recency


# ----------------------------------------------------------------------------- brute-force references (pure python)
def ref_decisions(student, teacher, budget):
    """[(keep, student_keeps, margin)] at every query with more than k eligible tokens, by sorting the prefix."""
    size, (s, w, k) = len(teacher), (budget.sink, budget.window, budget.topk)
    out = []
    for d in range(size):
        t_new = d - w
        if k < 1 or t_new < s or t_new - s + 1 <= k:
            continue
        others = sorted(range(s, t_new), key=lambda t: (teacher[t], t), reverse=True)
        t_bnd = others[k - 1]
        keep = (teacher[t_new], t_new) > (teacher[t_bnd], t_bnd)
        out.append((keep, student[t_new] >= student[t_bnd], student[t_new] - student[t_bnd],
                    abs(teacher[t_new] - teacher[t_bnd])))
    return out


def ref_auc(scores, labels):
    pos = [x for x, y in zip(scores, labels) if y]
    neg = [x for x, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def ref_ranks(values):
    return [sum(1 for u in values if u < v) + (sum(1 for u in values if u == v) - 1) / 2 for v in values]


def ref_spearman(a, b):
    ra, rb = ref_ranks(a), ref_ranks(b)
    n = len(a)
    if n == 0:
        return math.nan
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else math.nan


def ref_kept(priority, budget, d):
    s, w, k = budget.sink, budget.window, budget.topk
    eligible = sorted(range(s, d - w + 1), key=lambda t: (priority[t], t), reverse=True)
    return set(eligible[:k])


def close(a, b, tol=1e-9):
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def cases(n, seed=0):
    rng = random.Random(seed)
    fixed = [(30, Budget(0, 1, 1)), (30, Budget(2, 3, 0)), (20, Budget(1, 25, 3)), (12, Budget(0, 12, 2)),
             (25, Budget(3, 4, 30)), (40, Budget(0, 1, 39)), (2, Budget(0, 1, 1))]
    yield from fixed
    for _ in range(n):
        yield rng.randint(3, 50), Budget(rng.randint(0, 4), rng.randint(1, 10), rng.randint(0, 8))


def random_inputs(size, ties, lead=(2, 3)):
    if ties:  # few distinct values: ties in priorities, targets, margins and ranks
        return torch.randint(0, 3, (*lead, size)).double(), torch.randint(-3, 0, (*lead, size)).double()
    return torch.randn(*lead, size).double(), torch.randn(*lead, size).double()


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("size,budget", list(cases(20)))
@pytest.mark.parametrize("ties", [False, True])
def test_decision_metrics_match_brute_force(size, budget, ties):
    torch.manual_seed(size * 31 + budget.total)
    student, teacher = random_inputs(size, ties)
    got = decision_metrics(student, teacher, budget)
    for idx in [(i, j) for i in range(2) for j in range(3)]:
        terms = ref_decisions(student[idx].tolist(), teacher[idx].tolist(), budget)
        n = len(terms)
        pos = sum(t[0] for t in terms)
        neg = n - pos
        tp = sum(t[0] and t[1] for t in terms)
        tn = sum((not t[0]) and (not t[1]) for t in terms)
        nan = math.nan
        expected = {"decisions": n, "keep_rate": pos / n if n else nan, "agreement": (tp + tn) / n if n else nan,
                    "balanced_accuracy": (tp / pos + tn / neg) / 2 if pos and neg else nan,
                    "auc": ref_auc([t[2] for t in terms], [t[0] for t in terms]),
                    "weighted_agreement": (sum(t[3] for t in terms if t[0] == t[1]) / sum(t[3] for t in terms)
                                           if sum(t[3] for t in terms) > 0 else nan)}
        for key, value in expected.items():
            assert close(got[key][idx].item(), value), (key, idx, got[key][idx].item(), value)


@pytest.mark.parametrize("size,budget", list(cases(12, seed=1)))
@pytest.mark.parametrize("ties", [False, True])
def test_kept_sets_match_brute_force(size, budget, ties):
    torch.manual_seed(size * 17 + budget.total)
    student, teacher = random_inputs(size, ties)
    queries = sorted({0, size // 2, size - 1})
    kept = kept_long_range(student, budget, queries)
    report = diagnose(student, teacher, [budget], queries=queries)
    metrics = report["budgets"][str(budget)]["kept"]["scorer"]
    for idx in [(i, j) for i in range(2) for j in range(3)]:
        p, y = student[idx].tolist(), teacher[idx].tolist()
        for qi, d in enumerate(queries):
            mine, oracle = ref_kept(p, budget, d), ref_kept(y, budget, d)
            assert set(torch.nonzero(kept[idx][qi]).flatten().tolist()) == mine
            overlap = len(mine & oracle) / len(oracle) if oracle else math.nan
            mass = (sum(math.exp(y[t]) for t in mine) / sum(math.exp(y[t]) for t in oracle)) if oracle else math.nan
            assert close(metrics["overlap"][idx][qi].item(), overlap)
            assert close(metrics["mass_ratio"][idx][qi].item(), mass, 1e-9)


@pytest.mark.parametrize("ties", [False, True])
def test_rank_statistics_match_brute_force(ties):
    torch.manual_seed(3)
    a, b = random_inputs(17, ties, lead=(5,))
    mask = torch.rand(5, 17) < 0.7
    mask[0] = False  # an empty row
    mask[1, :] = False
    mask[1, 4] = True  # a single entry: no variance
    labels = torch.rand(5, 17) < 0.4
    ranks, rho, area = average_ranks(a, mask), spearman(a, b, mask), auc(a, labels, mask)
    for r in range(5):
        keep = [i for i in range(17) if mask[r, i]]
        va, vb = [a[r, i].item() for i in keep], [b[r, i].item() for i in keep]
        assert [ranks[r, i].item() for i in keep] == ref_ranks(va)
        assert torch.isnan(ranks[r][~mask[r]]).all()
        assert close(rho[r].item(), ref_spearman(va, vb))
        assert close(area[r].item(), ref_auc(va, [bool(labels[r, i]) for i in keep]))
    with pytest.raises(ValueError, match="finite"):
        average_ranks(torch.tensor([1.0, math.inf]), torch.tensor([True, True]))


def test_reference_rules_and_oracle():
    """Newest-wins agrees at the keep rate, oldest-wins at its complement, both at balanced accuracy 0.5; the oracle
    is 1.0 on every view; and a scorer equal to recency cannot be told from newest-wins."""
    torch.manual_seed(0)
    budget = Budget(2, 8, 6)
    targets = torch.randn(3, 2, 2, 96)
    targets[..., 96 - 8:] = -math.inf  # no deciding query, as teacher targets are
    recency_only = torch.arange(96.).expand(3, 2, 2, 96) * 0.25  # exact in binary: the same ties
    report = diagnose(recency_only, targets, [budget, Budget(2, 8, 20)], recency=0.01)
    assert report["queries"] == default_queries(96, budget)
    for key, per_budget in report["budgets"].items():
        dec = per_budget["decisions"]
        rate = dec["oracle"]["keep_rate"]
        assert torch.allclose(dec["newest"]["agreement"], rate)
        assert torch.allclose(dec["oldest"]["agreement"], 1 - rate)
        for rule in ("newest", "oldest"):
            assert torch.allclose(dec[rule]["balanced_accuracy"], torch.tensor(0.5, dtype=torch.float64))
        # the margin of a position rule is the boundary token's age gap: informative, and mirrored between the two
        assert torch.allclose(dec["newest"]["auc"], 1 - dec["oldest"]["auc"])
        for metric in ("agreement", "balanced_accuracy", "auc", "weighted_agreement"):
            assert (dec["oracle"][metric] == 1).all()
            assert torch.equal(dec["scorer"][metric], dec["newest"][metric])
        kept = per_budget["kept"]
        assert (kept["oracle"]["overlap"] == 1).all() and (kept["oracle"]["mass_ratio"] == 1).all()
        assert torch.equal(kept["scorer"]["overlap"], kept["newest"]["overlap"])
    assert (report["spearman"]["oracle"] > 1 - 1e-12).all()
    assert torch.allclose(report["spearman"]["scorer"], report["spearman"]["newest"])
    assert set(report["spearman"]) == {"scorer", *REFERENCES}
    summary = summarize(report)
    assert summary["spearman"]["scorer"].shape == (3, 2)
    assert summary["budgets"][str(budget)]["kept"]["scorer"]["overlap"].shape == (3, 2, len(report["queries"]))


def test_teacher_ranks_with_the_recency_term():
    """A scorer that reproduces target + λ·t is the oracle at that λ; without the term it is not."""
    torch.manual_seed(1)
    targets = torch.randn(1, 2, 1, 80)
    budget = Budget(0, 4, 5)
    ranked = with_recency(targets, 0.05)
    with_term = diagnose(ranked, targets, [budget], recency=0.05)["budgets"][str(budget)]["decisions"]["scorer"]
    without = diagnose(ranked, targets, [budget], recency=0.0)["budgets"][str(budget)]["decisions"]["scorer"]
    assert (with_term["agreement"] == 1).all()
    assert (without["agreement"] < 1).any()


def test_edge_budgets_give_nan_not_errors():
    """k = 0 (no decision, no long-range slot) and w >= S (nothing ever eligible): NaN everywhere, no crash."""
    student, targets = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    for budget in (Budget(2, 4, 0), Budget(0, 16, 3), Budget(0, 40, 3)):
        report = diagnose(student, targets, [budget])
        per_budget = report["budgets"][str(budget)]
        assert (per_budget["decisions"]["scorer"]["decisions"] == 0).all()
        assert torch.isnan(per_budget["decisions"]["scorer"]["balanced_accuracy"]).all()
        assert torch.isnan(per_budget["kept"]["scorer"]["overlap"]).all()
    report = diagnose(student, targets, [Budget(0, 40, 3)])  # no token has a target either
    assert torch.isnan(report["spearman"]["scorer"]).all()


def ref_attention(q, k, v, priority, budget, scale):
    """Explicit per head: the dense causal softmax, the rule's mask from the per-query top-k (``visible``), the share
    outside it, the share outside it older than the streaming band (python loops over the band), and the output of a
    softmax over the retained tokens only against the dense output. Queries before B are computed too (all 0)."""
    batch, heads, size, _ = q.shape
    group = heads // k.shape[1]
    lost, far, change, norm = (torch.zeros(batch, heads, size, dtype=torch.float64) for _ in range(4))
    causal = torch.ones(size, size).tril().bool()
    for b in range(batch):
        for h in range(heads):
            kv = h // group
            scores = (q[b, h].double() @ k[b, kv].double().T) * scale
            probs = scores.masked_fill(~causal, -math.inf).softmax(-1)
            keep = visible(priority[b, kv], budget)
            gone = torch.where(keep, 0.0, probs)
            lost[b, h] = gone.sum(-1)
            for d in range(size):
                far[b, h, d] = sum(gone[d, t].item() for t in range(size) if d - t >= budget.window + budget.topk)
            dense = probs @ v[b, kv].double()
            masked = scores.masked_fill(~keep, -math.inf).softmax(-1) @ v[b, kv].double()
            change[b, h], norm[b, h] = (masked - dense).norm(dim=-1), dense.norm(dim=-1)
    return {"lost": lost, "lost_far": far, "output_change": change, "output_norm": norm}


@pytest.mark.parametrize("ties", [False, True])
def test_attention_under_eviction_matches_brute_force(ties):
    """Against the explicit softmaxes and the per-query rule, GQA and MHA, on random budgets with the edges
    (``k = 0``, ``s = 0``, ``w >= S``); and nothing lost, no output change, for a rule that keeps everything."""
    gen = torch.Generator().manual_seed(3 + ties)
    for n, (size, budget) in enumerate(cases(6, seed=11)):
        heads, kv_heads = (4, 2) if n % 2 else (2, 2)
        q = torch.randn(2, heads, size, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(2, kv_heads, size, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(2, kv_heads, size, 5, generator=gen, dtype=torch.float64)
        priority = (torch.randint(0, 3, (2, kv_heads, size), generator=gen).double() if ties
                    else torch.randn(2, kv_heads, size, generator=gen, dtype=torch.float64))
        found = attention_under_eviction(q, k, v, {"rule": eviction_positions(priority, budget)}, budget, scale=0.3,
                                         rows=7)["rule"]
        reference = ref_attention(q, k, v, priority, budget, 0.3)
        reference["output_norm"][..., :budget.total] = 0  # not computed before B (nothing is evicted there)
        for part, value in reference.items():
            torch.testing.assert_close(found[part], value, atol=1e-10, rtol=0, msg=f"{part} {size} {budget}")
    everything = Budget(1, 2, 64)
    q, k, v = torch.randn(1, 2, 20, 4), torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 3)
    kept = attention_under_eviction(q, k, v, {"all": eviction_positions(torch.randn(1, 1, 20), everything)},
                                    everything, scale=1.0)["all"]
    assert all((kept[part] == 0).all() for part in ("lost", "lost_far", "output_change"))


def test_attention_under_eviction_refuses_bad_shapes():
    q, k, v = torch.randn(1, 3, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_under_eviction(q, k, v, {}, Budget(0, 2, 2), scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_under_eviction(torch.randn(1, 2, 10, 4), k, v[:, :1], {}, Budget(0, 2, 2), scale=1.0)
    with pytest.raises(ValueError, match=r"evictions\['x'\]"):
        attention_under_eviction(torch.randn(1, 2, 10, 4), k, v, {"x": torch.zeros(1, 2, 9, dtype=torch.long)},
                                 Budget(0, 2, 2), scale=1.0)


def test_bad_input_is_refused():
    a = torch.randn(1, 1, 1, 10)
    with pytest.raises(ValueError, match="same shape"):
        diagnose(a, torch.randn(1, 1, 1, 11), [Budget(0, 2, 2)])
    with pytest.raises(ValueError, match="NaN"):
        diagnose(a, torch.full_like(a, math.nan), [Budget(0, 2, 2)])
    with pytest.raises(ValueError, match="one sink and window"):
        diagnose(a, a, [Budget(0, 2, 2), Budget(0, 3, 2)])
    with pytest.raises(ValueError, match="query positions"):
        diagnose(a, a, [Budget(0, 2, 2)], queries=[10])


def test_mlflow_metrics_and_figure(tmp_path):
    """The tracking view: flat metric names per budget/rule and a per-layer figure that shows recency as such."""
    from pipelines.scorer_diagnostics import diagnostics_figure, flat_metrics

    torch.manual_seed(0)
    targets = torch.randn(3, 2, 2, 64)
    report = diagnose(torch.arange(64.).expand(3, 2, 2, 64), targets, [Budget(2, 4, 6), Budget(2, 4, 0)])
    flat = flat_metrics(report)
    assert flat["diag.s2-w4-k6.newest.balanced_accuracy"] == 0.5
    assert flat["diag.s2-w4-k6.scorer.agreement"] == flat["diag.s2-w4-k6.newest.agreement"]
    assert flat["diag.s2-w4-k6.oracle.overlap_end"] == 1.0
    assert {f"diag.s2-w4-k6.scorer.balanced_accuracy.layer{i:02d}" for i in range(3)} <= set(flat)
    assert not any(key.startswith("diag.s2-w4-k0.") and "decisions" not in key for key in flat)  # NaN left out
    assert all(not math.isnan(v) for v in flat.values())
    fig = diagnostics_figure(report, path=tmp_path / "diag.png")
    assert (tmp_path / "diag.png").stat().st_size > 0 and len(fig.axes) == 2
