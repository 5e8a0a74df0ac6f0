"""pipelines.evaluate on a tiny random Llama (SmolLM2's tokenizer, so that task and problem prompts tokenize for real):
budgets, the output directory and its reuse, and the MLflow run (one per input hash)."""
import json
import shutil

import pytest
import torch

import kvpop
from kvpop import Budget
from pipelines import eval_parts
from pipelines import evaluate as E
from pipelines.config import ConfigError, config_from_dict
from tests.models import tiny_model
from tests.test_evaluation import one_thread  # noqa: F401  (autouse: one torch thread here too)

SEQ = 48


def test_resolve_budgets():
    base = Budget(4, 32, 96)
    assert E.resolve_budgets(base, 512) == ([base], [])
    got, unreachable = E.resolve_budgets(base, 512, totals=(256, 128), ratios=(0.75, 0.875, 0.9375, 0.96875))
    assert got == [Budget(4, 32, 220), Budget(4, 32, 92), Budget(4, 32, 28)]  # 128 = CR .75: deduplicated
    assert [(u["CR"], u["B"]) for u in unreachable] == [(0.9375, 32), (0.96875, 16)]  # below sink + window = 36
    only_unreachable = E.resolve_budgets(base, 512, ratios=(0.96875,))
    assert only_unreachable[0] == [] and len(only_unreachable[1]) == 1  # said so, not replaced by another budget
    with pytest.raises(ConfigError, match="sink \\+ window"):
        E.resolve_budgets(base, 512, totals=(30,))


def test_matched_budgets_of_ragged_baselines():
    base = Budget(4, 32, 96)
    got, unreachable = E.matched_budgets(base, [Budget(4, 32, 220)], [256, 130, 30, 256], 512)
    assert got == [Budget(4, 32, 220), Budget(4, 32, 94)]  # 256 is there already; 130 added, largest first
    assert unreachable == [{"CR": 1 - 30 / 512, "B": 30, "reason": "a ragged baseline's mean retained B < sink + "
                            "window = 36"}]
    assert E.matched_budgets(base, [], [30], 512)[0] == []  # no CR reachable and the matched one below the floor
    assert E.matched_budgets(base, [], [], 512) == ([], [])


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture
def setup(tokenizer, tmp_path, monkeypatch):
    model = kvpop.retrofit(tiny_model("llama", "gqa", vocab=len(tokenizer)), Budget(2, 8, 14), scorer="mlp")
    checkpoint = kvpop.save_retrofitted(model, tmp_path / "trained", tokenizer)
    g = torch.Generator().manual_seed(0)
    heldout = [{"id": f"eval-{i:06d}", "input_ids": torch.randint(3, 2000, (SEQ,), generator=g).tolist(), "docs": []}
               for i in range(5)]
    monkeypatch.setattr(eval_parts, "heldout_sequences", lambda cfg, tok: heldout)
    monkeypatch.setattr(eval_parts, "training_documents", lambda cfg, tok: [])
    cfg = config_from_dict({
        "home": str(tmp_path / "home"), "model": {"path": str(checkpoint)},  # a folder with its weights: their own base
        "budget": {"sink": 2, "window": 8, "topk": 14},
        "precompute": {"windows": [8]}, "data": {"seq_len": SEQ}, "tracking": {"experiment": "tests"},
        "eval": {"checkpoint": str(checkpoint), "budgets": [24], "compression_ratios": [0.75, 0.875],
                 "policies": ["dense", "streaming", "tova", "oracle", "kvpop"], "tasks": ["niah_single"],
                 "task_contexts": [128], "task_depths": [0.1, 0.5], "task_samples": 2, "task_min_dense": 0.0,
                 "max_new_tokens": 3, "generation_prompts": 2, "generation_tokens": 5, "batch_size": 2,
                 "generation_batch_size": 3, "resamples": 200, "dynamic_sequences": 0}})
    return cfg, checkpoint


@pytest.mark.pretrained
@pytest.mark.slow
def test_run_writes_a_complete_directory_logs_it_once_and_reuses_it(setup, monkeypatch, tmp_path):
    import mlflow

    cfg, checkpoint = setup
    result = E.run(cfg, progress=False)
    out = result.output_dir
    assert out.parent == cfg.home_dir() / "eval" and not result.reused
    for name in ("config.json", "predictions.jsonl", "metrics.json", "report.txt", "metrics_vs_cr.png",
                 "recall_map_B24.png", "recall_map_B12.png", "complete.json"):
        assert (out / name).is_file(), name
    # CR 0.75 -> B = 12, CR 0.875 -> B = 6 < sink + window = 10: unreachable, and said so
    config = json.loads((out / "config.json").read_text())
    assert config["budgets"] == ["s2-w8-k14", "s2-w8-k2"] and config["unreachable"][0]["B"] == 6
    assert "Not reachable" in result.text and "CR 87.5% (B = 6)" in result.text
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    by_part = {part: [r for r in records if r["part"] == part] for part in ("text", "recall", "generation")}
    assert len(by_part["text"]) == 5 * 5 * 2  # sequences × policies × budgets (dense once per budget)
    assert len(by_part["recall"]) == 4 * (1 + 4 * 2) and len(by_part["generation"]) == 2 * (1 + 4 * 2)
    assert all(isinstance(r["text"], str) and "tokens" not in r for r in by_part["recall"] + by_part["generation"])
    assert {r["item"] for r in by_part["recall"]} == {f"niah_single/c128/d{d}/s0/{i}" for d in (0.1, 0.5) for i in (0, 1)}
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    names = {(m["policy"], m["B"], m["metric"]) for m in summary["metrics"]}
    for metric in ("top1_agreement", "kl", "recall_exact", "recall_gold_logprob", "gen_divergence", "gen_kl"):
        assert ("kvpop", 12, metric) in names and ("dense", 24, metric) in names, metric
    diffs = {(d["policy"], d["B"], d["metric"], d["vs"]) for d in summary["differences"]}
    assert ("kvpop", 24, "kl", "streaming") in diffs and ("kvpop", 24, "kl", "best_heuristic") in diffs
    assert any(g["policy"] == "kvpop" and g["metric"] == "kl" for g in summary["gap_closed"])
    assert "paired differences" in result.text and "At B = 24 (CR 50%), kvpop vs streaming:" in result.text

    mlflow.set_tracking_uri(cfg.tracking_uri())
    run = mlflow.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kvpop.stage"] == "evaluate"
    metrics = run.data.metrics
    assert metrics["dense.B24.top1_agreement"] == 1.0
    for key in ("kvpop.B12.kl", "kvpop.B12.kl.lo", "kvpop.B12.kl.hi", "kvpop.B12.kl.vs_streaming",
                "kvpop.B12.kl.vs_streaming.lo", "tova.B24.recall_exact", "oracle.B12.gen_divergence"):
        assert key in metrics, key
    assert metrics["kvpop.B12.kl.lo"] <= metrics["kvpop.B12.kl"] <= metrics["kvpop.B12.kl.hi"]
    inputs = {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"eval-heldout", "eval-recall", "eval-generation"}
    assert inputs["eval-heldout"] == config["heldout"]["sha256"][:32]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result.run_id, "eval")}
    assert {"eval/metrics.json", "eval/predictions.jsonl", "eval/metrics_vs_cr.png", "eval/report.txt"} <= artifacts

    def no_model(*args, **kwargs):
        raise AssertionError("a complete result must not load the model again")

    monkeypatch.setattr(eval_parts, "load_models", no_model)
    # a re-run is a fresh process: MLflow's tracking URI is its default again, the working directory another one
    mlflow.set_tracking_uri(None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for _ in range(2):
        again = E.run(cfg, progress=False)
        assert again.reused and again.output_dir == out and again.run_id == result.run_id
        assert again.summary == summary
        mlflow.set_tracking_uri(None)
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert list(cwd.iterdir()) == []  # no stray ./mlflow.db
    store = mlflow.MlflowClient(cfg.tracking_uri())
    runs = store.search_runs([store.get_experiment_by_name("tests").experiment_id],
                             filter_string=f"tags.mlflow.runName = 'evaluate-{out.name}'")
    assert len(runs) == 1  # no second run with the same name

    # a store that never saw the run (another tracking.uri) gets it once, as complete as the first one
    elsewhere = config_from_dict({**cfg.to_dict(), "tracking": {"uri": f"sqlite:///{tmp_path / 'other.db'}",
                                                                "experiment": "tests"}})
    copy = E.run(elsewhere, progress=False)
    assert copy.reused and copy.run_id != result.run_id
    copied = mlflow.MlflowClient(elsewhere.tracking_uri()).get_run(copy.run_id)
    assert copied.info.status == "FINISHED"
    assert {k for k in copied.data.metrics if k.startswith("seconds.")} == {k for k in metrics
                                                                          if k.startswith("seconds.")} != set()
    assert E.run(elsewhere, progress=False).run_id == copy.run_id


@pytest.mark.pretrained
def test_an_interrupted_result_resumes_its_run_and_other_inputs_get_another_directory(setup):
    import mlflow

    cfg, checkpoint = setup
    cfg = config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], "task_samples": 0,
                                                       "generation_prompts": 0}})  # held-out text only: faster
    first = E.run(cfg, progress=False)
    (first.output_dir / "complete.json").unlink()  # as if killed after logging, before the marker
    mlflow.set_tracking_uri(cfg.tracking_uri())
    mlflow.MlflowClient().update_run(first.run_id, status="RUNNING")
    again = E.run(cfg, progress=False)
    assert not again.reused and again.run_id == first.run_id
    assert mlflow.get_run(first.run_id).info.status == "FINISHED"
    other = E.plan(config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"],
                                                                "policies": ["dense", "kvpop"]}}))
    assert other["key"] != again.output_dir.name
    (checkpoint / "kvpop_scorers.safetensors").write_bytes(b"changed")  # another trained model
    assert E.plan(cfg)["key"] != again.output_dir.name


@pytest.mark.pretrained
def test_eval_recency_changes_the_kvpop_rows_only(setup):
    """eval.recency: the kvpop rows rank by scorer + λ·t (a λ that outweighs every score: streaming's records at the
    same B), the references are the plain evaluation's, the report says so, and it is another result directory."""
    cfg, _ = setup
    plain_tree = {**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], "task_samples": 0, "generation_prompts": 0,
                                            "policies": ["dense", "streaming", "oracle", "kvpop"]}}
    plain = E.run(config_from_dict(plain_tree), progress=False)
    blended = E.run(config_from_dict({**plain_tree, "eval": {**plain_tree["eval"], "recency": 1e6}}), progress=False)
    assert blended.output_dir != plain.output_dir
    assert json.loads((blended.output_dir / "config.json").read_text())["kvpop_recency"] == 1e6
    assert "kvpop ranks by its scorer + 1e+06 * t (eval.recency, METHOD §3; trained with 0)" in blended.text

    def rows(result):
        found = [json.loads(line) for line in (result.output_dir / "predictions.jsonl").read_text().splitlines()]
        return {(r["policy"], r["B"], r["item"]): r["kl"] for r in found}

    before, after = rows(plain), rows(blended)
    assert {k: v for k, v in after.items() if k[0] != "kvpop"} == {k: v for k, v in before.items() if k[0] != "kvpop"}
    kvpop_rows = [k for k in after if k[0] == "kvpop"]
    assert kvpop_rows and all(after[k] == pytest.approx(after[("streaming", *k[1:])], abs=1e-6) for k in kvpop_rows)
    assert any(after[k] != pytest.approx(before[k], abs=1e-6) for k in kvpop_rows)
    # eval.anchor_share: with every slot an anchor ranked by the scorer's own term the decay is undone — the plain
    # kvpop rows again, in another result directory whose report says so
    anchored = E.run(config_from_dict({**plain_tree, "eval": {**plain_tree["eval"], "recency": 1e6,
                                                              "anchor_share": 1.0}}), progress=False)
    assert anchored.output_dir not in (plain.output_dir, blended.output_dir)
    assert json.loads((anchored.output_dir / "config.json").read_text())["kvpop_anchor_share"] == 1.0
    assert "kvpop's anchor slots (eval.anchor_share, METHOD §1): 1 of the topk slots keep the best by its scorer " \
           "+ 0 * t" in anchored.text
    assert all(v == pytest.approx(before[k], abs=1e-6) for k, v in rows(anchored).items())


@pytest.mark.pretrained
def test_a_run_cut_off_keeps_the_parts_it_finished(setup, monkeypatch, tmp_path):
    """Killed during recall, an evaluation keeps its held-out text part (``<key>.parts``); the re-run — here after
    the home and the checkpoint moved, as onto another machine — takes it instead of teacher-forcing again,
    finishes, and removes the parts folder."""
    from kvpop import evaluation as runner

    cfg, checkpoint = setup
    cfg = config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], "generation_prompts": 0}})
    real_generation, real_forcing = runner.generation_items, runner.teacher_forced_items

    def cut_off(*args, **kwargs):
        raise KeyboardInterrupt  # the session ends during recall

    monkeypatch.setattr(runner, "generation_items", cut_off)
    with pytest.raises(KeyboardInterrupt):
        E.run(cfg, progress=False)
    out = cfg.home_dir() / "eval" / E.plan(cfg)["key"]
    assert not (out / "complete.json").exists()
    kept = json.loads((E.parts_dir(out) / "text.json").read_text())
    assert not (E.parts_dir(out) / "recall.json").exists() and len(kept["records"]) == 5 * 5 * 2
    # what the cut-off run finished, reported without the model: a baseline's part becomes rows of its own name
    seq_len = len(E.plan(cfg)["sequences"][0]["input_ids"])
    streaming = [r for r in kept["records"] if r["policy"] in ("dense", "streaming")]  # a baseline's own part
    (E.parts_dir(out) / "sp.text.json").write_text(json.dumps({"seconds": 1.0, "records": streaming}))
    summary, text = E.parts_summary(E.parts_dir(out), seq_len, resamples=200)
    by = {(m["policy"], m["B"], m["metric"]): m["estimate"] for m in summary["metrics"]}
    totals = sorted({r["B"] for r in kept["records"] if r["B"] is not None})
    assert {b for _, b, _ in by} == set(totals) and "finished parts sp.text, text" in text
    assert all(by[("sp", b, "kl")] == by[("streaming", b, "kl")] for b in totals)
    assert sum(m["policy"] == "dense" for m in summary["metrics"]) == len(totals) * 3  # top1, kl, acc; not twice
    (E.parts_dir(out) / "sp.text.json").unlink()
    with pytest.raises(ConfigError, match="no finished evaluation parts"):
        E.parts_summary(out / "nowhere", seq_len)

    def no_forcing(*args, **kwargs):
        raise AssertionError("the finished text part ran again")

    key = E.plan(cfg)["key"]
    shutil.move(cfg.home_dir(), tmp_path / "moved_home")
    shutil.move(checkpoint, tmp_path / "moved_checkpoint")
    tree = cfg.to_dict()
    cfg = config_from_dict({**tree, "home": str(tmp_path / "moved_home"),
                            "model": {**tree["model"], "path": str(tmp_path / "moved_checkpoint")},
                            "eval": {**tree["eval"], "checkpoint": str(tmp_path / "moved_checkpoint")}})
    assert E.plan(cfg)["key"] == key  # the folders are keyed by their files, not their paths
    out = cfg.home_dir() / "eval" / key
    monkeypatch.setattr(runner, "generation_items", real_generation)
    monkeypatch.setattr(runner, "teacher_forced_items", no_forcing)
    result = E.run(cfg, progress=False)
    assert (out / "complete.json").is_file() and not E.parts_dir(out).exists()
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r for r in records if r["part"] == "text"] == kept["records"]
    assert {r["part"] for r in records} == {"text", "recall"} and result.seconds["text"] == kept["seconds"]
    monkeypatch.setattr(runner, "teacher_forced_items", real_forcing)


@pytest.mark.pretrained
def test_bad_eval_inputs_are_clear_errors(setup):
    cfg, checkpoint = setup
    too_long = config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], "task_contexts": [4096]}})
    with pytest.raises(ConfigError, match="longer than the model's context of 1024"):
        E.plan(too_long)  # before any model is loaded or anything written
    assert not (cfg.home_dir() / "eval").exists()
    for key, value, message in (("task_depths", [1.5], "must all be in \\[0, 1\\]"),
                                ("tasks", ["sorting"], "unknown task 'sorting'; known: niah_single"),
                                ("task_contexts", [10], ">= 64 tokens")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], key: value}})
    with pytest.raises(ConfigError, match="no trained retrofitted model"):
        E.plan(config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], "checkpoint": str(checkpoint.parent)}}))


@pytest.mark.pretrained
def test_a_checkpoint_of_another_base_model_is_refused_naming_both(setup, tokenizer, tmp_path):
    from kvpop.pretrained import load_pretrained
    from tests.models import save_tiny_teacher

    cfg, checkpoint = setup
    base, other = (save_tiny_teacher(tmp_path / name, tokenizer, seed=seed) for name, seed in (("a", 0), ("b", 1)))
    scorers = kvpop.save_retrofitted(kvpop.retrofit(load_pretrained(base)[0], Budget(2, 8, 14), scorer="mlp"),
                                     tmp_path / "scorers", tokenizer, base=base)

    def with_model(path, folder):
        return config_from_dict({**cfg.to_dict(), "model": {"path": str(path)},
                                 "eval": {**cfg.to_dict()["eval"], "checkpoint": str(folder)}})

    E.plan(with_model(base, scorers))  # its own base: accepted
    with pytest.raises(ConfigError) as err:  # same architecture, other weights
        E.plan(with_model(other, scorers))
    assert str(scorers) in str(err.value) and str(other) in str(err.value) and "\n" not in str(err.value)
    wide = save_tiny_teacher(tmp_path / "wide", tokenizer, layers=3)
    with pytest.raises(ConfigError, match="num_hidden_layers 2 vs 3") as err:  # a folder with its own weights
        E.plan(with_model(wide, checkpoint))
    assert str(checkpoint) in str(err.value) and str(wide) in str(err.value)
    assert not (cfg.home_dir() / "eval").exists()


@pytest.mark.pretrained
def test_out_of_memory_is_one_line_naming_the_batch_sizes(setup, monkeypatch):
    cfg, _ = setup

    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(eval_parts, "evaluate_items", too_big)
    with pytest.raises(ConfigError) as err:
        E.run(cfg, progress=False)
    message = str(err.value)
    assert "\n" not in message and "out of cpu memory at eval.batch_size=2, eval.generation_batch_size=3" in message
    assert not (cfg.home_dir() / "eval" / E.plan(cfg)["key"] / "complete.json").exists()


KILLED_DRIVER = """
import json, sys
from pipelines import eval_parts, evaluate
from pipelines.config import config_from_dict

heldout = json.loads(sys.argv[2])
eval_parts.heldout_sequences = lambda cfg, tokenizer: heldout
eval_parts.training_documents = lambda cfg, tokenizer: []
evaluate.run(config_from_dict(json.loads(sys.argv[1])), progress=False)
"""


@pytest.mark.pretrained
@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["evaluate.logged", "evaluate.complete"])
def test_a_killed_evaluation_completes_on_a_rerun_with_one_finished_run(setup, monkeypatch, crash_at):
    """A driver killed after logging its MLflow run, or after the completion marker, then a re-run: one FINISHED run
    ``evaluate-<key>``, the directory complete, the hand-over record written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mlflow

    from pipelines import records

    cfg, _ = setup
    cfg = config_from_dict({**cfg.to_dict(), "eval": {**cfg.to_dict()["eval"], "task_samples": 0,
                                                       "generation_prompts": 0}})  # held-out text only: faster
    heldout = eval_parts.heldout_sequences(cfg, None)  # the fixture's
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), records.CRASH_ENV: crash_at}
    killed = subprocess.run([sys.executable, "-c", KILLED_DRIVER, json.dumps(cfg.to_dict()), json.dumps(heldout)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == records.CRASH_EXIT_CODE, killed.stderr[-3000:]
    assert records.for_config(cfg, "evaluate") is None
    result = E.run(cfg, progress=False)
    assert (result.output_dir / "complete.json").is_file()
    assert records.for_config(cfg, "evaluate").payload["mlflow_run_id"] == result.run_id
    client = mlflow.MlflowClient(cfg.tracking_uri())
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id],
                              filter_string=f"tags.mlflow.runName = 'evaluate-{result.output_dir.name}'")
    assert [r.info.status for r in runs] == ["FINISHED"] and runs[0].info.run_id == result.run_id
    assert "seconds.total" in runs[0].data.metrics


def _corpus(path, docs: int = 12):
    """A small JSONL corpus of distinct documents (a few hundred tokens each)."""
    path.write_text("".join(json.dumps({"text": " ".join(f"word{i}x{j} of document {i}." for j in range(40))}) + "\n"
                            for i in range(docs)))
    return path


@pytest.mark.pretrained
def test_heldout_sources_are_evaluated_reported_and_logged_per_corpus(setup, tmp_path):
    """eval.heldout_sources: the extra corpus's held-out split under every policy and budget (text only), its own
    summary, report section and <corpus>.-prefixed MLflow metrics; the main corpus's names and numbers unchanged;
    another list is another evaluation; a bad source is one line before anything is written."""
    import mlflow

    cfg, _ = setup
    tree = {**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "eval_sequences": 3},
            "eval": {**cfg.to_dict()["eval"], "task_samples": 0, "generation_prompts": 0, "compression_ratios": [],
                     "policies": ["dense", "streaming", "oracle", "kvpop"]}}
    plain = E.run(config_from_dict(tree), progress=False)
    source = str(_corpus(tmp_path / "extra_docs.jsonl"))
    tree["eval"]["heldout_sources"] = [source]
    result = E.run(config_from_dict(tree), progress=False)
    assert result.output_dir != plain.output_dir  # the sources are part of the evaluation's identity
    config = json.loads((result.output_dir / "config.json").read_text())
    assert [(c["source"], c["corpus"], c["count"]) for c in config["heldout_sources"]] == [(source, "extra_docs", 3)]
    records = [json.loads(line) for line in (result.output_dir / "predictions.jsonl").read_text().splitlines()]
    extra = [r for r in records if r.get("corpus") == "extra_docs"]
    assert {r["part"] for r in extra} == {"text"} and len(extra) == 3 * 4  # sequences × policies at B = 24
    summary = result.summary
    assert summary["metrics"] == plain.summary["metrics"]  # the main corpus's summary is as without the sources
    other = summary["corpora"]["extra_docs"]
    assert other["source"] == source and {m["n"] for m in other["metrics"]} == {3}
    assert any(g["policy"] == "kvpop" and g["metric"] == "kl" for g in other["gap_closed"])
    assert f"held-out corpus extra_docs ({source})" in result.text
    mlflow.set_tracking_uri(cfg.tracking_uri())
    metrics = mlflow.get_run(result.run_id).data.metrics
    assert metrics["extra_docs.dense.B24.top1_agreement"] == 1.0
    assert "extra_docs.kvpop.B24.kl.gap_closed" in metrics and "extra_docs.kvpop.B24.kl.vs_streaming" in metrics
    assert {k: v for k, v in metrics.items() if not k.startswith(("extra_docs.", "seconds."))} == \
        {k: v for k, v in mlflow.get_run(plain.run_id).data.metrics.items() if not k.startswith("seconds.")}
    kl = next(m for m in other["metrics"] if m["policy"] == "kvpop" and m["metric"] == "kl")
    assert metrics["extra_docs.kvpop.B24.kl"] == pytest.approx(kl["estimate"])

    missing = {**tree, "home": str(tmp_path / "other_home"),
               "eval": {**tree["eval"], "heldout_sources": [str(tmp_path / "nowhere.jsonl")]}}
    with pytest.raises(ConfigError, match="eval.heldout_sources .*nowhere.jsonl.* does not exist"):
        E.plan(config_from_dict(missing))
    with pytest.raises(ConfigError, match="the main corpus is evaluated already"):
        E.plan(config_from_dict({**missing, "eval": {**tree["eval"], "heldout_sources": ["champ"]}}))
    assert not (tmp_path / "other_home").exists()  # nothing written
    with pytest.raises(ConfigError, match="share a corpus name"):
        config_from_dict({**tree, "eval": {**tree["eval"], "heldout_sources": [source, str(tmp_path / "x" /
                                                                                           "extra_docs.jsonl")]}})
