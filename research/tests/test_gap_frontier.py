"""research/gap_frontier.py: every committed recency-blend rule at one budget, merged per rule and corpus."""
from __future__ import annotations

import json

import pytest

from research import gap_frontier


def _gap(mean, n):
    return {"mean": mean, "low": mean - 0.05, "high": mean + 0.05, "n": n}


def _result(path, budget, versus, recall=None, checkpoint="/tmp/r/a/step-1", rules=("streaming", "kvpop",
                                                                                    "kvpop+0.002")):
    path.write_text(json.dumps({"checkpoint": checkpoint, "budget": budget, "streaming_layers": None,
                                "rules": list(rules), "versus_references": versus, "recall": recall or {}}))


def test_rules_merge_per_corpus_by_items_and_skip_cpu_and_other_budgets(tmp_path):
    _result(tmp_path / "recency_blend_h200_a.json", "s4-w256-k252",
            {"champ": {"gap:kvpop": _gap(0.6, 32), "gap:kvpop+0.002": _gap(0.9, 32)},
             "stdlib": {"gap:kvpop": _gap(0.0, 32), "gap:kvpop+0.002": _gap(0.4, 32)}},
            recall={"items": [0, 1], "exact": {"dense": 1.0, "streaming": 0.0, "kvpop": 1.0, "kvpop+0.002": 0.5}})
    # a later run of the same scorer: the docs (under a rebuilt file's name) and stdlib on more items
    _result(tmp_path / "recency_blend_h200_a_docs.json", "s4-w256-k252",  # the same scorer unpacked elsewhere
            {"/tmp/gpu/python_docs_deb12u8.jsonl": {"gap:kvpop": _gap(-0.2, 32), "gap:kvpop+0.002": _gap(0.7, 32)},
             "stdlib": {"gap:kvpop": _gap(0.1, 64), "gap:kvpop+0.002": _gap(0.65, 64)}},
            checkpoint="/tmp/r2/a/step-1")
    # another scorer's folder of the same step name is another rule
    _result(tmp_path / "recency_blend_h200_a_other.json", "s4-w256-k252",
            {c: {"gap:kvpop+0.002": _gap(0.99, 32)} for c in ("champ", "python_docs.jsonl")},
            checkpoint="/tmp/r/other/step-1")
    # CPU records (other token ids) and another budget are left out, whatever they say
    _result(tmp_path / "recency_blend_h200_a_cpu.json", "s4-w256-k252",
            {c: {"gap:kvpop+0.002": _gap(0.99, 999)} for c in ("champ", "stdlib", "python_docs.jsonl")})
    _result(tmp_path / "recency_blend_h200_b.json", "s4-w128-k124",
            {c: {"gap:kvpop+0.002": _gap(0.99, 999)} for c in ("champ", "stdlib", "python_docs.jsonl")},
            checkpoint="/tmp/r/b/step-1")
    rows = gap_frontier.collect(tmp_path, 512)
    assert [r["rule"] for r in rows] == ["kvpop+0.002", "kvpop"]  # by the smaller held-out gap
    best = rows[0]
    assert best["gap"]["stdlib"] == {**_gap(0.65, 64), "file": "h200_a_docs"}  # the result with more items
    assert best["gap"]["champ"]["file"] == "h200_a" and best["gap"]["docs"]["mean"] == 0.7
    assert best["held_out_min"] == 0.65 and best["recall_kept"] == 0.5
    assert rows[1]["held_out_min"] == pytest.approx(-0.2)
    assert gap_frontier.main(["--results", str(tmp_path), "--B", "512"]) == 0
    text = (tmp_path / "gap_frontier_b512.md").read_text()
    assert "| h200_a kvpop+0.002 | s4-w256-k252 | 0.90" in text and text.count("| yes |") == 1
    assert (tmp_path / "gap_frontier_b512.png").stat().st_size > 0
    assert json.loads((tmp_path / "gap_frontier_b512.json").read_text())["rows"][0]["rule"] == "kvpop+0.002"


def test_no_rule_with_every_corpus_is_one_line_and_exit_2(tmp_path, capsys):
    _result(tmp_path / "recency_blend_h200_a.json", "s4-w256-k252", {"champ": {"gap:kvpop": _gap(0.6, 32)}})
    assert gap_frontier.main(["--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gap_frontier: no GPU recency_blend result") and "\n" not in err
    (tmp_path / "recency_blend_h200_c.json").write_text(json.dumps({"budget": "w256", "rules": []}))
    assert gap_frontier.main(["--results", str(tmp_path)]) == 2
    assert "not a budget split" in capsys.readouterr().err
