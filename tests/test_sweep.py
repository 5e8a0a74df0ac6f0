"""pipelines.sweep: Ray Tune over TorchTrainer trials (Train V2 pattern), ASHA, nested MLflow runs, the best preset."""
from __future__ import annotations

import time

import pytest

from pipelines import sweep
from pipelines.config import ConfigError, load_config
from pipelines.store import TargetsError
from tests.pipeline_helpers import tiny_config

pytestmark = pytest.mark.pretrained  # the tiny teachers use SmolLM2's tokenizer

SWEEP = ["train.num_workers=1", "train.cpus_per_worker=1", "train.batch_size=2", "train.checkpoint_every=4",
         "train.lr=0.01", "sweep.scorers=[mlp, mlstm]", "sweep.budgets=[[4, 16, 8]]", "sweep.steps=4",
         "sweep.grace_period=2", "sweep.reduction_factor=2", "sweep.max_concurrent_trials=2", "sweep.metric=kl"]
# one trial after the other, the second with a learning rate so large that it diverges: at the grace period (step 2)
# ASHA compares it with the first one's value at step 2 and stops it (deterministic)
EARLY_STOP = ["sweep.scorers=[mlstm]", "sweep.lrs=[1e-07, 1.0]", "sweep.metric=ret_loss",
              "sweep.max_concurrent_trials=1"]


@pytest.mark.ray
def test_placement_groups_a_stopped_trial_leaves_are_released_and_no_others(ray_cluster):
    """What a killed TorchTrainer controller leaves behind (its worker group's placement group, which Ray Train's own
    cleaner fails to remove where the state API does not answer) is removed; groups from before the sweep stay."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    def free_cpus(expected: float) -> float:  # the raylet returns a removed group's resources a moment later
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        return ray.available_resources().get("CPU", 0)

    free = ray.available_resources().get("CPU", 0)
    kept = placement_group([{"CPU": 1}])
    ray.get(kept.ready(), timeout=60)
    before = sweep.live_placement_groups()
    left = placement_group([{"CPU": 1}])
    ray.get(left.ready(), timeout=60)
    try:
        assert sweep.release_placement_groups(before) == [left.id.hex()]
        assert sweep.live_placement_groups() == before and kept.id.hex() in before
        assert free_cpus(free - 1) == free - 1  # the released group's CPU is back, the kept one's is not
        assert sweep.release_placement_groups(before) == []
    finally:
        remove_placement_group(kept)
    assert free_cpus(free) == free


def test_grid_and_sampled_learning_rates():
    cfg = load_config(None, ["sweep.scorers=[mlp, mlstm, mlstm_immediate]", "sweep.lrs=[0.01, 0.001]",
                             "sweep.budgets=[[4, 32, 96], [4, 64, 64]]", "precompute.windows=[32, 64]",
                             "sweep.grid={train.beta: [0.5, 1.0]}"])
    points = sweep.variants(cfg)
    assert len(points) == 3 * 2 * 2 * 2
    assert points[0] == {"train.scorer": "mlp", "train.lr": 0.01, "budget.sink": 4, "budget.window": 32,
                         "budget.topk": 96, "train.beta": 0.5}
    assert sweep.variant_label(points[0]) == "mlp-s4-w32-k96-lr0.01-beta0.5"
    ranged = load_config(None, ["sweep.scorers=[mlp]", "sweep.lr_range=[0.0001, 0.01]", "sweep.num_samples=3"])
    assert sweep.variants(ranged) == [{"train.scorer": "mlp", "budget.sink": 4, "budget.window": 64,
                                       "budget.topk": 32}]
    assert sweep.trial_overrides({"variant": sweep.variants(ranged)[0], "lr": 0.002})["train.lr"] == 0.002
    best = sweep.best_config(ranged, {"train.scorer": "mlp", "train.lr": 0.002, "budget.topk": 64})
    assert (best.train.scorer, best.train.lr, best.budget.topk, best.train.steps) == ("mlp", 0.002, 64, 90)


@pytest.mark.parametrize("overrides, message", [
    (["sweep.num_samples=4"], "repeats identical trials"),
    (["sweep.lrs=[0.01]", "sweep.lr_range=[0.001, 0.1]"], "exclude each other"),
    (["sweep.scorers=[lstm]"], "unknown scorer 'lstm'"),
    (["sweep.metric=accuracy"], "sweep.metric must be one of"),
    (["sweep.grace_period=30"], "grace_period must be between 1 and sweep.steps"),
    (["sweep.grid={train.steps: [5, 10]}"], "set by the sweep itself"),
    (["sweep.grid={budget.sink: [1, 2]}"], "not a train.\\* key"),
])
def test_bad_sweep_sections_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_plan_needs_targets_for_every_window_and_writes_nothing(tiny_targets, tiny_setup, tmp_path):
    home = tmp_path / "home"
    # a window outside precompute.windows: refused from the config alone
    cfg = tiny_config(tiny_setup, home, *SWEEP, "sweep.budgets=[[4, 8, 16], [4, 32, 8]]")
    with pytest.raises(ConfigError, match="windows \\[32\\] that precompute.windows=\\[8, 16\\] does not cover"):
        sweep.plan(cfg)
    # in precompute.windows, but the (explicit) targets were computed without it
    cfg = tiny_config(tiny_setup, home, *SWEEP, "sweep.budgets=[[4, 32, 8]]", "precompute.windows=[8, 16, 32]",
                      f"train.targets={tiny_targets[1].path}")
    with pytest.raises(TargetsError, match="the sweep also needs \\[32\\]"):
        sweep.plan(cfg)
    # a grid value that breaks a trial's config: named by trial
    cfg = tiny_config(tiny_setup, tiny_targets[0].home_dir(), *SWEEP, "sweep.budgets=[[4, 16, 60]]")
    with pytest.raises(ConfigError, match="sweep trial mlp-s4-w16-k60-lr0.01: budget .* more than data.seq_len"):
        sweep.plan(cfg)
    ok = sweep.plan(tiny_config(tiny_setup, tiny_targets[0].home_dir(), *SWEEP))
    assert ok.trials == 2 and ok.concurrent == 2 and ok.base["train"]["steps"] == 4
    assert not ok.root.exists()
    assert not any(p for p in home.rglob("*") if p.is_file() and p.parent.name != "cache")


# the sweep in its own driver, killed once every trial has ended (crash point sweep.trials_done, right after the
# placement groups of stopped trials were released): it prints what is left of the trials' placement groups there
KILLED_SWEEP = """
import json, sys
from pipelines import sweep
from pipelines.config import config_from_dict

release = sweep.release_placement_groups


def released_and_checked(before, *args, **kwargs):
    released = release(before, *args, **kwargs)
    print("placement groups left by the trials:", sorted(sweep.live_placement_groups() - before), flush=True)
    return released


sweep.release_placement_groups = released_and_checked
sweep.run(config_from_dict(json.loads(sys.argv[1])))
"""


@pytest.mark.ray
@pytest.mark.slow
def test_two_trial_sweep_asha_nested_mlflow_runs_best_preset_and_a_kill_before_the_preset(tiny_targets, tiny_setup,
                                                                                         ray_cluster):
    """Two trials, one after the other, the second diverging: ASHA stops it at the grace period. The driver is killed
    once both have ended (before best.yaml): the re-run restores the Tune experiment into the same parent MLflow run
    without training any trial again — one parent, one child per trial, one best.yaml — and a third run is refused."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mlflow

    from pipelines import records

    cfg = tiny_config(tiny_setup, tiny_targets[0].home_dir(), *SWEEP, *EARLY_STOP, "sweep.name=two-trials")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RAY_ADDRESS": ray_cluster,
           records.CRASH_ENV: "sweep.trials_done"}
    killed = subprocess.run([sys.executable, "-c", KILLED_SWEEP, json.dumps(cfg.to_dict())], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == records.CRASH_EXIT_CODE, killed.stderr[-3000:]
    # nothing of the trials outlived them: the stopped trial's worker group no longer held its CPU (it held it for
    # good on the H200, where the train stage after an in-pipeline sweep then never got the GPU)
    assert "placement groups left by the trials: []" in killed.stdout, killed.stdout[-3000:]
    root = sweep.sweep_root(cfg) / "two-trials"
    assert sweep.killed_sweep(root) and sweep.plan(cfg).resume
    client = mlflow.MlflowClient(cfg.tracking_uri())
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    trial_runs = "tags.`kvpop.stage` = 'sweep-trial' and tags.`kvpop.sweep` = 'two-trials'"
    children_before = {c.info.run_id for c in client.search_runs([experiment], filter_string=trial_runs)}
    assert len(children_before) == 2

    result = sweep.run(cfg)
    # Tune's view: the first trial ran its 4 steps, ASHA stopped the diverging one at the grace period
    rows = {t["overrides"]["train.lr"]: t for t in result.trials}
    assert set(rows) == {1e-07, 1.0}
    assert (rows[1e-07]["status"], rows[1e-07]["steps"], rows[1e-07]["early_stopped"]) == ("FINISHED", 4, False)
    assert (rows[1.0]["status"], rows[1.0]["steps"], rows[1.0]["early_stopped"]) == ("KILLED", 2, True)

    # the best config: a loadable preset, the winner's variant on the input config (train.steps kept)
    assert result.best_path == result.root / "best.yaml" == root / "best.yaml" and result.best_path.is_file()
    assert sorted(p.name for p in root.glob("*.yaml")) == ["best.yaml"]
    best = load_config(result.best_path)
    assert best == result.best_config
    assert (best.train.scorer, best.train.lr, best.budget.sink, best.budget.window, best.budget.topk) == \
        ("mlstm", 1e-07, 4, 16, 8)
    assert best.train.steps == cfg.train.steps and best.train.targets == "" and best.name == cfg.name

    # one parent run (the killed driver's, resumed), two children with the trial config as params and per-step
    # metric histories, none of them trained again
    parents = client.search_runs([experiment], filter_string="tags.mlflow.runName = 'two-trials' and "
                                                             "tags.`kvpop.stage` = 'sweep'")
    assert [r.info.run_id for r in parents] == [result.parent_run_id]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["kvpop.stage"] == "sweep"
    assert parent.data.metrics["best.ret_loss"] == pytest.approx(result.best_value)
    assert parent.data.metrics["trials.early_stopped"] == 1 and parent.data.metrics["trials.finished"] == 1
    assert parent.data.tags["kvpop.best_run_id"] == result.best_run_id == rows[1e-07]["run_id"]
    artifacts = {a.path for a in client.list_artifacts(result.parent_run_id, "sweep")}
    assert {"sweep/best.yaml", "sweep/trials.json"} <= artifacts
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert {c.info.run_id for c in children} == {rows[1e-07]["run_id"], rows[1.0]["run_id"]} == children_before
    for child in children:
        lr = float(child.data.params["train.lr"])
        assert child.data.params["train.scorer"] == "mlstm" and child.data.params["budget.window"] == "16"
        assert child.data.params["train.steps"] == "4"
        assert child.data.tags["kvpop.stage"] == "sweep-trial" and child.data.tags["kvpop.sweep"] == "two-trials"
        assert child.data.tags["kvpop.trial_id"] == rows[lr]["trial_id"]
        assert child.info.status == rows[lr]["status"]
        assert child.data.tags["kvpop.early_stopped"] == ("true" if lr == 1.0 else "false")
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "ret_loss")]
        assert steps[:2] == [1, 2]  # a stopped trial may log a step or two more while its actors go
        for key in ("kl", "boundary_acc", "loss", "tokens_per_s"):
            assert client.get_metric_history(child.info.run_id, key)
    assert [m.step for m in client.get_metric_history(result.best_run_id, "ret_loss")] == [1, 2, 3, 4]  # once
    with pytest.raises(ConfigError, match="already exists"):
        sweep.plan(cfg)
