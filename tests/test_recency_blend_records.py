"""benchmarks/recency_blend.py's recall bookkeeping: a re-run measures exactly the (rule, sample) pairs it lacks, and a
report holds only the tasks, contexts, depths and samples asked (a records file may hold more)."""
import argparse
from types import SimpleNamespace

from benchmarks import recency_blend


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
