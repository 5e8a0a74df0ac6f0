"""pipelines.train: Ray Train (V2) + FSDP2 on CPU, DCP checkpoints, resume by run name, MLflow, input validation."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipelines import precompute, tracking, train
from pipelines.config import ConfigError
from tests.pipeline_helpers import tiny_config

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer

TRAIN = ["train.scorer=mlstm", "train.lr=0.01", "train.steps=6", "train.checkpoint_every=2", "train.batch_size=2",
         "train.num_workers=2", "train.cpus_per_worker=1", "train.max_failures=0"]


def _boundary_loss(model, rows: dict, cfg) -> float:
    batch = {k: torch.tensor(v) for k, v in rows.items()}
    with torch.no_grad():
        return train.step_losses(model, batch, cfg)["ret_loss"].item()


@pytest.mark.ray
@pytest.mark.slow
def test_training_resumes_by_name_after_a_crash_learns_and_is_tracked(tiny_targets, tiny_setup):
    import mlflow

    import kvpop

    cfg = tiny_config(tiny_setup, tiny_targets[0].home_dir(), *TRAIN, "train.fail_at_step=3")
    assert train._strategy(cfg) == ("fsdp", "fp32")  # 2 CPU workers: FSDP2 over gloo
    # 1. the run dies at step 3, after the checkpoint of step 2 (max_failures=0: no restart inside the run)
    with pytest.raises(Exception, match="fault injected at step 3"):
        train.run(cfg)
    name = train.run_name_of(cfg)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    run_id = tracking.find_run(cfg, name, "train")
    assert client.get_run(run_id).info.status == "FAILED"
    assert not (train.runs_root(cfg) / name / train.FINAL_MODEL).exists()

    # 2. the same config again: Ray Train V2 finds the run by (name, storage_path) and hands over the checkpoint
    result = train.run(cfg)
    assert result.run_name == name and result.mlflow_run_id == run_id
    assert result.resumed_from == 2 and result.metrics["step"] == 6

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.01" and run.data.params["budget.topk"] == "16"
    history = client.get_metric_history(run_id, "ret_loss")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5, 6]
    for key in ("kl", "boundary_acc", "tokens_per_s", "loss"):
        assert client.get_metric_history(run_id, key)
    artifacts = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/kvpop.json", "model/kvpop_scorers.safetensors"} <= artifacts

    # 3. the trained scorers beat the untrained ones on the teacher's boundary decisions
    table = precompute.open_targets(tiny_targets[1].path).read_table()
    rows = {name: table.column(name).combine_chunks().to_numpy_ndarray()
            for name in ("input_ids", "targets_w8", "topk_values", "topk_indices")}
    trained, _ = kvpop.load_retrofitted(result.model_dir)
    untrained, _ = train.build_student(cfg, tiny_setup / "teacher")
    before, after = _boundary_loss(untrained, rows, cfg), _boundary_loss(trained, rows, cfg)
    assert after < 0.8 * before, (before, after)

    # 4. a finished run is not trained again
    again = train.run(cfg)
    assert again.model_dir == result.model_dir and again.mlflow_run_id == run_id


def _copy_targets(tiny_targets, tmp_path):
    copy = tmp_path / "targets"
    shutil.copytree(tiny_targets[1].path, copy)
    return copy


def _rewrite_manifest_entry(folder, shard: int) -> None:
    records = precompute.read_manifest(folder)
    file = folder / precompute.SHARDS / records[shard]["file"]
    records[shard].update(bytes=file.stat().st_size, sha256=precompute._sha256(file))
    (folder / precompute.MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in records.values()))


@pytest.mark.parametrize("case, message", [
    ("other_teacher", "another teacher"),
    ("seq_len", "sequences of 64 tokens"),
    ("window", "windows \\[8, 16\\]"),
    ("missing_column", "has no column 'topk_values'"),
    ("flipped_bytes", "corrupt"),
    ("truncated", "corrupt"),
    ("incomplete", "incomplete \\(7 of 8"),
    ("nothing", "no precomputed targets"),
    ("batch_too_large", "needs more than the 8 precomputed sequences"),
])
def test_bad_inputs_fail_before_training_and_write_nothing(tiny_targets, tiny_setup, tmp_path, case, message):
    import pyarrow.parquet as pq

    folder = _copy_targets(tiny_targets, tmp_path)
    extra = []
    shard0 = folder / precompute.SHARDS / precompute.shard_name(0)
    if case == "other_teacher":
        extra = [f"model.path={tiny_setup / 'other_teacher'}"]
    elif case == "seq_len":
        extra = ["data.seq_len=128"]
    elif case == "window":
        extra = ["budget.window=4", "precompute.windows=[4]"]
    elif case == "missing_column":
        pq.write_table(pq.read_table(shard0).drop_columns(["topk_values"]), shard0)
        _rewrite_manifest_entry(folder, 0)
    elif case == "flipped_bytes":
        data = bytearray(shard0.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard0.write_bytes(bytes(data))
    elif case == "truncated":
        shard0.write_bytes(shard0.read_bytes()[: shard0.stat().st_size // 2])
    elif case == "incomplete":
        lines = (folder / precompute.MANIFEST).read_text().splitlines()
        (folder / precompute.MANIFEST).write_text("\n".join(lines[:-1]) + "\n")
    elif case == "nothing":
        folder = tmp_path / "nothing"
    elif case == "batch_too_large":
        extra = ["train.batch_size=5", "train.num_workers=2"]
    home = tmp_path / "home"
    cfg = tiny_config(tiny_setup, home, f"train.targets={folder}", "train.steps=2", *extra)
    with pytest.raises((precompute.TargetsError, ConfigError), match=message) as err:
        train.run(cfg)
    assert "\n" not in str(err.value)
    assert not (home / "runs").exists() and not (home / "mlflow.db").exists()
