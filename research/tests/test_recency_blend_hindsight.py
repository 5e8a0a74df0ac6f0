"""research/recency_blend.py's versus_references: the gap when each sequence takes its own best λ (a ceiling)."""
import random

import pytest

from research import recency_blend
from pipelines.stats import gap_closed


def _records(kl_by_rule: dict[str, list[float]], source="docs") -> list[dict]:
    return [{"source": source, "id": f"eval-{i:06d}", "rule": rule, "kl": kl, "top1": 0.9}
            for rule, kls in kl_by_rule.items() for i, kl in enumerate(kls)]


def _references(streaming, oracle) -> dict:
    def by_id(kls):
        return {f"eval-{i:06d}": {"kl": kl, "top1_agreement": 0.9} for i, kl in enumerate(kls)}
    return {"docs": {"streaming": by_id(streaming), "oracle": by_id(oracle), "tova": {}, "h2o": {}}}


def test_the_per_sequence_best_lambda_is_a_brute_force_minimum_and_bounds_every_rule():
    rng = random.Random(0)
    n = 12
    streaming = [0.1 + rng.random() * 0.05 for _ in range(n)]
    oracle = [s - 0.06 for s in streaming]
    kls = {"streaming": streaming, "kvpop": [s + 0.01 for s in streaming]}
    for lam in ("kvpop+0.002", "kvpop+0.003", "kvpop+0.004"):
        kls[lam] = [s - rng.uniform(0.0, 0.05) for s in streaming]
    kls["kvpop+0.003@a0.5"] = [o for o in oracle]  # an anchored rule: not one of the plain λ
    kls["kvpop+0.003"][4] = kls["kvpop+0.002"][4]  # a tie
    rules = list(kls)
    cell = recency_blend.versus_references(_records(kls), _references(streaming, oracle), rules)["docs"]
    best = cell[recency_blend.HINDSIGHT]
    plain = ["kvpop+0.002", "kvpop+0.003", "kvpop+0.004"]
    assert best["rules"] == plain
    brute = [min(kls[r][i] for r in plain) for i in range(n)]
    want = gap_closed(brute, streaming, oracle)
    assert (best["mean"], best["low"], best["high"], best["n"]) == pytest.approx((want.estimate, want.lo, want.hi, n))
    assert all(best["mean"] >= cell[f"gap:{r}"]["mean"] - 1e-12 for r in plain)
    assert best["mean"] < cell["gap:kvpop+0.003@a0.5"]["mean"]  # the anchored rule (here: the oracle) is not in it


def test_no_ceiling_without_two_decayed_rules_or_two_shared_sequences():
    streaming, oracle = [0.2, 0.3, 0.25], [0.1, 0.1, 0.1]
    one = {"streaming": streaming, "kvpop": streaming, "kvpop+0.002": [0.15, 0.2, 0.2]}
    cell = recency_blend.versus_references(_records(one), _references(streaming, oracle), list(one))["docs"]
    assert recency_blend.HINDSIGHT not in cell and "gap:kvpop+0.002" in cell
    two = {**one, "kvpop+0.003": [0.15, 0.2, 0.2]}
    records = [r for r in _records(two) if not (r["rule"] == "kvpop+0.003" and r["id"] != "eval-000000")]
    cell = recency_blend.versus_references(records, _references(streaming, oracle), list(two))["docs"]
    assert recency_blend.HINDSIGHT not in cell  # one sequence has every λ: no interval to give


def test_a_run_reports_its_own_items_only():
    """A records file with 8 items of two rules and 4 of a third: a run of --sequences 4 reports every rule on the
    same 4 items (the gap of a rule measured on more items is not mixed in)."""
    rng = random.Random(1)
    streaming = [0.1 + rng.random() * 0.05 for _ in range(8)]
    oracle = [s - 0.06 for s in streaming]
    kls = {"streaming": streaming, "kvpop+0.002": [s - rng.uniform(0, 0.05) for s in streaming]}
    records = [{**r, "item": int(r["id"][-6:])} for r in _records(kls)]
    records += [{**r, "item": int(r["id"][-6:])} for r in _records({"kvpop+0.003": [s - 0.01 for s in streaming[:4]]})]
    records += [{**r, "source": "other", "item": 0} for r in _records({"streaming": [0.2]})]
    mine = recency_blend.of_the_run(records, ["docs"], 4)
    assert {(r["rule"], r["item"]) for r in mine} == {(rule, i) for rule in [*kls, "kvpop+0.003"] for i in range(4)}
    cell = recency_blend.versus_references(mine, _references(streaming, oracle), [*kls, "kvpop+0.003"])["docs"]
    want = gap_closed(kls["kvpop+0.002"][:4], streaming[:4], oracle[:4])
    assert cell["gap:kvpop+0.002"]["n"] == cell["gap:kvpop+0.003"]["n"] == 4
    assert cell["gap:kvpop+0.002"]["mean"] == pytest.approx(want.estimate)
    assert recency_blend.of_the_run(records, ["docs"], 8) == [r for r in records if r["source"] == "docs"]
