"""research/split_half.py: gap closed per item range equals the ratio of paired means; an oracle is borrowed only
from records of the same sequences; bad input is one line and exit code 2."""
import json
import random

import numpy as np

from research import split_half

BUDGET = {"sink": 4, "window": 256, "topk": 252}


def write(path, rows, checkpoint="/x"):
    path.write_text("".join(json.dumps({"checkpoint": checkpoint, "budget": BUDGET, "seq_len": 4096, "source": s,
                                        "item": i, "id": f"eval-{i:06d}", "rule": r, "kl": kl, "top1": t1}) + "\n"
                            for s, i, r, kl, t1 in rows))
    return str(path)


def records(rng, sources, items, rules, tie=False):
    rows = []
    for s in sources:
        for i in items:
            st = rng.uniform(0.1, 0.2)
            rows.append((s, i, "streaming", st, 0.9))
            for r in rules:
                # ties: a rule exactly at streaming or at the oracle on some items
                rows.append((s, i, r, st if tie and i % 3 == 0 else rng.uniform(0.02, st), rng.uniform(0.9, 0.95)))
    return rows


def test_gap_and_differences_per_range_match_a_brute_force(tmp_path, capsys):
    rng = random.Random(0)
    rows = records(rng, ["champ", "stdlib"], range(10), ["kvpop+0.003"], tie=True)
    oracle = [(s, i, "oracle", rng.uniform(0.0, 0.02), 0.97) for s in ["champ", "stdlib"] for i in range(10)]
    path = write(tmp_path / "a_items.jsonl", rows + oracle[:-1])  # stdlib item 9 has no oracle: left out
    assert split_half.main(["--items", path, "--rules", "kvpop+0.003", "--split", "4", "--tag", "t",
                            "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "split_half_t.json").read_text())
    got = {(r["corpus"], r["items"]): r for r in out["rows"]}
    kl = {(s, i, r): v for s, i, r, v, _ in rows + oracle[:-1]}
    for source, label, ids in [("champ", "< 4", range(4)), ("champ", ">= 4", range(4, 10)), ("champ", "all", range(10)),
                               ("stdlib", ">= 4", range(4, 9)), ("stdlib", "all", range(9))]:
        row = got[(source, label)]
        b = np.array([kl[(source, i, "streaming")] for i in ids])
        p = np.array([kl[(source, i, "kvpop+0.003")] for i in ids])
        c = np.array([kl[(source, i, "oracle")] for i in ids])
        assert row["n"] == len(ids)
        assert abs(row["gap"]["mean"] - (b - p).mean() / (b - c).mean()) < 1e-12
        assert row["gap"]["low"] <= row["gap"]["mean"] <= row["gap"]["high"]
        assert abs(row["kl_minus_streaming"]["mean"] - (p - b).mean()) < 1e-12
    assert got[("stdlib", "all")]["left_out"] == 1 and got[("champ", "all")]["left_out"] == 0
    assert "| stdlib | kvpop+0.003 | all | 9 |" in (tmp_path / "split_half_t.md").read_text()


def test_oracle_is_borrowed_only_where_missing_and_only_from_the_same_sequences(tmp_path, capsys):
    rng = random.Random(1)
    rows = records(rng, ["docs"], range(6), ["kvpop+0.0025"])
    own_oracle = [("docs", 0, "oracle", 0.001, 0.99)]
    path = write(tmp_path / "a_items.jsonl", rows + own_oracle)
    streaming = [r for r in rows if r[2] == "streaming"]
    theirs = streaming + [("docs", i, "oracle", 0.01, 0.97) for i in range(6)]
    other = write(tmp_path / "b_items.jsonl", theirs, checkpoint="/another")
    assert split_half.main(["--items", path, "--oracle-from", other, "--rules", "kvpop+0.0025", "--split", "3",
                            "--tag", "t", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "split_half_t.json").read_text())
    assert out["meta"]["borrowed"] == 5  # item 0 keeps its own oracle
    all_row = next(r for r in out["rows"] if r["items"] == "all")
    b = np.array([r[3] for r in streaming])
    p = np.array([r[3] for r in rows if r[2] == "kvpop+0.0025"])
    c = np.array([0.001] + [0.01] * 5)
    assert abs(all_row["gap"]["mean"] - (b - p).mean() / (b - c).mean()) < 1e-12
    # one streaming value off by a hair: other sequences, refused
    bad = [(s, i, r, kl + (1e-9 if i == 4 and r == "streaming" else 0), t) for s, i, r, kl, t in theirs]
    capsys.readouterr()
    assert split_half.main(["--items", path, "--oracle-from", write(tmp_path / "c_items.jsonl", bad), "--rules",
                            "kvpop+0.0025", "--split", "3", "--tag", "t", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "docs item 4 differs" in err, err


def test_bad_input_is_one_line(tmp_path, capsys):
    rng = random.Random(2)
    rows = records(rng, ["champ"], range(3), ["kvpop"])
    a = write(tmp_path / "a_items.jsonl", rows)
    b = write(tmp_path / "b_items.jsonl", rows, checkpoint="/other")
    conflict = write(tmp_path / "c_items.jsonl", [(s, i, r, kl + 1, t) for s, i, r, kl, t in rows])
    for argv, message in [(["--items", a, b, "--rules", "kvpop", "--split", "1"], "give one scorer's files"),
                          (["--items", a, conflict, "--rules", "kvpop", "--split", "1"], "recorded twice"),
                          (["--items", a, "--rules", "kvpop+0.01", "--split", "1"], "not in the records"),
                          (["--items", a, "--rules", "kvpop", "--split", "0"], "--split must be >= 1"),
                          (["--items", str(tmp_path / "none.jsonl"), "--rules", "kvpop", "--split", "1"], "no such file"),
                          (["--items", a, "--oracle-from", str(tmp_path / "none.jsonl"), "--rules", "kvpop",
                            "--split", "1"], "no such file")]:
        assert split_half.main([*argv, "--tag", "t", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
