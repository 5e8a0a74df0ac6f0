"""The results ledger (pipelines/ledger.py, jobs/results.py): validation, append-only, rendering, MLflow round trip,
the legacy converters and the artifact check."""
from __future__ import annotations

import io
import json
import random
import re
import shutil
import tarfile
from pathlib import Path

import pytest

from jobs import results as cli
from pipelines import ledger as L
from pipelines.config import load_config

FIXTURE = Path(__file__).parent / "data" / "ledger_fixture.jsonl"


@pytest.fixture
def ledger(tmp_path) -> Path:
    path = tmp_path / "ledger.jsonl"
    shutil.copy(FIXTURE, path)
    return path


def _table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


# ------------------------------------------------------------------------------------------------ rendering
def test_render_is_byte_identical_and_independent_of_line_order(ledger, tmp_path):
    runs = L.read(ledger)
    first = L.render(runs)
    assert L.render(L.read(ledger)) == first
    shuffled = runs[:]
    random.Random(1).shuffle(shuffled)
    assert L.render(shuffled) == first
    out, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    readme.write_text("intro\n")
    assert cli.main(["--ledger", str(ledger), "render", "--out", str(out), "--readme", str(readme)]) == 0
    assert out.read_bytes() == first.encode()
    assert cli.main(["--ledger", str(ledger), "render", "--out", str(out), "--readme", str(readme), "--check"]) == 0
    out.write_text(first + "edited\n")
    assert cli.main(["--ledger", str(ledger), "render", "--out", str(out), "--readme", str(readme), "--check"]) == 1
    assert readme.read_text() == "intro\n"  # no markers: untouched


def test_every_number_carries_a_run_id_and_commit(ledger):
    runs = L.read(ledger)
    text = L.render(runs)
    ids = {r.run_id[:12] for r in runs}
    commits = {r.commit[:10] for r in runs}
    header_words = {"policy", "CR", "corpus", "row", "name", "sha256", "bytes"}
    numbered = 0
    for row in _table_rows(text):
        if row[0] in header_words:
            continue
        bare = " ".join(re.sub(r"`[^`]*`", "", c) for c in row)  # numbers outside code spans
        if re.search(r"\d", bare):
            numbered += 1
            cells = " ".join(row)
            assert any(f"`{i}`" in cells for i in ids), row
            assert any(f"`{c}`" in cells for c in commits), row
    assert numbered >= 10
    for run in runs:  # nothing measured is left out
        for key, m in run.metrics.items():
            if L.parse_cell(key) and L.parse_cell(key)[3] not in dict(L.LEADERBOARD_COLUMNS):
                continue
            if key.endswith(".resolved"):  # restates a paired interval: not rendered
                continue
            assert L.fmt_metric(m) in text, (run.name, key)
    assert f"`{L.NOTEBOOK_COMMIT[:12]}`" in text and "`" + "0" * 64 + "`" in text


def _renamed(run: L.Run, name: str, run_id: str, commit: str) -> L.Run:
    return L.Run(run_id, name, run.kind, run.params, run.metrics, {**run.tags, "commit": commit}, run.artifacts)


def test_readme_headline_block_is_refreshed_between_markers(ledger):
    (evaluation,) = [r for r in L.read(ledger) if r.name == "evaluate/smollm2_scorer_wide_kernel"]
    headline = L.HEADLINE[0][0]
    old, new_reading, other_reading = (_renamed(evaluation, headline, i * 32, c) for i, c in
                                       (("1", "aaaaaaa111"), ("2", "bbbbbbb222"), ("3", "bbbbbbb222")))
    old = L.Run(old.run_id, old.name, old.kind, old.params,
                {k: L.Metric(0.123456) for k in old.metrics}, old.tags)
    other_reading = L.Run(other_reading.run_id, other_reading.name, other_reading.kind, other_reading.params,
                          dict(other_reading.metrics), other_reading.tags)  # an earlier commit's run of the name
    other_reading.metrics["python_docs.kvpop.B512.kl.vs_streaming.resolved"] = L.Metric(1.0)
    runs = L.read(ledger) + [old, new_reading, other_reading]
    assert ".resolved" not in L.render(runs)  # a paired interval's flag, restated: MLflow keeps it
    readme = f"# KVpop\n\nintro\n\n{L.HEADLINE_BEGIN}\nstale table\n{L.HEADLINE_END}\n\nrest\n"
    new = L.refresh_readme(readme, runs)
    assert "stale table" not in new and new.startswith("# KVpop\n\nintro\n\n") and new.endswith("\n\nrest\n")
    block = new.split(L.HEADLINE_BEGIN)[1]
    # every reading of the name made at its latest commit (e.g. one run per read window), not an earlier commit's
    assert f"`{'2' * 12}`" in block and f"`{'3' * 12}`" in block and "0.9 [0.85, 0.94]" in block
    assert f"`{'1' * 12}`" not in block and "0.1235" not in block
    assert "dms" not in block and "`6b1b48fd6f87`" not in block  # other runs stay out of the headline
    assert L.refresh_readme(new, runs) == new
    assert L.refresh_readme("no markers\n", runs) == "no markers\n"


# ------------------------------------------------------------------------------------------------ validation
GOOD = json.loads(FIXTURE.read_text().splitlines()[0])


def _with(**changes) -> str:
    record = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is KeyError:
            record.pop(key)
        else:
            record[key] = value
    return json.dumps(record)


BAD_LINES = {
    "not json": "{not json",
    "missing key": _with(kind=KeyError),
    "unknown key": _with(extra=1),
    "kind": _with(kind="figure"),
    "run id": _with(run_id="ABC"),
    "name": _with(name="no-slash"),
    "interval suffix key": _with(metrics={"champ/kvpop/cr0.875/kl.lo": {"value": 1.0}}),
    "lo > hi": _with(metrics={"kl": {"value": 0.5, "lo": 0.6, "hi": 0.4}}),
    "half interval": _with(metrics={"kl": {"value": 0.5, "lo": 0.4}}),
    "nan": '{"run_id": "6b1b48fd6f874af28cdc5a7f4c910f6b", "name": "a/b", "kind": "study", "params": {}, '
           '"metrics": {"kl": {"value": NaN}}, "tags": {"commit": "abcdef1", "produced_by": "x"}, "artifacts": []}',
    "bool metric": _with(metrics={"kl": {"value": True}}),
    "n": _with(metrics={"kl": {"value": 0.5, "n": 0}}),
    "no commit": _with(tags={"produced_by": "x"}),
    "bad commit": _with(tags={"commit": "HEAD", "produced_by": "x"}),
    "param list": _with(params={"x": [1, 2]}),
    "artifact sha": _with(artifacts=[{"name": "a", "path": "p", "sha256": "xyz", "size": 1}]),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_lines_are_refused_with_their_line_number(tmp_path, case, capsys):
    path = tmp_path / "ledger.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[1] + "\n" + BAD_LINES[case] + "\n")
    with pytest.raises(L.LedgerError, match=r"ledger\.jsonl:2: "):
        L.read(path)
    out = tmp_path / "RESULTS.md"
    assert cli.main(["--ledger", str(path), "render", "--out", str(out), "--readme", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvpop results: error: ") and not out.exists()


def test_duplicate_ids_and_append_only(ledger):
    lines = ledger.read_text().splitlines()
    before = ledger.read_bytes()
    runs = L.read(ledger)
    with pytest.raises(L.LedgerError, match="already in the ledger"):
        L.append([runs[0]], ledger)
    new = L.make_run(L.ledger_id("new"), "study/x", "study", {}, {"m": 1.0}, {"commit": "abcdef1", "produced_by": "t"})
    with pytest.raises(L.LedgerError, match="already in the ledger"):  # one clash refuses the whole batch
        L.append([new, new], ledger)
    assert ledger.read_bytes() == before
    L.append([new], ledger)
    assert ledger.read_bytes() == before + (new.to_line() + "\n").encode()
    ledger.write_text("\n".join(lines + [lines[0]]) + "\n")
    with pytest.raises(L.LedgerError, match=rf":{len(lines) + 1}: run_id .* already on line 1"):
        L.read(ledger)


# ------------------------------------------------------------------------------------------------ converters
def _summary():
    return {"metrics": [
        {"part": "text", "metric": "kl", "B": 512, "CR": 0.875, "policy": "kvpop", "estimate": 0.04, "lo": 0.03,
         "hi": 0.05, "n": 32},
        {"part": "recall", "metric": "recall_exact", "B": 512, "CR": 0.875, "policy": "kvpop", "estimate": 0.5,
         "lo": 0.25, "hi": 0.75, "n": 16},
        {"part": "text", "metric": "kl", "B": 256, "CR": 0.9375, "policy": "streaming", "estimate": float("nan"),
         "lo": None, "hi": None, "n": 32}],
        "gap_closed": [{"part": "text", "metric": "kl", "B": 512, "CR": 0.875, "policy": "kvpop", "estimate": 0.9,
                        "lo": 0.85, "hi": 0.94, "n": 32}],
        "differences": []}


def test_legacy_pipeline_and_recency_blend_results_convert():
    extra = {"run_id": "6b1b48fd6f874af28cdc5a7f4c910f6b",
             "config": {"model": {"dtype": "bfloat16", "files_sha256": "ab" * 32}, "heldout": {"count": 32,
                                                                                             "seq_len": 4096}}}
    (run,) = L.legacy_runs("benchmarks/results/pipeline_h200_smollm2_x/metrics.json", {"summary": _summary()},
                           "abcdef1234", extra=extra)
    assert (run.run_id, run.name, run.kind, run.commit) == (extra["run_id"], "evaluate/smollm2_x", "evaluation",
                                                            "abcdef1234")
    assert run.tags["weights_digest"] == "ab" * 32 and run.tags["device"] == "NVIDIA H200"
    assert run.metrics == {"champ/kvpop/cr0.875/kl": L.Metric(0.04, 0.03, 0.05, 32),
                           "recall/kvpop/cr0.875/recall_exact": L.Metric(0.5, 0.25, 0.75, 16),
                           "champ/kvpop/cr0.875/kl.gap_closed": L.Metric(0.9, 0.85, 0.94, 32)}  # NaN left out
    blend = {"budget": "s4-w128-k124",
             "args": {"seq_len": 4096, "sources": ["champ", "/tmp/g/python_docs_deb12u8.jsonl"], "sequences": 2,
                      "recency": [0.0025]},
             "summary": {"champ": {"items": [1, 2], "kl": {"streaming": 0.2, "kvpop+0.0025@a0.0625": 0.1}},
                         "/tmp/g/python_docs_deb12u8.jsonl": {"items": [1, 2], "top1": {"kvpop": 0.9}}},
             "versus_references": {"champ": {"gap:kvpop+0.0025@a0.0625": {"mean": 0.7, "low": 0.6, "high": 0.8},
                                             "gap:best-λ": {"mean": 1.0, "low": 1.0, "high": 1.0}}},
             "recall": {"items": list(range(4)), "exact": {"dense": 1.0},
                        "share:kvpop": {"mean": 0.5, "low": 0.25, "high": 0.75, "n": 4}}}
    (study,) = L.legacy_runs("benchmarks/results/recency_blend_h200_x.json", blend, "abcdef1234")
    assert study.kind == "study" and study.name == "recency_blend/h200_x"
    assert study.run_id == L.ledger_id("benchmarks/results/recency_blend_h200_x.json", "recency_blend/h200_x",
                                       "abcdef1234")
    assert study.metrics == {  # B = 256 of S = 4096: CR 0.9375
        "champ/streaming/cr0.9375/kl": L.Metric(0.2, n=2),
        "champ/kvpop_r0.0025_a0.0625/cr0.9375/kl": L.Metric(0.1, n=2),
        "python_docs/kvpop/cr0.9375/top1_agreement": L.Metric(0.9, n=2),
        "champ/kvpop_r0.0025_a0.0625/cr0.9375/kl.gap_closed": L.Metric(0.7, 0.6, 0.8, 2),
        "recall/dense/cr0.9375/recall_exact": L.Metric(1.0, n=4),
        "recall/kvpop/cr0.9375/recall_exact.share_of_dense": L.Metric(0.5, 0.25, 0.75, 4)}
    with pytest.raises(L.LedgerError, match="no converter"):
        L.legacy_runs("benchmarks/results/gap_frontier_b256.json", {}, "abcdef1234")


def _lc_summary(kl, lo, hi, n, *, policy="kvpop", differences=()):
    return {"metrics": [{"part": "text", "metric": "kl", "B": 512, "CR": 0.875, "policy": policy, "estimate": kl,
                         "lo": lo, "hi": hi, "n": n}],
            "differences": list(differences), "gap_closed": [], "cells": [], "sentences": []}


def test_learning_curves_keep_the_final_checkpoint_summary_and_token_count():
    """Two checkpoints, given out of order: only the one with the most tokens is kept, with its intervals, its paired
    differences, its other corpora, its diagnostics and its training; the references once; no per-item record."""
    diff = {"part": "text", "metric": "top1_agreement", "B": 512, "CR": 0.875, "policy": "kvpop", "vs": "streaming",
            "estimate": -0.0088, "lo": -0.0135, "hi": -0.0043, "n": 32, "sd": 0.01, "resolved": True}
    ref_diff = dict(diff, policy="oracle")
    final = {"step": 943, "tokens": 15450112, "epochs": 0.737, "train_s": 243.8, "records": [{"kl": 9.0}] * 3,
             "summary": _lc_summary(0.10, 0.09, 0.11, 32, differences=[diff]),
             "corpora": {"/tmp/gpu/python_docs_deb12u8.jsonl": {"records": [], "summary": _lc_summary(
                 0.2, 0.15, 0.25, 16)}},
             "diagnostics": {"spearman": {"scorer": 0.67}, "budgets": {"s4-w128-k380": {"scorer": {
                 "auc": 0.91, "balanced_accuracy_per_layer": [0.8, 0.7]}}}}}
    early = {"step": 62, "tokens": 1015808, "summary": _lc_summary(0.3, 0.2, 0.4, 32), "records": []}
    study = {"meta": {"sessions": [{"device": "NVIDIA H200", "args": {"source": "champ", "seq_len": 4096,
                                                                         "sink": 4, "window": 128, "topk": 380}}]},
             "references": {"records": [], "summary": _lc_summary(0.15, 0.13, 0.16, 32, policy="streaming",
                                                                   differences=[ref_diff])},
             "points": [final, early]}
    path = "benchmarks/results/learning_curves_h200_qp16.json"
    (run,) = L.legacy_runs(path, study, "abcdef1234")
    assert (run.name, run.kind, run.commit, run.tags["produced_by"], run.tags["device"]) == (
        "learning_curves/h200_qp16", "study", "abcdef1234", "benchmarks/learning_curves.py", "NVIDIA H200")
    assert run.run_id == L.ledger_id(path, "learning_curves/h200_qp16", "abcdef1234")
    assert run.params["budget"] == "s4-w128-k380"
    assert run.metrics == {
        "champ/kvpop/cr0.875/kl": L.Metric(0.10, 0.09, 0.11, 32),
        "champ/kvpop/cr0.875/top1_agreement.minus_streaming": L.Metric(-0.0088, -0.0135, -0.0043, 32),
        "python_docs/kvpop/cr0.875/kl": L.Metric(0.2, 0.15, 0.25, 16),
        "champ/streaming/cr0.875/kl": L.Metric(0.15, 0.13, 0.16, 32),  # the reference's own difference left out
        "diagnostics/spearman/scorer": L.Metric(0.67),
        "diagnostics/s4-w128-k380/scorer/auc": L.Metric(0.91),  # a per-layer list is not a summary
        "training/tokens": L.Metric(15450112), "training/step": L.Metric(943), "training/epochs": L.Metric(0.737),
        "training/train_s": L.Metric(243.8)}
    with pytest.raises(L.LedgerError, match="no checkpoint"):
        L.legacy_runs(path, dict(study, points=[]), "abcdef1234")


def test_compare_results_convert_under_the_script_that_wrote_them():
    """compare_studies (sides are studies with their token counts) and compare_blends (sides are records files,
    rows per rule, recall rows per task) both wrote compare_<tag>.json: each becomes a run of its own script."""
    studies = {"tag": "x", "baseline": {"path": "a.json", "tokens": 11010048, "label": "plain"},
               "candidate": {"path": "b.json", "tokens": 11010048, "label": "prior"},
               "rows": [{"corpus": "champ", "budget": "s4-w256-k252", "B": 512, "metric": "KL", "n": 64,
                         "baseline": 0.0716, "candidate": 0.0801,
                         "difference": {"estimate": 0.0085, "lo": 0.0072, "hi": 0.0099, "n": 64, "sd": 0.005},
                         "verdict": "candidate worse"},
                        {"corpus": "/tmp/gpu/python_docs.jsonl", "budget": "s4-w256-k252", "B": 512,
                         "metric": "gold logp", "n": 16, "baseline": -0.87, "candidate": -18.8,
                         "difference": {"estimate": -17.9, "lo": -19.0, "hi": -16.8, "n": 16}}]}
    (run,) = L.legacy_runs("benchmarks/results/compare_h200_x.json", studies, "abcdef1234")
    assert (run.name, run.kind, run.tags["produced_by"]) == ("compare_studies/h200_x", "study",
                                                             "benchmarks/compare_studies.py")
    assert run.params["baseline"] == "a.json" and run.params["candidate_label"] == "prior"
    assert run.metrics == {
        "champ/B512/kl/baseline": L.Metric(0.0716, n=64), "champ/B512/kl/candidate": L.Metric(0.0801, n=64),
        "champ/B512/kl/difference": L.Metric(0.0085, 0.0072, 0.0099, 64),
        "python_docs/B512/recall_gold_logprob/baseline": L.Metric(-0.87, n=16),
        "python_docs/B512/recall_gold_logprob/candidate": L.Metric(-18.8, n=16),
        "python_docs/B512/recall_gold_logprob/difference": L.Metric(-17.9, -19.0, -16.8, 16),
        "baseline/tokens": L.Metric(11010048), "candidate/tokens": L.Metric(11010048)}
    blends = {"baseline": "r_a_items.jsonl", "candidate": "r_b_items.jsonl", "B": 512, "aliases": {},
              "rows": [{"corpus": "stdlib", "rule": "kvpop+0.0025", "metric": "top1", "label": "top-1", "n": 32,
                        "baseline": 0.9, "candidate": 0.88,
                        "difference": {"mean": -0.02, "low": -0.03, "high": -0.01, "n": 32}}],
              "recall": [{"corpus": "recall niah_single", "rule": "kvpop", "metric": "exact", "n": 16,
                          "baseline": 0.75, "candidate": 0.5,
                          "difference": {"mean": -0.25, "low": -0.5, "high": 0.0, "n": 16}}]}
    (run,) = L.legacy_runs("benchmarks/results/compare_h200_y.json", blends, "abcdef1234")
    assert (run.name, run.tags["produced_by"]) == ("compare_blends/h200_y", "benchmarks/compare_blends.py")
    assert run.metrics == {
        "stdlib/kvpop_r0.0025/B512/top1_agreement/baseline": L.Metric(0.9, n=32),
        "stdlib/kvpop_r0.0025/B512/top1_agreement/candidate": L.Metric(0.88, n=32),
        "stdlib/kvpop_r0.0025/B512/top1_agreement/difference": L.Metric(-0.02, -0.03, -0.01, 32),
        "recall_niah_single/kvpop/B512/recall_exact/baseline": L.Metric(0.75, n=16),
        "recall_niah_single/kvpop/B512/recall_exact/candidate": L.Metric(0.5, n=16),
        "recall_niah_single/kvpop/B512/recall_exact/difference": L.Metric(-0.25, -0.5, 0.0, 16)}
    table = "\n".join(L._run_table(run))  # rows × (baseline, candidate, difference) in RESULTS.md
    assert "| `stdlib/kvpop_r0.0025/B512/top1_agreement` | 0.9 | 0.88 | -0.02 [-0.03, -0.01] |" in table


def test_capacity_converter_keeps_the_prefill_table_and_the_compiled_step():
    """The prefill table's timed rows by model / context / policy / rows / chunk (skipped ones left out), and the
    largest decode batch timed again with the compiled layer step under ``…/compiled``."""
    capacity = {"rows": [{"model": "m", "policy": "kvpop-B1024", "context": 8192, "batch": 900, "tokens_per_s": 9e3,
                          "x_floor": 1.2, "compiled_step": True, "largest_compiled": True}]}
    capacity["prefill"] = [{"model": "m", "policy": "dense", "context": 8192, "rows": 4, "chunk": None,
                            "prefill_s": 0.5, "tokens_per_s": 65536.0, "peak_gib": None},
                           {"model": "m", "policy": "kvpop-B1024", "context": 8192, "rows": 1, "chunk": 2048,
                            "prefill_s": 0.1, "tokens_per_s": 81920.0, "x_dense": 1.25, "peak_gib": 0.5},
                           {"model": "m", "policy": "kvpop-B1024", "context": 32768, "rows": 1, "chunk": 2048,
                            "skipped": "time limit"}]
    _, metrics = L.capacity_metrics(capacity)
    assert {k: v["value"] for k, v in metrics.items()} == {
        "m/ctx8192/kvpop-B1024/compiled/batch": 900, "m/ctx8192/kvpop-B1024/compiled/tokens_per_s": 9e3,
        "m/ctx8192/kvpop-B1024/compiled/x_floor": 1.2, "prefill/m/ctx8192/dense/rows4/prefill_s": 0.5,
        "prefill/m/ctx8192/dense/rows4/tokens_per_s": 65536.0, "prefill/m/ctx8192/kvpop-B1024/rows1/chunk2048/prefill_s":
        0.1, "prefill/m/ctx8192/kvpop-B1024/rows1/chunk2048/tokens_per_s": 81920.0,
        "prefill/m/ctx8192/kvpop-B1024/rows1/chunk2048/x_dense": 1.25,
        "prefill/m/ctx8192/kvpop-B1024/rows1/chunk2048/peak_gib": 0.5}


def test_benchmark_converters_keep_every_table_cell():
    capacity = {"rows": [{"model": "m", "policy": "dense", "context": 8192, "batch": 3, "tokens_per_s": 1.0},
                         {"model": "m", "policy": "dense", "context": 8192, "largest_batch": 35, "tokens_per_s": 436.5,
                          "x_floor": 1.16, "prefill_s": None}]}
    _, metrics = L.capacity_metrics(capacity)
    assert metrics == {"m/ctx8192/dense/largest_batch": {"value": 35}, "m/ctx8192/dense/tokens_per_s":
                       {"value": 436.5}, "m/ctx8192/dense/x_floor": {"value": 1.16}}
    decode = {"rows": [{"policy": "kvpop", "context": 131072, "batch": 1, "graph_ms": 7.37, "cache_gib": 0.23}]}
    assert L.decode_metrics(decode)[1] == {"kvpop/ctx131072/1/graph_ms": {"value": 7.37},
                                           "kvpop/ctx131072/1/cache_gib": {"value": 0.23}}
    kernels = {"targets": [{"S": 4096, "ratio": 0.9}], "correctness": [{"max_abs_err": 0.01}, {"max_abs_err": 0.02}]}
    assert L.kernels_metrics(kernels)[1] == {"targets/S4096/ratio": {"value": 0.9},
                                             "correctness/all/max_abs_err": {"value": 0.02}}
    run = L.make_run(L.ledger_id("c"), "capacity/t", "benchmark", {}, metrics,
                     {"commit": "abcdef1", "produced_by": "b"})
    table = "\n".join(L._run_table(run))
    assert "| `m/ctx8192/dense` | 35 | 436.5 | 1.16 |" in table


def test_cost_model_converter_keeps_stages_serving_and_gpu_hours():
    result = {"shape_name": "qwen3-4b", "seq_len": 16384, "budget": "s4-w256-k1788", "gpus": 1, "tokens": 2e9,
              "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
              "stages": [{"stage": "precompute", "tokens_per_s_per_gpu": 9000.5, "peak_gib": 30.2, "wall_s": 61.0},
                         {"stage": "train_scorer_only", "tokens_per_s_per_gpu": 20000.0, "peak_gib": None,
                          "wall_s": 80.0, "strategy": "fsdp2"},
                         {"stage": "train_distill", "error": "OutOfMemoryError: CUDA out of memory"}],
              "serving": [{"context": 32768, "prefill_s": 2.5, "prefill_tokens_per_s": 13107.2,
                           "decode_ms_per_token": 20.0, "decode_tokens_per_s": 50.0, "peak_gib": 9.5},
                          {"context": 131072, "error": "OutOfMemoryError: CUDA out of memory"}],
              "hours": [{"stage": "precompute", "gpus": 1, "hours": 61.7, "gpu_hours": 61.7},
                        {"stage": "precompute", "gpus": 8, "hours": 7.7, "gpu_hours": 61.7}],
              "pipelines": [{"pipeline": "precompute + scorer_only", "gpus": 8, "hours": 11.2, "gpu_hours": 89.5,
                             "bounded_by": "precompute"}]}
    params, metrics = L.cost_model_metrics(result)
    assert params["shape"] == "qwen3-4b" and params["seq_len"] == 16384 and params["tokens"] == 2e9
    assert metrics == {
        "stage/precompute/tokens_per_s_per_gpu": {"value": 9000.5}, "stage/precompute/peak_gib": {"value": 30.2},
        "stage/precompute/wall_s": {"value": 61.0}, "stage/train_scorer_only/tokens_per_s_per_gpu": {"value": 20000.0},
        "stage/train_scorer_only/wall_s": {"value": 80.0},  # no memory sampled, the failed stage: nothing
        "serving/ctx32768/prefill_s": {"value": 2.5}, "serving/ctx32768/prefill_tokens_per_s": {"value": 13107.2},
        "serving/ctx32768/decode_ms_per_token": {"value": 20.0},
        "serving/ctx32768/decode_tokens_per_s": {"value": 50.0},
        "serving/ctx32768/peak_gib": {"value": 9.5},
        "hours/precompute/gpus1/hours": {"value": 61.7}, "hours/precompute/gpus1/gpu_hours": {"value": 61.7},
        "hours/precompute/gpus8/hours": {"value": 7.7}, "hours/precompute/gpus8/gpu_hours": {"value": 61.7},
        "pipeline/precompute_scorer_only/gpus8/hours": {"value": 11.2},
        "pipeline/precompute_scorer_only/gpus8/gpu_hours": {"value": 89.5}}
    run = L.make_run(L.ledger_id("cost"), "cost_model/h100_qwen3-4b", "benchmark", params, metrics,
                     {"commit": "abcdef1", "produced_by": "benchmarks/cost_model.py"})  # every key passes the rules
    table = "\n".join(L._run_table(run))
    assert "| `pipeline/precompute_scorer_only/gpus8` | — | — | 89.5 | 11.2 |" in table  # one table per run


# ------------------------------------------------------------------------------------------------ MLflow
@pytest.mark.slow
def test_import_export_round_trip_and_publish(ledger, tmp_path):
    import mlflow

    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"home={tmp_path}/home"])
    runs = L.read(ledger)
    assert [r.run_id for r in L.import_runs(runs, cfg)] == [r.run_id for r in runs]
    assert L.import_runs(runs, cfg) == []  # idempotent
    assert L.export_runs(cfg, {r.run_id for r in runs}) == []  # all known: nothing new
    back = {r.run_id: r for r in L.export_runs(cfg, set())}
    assert {i: r.to_dict() for i, r in back.items()} == {r.run_id: r.to_dict() for r in runs}
    assert L.render(list(back.values())) == L.render(runs)

    client = mlflow.MlflowClient(cfg.tracking_uri())  # a run the evaluation stage logged: picked up by export
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    native = client.create_run(experiment, run_name="evaluate-abc",
                               tags={"kvpop.stage": "evaluate", "kvpop.config": "smollm2_scorer_wide_kernel",
                                     "mlflow.source.git.commit": "abcdef1234"})
    client.log_param(native.info.run_id, "data.seq_len", "4096")
    client.log_param(native.info.run_id, "data.source", "champ")
    for key, value in {"kvpop.B512.kl": 0.04, "kvpop.B512.kl.lo": 0.03, "kvpop.B512.kl.hi": 0.05,
                       "kvpop.B512.recall_exact": 0.5, "seconds.text": 12.0,
                       # eval.heldout_sources: another corpus's text metrics under its name
                       "python_docs.kvpop.B512.kl": 0.07, "python_docs.kvpop.B512.kl.gap_closed": 0.6,
                       "python_docs.kvpop.B512.kl.vs_streaming.resolved": 1.0}.items():
        client.log_metric(native.info.run_id, key, value)
    client.set_terminated(native.info.run_id)
    (new,) = L.export_runs(cfg, {r.run_id for r in runs})
    assert (new.run_id, new.name, new.kind, new.commit) == (native.info.run_id, "evaluate/smollm2_scorer_wide_kernel",
                                                            "evaluation", "abcdef1234")
    assert new.tags["config"] == "smollm2_scorer_wide_kernel"
    assert new.metrics == {"champ/kvpop/cr0.875/kl": L.Metric(0.04, 0.03, 0.05),
                           "recall/kvpop/cr0.875/recall_exact": L.Metric(0.5), "seconds.text": L.Metric(12.0),
                           "python_docs/kvpop/cr0.875/kl": L.Metric(0.07),
                           "python_docs/kvpop/cr0.875/kl.gap_closed": L.Metric(0.6),
                           "python_docs.kvpop.B512.kl.vs_streaming.resolved": L.Metric(1.0)}

    result = tmp_path / "capacity_t.json"
    result.write_text("{}")
    published = L.publish("capacity/t", "benchmark", {"steps": 3}, {"m/ctx8/dense/tokens_per_s": 5.0},
                          {"commit": "abcdef1", "produced_by": "benchmarks/capacity.py"}, [result], ledger=ledger,
                          tracking_uri=cfg.tracking_uri())
    assert L.read(ledger)[-1] == published
    logged = client.get_run(published.run_id)
    assert logged.data.metrics["m/ctx8/dense/tokens_per_s"] == 5.0 and logged.data.tags["kvpop.commit"] == "abcdef1"
    assert [f.path for f in client.list_artifacts(published.run_id, "result")] == ["result/capacity_t.json"]


def test_a_run_keeps_when_it_ran_through_the_ledger(tmp_path):
    """MLflow shows when a run ran: a native run's start and end leave with it as tags (UTC, to the second), an
    imported line starts and ends then again; a line without them imports as before; a benchmark's line starts
    its own duration before it was published."""
    import mlflow

    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"home={tmp_path}/home"])
    client = mlflow.MlflowClient(cfg.tracking_uri())
    experiment = client.get_experiment_by_name(cfg.tracking.experiment) or client.get_experiment(
        client.create_experiment(cfg.tracking.experiment))
    start, end = 1796659200000, 1796659260000  # 2026-12-07T16:00:00Z, a minute later
    native = client.create_run(experiment.experiment_id, run_name="train-x", start_time=start,
                               tags={"kvpop.stage": "train", "mlflow.source.git.commit": "abcdef1234"})
    client.log_metric(native.info.run_id, "loss", 0.3)
    client.set_terminated(native.info.run_id, end_time=end)
    (line,) = L.export_runs(cfg, set())
    assert (line.tags["start_time"], line.tags["end_time"]) == ("2026-12-07T16:00:00Z", "2026-12-07T16:01:00Z")

    other = load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/other.db", f"home={tmp_path}/home"])
    untimed = L.make_run("b" * 32, "capacity/u", "benchmark", {}, {"m/x/y": 1.0},
                         {"commit": "abcdef1", "produced_by": "benchmarks/capacity.py"})
    assert len(L.import_runs([line, untimed], other)) == 2
    back = mlflow.MlflowClient(other.tracking_uri())
    runs = {r.data.tags["kvpop.ledger_id"]: r.info for r in back.search_runs(
        [back.get_experiment_by_name(other.tracking.experiment).experiment_id])}
    assert (runs[line.run_id].start_time, runs[line.run_id].end_time) == (start, end)
    assert L.epoch_ms(None) is None and L.epoch_ms("not a time") is None and L.utc_text(None) is None

    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("")
    published = L.publish_result("capacity", "t", {"rows": [], "prefill": [], "seconds": 3600.0}, config={},
                                 ledger=ledger)
    began, ended = (L.epoch_ms(published.tags[tag]) for tag in L.RUN_TIMES)
    assert 3599e3 <= ended - began <= 3601e3


def test_a_stage_run_made_with_the_client_carries_the_commit_that_export_needs(tmp_path, monkeypatch):
    """The train stage creates its run with MlflowClient (safe in Ray actors), which tags no git commit by itself:
    without one, export would leave the run out of the ledger."""
    import mlflow

    from pipelines import tracking

    monkeypatch.setenv("KVPOP_COMMIT", "abcdef1234")  # a tree without .git, as on a rented GPU machine
    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"home={tmp_path}/home"])
    run_id = tracking.create_run(cfg, "recipe-kernel-mlstm", stage="train", log_config=False)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    client.log_metric(run_id, "loss", 0.3)
    client.set_terminated(run_id)
    skipped: list[str] = []
    (new,) = L.export_runs(cfg, set(), skipped=skipped)
    assert (new.run_id, new.kind, new.commit, skipped) == (run_id, "training", "abcdef1234", [])
    # the same store named through the recipe that made the run (its phases share one tracking section)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("")
    recipe = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "smollm2_kvpop.yaml"
    assert cli.main(["--ledger", str(ledger), "export", "--config", str(recipe), "--set",
                     f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--set", f"home={tmp_path}/home"]) == 0
    assert [r.run_id for r in L.read(ledger)] == [run_id]


# ------------------------------------------------------------------------------------------------ artifacts
def _tarball(path: Path) -> None:
    with tarfile.open(path, "w:gz") as archive:
        data = b"scorer weights"
        info = tarfile.TarInfo("final_model/kvpop.json")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))


def test_artifact_is_checked_and_unpacked(tmp_path):
    root = tmp_path / "repo"
    (root / "results" / "artifacts").mkdir(parents=True)
    tgz = root / "results" / "artifacts" / "scorer.tgz"
    _tarball(tgz)
    entry = L.artifact_entry("scorer.tgz", tgz, root)
    ledger = root / "results" / "ledger.jsonl"
    L.append([L.make_run(L.ledger_id("a"), "train/x", "training", {}, {}, {"commit": "abcdef1", "produced_by": "t"},
                         [entry])], ledger)
    folder = L.artifact("scorer.tgz", ledger, tmp_path / "cache", root)
    assert (folder / "final_model" / "kvpop.json").read_bytes() == b"scorer weights"
    assert L.artifact("scorer.tgz", ledger, tmp_path / "cache", root) == folder
    data = bytearray(tgz.read_bytes())
    data[-1] ^= 1
    tgz.write_bytes(bytes(data))
    with pytest.raises(L.LedgerError, match="sha256 .* is not the ledger's"):
        L.artifact("scorer.tgz", ledger, tmp_path / "cache2", root)
    assert not (tmp_path / "cache2").exists()
    with pytest.raises(L.LedgerError, match="not in the ledger"):
        L.artifact("other.tgz", ledger, tmp_path / "cache", root)


def test_a_trained_folder_becomes_a_reproducible_artifact_and_its_training_line(tmp_path):
    """``jobs.results scorer``: the final_model packed the same bytes on every run (names sorted, no times or owners),
    its line ``train/<name>`` naming it, ``artifact`` unpacking it; a folder that is not a final_model is one line and
    exit 2; an artifact that left the tree is rendered as in git history."""
    root = tmp_path / "repo"
    final = tmp_path / "runs" / "r" / "final_model"
    final.mkdir(parents=True)
    (final / "kvpop.json").write_text(json.dumps({"budget": {"sink": 4, "window": 256, "topk": 252},
                                                  "scorer": {"name": "mlstm"}, "base": {"weights_sha256": "ab" * 32}}))
    (final / "kvpop_train.json").write_text(json.dumps({"steps": 184, "mode": "scorer_only", "policy": "kvpop",
                                                        "run_name": "r"}))
    (final / "kvpop_scorers.safetensors").write_bytes(bytes(range(256)) * 4)
    first = L.pack_folder(final, "final_model")
    (final / "kvpop_scorers.safetensors").touch()  # another mtime: the same bytes
    assert L.pack_folder(final, "final_model") == first

    run = L.scorer_folder_run(final, "smollm2-kvpop-kernel", "abcdef1", root)
    assert (run.name, run.kind, run.commit) == ("train/smollm2-kvpop-kernel", "training", "abcdef1")
    assert (run.params["steps"], run.params["budget"], run.tags["weights_digest"]) == (184, "s4-w256-k252", "ab" * 32)
    [entry] = run.artifacts
    assert entry.path == "results/artifacts/smollm2-kvpop-kernel_scorer.tgz" and (root / entry.path).read_bytes() == first
    ledger = root / "results" / "ledger.jsonl"
    L.append([run], ledger)
    unpacked = L.artifact(entry.name, ledger, tmp_path / "cache", root)
    assert (unpacked / "final_model" / "kvpop_scorers.safetensors").read_bytes() == bytes(range(256)) * 4

    other = root / "results" / "other.jsonl"
    assert cli.main(["--ledger", str(other), "scorer", str(final), "--name", "again", "--commit", "abcdef1"]) == 0
    assert [r.name for r in L.read(other)] == ["train/again"] and (root / "results/artifacts/again_scorer.tgz").is_file()
    (final / "kvpop.json").unlink()
    assert cli.main(["--ledger", str(other), "scorer", str(final), "--name", "x", "--commit", "abcdef1"]) == 2
    assert len(L.read(other)) == 1

    assert "| `smollm2-kvpop-kernel_scorer.tgz` |" in L.render([run], root)
    (root / entry.path).unlink()
    assert "| `smollm2-kvpop-kernel_scorer.tgz` (git history only) |" in L.render([run], root)


def test_committed_results_md_is_what_the_committed_ledger_renders():
    """RESULTS.md (and README.md's headline block) are rendered copies: after a ledger change run
    ``python -m jobs.results render``."""
    assert cli.main(["render", "--check"]) == 0
    runs = L.read(L.LEDGER)
    assert all(a.path.startswith("results/artifacts/") for r in runs for a in r.artifacts)
    assert sum(a.size for r in runs for a in r.artifacts if (L.ROOT / a.path).is_file()) < 15 * 2**20


def test_publish_without_mlflow_writes_the_ledger_line_alone(tmp_path, monkeypatch):
    """A bare GPU machine (no MLflow, no .git): the line travels back in git; provenance from $KVPOP_COMMIT."""
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # `import mlflow` raises ImportError
    monkeypatch.setenv("KVPOP_COMMIT", "abcdef1234")
    ledger = tmp_path / "ledger.jsonl"
    result = {"device": "NVIDIA H100", "dtype": "bfloat16",
              "rows": [{"policy": "kvpop", "context": 8192, "batch": 1, "graph_ms": 7.4}]}
    run = L.publish_result("decode", "h100_run1", result, config={"preset": "h200"}, ledger=ledger)
    assert L.read(ledger) == [run]
    assert (run.name, run.kind, run.commit, run.tags["device"], run.tags["dtype"]) == (
        "decode/h100_run1", "benchmark", "abcdef1234", "NVIDIA H100", "bfloat16")
    assert run.tags["config_hash"] == L.fingerprint({"preset": "h200"})
    assert run.metrics == {"kvpop/ctx8192/1/graph_ms": L.Metric(7.4)}

    cost = {"shape_name": "tiny-qwen3-4b", "device": "cpu", "dtype": "float32",
            "stages": [{"stage": "precompute", "tokens_per_s_per_gpu": 100.0}]}
    run = L.publish_result("cost_model", "tiny", cost, config={"shape": "tiny-qwen3-4b"}, ledger=ledger)
    assert (run.name, run.tags["produced_by"], run.params["shape"]) == (
        "cost_model/tiny", "benchmarks/cost_model.py", "tiny-qwen3-4b")


# ------------------------------------------------------------------------------------------------ citations
# Nothing is lost, every number has a run: the manual's pages cite ledger rows by name, `<producer>/<tag>`, and a
# decision page's quoted figures are those rows' metrics.
_CITED = re.compile(r"`([a-z0-9_]+/[A-Za-z0-9_.\-]+)`")
_NOT_A_NAME = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".tgz", ".sh", ".txt", ".toml")
# The producers of the ledger, and the prefixes of the result files it was converted from (a page citing one of
# those by file stem, `compare/…`, cites a name that is not the ledger's).
_PRODUCERS = {"evaluate", "baselines", "recency_blend", "learning_curves", "compare", "compare_studies",
              "compare_blends", "train", "capacity", "decode", "kernels", "precompute", "quality", "cost_model"}
_NUMBER = r"[−+-]?\d+(?:\.\d+)?"
_INTERVAL = re.compile(rf"({_NUMBER}) \[({_NUMBER}), ({_NUMBER})\]")
_RUN = re.compile(r"\brun ([0-9a-f]{8,32})\b")


def _cited_names(text: str, producers: set[str]) -> set[str]:
    return {m for m in _CITED.findall(text) if m.split("/")[0] in producers and not m.endswith(_NOT_A_NAME)}


def _citing_files() -> list[Path]:
    root = L.ROOT
    return sorted({root / "README.md", *root.glob("docs/**/*.md"), *root.glob("configs/**/*.yaml")})


def _number(text: str) -> tuple[float, int]:
    """A quoted number and its decimals (the rounding shown)."""
    text = text.replace("−", "-")
    return float(text), len(text.split(".")[1]) if "." in text else 0


def _shown_as(value: float, quoted: tuple[float, int]) -> bool:
    number, decimals = quoted
    return abs(value - number) <= 0.5 * 10 ** -decimals + 1e-9


def _quoted_figures(text: str) -> tuple[list[tuple], list[tuple]]:
    """A page's intervals ``v [lo, hi]`` and the bare numbers of its tables (a decimal, or a token count ``15.45M``)."""
    intervals = [tuple(_number(x) for x in m.groups()) for m in _INTERVAL.finditer(text)]
    bare = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            for c in (c.strip() for c in line.strip("|").split("|")):
                if re.fullmatch(rf"{_NUMBER}M", c):
                    value, decimals = _number(c[:-1])
                    bare.append((value * 1e6, decimals - 6))
                elif re.fullmatch(r"[−+-]?\d+\.\d+", c):
                    bare.append(_number(c))
    return intervals, bare


def test_quoted_figures_are_checked_to_the_rounding_shown():
    intervals, bare = _quoted_figures("| a | −0.0088 [−0.0135, −0.0043] (below) | 15.45M | 0.81 | 128 |\n"
                                      "gap 0.41 [0.30, 0.50] at λ = 0.003")
    assert intervals == [((-0.0088, 4), (-0.0135, 4), (-0.0043, 4)), ((0.41, 2), (0.30, 2), (0.50, 2))]
    assert bare == [(15.45e6, -4), (0.81, 2)]
    assert _shown_as(15450112, bare[0]) and not _shown_as(15460112, bare[0])
    assert _shown_as(0.8125, bare[1]) and not _shown_as(0.8151, bare[1])
    assert _cited_names("`kvpop/retention.py` `compare/x` `evaluate/a_b` `pipelines/ledger.py`",
                        _PRODUCERS) == {"compare/x", "evaluate/a_b"}


def test_every_cited_ledger_name_is_in_the_committed_ledger():
    runs = L.read(L.LEDGER)
    names = {r.name for r in runs}
    producers = _PRODUCERS | {r.producer for r in runs}
    missing = {f"{path.relative_to(L.ROOT)}: {name}" for path in _citing_files()
               for name in _cited_names(path.read_text(), producers) if name not in names}
    assert not missing, f"cited but not in results/ledger.jsonl: {sorted(missing)}"


def test_decision_pages_quote_the_metrics_of_the_rows_they_cite():
    """Every interval a decision page quotes is a metric (value, lo, hi) of a row the page cites, and every bare
    decimal of its tables a metric value, each to the rounding shown; every run id it quotes is a cited row's."""
    runs = L.read(L.LEDGER)
    by_name: dict[str, list[L.Run]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    pages = sorted((L.ROOT / "docs" / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert pages
    wrong = []
    for page in pages:
        text = page.read_text()
        cited = [r for name in _cited_names(text, _PRODUCERS | set(by_name)) for r in by_name.get(name, [])]
        assert cited, f"{page.name} cites no ledger row"
        metrics = [m for r in cited for m in r.metrics.values()]
        intervals, bare = _quoted_figures(text)
        for v, lo, hi in intervals:
            if not any(m.lo is not None and _shown_as(m.value, v) and _shown_as(m.lo, lo) and _shown_as(m.hi, hi)
                       for m in metrics):
                wrong.append(f"{page.name}: {v[0]} [{lo[0]}, {hi[0]}]")
        for quoted in bare:
            if not any(_shown_as(m.value, quoted) for m in metrics):
                wrong.append(f"{page.name}: {quoted[0]}")
        for prefix in _RUN.findall(text):
            if not any(r.run_id.startswith(prefix) for r in cited):
                wrong.append(f"{page.name}: run {prefix}")
    assert not wrong, f"quoted but no metric of a cited row: {wrong}"


def test_an_evaluation_summary_with_other_corpora_gives_their_cells():
    """eval.heldout_sources: metrics.json's summary.corpora become cells of their own corpus, the main summary's stay
    under the main corpus."""
    entry = {"part": "text", "policy": "kvpop", "CR": 0.875, "metric": "kl", "estimate": 0.1, "lo": 0.05, "hi": 0.2,
             "n": 64}
    gap = {**entry, "estimate": 0.6, "lo": 0.5, "hi": 0.7}
    summary = {"metrics": [entry], "corpora": {"python_docs": {"source": ".kvpop/data/python_docs.jsonl",
                                                               "metrics": [{**entry, "estimate": 0.3}],
                                                               "gap_closed": [gap]}}}
    assert L.eval_summary_metrics(summary, "champ") == {
        "champ/kvpop/cr0.875/kl": {"value": 0.1, "lo": 0.05, "hi": 0.2, "n": 64},
        "python_docs/kvpop/cr0.875/kl": {"value": 0.3, "lo": 0.05, "hi": 0.2, "n": 64},
        "python_docs/kvpop/cr0.875/kl.gap_closed": {"value": 0.6, "lo": 0.5, "hi": 0.7, "n": 64}}
