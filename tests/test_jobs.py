"""jobs/ CLIs (bad input → one line, exit 2, nothing written), `ray job submit` to a head started by infra/local.sh, and
the MLflow server it starts answering REST queries for the evaluate stage's metrics."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipelines.config import REPO_ROOT

pytestmark = pytest.mark.pretrained  # the tiny teacher uses SmolLM2's tokenizer

STAGES = ("precompute", "train", "sweep", "evaluate", "pipeline")


def _cli(stage: str):
    import importlib

    module = importlib.import_module(f"jobs.{stage}")
    return lambda argv: module.main(stage, module.__doc__, module.body, argv)


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("KVPOP_HOME", str(home))
    return home


def _bad_inputs(tiny: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    model = ["--set", f"model.path={tiny / 'teacher'}", "--set", f"data.source={tiny / 'docs.jsonl'}"]
    return {
        "unknown_key": (["--set", "train.nope=1"], "unknown key train.nope"),
        "unknown_section": (["--set", "trainer.steps=1"], "unknown key trainer"),
        "wrong_type": (["--set", "data.seq_len=long"], "data.seq_len: expected an integer, got 'long'"),
        "wrong_type_list": (["--set", "precompute.windows=32"], "precompute.windows: expected a list"),
        "missing_config": (["--config", str(tmp / "missing.yaml")], "missing.yaml does not exist"),
        "bad_yaml": (["--config", str(tmp / "bad.yaml")], "not valid YAML"),
        "missing_model": (["--set", f"model.path={tmp / 'no-model'}"], "no-model not found"),
        "missing_data": (model[:2] + ["--set", f"data.source={tmp / 'none.jsonl'}"], "none.jsonl' does not exist"),
        "budget_over_seq_len": (model + ["--set", "budget.topk=1000"], "more than data.seq_len=512"),
        "budget_over_context": (model + ["--set", "data.seq_len=4096", "--set", "budget.topk=2000"],
                                "more than the model's context of 1024"),
        "budget_negative": (model + ["--set", "budget.sink=-1"], "budget: Budget.sink must be"),
        "window_without_targets": (model + ["--set", "budget.window=48"], "add it to precompute.windows"),
        "eval_budget_below_sink_window": (model + ["--set", "eval.budgets=[10]"], "impossible budget"),
        "bad_flag": (["--bogus"], "unrecognized arguments: --bogus"),
    }


CASES = ["unknown_key", "unknown_section", "wrong_type", "wrong_type_list", "missing_config", "bad_yaml",
         "missing_model", "missing_data", "budget_over_seq_len", "budget_over_context", "budget_negative",
         "window_without_targets", "eval_budget_below_sink_window", "bad_flag"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", STAGES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(stage, case, tiny_setup, tmp_path, empty_home, capsys):
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    argv, message = _bad_inputs(tiny_setup, tmp_path)[case]
    try:
        code = _cli(stage)(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert out == ""
    assert not empty_home.exists()


@pytest.mark.parametrize("stage, extra, message", [
    ("train", [], "no precomputed targets"),
    ("sweep", ["--set", "sweep.budgets=[[4, 8, 16]]"], "no precomputed targets"),
    ("sweep", ["--set", "sweep.budgets=[[4, 16, 8]]"], "windows [16] that precompute.windows=[8] does not cover"),
    ("evaluate", [], "no trained retrofitted model"),
    ("precompute", ["--set", "data.text_field=body"], "has no column 'body'"),
    ("pipeline", ["--set", "data.text_field=body"], "has no column 'body'"),
])
def test_stage_input_errors_are_one_line_exit_2_before_any_output(stage, extra, message, tiny_setup, tmp_path,
                                                                 empty_home, capsys, monkeypatch):
    import importlib

    # the CLI process sets HF_DATASETS_DISABLE_PROGRESS_BARS before datasets is imported; here it may be already
    monkeypatch.setattr(importlib.import_module("datasets.utils.tqdm"), "_hf_datasets_progress_bars_disabled", True)
    argv = ["--set", f"model.path={tiny_setup / 'teacher'}", "--set", f"data.source={tiny_setup / 'docs.jsonl'}",
            "--set", "data.seq_len=64", "--set", "budget.window=8", "--set", "budget.topk=16",
            "--set", "precompute.windows=[8]", *extra]
    code = _cli(stage)(argv)
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    # only the content-digest memo (and the datasets cache) may exist: no sequences, targets, runs, sweeps, store
    written = [p.relative_to(empty_home) for p in empty_home.rglob("*") if p.is_file()] if empty_home.exists() else []
    assert all(p.parts[0] == "cache" for p in written), written


def test_every_cli_module_exits_2_in_its_own_process(tiny_setup, tmp_path):
    """``python -m jobs.<stage>`` itself: the exit code, one stderr line, and an untouched KVPOP_HOME."""
    home = tmp_path / "home"
    env = {**os.environ, "KVPOP_HOME": str(home)}
    budget = "budget s4-w64-k1000 keeps 1068 tokens, more than data.seq_len=512: nothing would be evicted"
    runs = {stage: (["--set", "budget.topk=1000"], budget) for stage in STAGES}
    data = ["--set", f"model.path={tiny_setup / 'teacher'}", "--set", f"data.source={tiny_setup / 'docs.jsonl'}",
            "--set", "data.text_field=body"]  # found only once the stage reads the data: datasets is imported by then
    runs["precompute+data"] = (data, f"data.source '{tiny_setup / 'docs.jsonl'}' has no column 'body'")
    procs = {name: subprocess.Popen([sys.executable, "-m", f"jobs.{name.split('+')[0]}", *argv], cwd=REPO_ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, _) in runs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (name, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvpop {name.split('+')[0]}: error: ") \
            and runs[name][1] in lines[0], err
    assert not home.exists() or all(p.relative_to(home).parts[0] == "cache" for p in home.rglob("*") if p.is_file())
    assert not (home / "data").exists()


# --------------------------------------------------------------------------------------------- job submit + mlflow
def _free_ports(count: int) -> list[int]:
    """Free TCP ports from the ephemeral range (outside Ray's default worker ports 10002-19999)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _get(url: str, payload: dict | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.ray
@pytest.mark.slow
def test_job_submit_to_a_local_head_and_mlflow_server_serves_the_eval_metrics(tiny_setup, tmp_path):
    home = tmp_path / "home"
    gcs, dashboard, client, agent, mlflow_port = _free_ports(5)
    env = {**os.environ, "KVPOP_HOME": str(home), "RAY_PORT": str(gcs), "RAY_DASHBOARD_PORT": str(dashboard),
           "RAY_CLIENT_PORT": str(client), "RAY_DASHBOARD_AGENT_PORT": str(agent), "MLFLOW_PORT": str(mlflow_port),
           "PYTHON": sys.executable, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    tracking = f"http://127.0.0.1:{mlflow_port}"
    config = tmp_path / "tiny.yaml"  # the home comes from the head's KVPOP_HOME, the store is the server
    config.write_text(yaml.safe_dump({
        "name": "tiny-job", "model": {"path": str(tiny_setup / "teacher")},
        "data": {"source": str(tiny_setup / "docs.jsonl"), "seq_len": 64, "num_sequences": 4, "eval_sequences": 2},
        "budget": {"sink": 4, "window": 8, "topk": 16},
        "precompute": {"windows": [8], "top_k": 8, "sequences_per_shard": 2, "num_cpus_per_actor": 1},
        "train": {"scorer": "mlp", "steps": 2, "batch_size": 2, "num_workers": 1, "cpus_per_worker": 1,
                  "checkpoint_every": 2},
        "eval": {"budgets": [28, 20], "compression_ratios": [], "policies": ["dense", "streaming", "kvpop"],
                 "tasks": ["kv_retrieval"], "task_samples": 1, "task_contexts": [64], "task_min_dense": 0.0,
                 "max_new_tokens": 4, "batch_size": 2, "generation_batch_size": 2},
        "tracking": {"uri": tracking, "experiment": "jobs"}}))
    local = [str(REPO_ROOT / "infra" / "local.sh")]
    try:
        started = subprocess.run(local + ["start"], env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        ray_bin = str(Path(sys.executable).parent / "ray")
        job = subprocess.run([ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
                              "--working-dir", str(REPO_ROOT), "--runtime-env", "infra/runtime_env.yaml", "--",
                              "python", "-m", "jobs.pipeline", "--config", str(config)],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=480)
        log = job.stdout + job.stderr
        assert job.returncode == 0 and "succeeded" in log, log[-5000:]
        assert "[kvpop] 3/3 evaluate" in log
        assert list((home / "targets").iterdir()) and list((home / "runs").iterdir())  # the head's KVPOP_HOME

        # the MLflow server (on loopback, started by local.sh) serves the evaluate stage's metrics over REST
        api = f"{tracking}/api/2.0/mlflow"
        experiment = _get(f"{api}/experiments/get-by-name?experiment_name=jobs")["experiment"]
        runs = _get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]],
                                           "filter": "tags.`kvpop.stage` = 'evaluate'"})["runs"]
        assert len(runs) == 1 and runs[0]["info"]["status"] == "FINISHED"
        metrics = {m["key"]: m["value"] for m in runs[0]["data"]["metrics"]}
        assert metrics["dense.B28.top1_agreement"] == 1.0
        for key in ("kvpop.B28.kl", "kvpop.B20.top1_agreement", "streaming.B20.token_acc", "kvpop.B20.recall_exact"):
            assert key in metrics, sorted(metrics)
        query = urllib.parse.urlencode({"run_id": runs[0]["info"]["run_id"], "metric_key": "kvpop.B20.kl"})
        history = _get(f"{api}/metrics/get-history?{query}")["metrics"]
        assert len(history) == 1 and history[0]["value"] == metrics["kvpop.B20.kl"] > 0
        train_runs = _get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]],
                                                 "filter": "tags.`kvpop.stage` = 'train'"})["runs"]
        assert {m["key"] for m in train_runs[0]["data"]["metrics"]} >= {"loss", "ret_loss", "kl", "boundary_acc"}
    finally:
        stopped = subprocess.run(local + ["stop"], env=env, capture_output=True, text=True, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "ray head stopped" in stopped.stdout and "mlflow stopped" in stopped.stdout
    time.sleep(1)
    with pytest.raises(OSError):  # both gone
        urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{tracking}/health", timeout=2)
    assert not (home / "run" / "ray.pid").exists() and not (home / "run" / "mlflow.pid").exists()
