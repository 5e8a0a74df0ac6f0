"""research/compare_studies.py: two studies' KVpop records paired per item, and refusal of studies on other items."""
import json
import random

import numpy as np
import pytest

from research import compare_studies
from research.learning_curves import REUSE_MUST_MATCH
from pipelines.stats import paired_difference

SETTINGS = {"source": "champ", "seq_len": 4096, "seed": 0, "eval_sequences": 6, "dynamic_sequences": 2,
            "recall_tasks": ["niah_single"], "recall_contexts": [2048], "recall_depths": [0.1],
            "recall_samples": 2, "recall_tokens": 12, "base_sha256": "ab", "dtype": "bfloat16",
            "sink": 4, "window": 256, "topk": 252, "query_power": 16.0}


def text_record(item, kl, top1, budget="s4-w256-k252"):
    return {"part": "text", "policy": "kvpop", "B": 512, "budget": budget, "item": item, "kl": kl,
            "top1_agreement": top1}


def recall_record(item, exact, logprob, headline=True):
    return {"part": "recall", "policy": "kvpop", "B": 512, "budget": "s4-w256-k252", "item": item, "exact": exact,
            "logprob": logprob, "headline": headline}


def study(path, points, **settings):
    path.write_text(json.dumps({"meta": {"study": {**SETTINGS, **settings}}, "points": points,
                                "references": {"records": []}, "corpora": {}}))
    return path


def point(tokens, records, corpora=None):
    return {"tokens": tokens, "records": records, "corpora": {k: {"records": v} for k, v in (corpora or {}).items()}}


def test_pairs_per_item_whatever_the_order(tmp_path):
    rng = random.Random(0)
    items = [f"eval-{i:06d}" for i in range(6)]
    kl_a = [rng.random() for _ in items]
    kl_b = [x - 0.01 * rng.random() for x in kl_a]  # the candidate lower (better) on every item
    kl_b[2] = kl_a[2]  # a tie
    top_a = [0.9 + 0.01 * rng.random() for _ in items]
    top_b = [x - 0.02 for x in top_a]  # worse on every item
    a = [text_record(i, k, t) for i, k, t in zip(items, kl_a, top_a)]
    b = [text_record(i, k, t) for i, k, t in zip(items, kl_b, top_b)]
    b.append(text_record("eval-000099", 9.0, 0.0))  # an item the baseline lacks: left out
    rng.shuffle(b)
    docs_a = [text_record(i, 0.5, 0.8) for i in items[:3]]
    docs_b = [text_record(i, 0.5 + d, 0.8) for i, d in zip(items[:3], (0.1, -0.1, 0.3))]
    base = study(tmp_path / "a.json", [point(1e6, []), point(4e6, a, {"docs": docs_a})])
    cand = study(tmp_path / "b.json", [point(4e6, b, {"docs": docs_b})])
    assert compare_studies.main([str(base), str(cand), "--tag", "t", "--out", str(tmp_path)]) == 0
    rows = {(r["corpus"], r["metric"]): r for r in json.loads((tmp_path / "compare_t.json").read_text())["rows"]}
    assert set(rows) == {("champ", "KL"), ("champ", "top-1"), ("docs", "KL"), ("docs", "top-1")}
    kl = rows["champ", "KL"]
    want = paired_difference(kl_b, kl_a)
    assert kl["n"] == 6 and kl["difference"]["estimate"] == pytest.approx(np.mean(np.subtract(kl_b, kl_a)))
    assert (kl["difference"]["lo"], kl["difference"]["hi"]) == pytest.approx((want.lo, want.hi))
    assert kl["verdict"] == "candidate better"  # lower KL
    assert rows["champ", "top-1"]["verdict"] == "candidate worse"
    assert rows["docs", "KL"]["n"] == 3 and rows["docs", "KL"]["difference"]["estimate"] == pytest.approx(0.1)
    assert rows["docs", "top-1"]["verdict"] == "not resolved"  # identical
    assert "| champ | 512 | KL (lower is better) | 6 |" in (tmp_path / "compare_t.md").read_text()


def test_recall_pairs_headline_cells_only_and_points_are_chosen_by_tokens(tmp_path):
    a0 = [recall_record(f"r{i}", 0.0, -20.0) for i in range(4)]
    a1 = [recall_record(f"r{i}", 1.0, -0.5) for i in range(4)] + [recall_record("r9", 0.0, -30.0, headline=False)]
    b = [recall_record(f"r{i}", 0.0, -19.0) for i in range(4)] + [recall_record("r9", 1.0, 0.0, headline=False)]
    base = study(tmp_path / "a.json", [point(1e6, a0), point(11e6, a1)])
    cand = study(tmp_path / "b.json", [point(11e6, b)])
    out = tmp_path / "out"
    assert compare_studies.main([str(base), str(cand), "--tag", "last", "--out", str(out)]) == 0
    rows = {r["metric"]: r for r in json.loads((out / "compare_last.json").read_text())["rows"]}
    assert rows["recall exact"]["n"] == 4 and rows["recall exact"]["difference"]["estimate"] == -1.0
    assert rows["recall exact"]["verdict"] == "candidate worse"
    assert compare_studies.main([str(base), str(cand), "--tag", "first", "--out", str(out), "--tokens-a", "1.2e6"]) == 0
    rows = {r["metric"]: r for r in json.loads((out / "compare_first.json").read_text())["rows"]}
    assert rows["gold logp"]["difference"]["estimate"] == pytest.approx(1.0)  # -19 vs -20: the first point
    assert rows["recall exact"]["verdict"] == "not resolved"


@pytest.mark.parametrize("key", ["eval_sequences", "base_sha256", "source"])
def test_refuses_studies_on_other_items_in_one_line(tmp_path, capsys, key):
    assert key in REUSE_MUST_MATCH
    records = [text_record(f"eval-{i:06d}", 0.1, 0.9) for i in range(3)]
    base = study(tmp_path / "a.json", [point(1e6, records)])
    cand = study(tmp_path / "b.json", [point(1e6, records)], **{key: "other"})
    assert compare_studies.main([str(base), str(cand), "--tag", "t", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "other items" in err
    assert not (tmp_path / "compare_t.json").exists()


def test_refuses_other_heldout_text_under_the_same_corpus_name(tmp_path, capsys):
    records = [text_record(f"eval-{i:06d}", 0.1, 0.9) for i in range(3)]
    base = study(tmp_path / "a.json", [point(1e6, records)])
    meta = json.loads(base.read_text())
    meta["meta"]["heldout_sha256"] = {"champ": "a" * 64, "docs": "b" * 64}
    base.write_text(json.dumps(meta))
    meta["meta"]["heldout_sha256"] = {"champ": "a" * 64}  # a corpus only one of them has: not compared
    same = tmp_path / "same.json"
    same.write_text(json.dumps(meta))
    assert compare_studies.main([str(base), str(same), "--tag", "t", "--out", str(tmp_path)]) == 0
    meta["meta"]["heldout_sha256"] = {"champ": "c" * 64}
    other = tmp_path / "other.json"
    other.write_text(json.dumps(meta))
    capsys.readouterr()
    assert compare_studies.main([str(base), str(other), "--tag", "t", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other held-out sequences" in err and "champ (cccccccccccc" in err


def test_refuses_a_file_that_is_not_a_study_and_a_study_without_points(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    empty = study(tmp_path / "empty.json", [])
    good = study(tmp_path / "good.json", [point(1e6, [text_record("eval-000000", 0.1, 0.9)])])
    assert compare_studies.main([str(bad), str(good), "--tag", "t", "--out", str(tmp_path)]) == 2
    assert "not a learning-curves study" in capsys.readouterr().err
    assert compare_studies.main([str(good), str(empty), "--tag", "t", "--out", str(tmp_path)]) == 2
    assert "no evaluated point" in capsys.readouterr().err
    # one shared item: nothing to pair (a paired interval needs two)
    assert compare_studies.main([str(good), str(good), "--tag", "t", "--out", str(tmp_path)]) == 2
    assert "share no corpus" in capsys.readouterr().err
