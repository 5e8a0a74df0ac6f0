"""research/gap_scaling.py: one recipe's gap against training tokens, and the line through it."""
from __future__ import annotations

import json
import math
import random

import pytest

from research import gap_scaling


def _gap(mean, n=32):
    return {"mean": mean, "low": mean - 0.05, "high": mean + 0.05, "n": n}


def _member(folder, tag, tokens, gaps, rules=("kvpop", "kvpop+0.002")):
    """A recency-blend result (gaps per corpus for each rule) and the study that trained its scorer."""
    versus = {source: {f"gap:{rule}": _gap(gaps[name] + 0.1 * i) for i, rule in enumerate(rules)}
              for source, name in (("champ", "champ"), ("stdlib", "stdlib"),
                                   ("/tmp/gpu/python_docs_deb12u8.jsonl", "docs"))}
    (folder / f"recency_blend_{tag}.json").write_text(json.dumps({
        "checkpoint": f"/tmp/r/{tag}_state/step-1", "budget": "s4-w256-k252", "streaming_layers": None,
        "rules": ["streaming", *rules], "versus_references": versus,
        "recall": {"items": [0, 1], "exact": {"dense": 1.0, **{r: 0.5 for r in rules}}}}))
    if tokens is not None:
        (folder / f"learning_curves_{tag}.json").write_text(json.dumps(
            {"points": [{"tokens": 0}, {"tokens": tokens}]}))


def test_fit_matches_a_brute_force_least_squares_line_on_random_points():
    rng = random.Random(0)
    for _ in range(50):
        points = [(rng.choice([1e6, 2e6, 4e6, 8e6, 3e7]) * rng.uniform(0.5, 2), rng.uniform(-0.5, 1.0))
                  for _ in range(rng.randint(2, 6))]
        f = gap_scaling.fit(points)
        xs = [math.log2(t) for t, _ in points]
        if max(xs) - min(xs) < 1e-12:
            assert f["per_doubling"] is None
            continue
        # brute force: the slope minimising the squared residuals, found by a fine search around the closed form
        def sse(b):
            a = (sum(g for _, g in points) - b * sum(xs)) / len(xs)
            return sum((g - a - b * x) ** 2 for x, (_, g) in zip(xs, points))
        b = f["per_doubling"]
        assert sse(b) <= min(sse(b + d) for d in (-1e-4, 1e-4, -1e-2, 1e-2)) + 1e-12
        a = (sum(g for _, g in points) - b * sum(xs)) / len(xs)
        if b > 0:
            assert a + b * math.log2(f["reaches_target_tokens"]) == pytest.approx(gap_scaling.TARGET)
        else:
            assert f["reaches_target_tokens"] is None


def test_fit_of_points_on_a_line_and_of_equal_scales():
    line = [(2 ** x, 0.1 + 0.05 * x) for x in (20, 22, 24)]
    f = gap_scaling.fit(line)
    assert f["per_doubling"] == pytest.approx(0.05)
    assert f["reaches_target_tokens"] == pytest.approx(2 ** 10)
    assert gap_scaling.fit([(4e6, 0.3), (4e6, 0.5)]) == {"per_doubling": None, "reaches_target_tokens": None}
    assert gap_scaling.fit([(4e6, 0.5), (8e6, 0.4)])["reaches_target_tokens"] is None  # falling: never


def test_build_orders_by_tokens_and_describes_each_corpus(tmp_path):
    _member(tmp_path, "big", 16_000_000, {"champ": 0.9, "stdlib": 0.55, "docs": 0.50})
    _member(tmp_path, "small", 4_000_000, {"champ": 0.8, "stdlib": 0.45, "docs": 0.50})
    result = gap_scaling.build(tmp_path, ["big", "small"], ["kvpop", "kvpop+0.002"], 512)
    assert [m["tag"] for m in result["members"]] == ["small", "big"]
    assert result["fits"]["kvpop"]["stdlib"]["per_doubling"] == pytest.approx(0.05)
    assert result["fits"]["kvpop"]["docs"]["per_doubling"] == pytest.approx(0.0)
    assert result["fits"]["kvpop+0.002"]["stdlib"]["reaches_target_tokens"] == pytest.approx(8e6)
    assert result["members"][0]["rules"]["kvpop"]["recall_kept"] == 0.5
    text = gap_scaling.render(result)
    assert "0.45 [0.40, 0.50] (n 32)" in text
    fit_rows = {line.split(" | ")[0]: line.split(" | ")[2:5] for line in text.splitlines() if "| fit:" in line}
    assert fit_rows["| kvpop"] == ["+0.050; the line is above it at every measured scale",  # champ 0.8 → 0.9
                                   "+0.050; ~32M (extrapolated, 2.0× the largest scale)",  # 0.45 + 0.05 a doubling
                                   "+0.000; never (not rising)"]
    assert fit_rows["| kvpop+0.002"][1] == "+0.050; ~8M (between the measured scales)"


def test_bad_families_are_refused_in_one_line(tmp_path, capsys):
    _member(tmp_path, "a", 4_000_000, {"champ": 0.8, "stdlib": 0.4, "docs": 0.4})
    _member(tmp_path, "same", 4_000_000, {"champ": 0.8, "stdlib": 0.5, "docs": 0.4})
    _member(tmp_path, "nostudy", None, {"champ": 0.8, "stdlib": 0.5, "docs": 0.4})
    cases = [(["a", "same"], ["kvpop"], "same token count"),
             (["a", "nostudy"], ["kvpop"], "learning_curves_nostudy.json is missing"),
             (["a", "missing"], ["kvpop"], "recency_blend_missing.json has no gap"),
             (["a", "same"], ["kvpop+0.01"], "['kvpop+0.01']")]
    for family, rules, message in cases:
        code = gap_scaling.main(["--results", str(tmp_path), "--family", *family, "--rules", *rules, "--tag", "t"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (family, err)
    with pytest.raises(SystemExit) as exit_:
        gap_scaling.main(["--results", str(tmp_path), "--family", "a", "a", "--tag", "t"])
    assert exit_.value.code == 2 and "at least two distinct tags" in capsys.readouterr().err
    assert not list(tmp_path.glob("gap_scaling_*"))


def test_main_writes_json_markdown_and_figure(tmp_path):
    _member(tmp_path, "s", 4_000_000, {"champ": 0.8, "stdlib": 0.45, "docs": 0.4})
    _member(tmp_path, "m", 11_000_000, {"champ": 0.85, "stdlib": 0.5, "docs": 0.45})
    _member(tmp_path, "l", 25_000_000, {"champ": 0.9, "stdlib": 0.56, "docs": 0.5})
    assert gap_scaling.main(["--results", str(tmp_path), "--family", "s", "m", "l", "--rules", "kvpop", "kvpop+0.002",
                             "--tag", "fam"]) == 0
    saved = json.loads((tmp_path / "gap_scaling_fam.json").read_text())
    assert [m["tokens"] for m in saved["members"]] == [4_000_000, 11_000_000, 25_000_000]
    assert (tmp_path / "gap_scaling_fam.png").stat().st_size > 0
    assert "| kvpop+0.002 | 25.00M (l) |" in (tmp_path / "gap_scaling_fam.md").read_text()
