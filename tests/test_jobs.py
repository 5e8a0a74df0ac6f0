"""jobs/ CLIs: bad input (a wrong key or file, a model folder transformers cannot load, an unreachable Ray address, …)
is one line, exit code 2, nothing written; Ctrl-C is one line, exit code 130. (`ray job submit` to infra/local.sh's
head: tests/test_infra.py.)"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.config import REPO_ROOT
from tests.pipeline_helpers import tiny_overrides

pytestmark = pytest.mark.pretrained  # the tiny teacher uses SmolLM2's tokenizer

STAGES = ("precompute", "train", "sweep", "evaluate", "pipeline")


def _cli(stage: str):
    import importlib

    return importlib.import_module(f"jobs.{stage}").cli


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
        "bad_yaml": (["--config", str(tmp / "bad.yaml")], "not valid YAML (line 2, column 1: expected ',' or ']', "
                     "but got '<stream end>' (while parsing a flow sequence at line 1, column 8))"),
        "missing_model": (["--set", f"model.path={tmp / 'no-model'}"], "no-model does not exist"),
        "model_without_model_type": (model[2:] + ["--set", f"model.path={tmp / 'untyped'}"],
                                     "config.json has no model_type"),
        "missing_data": (model[:2] + ["--set", f"data.source={tmp / 'none.jsonl'}"], "none.jsonl' does not exist"),
        "budget_over_seq_len": (model + ["--set", "budget.topk=1000"], "more than data.seq_len=512"),
        "budget_over_context": (model + ["--set", "data.seq_len=4096", "--set", "budget.topk=2000"],
                                "more than the model's context of 1024"),
        "budget_negative": (model + ["--set", "budget.sink=-1"], "budget: Budget.sink must be"),
        "window_without_targets": (model + ["--set", "budget.window=48"], "add it to precompute.windows"),
        "eval_budget_below_sink_window": (model + ["--set", "eval.budgets=[10]"], "impossible budget"),
        "bad_flag": (["--bogus"], "unrecognized arguments: --bogus"),
    }


def _untyped_copy(teacher: Path, dest: Path) -> Path:
    """The teacher's folder (files linked) with a config.json that names no model_type."""
    dest.mkdir()
    for item in teacher.iterdir():
        if item.name != "config.json":
            (dest / item.name).symlink_to(item)
    config = json.loads((teacher / "config.json").read_text())
    del config["model_type"]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


CASES = ["unknown_key", "unknown_section", "wrong_type", "wrong_type_list", "missing_config", "bad_yaml",
         "missing_model", "model_without_model_type", "missing_data", "budget_over_seq_len", "budget_over_context", "budget_negative",
         "window_without_targets", "eval_budget_below_sink_window", "bad_flag"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", STAGES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(stage, case, tiny_setup, tmp_path, empty_home, capsys):
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    _untyped_copy(tiny_setup / "teacher", tmp_path / "untyped")
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


@pytest.mark.slow
def test_every_cli_module_exits_2_in_its_own_process(tiny_setup, tmp_path):
    """``python -m jobs.<stage>`` itself: the exit code, one stderr line, and an untouched KVPOP_HOME."""
    home = tmp_path / "home"
    env = {**os.environ, "KVPOP_HOME": str(home)}
    budget = "budget s4-w64-k1000 keeps 1068 tokens, more than data.seq_len=512: nothing would be evicted"
    runs = {stage: (["--set", "budget.topk=1000"], budget) for stage in STAGES}
    data = ["--set", f"model.path={tiny_setup / 'teacher'}", "--set", f"data.source={tiny_setup / 'docs.jsonl'}",
            "--set", "data.text_field=body"]  # found only once the stage reads the data: datasets is imported by then
    runs["precompute+data"] = (data, f"data.source '{tiny_setup / 'docs.jsonl'}' has no column 'body'")
    untyped = _untyped_copy(tiny_setup / "teacher", tmp_path / "untyped")
    runs["precompute+model_type"] = (data[2:4] + ["--set", f"model.path={untyped}"],
                                     f"model.path: {untyped / 'config.json'} has no model_type")
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


# --------------------------------------------------------------------------------------------- unreachable Ray
@pytest.mark.parametrize("stage", ["precompute", "train", "sweep", "pipeline"])
def test_unreachable_ray_address_is_one_line_exit_2_before_anything_is_written(stage, tiny_setup, empty_home,
                                                                              monkeypatch, capsys):
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    argv = ["--set", f"model.path={tiny_setup / 'teacher'}", "--set", f"data.source={tiny_setup / 'docs.jsonl'}"]
    code = _cli(stage)(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert err.strip().splitlines() == [f"kvpop {stage}: error: RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster there "
                                        f"(Connection refused, {_probe_s(err)} s): start it (infra/local.sh start) or "
                                        f"fix RAY_ADDRESS"]
    assert not empty_home.exists()


def test_unreachable_ray_address_in_its_own_process(tiny_setup, tmp_path):
    """``python -m jobs.precompute --set ray.address=<closed port>``: one line within the probe's bound (not minutes of
    Ray retrying), exit 2, and nothing under the home — no sequences cache, no target header."""
    from pipelines.cluster import CONNECT_TIMEOUT_S

    home, port = tmp_path / "home", _closed_port()
    env = {**os.environ, "KVPOP_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jobs.precompute", "--set", f"ray.address=127.0.0.1:{port}",
                           "--set", f"model.path={tiny_setup / 'teacher'}",
                           "--set", f"data.source={tiny_setup / 'docs.jsonl'}"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvpop precompute: error: ray.address=127.0.0.1:{port}: no Ray cluster there")
    assert float(_probe_s(lines[0])) <= CONNECT_TIMEOUT_S
    assert elapsed < 120, elapsed  # interpreter start-up and imports included; the hang it replaces took minutes
    assert not home.exists()


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_s(message: str) -> str:
    return message.split("Connection refused, ")[1].split(" s)")[0]


# --------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_in_a_stage_is_one_line_exit_130(tiny_setup, tmp_path):
    """SIGINT while ``python -m jobs.pipeline`` is inside its first stage (starting Ray and reading the corpus take
    seconds on two cores) ends it at once with one stderr line and exit code 130, no traceback — wherever it lands
    (unwinding a KeyboardInterrupt could hang in a held logging lock or crash inside ray.init)."""
    env = {**os.environ, "KVPOP_HOME": str(tmp_path / "home")}
    env.pop("RAY_ADDRESS", None)
    overrides = [item for override in tiny_overrides(tiny_setup, tmp_path / "home") for item in ("--set", override)]
    proc = subprocess.Popen([sys.executable, "-m", "jobs.pipeline", *overrides], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the stage has begun
            if line.startswith("[kvpop] 1/3 precompute"):
                break
        time.sleep(1)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    # Ray may have logged its own start-up lines before; ours is the last, and nothing unwound into a traceback
    assert err.strip().splitlines()[-1] == "kvpop pipeline: interrupted", err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_ctrl_c_while_a_cli_still_imports_is_one_line():
    """Before ``main`` runs (importing torch takes seconds), the jobs package's hook keeps Ctrl-C to one line."""
    proc = subprocess.run([sys.executable, "-c", "import jobs\nraise KeyboardInterrupt"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), proc.returncode
    assert proc.stderr.strip().splitlines() == ["kvpop: interrupted"], proc.stderr


# --------------------------------------------------------------------------------------------- reviewing the runs
def test_the_experiment_is_a_machine_learning_one(tmp_path):
    """Created by a stage, or made before the tag existed: the experiment carries MLflow's kind for training runs."""
    import mlflow

    from pipelines import tracking
    from pipelines.config import load_config

    cfg = load_config(None, [f"home={tmp_path}", "tracking.experiment=fresh"])
    experiment_id = tracking.setup(cfg)
    assert mlflow.get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    old = mlflow.create_experiment("old", artifact_location=(tmp_path / "old").as_uri())
    assert "mlflow.experimentKind" not in mlflow.get_experiment(old).tags
    assert tracking.setup(load_config(None, [f"home={tmp_path}", "tracking.experiment=old"])) == old
    assert mlflow.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path):
    """Two stages started side by side on a fresh home (the fourth GPU session's recipe and baselines parts) both
    create and migrate the sqlite store: without the lock one of them fails ("Online migration expected to match one
    row", "table … already exists"; of 2 processes, 1 or 2 fail every time here)."""
    code = ("import sys; from pipelines import tracking; from pipelines.config import load_config; "
            "print(tracking.setup(load_config(None, [f'home={sys.argv[1]}'])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err.splitlines()[-1:] for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1  # one experiment, the same id everywhere


def test_the_closing_line_says_how_to_open_the_runs():
    """A command that works as written (this interpreter's mlflow, not one on PATH) and the link that opens the runs
    (MLflow 3.17's UI otherwise starts on the GenAI overview)."""
    from jobs.pipeline import review_hint

    mlflow_bin = Path(sys.executable).parent / "mlflow"
    assert review_hint("sqlite:////x/mlflow.db", "3") == (
        f"review with `{mlflow_bin} ui --backend-store-uri sqlite:////x/mlflow.db`, then open "
        f"http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning")
    assert review_hint("http://10.0.0.1:5000/", "7") == \
        "open http://10.0.0.1:5000/#/experiments/7?workflowType=machine_learning"


HEAVY = ("torch", "ray", "transformers", "datasets", "mlflow")


def test_a_bad_command_line_answers_before_any_heavy_import():
    """Each stage CLI parses its command line before importing torch, Ray or transformers (seconds each): a bad flag
    is exit 2 with none of them loaded (one process, the stages in turn)."""
    code = ("import sys\n"
            "for stage in sys.argv[1:]:\n"
            "    module = __import__(f'jobs.{stage}', fromlist=['cli'])\n"
            "    try:\n"
            "        module.cli(['--bad-flag'])\n"
            "    except SystemExit as done:\n"
            f"        print(stage, done.code, [m for m in {HEAVY!r} if m in sys.modules])\n")
    stages = ["precompute", "train", "sweep", "evaluate", "pipeline"]
    done = subprocess.run([sys.executable, "-c", code, *stages], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.stdout.splitlines() == [f"{stage} 2 []" for stage in stages], done.stderr
