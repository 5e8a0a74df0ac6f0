"""pipelines.train: Ray Train (V2) + FSDP2 on CPU, DCP checkpoints, resume by run name, MLflow committed exactly once,
the train record, input validation."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvpop
from kvpop.dms import CompressionSchedule
from kvpop.files import sha256_file, tensors_digest
from kvpop.objective import DMSObjective
from kvpop.sharding import decoder_layers
from pipelines import records, store, tracking, train
from pipelines.config import ConfigError
from pipelines.train_worker import (TRAIN_MARKER, TrainSpec, batch_losses, build_student, start_student,
                                    write_final_model)
from tests.pipeline_helpers import tiny_config

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer

TRAIN = ["train.scorer=mlstm", "train.lr=0.01", "train.steps=6", "train.checkpoint_every=2", "train.batch_size=2",
         "train.num_workers=2", "train.cpus_per_worker=1", "train.max_failures=0"]


def _boundary_loss(model, rows: dict, spec) -> float:
    batch = {k: torch.tensor(v) for k, v in rows.items()}
    with torch.no_grad():
        return batch_losses(model, batch, spec)["ret_loss"].item()


@pytest.mark.ray
@pytest.mark.slow
def test_training_resumes_by_name_after_a_crash_learns_and_is_tracked(tiny_targets, tiny_setup):
    import mlflow

    cfg = tiny_config(tiny_setup, tiny_targets[0].home_dir(), *TRAIN, "train.fail_at_step=4")
    assert (cfg.train.resolved_strategy, cfg.train.resolved_precision) == ("fsdp", "fp32")  # FSDP2 over gloo
    # 1. the run dies at step 4, after the checkpoint of step 2 and step 3's metrics (max_failures=0: no restart
    # inside the run)
    with pytest.raises(Exception, match="fault injected at step 4"):
        train.run(cfg)
    targets = train.open_inputs(cfg)
    name = train.run_name_of(cfg, targets)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    run_id = tracking.find_run(cfg, name, "train")
    assert client.get_run(run_id).info.status == "FAILED"
    assert not (train.runs_root(cfg) / name / train.FINAL_MODEL).exists()
    assert records.for_config(cfg, "train") is None

    # 2. the same config again: Ray Train V2 finds the run by (name, storage_path) and hands over the checkpoint
    result = train.run(cfg)
    assert result.run_name == name and result.mlflow_run_id == run_id
    assert result.resumed_from == 2 and result.metrics["step"] == 6
    assert records.for_config(cfg, "train").payload == {
        "run_name": name, "model_dir": str(result.model_dir), "mlflow_run_id": run_id, "steps": 6,
        "targets": str(targets.path), "mode": "scorer_only", "policy": "kvpop"}

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.01" and run.data.params["budget.topk"] == "16"
    for key in ("ret_loss", "step_s"):  # step 3, replayed after the resume, once
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3, 4, 5, 6], key
    for key in ("kl", "boundary_acc", "tokens_per_s", "loss"):
        assert client.get_metric_history(run_id, key)
    # train_s: the worker's seconds across both starts — the restart adds its time to what the crashed one logged
    spent = {m.step: m.value for m in client.get_metric_history(run_id, "train_s")}
    step_s = {m.step: m.value for m in client.get_metric_history(run_id, "step_s")}
    assert sorted(spent) == [1, 2, 3, 4, 5, 6] and all(spent[i] < spent[i + 1] for i in range(1, 6)), spent
    assert spent[6] >= spent[3] + step_s[4] + step_s[5] + step_s[6], (spent, step_s)
    # the model artifact: scorers + kvpop.json + the base's identity, no second copy of the base weights
    artifacts = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/kvpop.json", "model/kvpop_scorers.safetensors"} <= artifacts
    assert not any(path.endswith(".safetensors") and "scorers" not in path for path in artifacts), artifacts
    meta = json.loads((result.model_dir / "kvpop.json").read_text())
    assert "path" not in meta["base"], "a portable artifact names its base by identity, not by a path"
    assert meta["base"]["weights_sha256"] == targets.identity["teacher"]["weights_sha256"]
    assert meta["base"]["tensors_sha256"] == tensors_digest(tiny_setup / "teacher")

    # 3. the trained scorers beat the untrained ones on the teacher's boundary decisions
    table = store.open_targets(tiny_targets[1].path).read_table()
    rows = {name: table.column(name).combine_chunks().to_numpy_ndarray()
            for name in ("input_ids", "targets_w8", "topk_values", "topk_indices")}
    spec = train.make_spec(cfg, targets, name, train.runs_root(cfg), run_id)
    trained, _ = kvpop.load_retrofitted(result.model_dir, base=tiny_setup / "teacher")
    untrained, _ = build_student(spec)
    before, after = _boundary_loss(untrained, rows, spec), _boundary_loss(trained, rows, spec)
    assert after < 0.8 * before, (before, after)

    # 4. a finished run is not trained again; fewer steps than it holds are refused, with nothing changed
    again = train.run(cfg)
    assert again.model_dir == result.model_dir and again.mlflow_run_id == run_id
    fewer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4))
    with pytest.raises(ConfigError, match=f"run {name} has already trained 6 steps and train.steps=4 asks for fewer"):
        train.run(fewer)
    assert records.for_config(cfg, "train").payload["steps"] == 6

    # 5. more steps on a damaged latest checkpoint: one line naming it and what to do, before anything starts; the
    # finished run, its model and its record stay as they were
    checkpoint = train.latest_checkpoint(result.run_dir)
    shard = next(checkpoint.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    with pytest.raises(ConfigError, match="truncated") as err:
        train.run(more)
    assert str(checkpoint) in str(err.value) and f"Delete {result.run_dir}" in str(err.value)
    assert client.get_run(run_id).info.status == "FINISHED" and records.for_config(cfg, "train").payload["steps"] == 6


def _driver(cfg, ray_address: str, crash_at: str, tmp_path) -> subprocess.CompletedProcess:
    """``train.run(cfg)`` in its own driver process that dies at ``crash_at`` (``os._exit``: nothing cleaned up).

    It joins the session's cluster through ``RAY_ADDRESS`` as a CLI does (``pipelines.cluster.ensure_ray``), when
    the stage needs Ray: a driver that only completes the commit does not connect (nor pay for it)."""
    script = tmp_path / "driver.py"
    script.write_text("import json, sys\nfrom pipelines import train\n"
                      "from pipelines.config import config_from_dict\n"
                      "train.run(config_from_dict(json.loads(sys.argv[1])))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), records.CRASH_ENV: crash_at, "RAY_ADDRESS": ray_address}
    return subprocess.run([sys.executable, str(script), json.dumps(cfg.to_dict())], env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_restart_carries_the_train_seconds_of_the_last_logged_step(tmp_path):
    """train_s continues from the value at the run's last logged step — the latest logging of it when a replayed step
    was logged twice — and from 0 on a fresh run."""
    import mlflow

    from pipelines.train_worker import _last_logged_value

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    assert _last_logged_value(client, run_id, "train_s") == 0.0
    for step, value, ms in ((1, 5.0, 1000), (2, 9.0, 2000), (3, 12.0, 3000), (2, 30.0, 4000)):
        client.log_metric(run_id, "train_s", value, timestamp=ms, step=step)
    assert _last_logged_value(client, run_id, "train_s") == 12.0
    client.log_metric(run_id, "train_s", 40.0, timestamp=5000, step=3)
    assert _last_logged_value(client, run_id, "train_s") == 40.0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("read_once", [True, False])
def test_training_rows_come_in_file_order_every_epoch(tiny_targets, monkeypatch, read_once):
    from ray.data import DataContext

    targets = store.open_targets(tiny_targets[1].path)
    if not read_once:
        monkeypatch.setattr(train, "READ_ONCE_BYTES", 0)
    dataset = train.training_dataset(targets, ["input_ids"], copies=3)
    assert not DataContext.get_current().execution_options.preserve_order  # the driver's context as it was
    got = [list(row["input_ids"][:8]) for row in dataset.iter_rows()]
    rows = [row[:8] for row in targets.read_table(["input_ids"]).column("input_ids").to_pylist()]
    assert got == rows * 3 and len(rows) == targets.num_rows


@pytest.mark.ray
@pytest.mark.slow
def test_the_mlflow_run_is_committed_exactly_once_whatever_point_the_driver_dies_at(
        tiny_targets, tiny_setup, tmp_path, ray_cluster, monkeypatch):
    import mlflow

    cfg = tiny_config(tiny_setup, tiny_targets[0].home_dir(), "train.scorer=mlp", "train.steps=2",
                      "train.checkpoint_every=2", "train.num_workers=1", "train.cpus_per_worker=1",
                      "train.run_name=exactly-once", "train.max_failures=0")
    client = mlflow.MlflowClient(cfg.tracking_uri())

    def state():
        runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id],
                                  filter_string="tags.mlflow.runName = 'exactly-once'")
        assert len(runs) == 1, f"{len(runs)} runs named exactly-once"
        artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id, "model")}
        return (runs[0].info.status, "model/kvpop.json" in artifacts, "kvpop.model_dir" in runs[0].data.tags,
                records.for_config(cfg, "train") is not None)

    # each crash point in turn; every re-run takes over where the last one died, and trains only once
    expected = {"train.fitted": ("RUNNING", False, False, False),
                "train.artifact_logged": ("RUNNING", True, False, False),
                "train.run_finished": ("FINISHED", True, True, False)}
    for point, after in expected.items():
        proc = _driver(cfg, ray_cluster, point, tmp_path)
        assert proc.returncode == records.CRASH_EXIT_CODE, proc.stderr[-3000:]
        assert state() == after, point
        output = proc.stdout + proc.stderr
        if point == "train.fitted":  # the only run that trains (on the session's cluster): one line per step
            assert output.count("[kvpop.train] step 1/2 ") == 1 and output.count("[kvpop.train] step 2/2 ") == 1, \
                output[-3000:]
            assert f"Connecting to existing Ray cluster at address: {ray_cluster}" in output, output[-3000:]
        else:
            assert "[kvpop.train] step" not in output and "completing its MLflow run" in output
    proc = _driver(cfg, ray_cluster, "", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert state() == ("FINISHED", True, True, True)
    run_id = records.for_config(cfg, "train").payload["mlflow_run_id"]
    assert client.get_run(run_id).info.run_name == "exactly-once"

    # evaluate finds the trained model from the record alone: no tokenizer, no weight hashing
    model_dir = Path(records.for_config(cfg, "train").payload["model_dir"])
    loaded, _ = kvpop.load_retrofitted(model_dir, base=cfg.model.resolved_path())
    assert loaded.kvpop_runtime.policy.budget == cfg.budget

    def refuse(*args, **kwargs):
        raise AssertionError("finding the trained model must not load a tokenizer nor hash weights")
    for target in ("transformers.AutoTokenizer.from_pretrained", "pipelines.data.load_tokenizer",
                   "pipelines.train.load_tokenizer", "pipelines.identity.weights_digest",
                   "pipelines.identity.file_digest", "kvpop.files.sha256_file", "kvpop.files.weights_digest"):
        monkeypatch.setattr(target, refuse)
    assert train.model_dir(cfg) == model_dir
    assert train.trained_model_record(cfg).payload["mlflow_run_id"] == run_id


def _copy_targets(tiny_targets, tmp_path):
    copy = tmp_path / "targets"
    shutil.copytree(tiny_targets[1].path, copy)
    return copy


def _rewrite_manifest_entry(folder, shard: int) -> None:
    records_ = store.read_manifest(folder)
    file = folder / store.SHARDS / records_[shard].file
    records_[shard] = dataclasses.replace(records_[shard], bytes=file.stat().st_size, sha256=sha256_file(file))
    (folder / store.MANIFEST).write_text("".join(r.to_json() + "\n" for r in records_.values()))


@pytest.mark.parametrize("case, message", [
    ("other_teacher", "another teacher"),
    ("seq_len", "sequences of 64 tokens"),
    ("window", "windows \\[8, 16\\], not budget.window=4"),
    ("top_k", "another precompute.top_k \\(8, this config: 4\\)"),
    ("data", "another data"),
    ("missing_column", "has no column 'topk_values'"),
    ("flipped_bytes", "corrupt"),
    ("truncated", "corrupt"),
    ("incomplete", "incomplete \\(7 of 8"),
    ("garbage_header", "is not a target header"),
    ("nothing", "no precomputed targets"),
    ("no_record", "no precomputed targets for config 'default' \\(no precompute record"),
    ("batch_too_large", "needs more than the 8 precomputed sequences"),
])
def test_bad_inputs_fail_before_training_and_write_nothing(tiny_targets, tiny_setup, tmp_path, case, message):
    import pyarrow.parquet as pq

    folder = _copy_targets(tiny_targets, tmp_path)
    extra = []
    shard0 = folder / store.SHARDS / store.shard_name(0)
    if case == "other_teacher":
        extra = [f"model.path={tiny_setup / 'other_teacher'}"]
    elif case == "seq_len":
        extra = ["data.seq_len=128"]
    elif case == "window":
        extra = ["budget.window=4", "precompute.windows=[4]"]
    elif case == "top_k":
        extra = ["precompute.top_k=4"]
    elif case == "data":
        extra = ["data.seed=3"]
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
        lines = (folder / store.MANIFEST).read_text().splitlines()
        (folder / store.MANIFEST).write_text("\n".join(lines[:-1]) + "\n")
    elif case == "garbage_header":
        (folder / store.HEADER).write_text("[1, 2")
    elif case == "nothing":
        folder = tmp_path / "nothing"
    elif case == "batch_too_large":
        extra = ["train.batch_size=5", "train.num_workers=2"]
    home = tmp_path / "home"
    targets = [] if case == "no_record" else [f"train.targets={folder}"]
    cfg = tiny_config(tiny_setup, home, *targets, "train.steps=2", *extra)
    with pytest.raises(ConfigError, match=message) as err:
        train.run(cfg)
    assert "\n" not in str(err.value)
    assert not (home / "runs").exists() and not (home / "mlflow.db").exists() and not (home / "records").exists()


def _spec(tmp_path, mode: str) -> TrainSpec:
    from kvpop.objective import Objective

    return TrainSpec(run_name="r", run_dir=str(tmp_path / "r"), base_path=str(tmp_path / "base"),
                     base_sha256=kvpop.files.weights_digest(tmp_path / "base"),
                     objective=Objective(kvpop.Budget(2, 4, 6)), policy="kvpop", scorer="mlp", scorer_options={}, mode=mode,
                     target_column="targets_w4", lr=0.01, base_lr=1e-5, grad_clip=1.0, steps=3, batch_size=1,
                     seq_len=32, seed=0, use_gpu=False, sharded=False, bf16=False, threads=1, checkpoint_every=1,
                     log_every=1, fail_at_step=0, tracking_uri="", mlflow_run_id="")


@pytest.mark.parametrize("mode", ["scorer_only", "distill"])
def test_the_final_model_stores_base_weights_only_when_they_trained(tmp_path, tiny_setup, mode):
    shutil.copytree(tiny_setup / "teacher", tmp_path / "base")
    spec = _spec(tmp_path, mode)
    model, tokenizer = build_student(spec)
    trained = model.parameters() if mode == "distill" else kvpop.scorers(model).parameters()
    with torch.no_grad():
        for p in trained:
            p.add_(0.01)  # the scorers (and, distilling, the base) moved away from what was loaded
    out = tmp_path / "r" / "final_model"
    write_final_model(model, out, tokenizer, spec, steps=3)
    assert json.loads((out / TRAIN_MARKER).read_text())["steps"] == 3
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    if mode == "distill":
        assert weights == ["kvpop_scorers.safetensors", "model.safetensors"]
    else:
        assert weights == ["kvpop_scorers.safetensors"]
    loaded, loaded_tokenizer = kvpop.load_retrofitted(out, base=tmp_path / "base")
    assert loaded_tokenizer is not None
    ids = torch.randint(1, 100, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_the_configs_activation_checkpointing_reaches_the_workers(tiny_setup, tmp_path):
    stand_in = SimpleNamespace(identity={"teacher": {"weights_sha256": "0" * 64}})  # stored targets' identity
    for value in (True, False):
        cfg = tiny_config(tiny_setup, tmp_path, f"train.activation_checkpointing={str(value).lower()}")
        assert train.make_spec(cfg, stand_in, "r", tmp_path, "").activation_checkpointing is value


@pytest.mark.parametrize("policy, mode", [("kvpop", "distill"), ("kvpop", "scorer_only"), ("dms", "scorer_only")])
def test_activation_checkpointing_gives_the_same_step_and_replays_every_layer(tmp_path, tiny_setup, policy, mode):
    """``train.activation_checkpointing``: the worker's student (:func:`start_student`) gives the same loss and
    gradients on one batch with its decoder layers checkpointed as without — the scorers' gradients of a frozen base
    and DMS's noisy gates (the replay draws the same noise) included — and the backward runs each layer's attention
    again."""
    shutil.copytree(tiny_setup / "teacher", tmp_path / "base")
    spec = _spec(tmp_path, mode)
    if policy == "dms":
        spec = dataclasses.replace(spec, policy="dms", scorer="dms", target_column="",
                                   objective=DMSObjective(kvpop.Budget(2, 4, 0), CompressionSchedule(0.5, 2, 3)))
    generator = torch.Generator().manual_seed(0)
    values, indices = torch.randn(2, 32, 100, generator=generator).topk(8, dim=-1)
    batch = {"input_ids": torch.randint(1, 100, (2, 32), generator=generator), "topk_values": values,
             "topk_indices": indices, "targets_w4": torch.randn(2, 2, 2, 32, generator=generator)}  # [B, L, Hkv, S]
    steps = {}
    for checkpointed in (False, True):
        model, *_ = start_student(dataclasses.replace(spec, activation_checkpointing=checkpointed), "cpu")
        calls = []
        for layer in decoder_layers(model):
            layer.self_attn.register_forward_pre_hook(lambda *_: calls.append(1))  # a replay may stop inside it
        torch.manual_seed(1)  # DMS's Gumbel noise: the same draws in both runs
        parts = batch_losses(model, batch, spec, step=1)
        assert len(calls) == 2  # one forward of each layer
        parts["loss"].backward()
        assert len(calls) == (4 if checkpointed else 2)  # checkpointed: each layer again in the backward
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        steps[checkpointed] = {k: v.detach() for k, v in parts.items()}, grads
    (plain, plain_grads), (replayed, replayed_grads) = steps[False], steps[True]
    assert plain.keys() == replayed.keys() and all(torch.equal(plain[k], replayed[k]) for k in plain)
    trained = {n for n in plain_grads if mode == "distill" or ".kvpop_scorer." in n}
    assert replayed_grads.keys() == plain_grads.keys() == trained and trained
    for name, grad in plain_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(replayed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_workers_must_leave_ray_data_a_cpu(monkeypatch):
    import ray

    from pipelines.cluster import require_resources

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "GPU": 1.0})
    require_resources("2 workers × 1.5 CPUs", 3.0, 1)
    with pytest.raises(ConfigError, match="2 workers × 2 CPUs = 4 CPUs leaves none of the cluster's 4 to Ray Data"):
        require_resources("2 workers × 2 CPUs", 4.0)
    with pytest.raises(ConfigError, match="needs 2 GPUs; the cluster has 1"):
        require_resources("2 GPU workers", 2.0, 2)


def test_the_configs_extra_topks_reach_the_workers_objective(tiny_targets, tmp_path):
    """``train.extra_topks`` (e.g. ``[124, 508]``: the boundary loss at more budgets) is in the objective the workers
    train with, and names the run apart from the same config without it."""
    cfg, result = tiny_targets
    multi = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, extra_topks=(3, 12)))
    targets = store.open_targets(result.path)
    spec = train.make_spec(multi, targets, "multi", tmp_path, "")
    assert spec.objective.extra_topks == (3, 12) and spec.objective.budget == cfg.budget
    assert train.run_name_of(multi, targets) != train.run_name_of(cfg, targets)


def test_the_configs_scorer_options_reach_the_trained_student(tiny_targets, tmp_path):
    """``train.scorer_options`` (e.g. ``features: kv_norms``) is what the workers
    retrofit the student with."""
    cfg, result = tiny_targets
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, scorer_options={"features": "kv_norms"}))
    spec = train.make_spec(cfg, store.open_targets(result.path), "options", tmp_path, "")
    model, _ = build_student(spec)
    assert {s.config.features for s in kvpop.scorers(model)} == {"kv_norms"}
    assert all(s.in_features == 2 * s.head_dim + 2 for s in kvpop.scorers(model))


def test_a_failure_while_a_finished_run_trains_further_leaves_it_finished(tmp_path, monkeypatch):
    import mlflow

    from pipelines.config import config_from_dict

    cfg = config_from_dict({"home": str(tmp_path), "tracking": {"experiment": "tests"}})
    client = mlflow.MlflowClient(cfg.tracking_uri())
    finished, fresh = (tracking.create_run(cfg, name, stage="train", log_config=False) for name in ("a", "b"))
    client.set_terminated(finished, "FINISHED")

    class Broken:
        def fit(self):
            raise RuntimeError("out of memory")

    monkeypatch.setattr(train, "make_spec", lambda *args, **kwargs: None)
    monkeypatch.setattr(train, "make_trainer", lambda *args, **kwargs: Broken())
    for run_id, status in ((finished, "FINISHED"), (fresh, "FAILED")):
        with pytest.raises(RuntimeError, match="out of memory"):
            train._fit(cfg, None, "a", run_id)
        assert client.get_run(run_id).info.status == status
