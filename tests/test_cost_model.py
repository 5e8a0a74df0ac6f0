"""benchmarks/cost_model.py: the GPU-hours arithmetic against a direct computation, the refusals, and the tiny
Qwen3-4B shape through every stage of the benchmark's own code path on CPU (issue 44's CI point)."""
from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks import cost_model

pytestmark = pytest.mark.pretrained  # the model folder gets SmolLM2's tokenizer


def _hours_reference(rate: float, tokens: float, gpus: int, efficiency: float) -> float:
    return tokens / (rate * gpus * efficiency) / 3600


def test_gpu_hours_match_the_stated_assumption_on_random_rates():
    rng = random.Random(0)
    for _ in range(50):
        rates = {stage: rng.uniform(1.0, 1e5) for stage in ("precompute", "train_scorer_only", "train_distill")}
        if rng.random() < 0.2:  # a tie between the two stages of a pipeline
            rates["train_distill"] = rates["precompute"]
        tokens, efficiency = rng.uniform(1e6, 1e10), rng.uniform(0.1, 1.0)
        rows = cost_model.gpu_hours(rates, tokens, efficiency=efficiency)
        assert {(r["stage"], r["gpus"]) for r in rows} == {(s, g) for s in rates for g in cost_model.GPU_COUNTS}
        for r in rows:
            assert r["hours"] == pytest.approx(_hours_reference(rates[r["stage"]], tokens, r["gpus"], efficiency))
            assert r["gpu_hours"] == pytest.approx(r["hours"] * r["gpus"])
        _check_pipelines(rows, cost_model.pipelines_cost(rows))


def _check_pipelines(rows, pipelines):
    by = {(r["stage"], r["gpus"]): r for r in rows}
    assert len(pipelines) == len(cost_model.TRAIN_MODES) * len(cost_model.GPU_COUNTS)
    for p in pipelines:
        mode = p["pipeline"].split(" + ")[1]
        parts = [by[("precompute", p["gpus"])], by[(f"train_{mode}", p["gpus"])]]
        assert p["hours"] == pytest.approx(sum(x["hours"] for x in parts))
        assert p["gpu_hours"] == pytest.approx(sum(x["gpu_hours"] for x in parts))
        assert by[(p["bounded_by"], p["gpus"])]["hours"] == max(x["hours"] for x in parts)


def test_a_distillation_whose_optimiser_state_cannot_fit_is_not_run(monkeypatch):
    """16 B a parameter (fp32 weights, gradients, AdamW's two moments), FSDP2-sharded over the GPUs: Qwen3-8B's
    ~122 GiB exceed one 80 GB GPU (a row says how many it needs), Qwen3-4B's ~60 GiB do not; CPU checks nothing."""
    import argparse
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=79 << 30))
    short = cost_model.distill_memory_short
    assert "needs --gpus >= 2" in short(argparse.Namespace(shape="qwen3-8b", gpus=1), "distill", True)
    assert short(argparse.Namespace(shape="qwen3-8b", gpus=2), "distill", True) == ""
    assert short(argparse.Namespace(shape="qwen3-4b", gpus=1), "distill", True) == ""
    assert short(argparse.Namespace(shape="qwen3-8b", gpus=1), "scorer_only", True) == ""
    assert short(argparse.Namespace(shape="qwen3-8b", gpus=1), "distill", False) == ""


def test_a_pipeline_with_a_failed_stage_has_no_total():
    rows = cost_model.gpu_hours({"precompute": 10.0, "train_scorer_only": 5.0}, 1e6)
    assert {p["pipeline"] for p in cost_model.pipelines_cost(rows)} == {"precompute + scorer_only"}


@pytest.mark.parametrize("argv, message", [
    (["--shape", "tiny-qwen3-4b", "--device", "cpu", "--set", "train.no_such_key=1", "--dry-plan"], "unknown key"),
    (["--shape", "tiny-qwen3-4b", "--device", "cpu", "--steps", "2", "--warmup-steps", "2"], "--warmup-steps"),
    (["--shape", "tiny-qwen3-4b", "--device", "cpu", "--efficiency", "1.5"], "--efficiency"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cost_model.main([*argv, "--work", str(tmp_path / "work")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "work").exists()


def test_cuda_is_refused_without_cuda(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_info:
        cost_model.main(["--shape", "tiny-qwen3-4b", "--device", "cuda", "--work", str(tmp_path / "work")])
    assert exit_info.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_dry_plan_runs_nothing(capsys, tmp_path):
    assert cost_model.main(["--shape", "qwen3-8b", "--dry-plan", "--work", str(tmp_path / "work")]) == {}
    out = capsys.readouterr().out
    assert '"hidden_size": 4096' in out and "S = 16384" in out and "s4-w256-k3836" in out
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert lines["train distill"].endswith(", activation checkpointing")  # on CUDA: what fits one GPU
    assert not lines["train scorer_only"].endswith("activation checkpointing")
    assert cost_model.main(["--shape", "qwen3-8b", "--dry-plan", "--no-activation-checkpointing",
                            "--work", str(tmp_path / "work")]) == {}
    assert "activation checkpointing" not in capsys.readouterr().out
    assert not (tmp_path / "work").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_qwen3_4b_shape_runs_every_stage(ray_cluster, smollm2_dir, tmp_path, monkeypatch):
    from pipelines import ledger, train
    from pipelines.models import SMOLLM2_NAME

    # The published run's MLflow store and experiment artifacts in tmp_path (the stages' runs share the store).
    home = tmp_path / "kvpop_home"
    (home / "models").mkdir(parents=True)
    (home / "models" / SMOLLM2_NAME).symlink_to(smollm2_dir, target_is_directory=True)
    monkeypatch.setenv("KVPOP_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    complete = train._complete_tracking

    def fail_after_distilling(cfg, run_id, final):  # as a disk filled by the final model would, after every step
        if cfg.train.mode == "distill":
            raise OSError("No space left on device")
        complete(cfg, run_id, final)

    monkeypatch.setattr(train, "_complete_tracking", fail_after_distilling)
    out = tmp_path / "result" / "cost_model_tiny.json"
    ledger_path = tmp_path / "ledger.jsonl"
    result = cost_model.main(["--shape", "tiny-qwen3-4b", "--device", "cpu", "--seq-len", "256", "--steps", "3",
                              "--warmup-steps", "1", "--contexts", "384", "--prefill-chunk", "128",
                              "--decode-steps", "2", "--work", str(tmp_path / "work"), "--out", str(out),
                              "--ledger", str(ledger_path),
                              "--set", "train.activation_checkpointing=true"])  # through Ray Train, both modes
    config = json.loads((tmp_path / "work" / "model" / "config.json").read_text())
    shape = cost_model.SHAPES["qwen3-4b"]
    assert config["model_type"] == "qwen3"
    assert (config["num_attention_heads"] // config["num_key_value_heads"]
            == shape["num_attention_heads"] // shape["num_key_value_heads"])
    assert (config["num_attention_heads"] * config["head_dim"] / config["hidden_size"]
            == shape["num_attention_heads"] * shape["head_dim"] / shape["hidden_size"])

    stages = {s["stage"]: s for s in result["stages"]}
    assert set(stages) == {"precompute", "train_scorer_only", "train_distill"}
    for s in stages.values():
        assert "error" not in s, s
        assert math.isfinite(s["tokens_per_s_per_gpu"]) and s["tokens_per_s_per_gpu"] > 0
        assert s["wall_s"] > 0 and s["peak_gib"] is None  # no GPU memory on CPU
    assert stages["precompute"]["timed_tokens"] == 2 * 256  # 3 shards on one actor, its first one left out
    for mode in cost_model.TRAIN_MODES:
        s = stages[f"train_{mode}"]
        assert s["timed_steps"] == 2 and s["tokens_per_s_per_gpu"] == pytest.approx(256 / s["step_s"])
        assert s["activation_checkpointing"] is True
    assert "failed_after_steps" not in stages["train_scorer_only"]
    assert "No space left" in stages["train_distill"]["failed_after_steps"]
    assert not (tmp_path / "work" / "home" / "runs" / "cost-tiny-qwen3-4b-distill").exists()  # its disk given back

    rates = {name: s["tokens_per_s_per_gpu"] for name, s in stages.items()}
    assert len(result["hours"]) == len(rates) * len(cost_model.GPU_COUNTS)
    for r in result["hours"]:
        assert math.isfinite(r["hours"]) and r["hours"] > 0 and r["gpu_hours"] > 0
        assert r["hours"] == pytest.approx(_hours_reference(rates[r["stage"]], 2e9, r["gpus"], 1.0))
    _check_pipelines(result["hours"], result["pipelines"])

    (row,) = result["serving"]
    assert row["context"] == 384 and "error" not in row
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("prefill_s", "prefill_tokens_per_s",
                                                              "decode_ms_per_token", "decode_tokens_per_s"))

    saved = json.loads(out.read_text())
    assert saved["run_id"] == result["run_id"] and saved["commit"] == ledger.git_commit()
    markdown = out.with_suffix(".md").read_text()
    assert "failed after its steps: OSError: No space left on device" in markdown
    assert "none, fp32; activation checkpointing" in markdown
    assert "| precompute + distill | 64 |" in markdown and "Reproduce: `python benchmarks/cost_model.py" in markdown

    (line,) = ledger.read(ledger_path)  # the shared publishing path: one ledger line, its id the MLflow run's
    assert (line.run_id, line.name, line.kind) == (result["run_id"], "cost_model/tiny", "benchmark")
    assert line.params["shape"] == "tiny-qwen3-4b" and line.params["seq_len"] == 256
    assert {k: line.tags[k] for k in ("commit", "config_hash", "device", "dtype", "produced_by")} == {
        "commit": result["commit"], "config_hash": result["config_hash"], "device": result["device"],
        "dtype": "float32", "produced_by": "benchmarks/cost_model.py"}
    assert line.metrics == {k: ledger.Metric(v["value"]) for k, v in ledger.cost_model_metrics(result)[1].items()}
    assert line.metrics["stage/train_distill/tokens_per_s_per_gpu"].value == pytest.approx(rates["train_distill"])
    assert line.metrics["serving/ctx384/decode_tokens_per_s"].value == row["decode_tokens_per_s"]
    assert "pipeline/precompute_distill/gpus64/gpu_hours" in line.metrics

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "cost_model/tiny"
    assert {k: run.data.tags[f"kvpop.{k}"] for k in line.tags} == line.tags
    assert json.loads(run.data.params["shape"]) == "tiny-qwen3-4b"
    assert run.data.metrics == {k: m.value for k, m in line.metrics.items()}
    assert sorted(f.path for f in client.list_artifacts(run.info.run_id, "result")) == [
        "result/cost_model_tiny.json", "result/cost_model_tiny.md"]


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_the_built_models(tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {**cost_model.SHAPES["tiny-qwen3-4b"], "tie_word_embeddings": tied}
    model = Qwen3ForCausalLM(Qwen3Config(**shape))
    assert cost_model.parameter_count(shape) == sum(p.numel() for p in model.parameters())
