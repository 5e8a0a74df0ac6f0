"""pipelines.report: the summary is the stats of the right items, the wording follows the intervals, figures draw."""
import math
import random

import numpy as np
import pytest

from pipelines import report as R
from pipelines import stats as S

BUDGETS = [{"B": 100, "CR": 0.8}, {"B": 64, "CR": 0.875}]


def text_records(seed=0, n=24):
    """top1 / kl per sequence: kvpop better than streaming by a margin on every item, tova unresolved vs streaming,
    oracle best, h2o worst; tova ran on the first 16 sequences only."""
    rng = random.Random(seed)
    out = []
    for item in range(n):
        difficulty = rng.uniform(0.8, 0.95)
        for total in (100, 64):
            shift = 0.0 if total == 100 else -0.03
            values = {"streaming": difficulty + shift, "kvpop": difficulty + shift + 0.01 + rng.gauss(0, 0.002),
                      "tova": difficulty + shift + rng.gauss(0, 0.01), "oracle": difficulty + shift + 0.03,
                      "h2o": difficulty + shift - 0.02, "dense": 1.0}
            for policy, top1 in values.items():
                if policy == "tova" and item >= 16:
                    continue
                out.append({"part": "text", "policy": policy, "B": total, "item": f"s{item}", "top1_agreement": top1,
                            "kl": 0.0 if policy == "dense" else 1.0 - top1, "token_acc": 0.5})
    return out


def values_of(records, policy, total, field="top1_agreement", part="text"):
    """The items' values as the summary must use them (rounded to 1e-6, the report's rule)."""
    return {r["item"]: round(r[field], R.DECIMALS) for r in records if r["policy"] == policy and r["B"] in (total, None)
            and r["part"] == part and r.get(field) is not None and r.get("headline", True)}


def test_summary_is_the_bootstrap_of_the_right_items():
    records = text_records()
    summary = R.summarize(records, BUDGETS, resamples=500)
    entry = next(m for m in summary["metrics"] if (m["policy"], m["B"], m["metric"]) == ("tova", 64, "top1_agreement"))
    want = S.mean_interval(list(values_of(records, "tova", 64).values()), resamples=500)
    assert (entry["estimate"], entry["lo"], entry["hi"], entry["n"]) == (want.estimate, want.lo, want.hi, 16)
    # paired on the items both have: tova's 16
    diff = next(d for d in summary["differences"] if (d["policy"], d["B"], d["metric"], d["vs"]) ==
                ("tova", 64, "top1_agreement", "streaming"))
    t, s = values_of(records, "tova", 64), values_of(records, "streaming", 64)
    items = sorted(t)
    want = S.paired_difference([t[i] for i in items], [s[i] for i in items], resamples=500)
    assert diff["n"] == 16 and diff["estimate"] == pytest.approx(want.estimate) and diff["lo"] == want.lo
    assert diff["sd"] == pytest.approx(want.sd) and diff["items_needed"] == want.items_needed
    kv = next(d for d in summary["differences"] if (d["policy"], d["B"], d["metric"], d["vs"]) ==
              ("kvpop", 100, "top1_agreement", "streaming"))
    assert kv["resolved"] and kv["lo"] > 0 and kv["n"] == 24
    # the best heuristic is chosen per metric and direction: lowest KL, highest top-1
    best = {(d["metric"], d["B"]): d["baseline"] for d in summary["differences"]
            if d["vs"] == "best_heuristic" and d["policy"] == "kvpop"}
    for (metric, total), name in best.items():
        sign = 1 if metric != "kl" else -1
        field = "top1_agreement" if metric == "top1_agreement" else metric
        means = {h: np.mean(list(values_of(records, h, total, field).values())) for h in ("streaming", "tova")}
        assert name == max(means, key=lambda h: sign * means[h])
    # gap closed: the paired ratio of means, on the items all three have
    gap = next(g for g in summary["gap_closed"] if (g["policy"], g["B"], g["metric"]) == ("kvpop", 100, "kl"))
    k, s, o = (values_of(records, p, 100, "kl") for p in ("kvpop", "streaming", "oracle"))
    want = S.gap_closed([k[i] for i in sorted(k)], [s[i] for i in sorted(k)], [o[i] for i in sorted(k)],
                        resamples=500)
    assert (gap["estimate"], gap["lo"], gap["hi"]) == pytest.approx((want.estimate, want.lo, want.hi))
    assert 0.2 < gap["estimate"] < 0.45  # kvpop closes a third of the 0.03 gap


def test_undefined_values_headline_cells_and_budget_free_dense():
    records = [
        # generation: dense has B None and stands in every budget; "solved" only where dense solved
        *({"part": "generation", "policy": "dense", "B": None, "item": f"p{i}", "divergence": 9, "solved": 1.0
           if i < 3 else None} for i in range(5)),
        *({"part": "generation", "policy": "streaming", "B": 100, "item": f"p{i}", "divergence": i,
           "solved": (1.0 if i == 0 else 0.0) if i < 3 else None} for i in range(5)),
        # recall: only the headline cell counts in the headline metric, every cell in "cells"
        *({"part": "recall", "policy": p, "B": None if p == "dense" else 100, "item": f"r{i}", "task": "kv",
           "context": 64, "depth": d, "exact": float(p == "dense" or i % 2), "headline": d == 0.1}
          for p in ("dense", "streaming") for i in range(4) for d in (0.1, 0.9)),
    ]
    summary = R.summarize(records, BUDGETS[:1], resamples=200)
    by = {(m["policy"], m["metric"]): m for m in summary["metrics"]}
    assert by[("dense", "gen_divergence")]["estimate"] == 9 and by[("dense", "gen_divergence")]["B"] == 100
    assert by[("streaming", "gen_solved_where_dense")]["n"] == 3
    text = R.format_report(summary, BUDGETS[:1], evicting={"100": 0.0})  # a JSON round trip's keys: strings
    assert "after an eviction (prompt + generated > B): B = 100 0%. At 0 % a row differs from dense by arithmetic" \
        in text.replace("\n", " ")
    assert "after an eviction" not in R.format_report(summary, BUDGETS[:1])
    assert by[("streaming", "gen_solved_where_dense")]["estimate"] == pytest.approx(1 / 3)
    assert by[("streaming", "recall_exact")]["n"] == 4  # the headline cell's samples only
    assert by[("streaming", "recall_exact")]["estimate"] == 0.5
    cells = {(c["policy"], c["depth"]): c for c in summary["cells"]}
    assert len(cells) == 4 and cells[("dense", 0.9)]["exact"] == 1.0 and cells[("streaming", 0.9)]["n"] == 4


def test_report_wording_follows_the_intervals():
    records = text_records()
    summary = R.summarize(records, BUDGETS, resamples=500)
    text = R.format_report(summary, BUDGETS, unreachable=[{"CR": 0.96875, "B": 16}])
    assert "Not reachable" in text and "CR 96.88% (B = 16)" in text
    lines = [line for line in text.splitlines() if line.startswith("At B = 100 (CR 80%), kvpop vs streaming")]
    assert len(lines) == 1 and "top1 above (+0.0" in lines[0] and "better" in lines[0]
    assert "kl below (-0.0" in lines[0]
    tova = next(d for d in summary["differences"] if (d["policy"], d["B"], d["metric"], d["vs"]) ==
                ("oracle", 100, "top1_agreement", "best_heuristic"))
    assert tova["resolved"]
    for d in summary["differences"]:  # every narrated difference says "above"/"below" only when resolved
        if d["policy"] not in R.NARRATED or d["metric"] not in R.HEADLINE or (
                d["vs"] == "best_heuristic" and d["baseline"] == "streaming"):  # said against streaming already
            continue
        sentence = next(line for line in text.splitlines()
                        if line.startswith(f"At B = {d['B']} (CR {R.percent(d['CR'])}), {d['policy']} vs "
                                           f"{R._vs_label(d['vs'])}"))
        label = R._metric(d["metric"]).label
        word = next(w for w in ("above", "below", "not resolved", "identical")
                    if f"{label} {w}" in sentence)
        assert (word in ("above", "below")) == d["resolved"], (d, sentence)
    for metric in ("top1_agreement", "kl"):  # KVpop is paired with every heuristic that ran, not only the best
        against = {d["baseline"] for d in summary["differences"] if (d["policy"], d["B"], d["metric"]) ==
                   ("kvpop", 100, metric)}
        assert against == {"streaming", "tova", "h2o"}, against
        assert not {d["vs"] for d in summary["differences"] if d["policy"] == "oracle"} - {"streaming",
                                                                                          "best_heuristic"}
    unresolved = R.sentences({"differences": [{"policy": "kvpop", "metric": "kl", "B": 64, "vs": "streaming",
                                               "baseline": "streaming", "estimate": 0.002, "lo": -0.001,
                                               "hi": 0.005, "n": 8, "sd": 0.01, "resolved": False,
                                               "items_needed": 97.0}]}, BUDGETS)
    assert unresolved == ["At B = 64 (CR 87.5%), kvpop vs streaming: kl not resolved "
                          "(+0.00200 [-0.00100, +0.00500]; ~97 sequences needed)."]


def test_mlflow_names_and_figures():
    summary = R.summarize(text_records(), BUDGETS, resamples=200)
    metrics = R.mlflow_metrics(summary)
    for key in ("kvpop.B100.top1_agreement", "kvpop.B100.top1_agreement.lo", "kvpop.B100.top1_agreement.hi",
                "kvpop.B64.kl.vs_streaming", "kvpop.B64.kl.vs_streaming.lo", "kvpop.B64.kl.vs_best_heuristic.hi",
                "kvpop.B64.kl.vs_streaming.resolved", "kvpop.B64.kl.gap_closed"):
        assert key in metrics, key
    assert all(math.isfinite(v) for v in metrics.values())
    import matplotlib.pyplot as plt

    fig = R.plot_metrics_vs_cr(summary)
    assert len(fig.axes[0].collections) >= 4  # one interval band per policy
    plt.close(fig)
    assert R.plot_recall_maps(summary, 100) is None  # no recall part
    assert R.percent(0.9375) == "93.75%" and R.percent(0.75) == "75%"
    md = R.format_report(summary, BUDGETS, markdown=True)
    assert "### held-out text" in md and "| policy | budget | top1 | kl | acc |" in md
    assert "\n- At B = 100 (CR 80%), kvpop vs streaming: top1 above" in md


def test_float_noise_is_no_difference():
    """Identical policies whose per-item KL differs only by float noise (~1e-9, one sign) are identical, not
    "resolved": the values are rounded to 1e-6 before bootstrapping."""
    records = [{"part": "generation", "policy": p, "B": 100, "item": f"p{i}", "kl": 0.01 * i + (1e-9 if p == "kvpop"
                                                                                            else 0.0)}
               for p in ("streaming", "kvpop") for i in range(6)]
    summary = R.summarize(records, BUDGETS[:1], resamples=200)
    diff = next(d for d in summary["differences"] if d["policy"] == "kvpop")
    assert (diff["estimate"], diff["lo"], diff["hi"], diff["resolved"]) == (0.0, 0.0, 0.0, False)
    assert "gen_kl identical on every item" in " ".join(R.sentences(summary, BUDGETS[:1]))


def test_recall_share_of_dense_is_the_paired_ratio_of_headline_means():
    """Each policy's headline recall as a share of dense's on the same samples (issue 12's "≥ 0.8 × dense"): mean over
    mean, the same bootstrap's interval, non-headline cells left out, reported, in MLflow, and "yes" only above 0.8."""
    rng = random.Random(5)
    records = []
    for i in range(30):
        for depth, headline in ((0.1, True), (0.9, False)):
            dense = float(rng.random() < 0.95)
            hits = {"dense": dense, "streaming": 0.0, "kvpop": float(dense and rng.random() < 0.9),
                    "tova": float(rng.random() < 0.5)}
            records += [{"part": "recall", "policy": p, "B": None if p == "dense" else 100, "item": f"r{i}-{depth}",
                         "task": "kv", "context": 64, "depth": depth, "exact": e, "headline": headline}
                        for p, e in hits.items()]
    summary = R.summarize(records, BUDGETS[:1], resamples=300)
    shares = {s["policy"]: s for s in summary["recall_share"]}
    assert set(shares) == {"streaming", "kvpop", "tova"}
    heads = {p: values_of(records, p, 100, "exact", "recall") for p in ("dense", "kvpop")}
    items = sorted(heads["dense"])
    assert len(items) == 30 and shares["kvpop"]["n"] == 30  # the headline cell's samples only
    want = S.bootstrap_for(30, resamples=300).ratio([heads["kvpop"][i] for i in items],
                                                    [heads["dense"][i] for i in items])
    assert (shares["kvpop"]["estimate"], shares["kvpop"]["lo"], shares["kvpop"]["hi"]) == \
        (want.estimate, want.lo, want.hi)
    assert shares["kvpop"]["estimate"] == pytest.approx(sum(heads["kvpop"].values()) / sum(heads["dense"].values()))
    assert shares["streaming"]["estimate"] == 0.0
    text = R.format_report(summary, BUDGETS[:1])
    verdict = {"streaming": "no", "kvpop": "yes" if want.lo >= 0.8 else "no" if want.hi < 0.8 else "not resolved"}
    for policy, word in verdict.items():
        assert any(line.split()[:1] == [policy] and line.rstrip().endswith(word) for line in text.splitlines()
                   if "|" not in line and "100" in line), (policy, word, text)
    metrics = R.mlflow_metrics(summary)
    assert metrics["kvpop.B100.recall_exact.share_of_dense"] == pytest.approx(want.estimate)
    assert "kvpop.B100.recall_exact.share_of_dense.lo" in metrics
