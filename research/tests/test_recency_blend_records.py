"""research/recency_blend.py's recall bookkeeping: a re-run measures exactly the (rule, sample) pairs it lacks, and a
report holds only the tasks, contexts, depths and samples asked (a records file may hold more), and each rule's recall
is reported as a share of dense's with its interval, in every cell."""
import argparse
from types import SimpleNamespace

from research import recency_blend


def _id(task, depth, index, context=2048):
    return f"{task}/c{context}/d{depth:g}/s0/{index}"


def _record(rule, task, depth, index, context=2048):
    return {"rule": rule, "item": _id(task, depth, index, context), "task": task, "context": context, "depth": depth,
            "exact": 1.0}


def test_a_rerun_with_more_samples_measures_only_the_new_ones():
    samples = [SimpleNamespace(id=_id("niah_single", d, i)) for d in (0.1, 0.5) for i in range(4)]
    have = {("dense", s.id) for s in samples} | {("kvpop", s.id) for s in samples[:2]} | \
        {("kvpop+0.0025", s.id) for s in samples}
    todo = recency_blend.recall_to_measure(samples, have, ["kvpop", "kvpop+0.0025", "kvpop+0.0025@a0.25"])
    assert [s.id for s in todo["kvpop"]] == [s.id for s in samples[2:]]
    assert "kvpop+0.0025" not in todo  # complete: nothing to do
    assert todo["kvpop+0.0025@a0.25"] == samples


def test_a_report_holds_the_asked_cells_and_samples_only():
    done = [_record(r, t, d, i) for r in ("dense", "kvpop") for t in ("niah_single", "niah_multikey_2")
            for d in (0.1, 0.5) for i in range(12)]
    done += [_record("kvpop", "niah_single", 0.1, 0, context=4096)]
    args = argparse.Namespace(recall_tasks=["niah_single"], recall_contexts=[2048], recall_depths=[0.1],
                              recall_samples=10)
    mine = recency_blend.of_the_recall_run(done, args)
    assert {(r["rule"], r["item"]) for r in mine} == {(rule, _id("niah_single", 0.1, i)) for rule in ("dense", "kvpop")
                                                      for i in range(10)}


def _scored(rule, task, depth, index, exact, headline):
    return {**_record(rule, task, depth, index), "exact": float(exact), "logprob": -float(index), "headline": headline}


def test_recall_share_of_dense_is_mean_over_mean_paired_and_every_cell_is_reported():
    import random

    from pipelines.stats import Bootstrap

    rng = random.Random(3)
    done = []
    for depth, headline in ((0.1, True), (0.5, True), (0.9, False)):
        for i in range(9):
            dense = rng.random() < (0.95 if headline else 0.5)
            done.append(_scored("dense", "niah_single", depth, i, dense, headline))
            done.append(_scored("streaming", "niah_single", depth, i, False, headline))
            done.append(_scored("kvpop", "niah_single", depth, i, dense and rng.random() < 0.8, headline))
    out = recency_blend.summarize_recall(done, ["streaming", "kvpop"])
    heads = [r for r in done if r["headline"]]
    hits = {(r["rule"], r["item"]): r["exact"] for r in heads}
    items = sorted({r["item"] for r in heads})
    dense = [hits["dense", i] for i in items]
    mine = [hits["kvpop", i] for i in items]
    share = out["share:kvpop"]
    assert share["n"] == 18 and abs(share["mean"] - sum(mine) / sum(dense)) < 1e-12
    reference = Bootstrap(18).ratio(mine, dense)  # the same resamples (one seed): the same interval
    assert (share["low"], share["high"]) == (reference.lo, reference.hi)
    assert share["low"] <= share["mean"] <= share["high"]
    assert out["share:streaming"]["mean"] == 0.0
    # every cell, the non-headline one too, each rule's mean and count there
    assert set(out["cells"]) == {"niah_single c2048 d0.1", "niah_single c2048 d0.5", "niah_single c2048 d0.9"}
    far = out["cells"]["niah_single c2048 d0.9"]
    assert far["headline"] is False
    kvpop_far = [r["exact"] for r in done if r["depth"] == 0.9 and r["rule"] == "kvpop"]
    assert far["kvpop"]["n"] == 9 and abs(far["kvpop"]["mean"] - sum(kvpop_far) / 9) < 1e-12
    assert "share" not in far["dense"]


def test_recall_report_says_resolved_only_when_the_low_end_clears_the_line():
    rows = []
    for i in range(40):  # dense always right; kvpop right on 39 of 40 (share ≈ 0.98): resolved above 0.8
        rows += [_scored("dense", "niah_single", 0.1, i, True, True), _scored("streaming", "niah_single", 0.1, i,
                                                                                False, True),
                 _scored("kvpop", "niah_single", 0.1, i, i > 0, True)]
    recall = recency_blend.summarize_recall(rows, ["streaming", "kvpop"])
    text = recency_blend.render({"summary": {}, "versus_references": {}, "recall": recall, "rules": ["streaming", "kvpop"],
                                 "checkpoint": "c", "budget": "b", "own_recency": 0.0, "streaming_layers": None,
                                 "args": {"recall_min_dense": 0.9}})
    assert "| kvpop | 0.975 [" in text and "] | yes |" in text
    assert "| streaming | 0.000 [0.000, 0.000] | no |" in text
    assert "0.975 (40); 0.9" in text and "× dense" in text
