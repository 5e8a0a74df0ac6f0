"""research/heldout_structure.py: the own-document reach against a brute-force scan, the groups' gaps and their
difference, and the CLI on a tiny corpus end to end (refusing records it cannot pair in one line)."""
import json
import math
import random

import pytest

from research import heldout_structure as hs
from pipelines.stats import gap_closed

EOS = 0


def brute_reach(ids, eos, start, window):
    hits = 0
    for d in range(start, len(ids)):
        first = max([p + 1 for p in range(d) if ids[p] == eos], default=0)
        hits += d - first >= window
    return hits / (len(ids) - start)


@pytest.mark.parametrize("seed", range(40))
def test_own_document_reach_matches_a_scan_back_from_every_position(seed):
    rng = random.Random(seed)
    size = rng.randint(1, 40)
    density = rng.choice([0.0, 0.05, 0.3, 1.0])
    ids = [EOS if rng.random() < density else rng.randint(1, 9) for _ in range(size)]
    if seed % 5 == 0:
        ids[0] = EOS
    if seed % 7 == 0:
        ids[-1] = EOS
    start = rng.randint(0, size - 1)
    window = rng.choice([0, 1, 3, size, size + 5])
    assert hs.own_document_reach(ids, EOS, start, window) == pytest.approx(brute_reach(ids, EOS, start, window))


def test_own_document_reach_edges():
    assert hs.own_document_reach([1] * 10, EOS, 4, 4) == 1.0  # one document: every d >= 4 reaches 4 back
    assert hs.own_document_reach([1] * 10, EOS, 4, 11) == 0.0  # a window past the sequence: nothing is reached
    assert hs.own_document_reach([1, 1, EOS, 1, 1, 1], EOS, 3, 1) == pytest.approx(2 / 3)  # d = 3 starts a document
    with pytest.raises(ValueError, match="no evaluated position"):
        hs.own_document_reach([1, 2], EOS, 2, 1)


def items_closing(share, n, rng, noise=0.02):
    """``n`` items whose rule closes about ``share`` of a streaming → oracle gap of ~1."""
    out = []
    for _ in range(n):
        streaming, oracle = 1.0 + rng.random(), 0.1 * rng.random()
        out.append({"streaming": streaming, "oracle": oracle,
                    "rule": streaming - (share + noise * rng.gauss(0, 1)) * (streaming - oracle)})
    return out


def test_gap_difference_estimate_and_interval():
    rng = random.Random(0)
    high, low = items_closing(0.9, 30, rng), items_closing(0.1, 30, rng)
    d = hs.gap_difference(high, low)
    direct = (sum(i["streaming"] - i["rule"] for i in high) / sum(i["streaming"] - i["oracle"] for i in high)
              - sum(i["streaming"] - i["rule"] for i in low) / sum(i["streaming"] - i["oracle"] for i in low))
    assert d["mean"] == pytest.approx(direct) and d["n"] == [30, 30]
    assert 0.7 < d["low"] < d["mean"] < d["high"] < 0.9  # resolved: a large, low-noise difference
    same = hs.gap_difference(high, high)
    assert same["mean"] == 0 and same["low"] < 0 < same["high"]  # two independent resamplings of the same items
    one = hs.gap_difference(high[:1], low)
    assert math.isnan(one["low"]) and math.isnan(one["high"])  # one item has no spread to resample
    g = gap_closed([i["rule"] for i in low], [i["streaming"] for i in low], [i["oracle"] for i in low])
    assert hs.gap_of(low) == {"mean": g.estimate, "low": g.lo, "high": g.hi, "n": 30}


def test_groups_by_structure_leave_out_a_comparison_with_an_empty_side():
    items = [{"documents": d, "reach": r} for d, r in ((1, 1.0), (1, 0.9), (3, 0.2), (2, 0.9))]
    groups = hs.split_by_structure(items)
    ones, several = groups["one document − several"]
    assert [i["documents"] for i in ones] == [1, 1] and [i["documents"] for i in several] == [3, 2]
    high, below = groups["reach ≥ 0.90 − below"]  # the median of 0.2, 0.9, 0.9, 1.0
    assert sorted(i["reach"] for i in high) == [0.9, 0.9, 1.0] and [i["reach"] for i in below] == [0.2]
    assert hs.split_by_structure([{"documents": 2, "reach": 0.5}] * 3) == {}  # no single-document sequence, no spread


def test_the_cli_on_a_tiny_corpus(tiny_setup, tmp_path, capsys):
    from research.learning_curves import corpus_config
    from pipelines.data import load_sequences, load_tokenizer

    source, model, budget = str(tiny_setup / "docs.jsonl"), str(tiny_setup / "teacher"), {"sink": 2, "window": 8,
                                                                                          "topk": 4}
    cfg = corpus_config(model, source, 48, budget, 1.0, 6)
    tokenizer = load_tokenizer(cfg)
    rows = load_sequences(cfg, "eval", tokenizer)
    rng = random.Random(1)
    kl = {(r["id"], rule): rng.random() + (1.0 if rule == "streaming" else 0.0) for r in rows
          for rule in ("streaming", "kvpop+0.002")}
    oracle = {r["id"]: 0.01 * rng.random() for r in rows}
    records = tmp_path / "recency_blend_t_items.jsonl"
    records.write_text("".join(json.dumps({"checkpoint": "/x", "budget": budget, "seq_len": 48, "source": source,
                                           "item": k, "id": r["id"], "rule": rule, "kl": kl[r["id"], rule],
                                           "top1": 0.5}) + "\n"
                               for k, r in enumerate(rows) for rule in ("streaming", "kvpop+0.002")))
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"meta": {"study": {"source": source}}, "references": {"records": [
        {"part": "text", "policy": "oracle", "B": 14, "item": i, "kl": v, "top1_agreement": 0.9}
        for i, v in oracle.items()]}}))
    argv = [str(records), "--rule", "kvpop+0.002", "--references-from", str(study), "--model", model, "--tag", "t",
            "--out", str(tmp_path)]
    assert hs.main(argv) == 0
    result = json.loads((tmp_path / "heldout_structure_t.json").read_text())["corpora"][source]
    by_id = {r["id"]: r for r in rows}
    for item in result["items"]:
        row = by_id[item["id"]]
        assert item["documents"] == len(row["docs"])
        assert item["reach"] == pytest.approx(brute_reach(row["input_ids"], tokenizer.eos_token_id, 14, 8))
    ids = sorted(by_id)
    want = gap_closed([kl[i, "kvpop+0.002"] for i in ids], [kl[i, "streaming"] for i in ids], [oracle[i] for i in ids])
    assert result["all"]["mean"] == pytest.approx(want.estimate) and result["all"]["n"] == len(rows)
    assert result["document_lengths"]["documents"] == 40
    assert "| docs.jsonl | s2-w8-k4 |" in (tmp_path / "heldout_structure_t.md").read_text()

    study.write_text(json.dumps({"meta": {"study": {"source": source}}, "references": {"records": []}}))
    capsys.readouterr()
    assert hs.main(argv) == 2  # no oracle to pair with
    err = capsys.readouterr().err
    assert err.startswith("heldout_structure: ") and "no oracle record of eval-000000" in err and err.count("\n") == 1
