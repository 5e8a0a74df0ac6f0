"""research/compare_blends.py: two scorers' records paired by sequence id across a blend file and a study, with
corpus aliases, and refusal of sides that cannot be paired."""
import json
import random

import numpy as np
import pytest

from research import compare_blends
from pipelines.stats import paired_difference

BUDGET = {"sink": 4, "window": 256, "topk": 252}


def blend_file(path, rows):
    path.write_text("".join(json.dumps({"checkpoint": "/x", "budget": BUDGET, "seq_len": 4096, **r}) + "\n"
                            for r in rows))
    return str(path)


def blend_row(source, item, rule, kl, top1):
    return {"source": source, "item": item, "id": f"eval-{item:06d}", "rule": rule, "kl": kl, "top1": top1}


def study_file(path, records_by_corpus, tokens=4e6, B=512):
    def rec(item, kl, top1, policy="kvpop", at=B):
        return {"part": "text", "policy": policy, "B": at, "item": f"eval-{item:06d}", "kl": kl,
                "top1_agreement": top1}

    main, *others = records_by_corpus.items()
    points = [{"tokens": 1e6, "records": [], "corpora": {}},
              {"tokens": tokens, "records": [rec(*r) for r in main[1]] + [rec(0, 9.0, 0.0, "streaming")] +
               [rec(0, 9.0, 0.0, "kvpop", 256)],
               "corpora": {name: {"records": [rec(*r) for r in rows]} for name, rows in others}}]
    path.write_text(json.dumps({"meta": {"study": {"source": main[0]}}, "points": points}))
    return str(path)


def run(tmp_path, *argv) -> dict:
    assert compare_blends.main([*argv, "--tag", "t", "--out", str(tmp_path)]) == 0
    return {(r["corpus"], r["rule"], r["metric"]): r
            for r in json.loads((tmp_path / "compare_t.json").read_text())["rows"]}


def test_a_blend_against_a_study_point_pairs_by_sequence_id_with_aliases(tmp_path):
    rng = random.Random(0)
    kl_study = [rng.random() for _ in range(5)]
    kl_blend = [x - 0.01 * (1 + rng.random()) for x in kl_study]  # better on every sequence
    study = study_file(tmp_path / "s.json", {"champ": [(i, k, 0.9) for i, k in enumerate(kl_study)],
                                             "old_docs": [(i, 0.5, 0.8) for i in range(3)]})
    rows = [blend_row("champ", i, "kvpop", k, 0.9) for i, k in enumerate(kl_blend)]
    rows += [blend_row("champ", i, "kvpop+0.002", 0.1, 0.95) for i in range(5)]  # no such rule in a study
    rows += [blend_row("new_docs", i, "kvpop", 0.5 + d, 0.8) for i, d in enumerate((0.1, -0.1, 0.3, 0.2))]
    random.Random(1).shuffle(rows)
    blend = blend_file(tmp_path / "b_items.jsonl", rows)
    got = run(tmp_path, study + "@3.9e6", blend, "--alias", "new_docs=old_docs")
    assert set(got) == {(c, "kvpop", m) for c in ("champ", "old_docs") for m in ("kl", "top1")}
    kl = got["champ", "kvpop", "kl"]
    want = paired_difference(kl_blend, kl_study)
    assert kl["n"] == 5 and kl["difference"]["mean"] == pytest.approx(np.mean(np.subtract(kl_blend, kl_study)))
    assert (kl["difference"]["low"], kl["difference"]["high"]) == pytest.approx((want.lo, want.hi))
    assert kl["verdict"] == "candidate better" and got["champ", "kvpop", "top1"]["verdict"] == "not resolved"
    docs = got["old_docs", "kvpop", "kl"]
    assert docs["n"] == 3 and docs["difference"]["mean"] == pytest.approx(0.1)  # the study's 3: (0.1 - 0.1 + 0.3) / 3
    assert "| champ | kvpop | KL | 5 |" in (tmp_path / "compare_t.md").read_text()


def test_two_blends_compare_each_shared_rule(tmp_path):
    a = blend_file(tmp_path / "a_items.jsonl", [blend_row("stdlib", i, r, 0.2, 0.9) for i in range(4)
                                                for r in ("kvpop", "kvpop+0.002")])
    b = blend_file(tmp_path / "b_items.jsonl", [blend_row("stdlib", i, r, 0.2 + (0.01 if r == "kvpop" else -0.01),
                                                          0.9) for i in range(4) for r in ("kvpop", "kvpop+0.002")])
    got = run(tmp_path, a, b)
    assert got["stdlib", "kvpop", "kl"]["verdict"] == "candidate worse"
    assert got["stdlib", "kvpop+0.002", "kl"]["verdict"] == "candidate better"
    only = run(tmp_path, a, b, "--rules", "kvpop+0.002")
    assert {rule for _, rule, _ in only} == {"kvpop+0.002"}


def recall_file(items_path, rows):
    """The recall answers beside a blend records file: rows of (task, sample, rule, exact, logprob)."""
    path = items_path.with_name(items_path.name.replace("_items.jsonl", "_recall.jsonl"))
    path.write_text("".join(json.dumps({"checkpoint": "/x", "budget": BUDGET, "seq_len": 4096, "rule": rule,
                                        "item": f"{task}/c2048/d0.1/s0/{i}", "task": task, "exact": exact,
                                        "logprob": logprob}) + "\n" for task, i, rule, exact, logprob in rows))


def test_two_blends_pair_their_recall_answers_by_sample_where_both_have_them(tmp_path):
    rows = [blend_row("champ", i, "kvpop", 0.2, 0.9) for i in range(3)]
    a, b = (tmp_path / "a_items.jsonl"), (tmp_path / "b_items.jsonl")
    blend_file(a, rows), blend_file(b, rows)
    assert run(tmp_path, str(a), str(b)) and json.loads((tmp_path / "compare_t.json").read_text())["recall"] == []
    rng = random.Random(3)
    base = [(rng.random() < 0.7, -rng.random() * 5) for _ in range(16)]
    cand = [(0.0, lp - 1 - rng.random()) for _, lp in base]  # every answer lost, every log-probability lower
    recall_file(a, [("niah_single", i, "kvpop", float(e), lp) for i, (e, lp) in enumerate(base)] +
                [("niah_single", i, "dense", 1.0, -0.1) for i in range(16)])
    recall_file(b, [("niah_single", i, "kvpop", e, lp) for i, (e, lp) in enumerate(cand)] +
                [("niah_single", 99, "kvpop", 1.0, 0.0)])  # a sample the baseline never answered: not paired
    run(tmp_path, str(a), str(b))
    saved = json.loads((tmp_path / "compare_t.json").read_text())
    got = {(r["corpus"], r["rule"], r["metric"]): r for r in saved["recall"]}
    assert set(got) == {("recall niah_single", "kvpop", m) for m in ("exact", "logprob")}  # dense: one side only
    exact, logprob = got["recall niah_single", "kvpop", "exact"], got["recall niah_single", "kvpop", "logprob"]
    assert exact["n"] == 16 and exact["difference"]["mean"] == pytest.approx(-np.mean([e for e, _ in base]))
    order = sorted(range(16), key=lambda i: f"niah_single/c2048/d0.1/s0/{i}")  # samples paired in id order
    want = paired_difference([cand[i][1] for i in order], [base[i][1] for i in order])
    assert (logprob["difference"]["low"], logprob["difference"]["high"]) == pytest.approx((want.lo, want.hi))
    assert logprob["verdict"] == "candidate worse" and exact["verdict"] == "candidate worse"
    assert "| niah_single | kvpop | gold logp | 16 |" in (tmp_path / "compare_t.md").read_text()
    (a.with_name("a_recall.jsonl")).write_text(json.dumps({"rule": "kvpop"}) + "\n")
    assert compare_blends.main([str(a), str(b), "--tag", "t", "--out", str(tmp_path)]) == 2


@pytest.mark.parametrize("case", ["other budget", "nothing shared", "not a study", "bad alias"])
def test_sides_that_cannot_be_paired_are_one_line(tmp_path, capsys, case):
    blend = blend_file(tmp_path / "b_items.jsonl", [blend_row("champ", 0, "kvpop", 0.1, 0.9)])
    study = study_file(tmp_path / "s.json", {"champ": [(0, 0.1, 0.9)]})
    argv = {"other budget": [study + "@4e6", blend, "--B", "256"],
            "nothing shared": [study + "@4e6", blend_file(tmp_path / "c_items.jsonl",
                                                          [blend_row("stdlib", 0, "kvpop", 0.1, 0.9)])],
            "not a study": [str(tmp_path / "missing.json") + "@4e6", blend],
            "bad alias": [study + "@4e6", blend, "--alias", "nonsense"]}[case]
    capsys.readouterr()
    try:
        code = compare_blends.main([*argv, "--tag", "t", "--out", str(tmp_path)])
    except SystemExit as exit_:  # a bad command line: the parser's exit
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err, err
    assert not (tmp_path / "compare_t.json").exists()


def test_one_pair_is_no_interval_and_no_verdict():
    from research.bootstrap import format_interval, paired_bootstrap

    one = paired_bootstrap([0.3], [0.1])
    assert one["n"] == 1 and one["mean"] == pytest.approx(0.2)
    assert format_interval(one) == "+0.200 (n 1: no interval)"
    assert format_interval(paired_bootstrap([0.3, 0.31, 0.32], [0.1, 0.1, 0.1])).endswith(" *")
