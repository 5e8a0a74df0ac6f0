"""Stage 2b: a Ray Tune sweep over training variants, each trial a Ray Train run, tracked as nested MLflow runs.

**Grid.** ``sweep.scorers × sweep.lrs × sweep.budgets × sweep.grid`` (an empty axis is the config's own value), or
``train.lr`` drawn log-uniformly from ``sweep.lr_range`` (``sweep.num_samples`` draws per point). A trial is the input
config with its variant applied, ``train.steps = sweep.steps``, the verified targets and its own storage. Per-head
budgets (METHOD §7): ``train.allocation`` and ``allocate.mode`` may be grid keys, ``sweep.budgets`` the mean budgets;
each trial training at its allocation gets it from the allocate stage, run in the driver before Tune
(:func:`allocate_trials`).

**Before anything is written** (:func:`plan`): every trial's config is built and validated; the targets (the
precompute record's, or ``train.targets``) must match the config and hold a target column for every window the sweep
uses (targets depend on the window only, METHOD §2). Then, on the joined cluster, ``min(max_concurrent_trials,
trials)`` trials must fit with a CPU left for Ray Data.

**Trials.** A Tune function trainable per trial (the Ray Train V2 pattern; ``Tuner(TorchTrainer)`` is gone) builds
the train stage's trainer (:func:`pipelines.train.make_spec`, :func:`pipelines.train.make_trainer`) with Tune's
``TuneReportCallback`` and a report every step, and writes no final model. ASHA (``time_attr="step"``,
``sweep.grace_period``, ``sweep.reduction_factor``, ``sweep.metric``/``sweep.mode``) stops weaker trials by ending
their actors (``reuse_actors`` off: a reused actor would keep a stopped trial's training alive); a trial that reaches
``sweep.steps`` ends by returning. When the last trial has ended, the placement groups stopped trials left behind are
removed (:func:`release_placement_groups`): nothing of the sweep holds a GPU or CPU when the next stage starts.

**MLflow.** One parent run (stage ``sweep``) and a child run per trial (``mlflow.parentRunId``, the trial config as
params, per-step histories). After the sweep every child run is closed from Tune's view of its trial: ``FINISHED``,
``FAILED`` (tag ``kvpop.error``) or ``KILLED`` with ``kvpop.early_stopped=true``.

**Best config.** The trial with the best last ``sweep.metric`` gives the input config its scorer, lr, budget and grid
values (``train.steps`` unchanged): a loadable preset ``<sweep dir>/best.yaml``, logged to the parent run with
``sweep/trials.json``. The sweep directory is ``sweep.output_root`` (default ``$KVPOP_HOME/sweeps``)
``/<sweep name>/``, also Tune's experiment directory; an existing one is refused rather than mixed into, except a
killed one.

**Resuming.** A sweep directory that holds Tune's experiment state but no ``best.yaml`` is a sweep killed before it
finished: running the same ``sweep.name`` again restores it (``Tuner.restore``: finished trials are not run again)
into its own parent MLflow run, so a re-run ends with one parent run, one child run per finished trial and one
``best.yaml``. Crash point (:func:`pipelines.records.crash_point`): ``sweep.trials_done`` (every trial ended,
before the trials are closed and ``best.yaml`` is written).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpop.files import atomic_write_text
from kvpop.objective import METRICS as OBJECTIVE_METRICS
from pipelines import allocate, records, store, tracking, train
from pipelines.cluster import ensure_ray, require_resources
from pipelines.config import ConfigError, PipelineConfig, apply_overrides, config_path, load_config
from pipelines.data import load_tokenizer

BEST_CONFIG = "best.yaml"
TRIALS_DIR = "trials"
DRIVER_CPUS = 0.01  # a trial's Tune actor only drives its TorchTrainer


# ------------------------------------------------------------------------------------------------ the search space
def sweep_root(cfg: PipelineConfig) -> Path:
    root = cfg.sweep.output_root
    return config_path(root).resolve() if root else cfg.home_dir() / "sweeps"


def variants(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """The grid points as dotted overrides (``{"train.scorer": …, "train.lr": …, "budget.sink": …, …}``), in order.

    ``train.lr`` is absent when ``sweep.lr_range`` samples it (:func:`trial_overrides` adds the draw).
    ``train.policy`` may be a grid key: a ``dms`` or ``streaming`` point trains no scorer, so it runs once whatever
    ``sweep.scorers`` holds, and ``sweep.metric`` must be one its objective reports (``loss``, ``kl``).
    ``allocate.mode`` applies to the points that train at an allocation (``train.allocation``): a uniform point runs
    once, without it.
    """
    sw = cfg.sweep
    scorers = sw.scorers or (cfg.train.scorer,)
    lrs = () if sw.lr_range else (sw.lrs or (cfg.train.lr,))
    budgets = sw.budgets or ((cfg.budget.sink, cfg.budget.window, cfg.budget.topk),)
    grid_keys = list(sw.grid)
    out = []
    for scorer, lr, budget, *extra in itertools.product(scorers, lrs or (None,), budgets,
                                                        *(sw.grid[k] for k in grid_keys)):
        point: dict[str, Any] = {"train.scorer": scorer}
        if lr is not None:
            point["train.lr"] = float(lr)
        point.update({"budget.sink": int(budget[0]), "budget.window": int(budget[1]), "budget.topk": int(budget[2])})
        point.update(dict(zip(grid_keys, extra)))
        if not point.get("train.allocation", cfg.train.allocation):  # a uniform point: no allocation mode to vary
            point.pop("allocate.mode", None)
            if point in out:
                continue
        policy = point.get("train.policy", cfg.train.policy)
        if sw.metric not in OBJECTIVE_METRICS.get(policy, (sw.metric,)):  # an unknown policy: the trial config says
            raise ConfigError(f"sweep.metric={sw.metric} is not reported by train.policy={policy} (it reports "
                              f"{', '.join(OBJECTIVE_METRICS[policy])}): use sweep.metric=kl or loss")
        if policy != "kvpop" and any(_same_but_scorer(point, seen) for seen in out):
            continue
        out.append(point)
    return out


def _same_but_scorer(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "train.scorer"} == {k: v for k, v in b.items() if k != "train.scorer"}


def trial_overrides(config: dict) -> dict[str, Any]:
    """A Tune trial's config (``{"variant": {...}, "lr": draw?}``) as dotted overrides."""
    overrides = dict(config["variant"])
    if "lr" in config:
        overrides["train.lr"] = float(config["lr"])
    return overrides


def variant_label(overrides: dict[str, Any]) -> str:
    """``mlp-s4-w16-k8-lr0.01`` (+ ``-beta0.5`` … for grid keys; ``-H-per_layer`` for a trial at the allocate
    stage's allocation in that mode, ``-uniform`` for one beside them): a readable trial name."""
    parts = [str(overrides["train.scorer"]),
             f"s{overrides['budget.sink']}-w{overrides['budget.window']}-k{overrides['budget.topk']}"]
    if "train.lr" in overrides:
        parts.append(f"lr{overrides['train.lr']:.3g}")
    for key, value in overrides.items():
        if key == "train.allocation":
            parts.append("uniform" if not value else "H" if value == "allocate" else f"H{Path(value).name}")
        elif key.startswith("train.") and key not in ("train.scorer", "train.lr"):
            parts.append(f"{key.split('.', 1)[1]}{value}")
        elif key == "allocate.mode":
            parts.append(str(value))
    return "-".join(parts)


def allocate_trials(p: "Plan") -> list:
    """The allocate stage for every trial that trains at its allocation (``train.allocation=allocate``: with
    ``sweep.budgets`` and ``allocate.mode`` in the grid, allocation mode × mean budget), in the driver before Tune
    (cheap, no Ray): each trial's train stage then finds its own allocate record. Returns the stage's results."""
    made = []
    for point in p.variants:
        overrides = {**point, **({"train.lr": float(p.cfg.sweep.lr_range[0])} if p.cfg.sweep.lr_range else {})}
        trial = apply_overrides(p.base, overrides)
        if trial.train.allocation == "allocate":
            made.append(allocate.run(trial))
    return made


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class Plan:
    cfg: PipelineConfig  # home resolved, absolute paths
    name: str
    root: Path  # the sweep directory (Tune's experiment directory)
    variants: list[dict]
    trials: int  # grid points × num_samples
    targets: Path
    base: dict  # the trials' common config tree (to_dict), before a variant's overrides
    resume: bool = False  # the sweep directory is a killed run of this sweep (see the module docstring)

    @property
    def concurrent(self) -> int:
        return min(self.cfg.sweep.max_concurrent_trials, self.trials)


def plan(cfg: PipelineConfig) -> Plan:
    """Everything the sweep will do, validated; writes nothing and starts no Ray (see the module docstring)."""
    cfg = dataclasses.replace(cfg, home=str(cfg.home_dir()))
    sw = cfg.sweep
    if cfg.train.online:
        raise ConfigError("the sweep's trials read precomputed targets: set train.targets_source=stored (and run the "
                          "precompute stage) to sweep")
    points = variants(cfg)
    if not points:
        raise ConfigError("the sweep has no trials: sweep.scorers, sweep.lrs or sweep.budgets is empty")

    # 1. every window the sweep uses must be precomputed (targets depend on the window only)
    windows = sorted({p["budget.window"] for p in points})
    missing = [w for w in windows if w not in cfg.precompute.windows]
    if missing:
        raise ConfigError(f"sweep.budgets use windows {missing} that precompute.windows={list(cfg.precompute.windows)} "
                          f"does not cover: add them to precompute.windows and run precompute again (targets depend "
                          f"on the window)")
    path = train.targets_path(cfg)
    targets = store.open_targets(path, expect=store.training_identity(cfg, load_tokenizer(cfg)))
    absent = [w for w in windows if w not in targets.identity["windows"]]
    if absent:
        raise store.TargetsError(f"the targets at {path} hold windows {targets.identity['windows']}, the sweep also "
                                 f"needs {absent}: precompute with precompute.windows containing them")

    # 2. every trial's config, built and validated now (a bad grid value fails here, not in trial 7)
    name = sw.name or f"{cfg.name}-sweep-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    root = sweep_root(cfg) / name
    resume = root.exists() and killed_sweep(root)
    if root.exists() and not resume:
        raise ConfigError(f"sweep directory {root} already exists: pick another sweep.name (or remove it)")
    base = cfg.to_dict()
    base["model"]["path"] = str(cfg.model.resolved_path())  # trials may run in another working directory,
    base["tracking"]["uri"] = cfg.tracking_uri()  # on another node, with another environment
    base["train"].update(steps=sw.steps, targets=str(targets.path), output_root=str(root / TRIALS_DIR), run_name="",
                         fail_at_step=0)
    for point in points:
        overrides = dict(point)
        if sw.lr_range:
            overrides["train.lr"] = float(sw.lr_range[0])
        label = variant_label(overrides)
        try:
            trial = apply_overrides(base, overrides)
        except ConfigError as err:
            raise ConfigError(f"sweep trial {label}: {err}") from None
        try:
            train.check_trainable(trial, targets.num_rows)
        except ConfigError as err:
            raise ConfigError(f"sweep trial {label}: {err}") from None
    return Plan(cfg, name, root, points, len(points) * sw.num_samples, targets.path, base, resume)


def killed_sweep(root: Path) -> bool:
    """Whether ``root`` is a sweep killed before its end: Tune's experiment state, no ``best.yaml``."""
    return not (root / BEST_CONFIG).exists() and any(root.glob("experiment_state-*.json"))


def _check_cluster(p: Plan) -> None:
    """The concurrent trials (their workers and drivers) must fit the cluster with a CPU left for Ray Data."""
    t = p.cfg.train
    workers = max(int(v.get("train.num_workers", t.num_workers)) for v in p.variants)
    per_trial = max(float(v.get("train.num_workers", t.num_workers)) * float(v.get("train.cpus_per_worker",
                                                                                   t.cpus_per_worker))
                    for v in p.variants) + DRIVER_CPUS
    require_resources(f"{p.concurrent} concurrent trials × (train.num_workers × train.cpus_per_worker + the trial "
                      f"driver) (lower sweep.max_concurrent_trials or the workers' CPUs)", p.concurrent * per_trial,
                      workers if t.use_gpu else 0)


# ------------------------------------------------------------------------------------------------ one trial
def _trial(config: dict, *, base: dict, info: dict) -> None:
    """The Tune function trainable: one trial = one TorchTrainer run, reported to Tune step by step."""
    import mlflow
    import ray.exceptions
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    overrides = trial_overrides(config)
    cfg = apply_overrides(base, overrides)
    trial_id = ray.tune.get_context().get_trial_id()
    label = variant_label(overrides)
    run_id = tracking.create_run(cfg, f"{label}-{trial_id}", stage="sweep-trial", parent_run_id=info["parent_run_id"],
                                 tags={"kvpop.sweep": info["name"], "kvpop.trial_id": trial_id,
                                       "kvpop.variant": label})
    client = mlflow.MlflowClient(cfg.tracking_uri())
    try:
        targets = store.open_targets(cfg.train.targets, verify=False)  # verified by the driver's plan
        client.set_tag(run_id, "kvpop.strategy", cfg.train.resolved_strategy)
        client.set_tag(run_id, "kvpop.precision", cfg.train.resolved_precision)
        spec = train.make_spec(cfg, targets, f"{info['name']}-{trial_id}", Path(cfg.train.output_root), run_id,
                               report_every_step=True, save_final=False)
        train.make_trainer(cfg, targets, spec, callbacks=(TuneReportCallback(),)).fit()
    except ray.exceptions.ActorDiedError:
        # ASHA stopped this trial: Tune ends this actor, which kills the Train controller it owns (the driver marks
        # the run KILLED); nothing to record here
        raise
    except Exception:
        _end_run(client, run_id, "FAILED")
        raise
    _end_run(client, run_id, "FINISHED")


def _end_run(client, run_id: str, status: str) -> None:
    """End a trial's run unless the driver already did (its reconciliation after the sweep is authoritative)."""
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status)


# ------------------------------------------------------------------------------------------------ the driver
@dataclass
class SweepResult:
    name: str
    root: Path
    parent_run_id: str
    best_config: PipelineConfig
    best_path: Path
    best_value: float
    best_run_id: str
    trials: list[dict] = field(default_factory=list)  # one row per trial: ids, variant, status, last metrics


def best_config(cfg: PipelineConfig, overrides: dict[str, Any]) -> PipelineConfig:
    """The input config with a trial's variant applied (steps, targets, storage: the input's own)."""
    return apply_overrides(cfg.to_dict(), overrides)


def write_best(path: Path, best: PipelineConfig, header: str) -> None:
    body = yaml.safe_dump(best.to_dict(), sort_keys=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    atomic_write_text(path, comment + body)
    if load_config(path) != best:  # the preset must load back to exactly this config
        raise RuntimeError(f"{path} does not load back to the best config")


def run(cfg: PipelineConfig) -> SweepResult:
    """Run the sweep; returns the best config (also saved as ``<sweep dir>/best.yaml``) and one row per trial."""
    import mlflow
    import ray.tune
    from ray.tune.schedulers import ASHAScheduler

    original = cfg
    p = plan(cfg)  # one clear error before anything is written
    cfg, sw = p.cfg, p.cfg.sweep
    ensure_ray(cfg)
    _check_cluster(p)
    allocate_trials(p)

    parent_id = tracking.find_run(cfg, p.name, "sweep") if p.resume else None
    if p.resume and parent_id is None:
        raise ConfigError(f"sweep directory {p.root} holds a killed sweep without its MLflow parent run in "
                          f"{cfg.tracking_uri()}: remove the directory or pick another sweep.name")
    print(f"[kvpop.sweep] {'resuming ' if p.resume else ''}{p.name}: {p.trials} trials ({len(p.variants)} grid points "
          f"× {sw.num_samples}), "
          f"{p.concurrent} at a time, ASHA on {sw.metric} ({sw.mode}) over {sw.steps} steps, grace "
          f"{sw.grace_period}, reduction {sw.reduction_factor}; {p.root}", flush=True)
    with tracking.run(cfg, p.name, stage="sweep", run_id=parent_id,
                      tags={"kvpop.sweep": p.name, "kvpop.sweep_dir": str(p.root),
                            "kvpop.targets": str(p.targets)}) as parent:
        parent_id = parent.info.run_id
        if not p.resume:
            mlflow.log_params({"sweep.trials": p.trials, "sweep.grid_points": len(p.variants)})
        param_space: dict[str, Any] = {"variant": ray.tune.grid_search(p.variants)}
        if sw.lr_range:
            param_space["lr"] = ray.tune.loguniform(*sw.lr_range)
        trainable = ray.tune.with_resources(
            ray.tune.with_parameters(_trial, base=p.base, info={"name": p.name, "parent_run_id": parent_id}),
            {"cpu": DRIVER_CPUS})
        tuner = ray.tune.Tuner.restore(str(p.root), trainable) if p.resume else ray.tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=ray.tune.TuneConfig(
                metric=sw.metric, mode=sw.mode, num_samples=sw.num_samples,
                max_concurrent_trials=sw.max_concurrent_trials, reuse_actors=False,
                # stop_last_trials=False: a trial that reaches max_t ends by returning, not by being stopped
                scheduler=ASHAScheduler(time_attr="step", max_t=sw.steps, grace_period=sw.grace_period,
                                        reduction_factor=sw.reduction_factor, stop_last_trials=False)),
            run_config=ray.tune.RunConfig(name=p.name, storage_path=str(p.root.parent), verbose=1),
        )
        before = live_placement_groups()
        grid = tuner.fit()
        released = release_placement_groups(before)
        if released:
            print(f"[kvpop.sweep] released {len(released)} placement group(s) left by stopped trials", flush=True)
        records.crash_point("sweep.trials_done")
        trials = _close_trials(cfg, p, grid, parent.info.experiment_id, parent_id)
        mlflow.log_dict(trials, "sweep/trials.json")
        mlflow.log_metrics({"trials.finished": sum(t["status"] == "FINISHED" for t in trials),
                            "trials.early_stopped": sum(t["early_stopped"] for t in trials),
                            "trials.failed": sum(t["status"] == "FAILED" for t in trials)})
        scored = [t for t in trials if t["status"] != "FAILED" and t["metrics"].get(sw.metric) is not None]
        if not scored:
            errors = [t["error"] for t in trials if t.get("error")]
            raise RuntimeError(f"every trial of sweep {p.name} failed" + (f"; the first: {errors[0]}" if errors else ""))
        # the best trial by its last reported value (ASHA's view; a stopped trial competes with what it reached)
        best = (min if sw.mode == "min" else max)(scored, key=lambda t: t["metrics"][sw.metric])
        chosen = best_config(original, best["overrides"])
        best_path = p.root / BEST_CONFIG
        write_best(best_path, chosen, f"best config of sweep {p.name} (MLflow parent run {parent_id}): trial "
                                      f"{best['trial_id']} {best['variant']}, {sw.metric} = "
                                      f"{best['metrics'][sw.metric]:.6g} at step {best['steps']}\n"
                                      f"train it: python -m jobs.train --config {best_path}")
        mlflow.log_artifact(str(best_path), artifact_path="sweep")
        mlflow.log_metric(f"best.{sw.metric}", float(best["metrics"][sw.metric]))
        mlflow.log_params({f"best.{k}": v for k, v in best["overrides"].items()})
        mlflow.set_tags({"kvpop.best_trial": best["trial_id"], "kvpop.best_run_id": best["run_id"] or "",
                         "kvpop.best_variant": best["variant"], "kvpop.best_config": str(best_path)})
    print(f"[kvpop.sweep] best: {best['variant']} ({sw.metric} {best['metrics'][sw.metric]:.4g}) → {best_path}",
          flush=True)
    return SweepResult(p.name, p.root, parent_id, chosen, best_path, float(best["metrics"][sw.metric]),
                       best["run_id"] or "", trials)


def live_placement_groups() -> set[str]:
    """The ids (hex) of the cluster's placement groups that are not removed."""
    from ray.util.placement_group import placement_group_table

    return {pg for pg, info in placement_group_table().items() if info["state"] != "REMOVED"}


def release_placement_groups(before: set[str], timeout_s: float = 60.0) -> list[str]:
    """Remove the placement groups this driver's job created since ``before`` (:func:`live_placement_groups`) that
    are still alive once every trial has ended, and wait until the cluster lists them as removed; returns their ids.

    A trial's TorchTrainer controller removes its worker group's placement group when it shuts down; where Tune ends
    the trial's actor first (a trial ASHA stops; on the H200 also the sweep's last, finished trial), the group is left
    to Ray Train's detached ``PlacementGroupCleaner``, which removes it only once the state API says the controller is
    dead — and that API fails where the dashboard does not run (the H200's Ray) or two clusters share a machine. The
    group then holds the trial's GPU and CPUs for good: the train stage after an in-pipeline sweep waited for its
    worker forever. A placement group id ends with its creator's job id: other jobs' groups are never touched.
    Removal is asynchronous (the table still lists a group for a moment after ``remove_placement_group``), so this
    polls until none is left, removing any that a controller still winding down creates meanwhile."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = ray.get_runtime_context().get_job_id()
    released: list[str] = []
    deadline = time.monotonic() + timeout_s
    while left := sorted(pg for pg in live_placement_groups() - before if pg.endswith(job)):
        for pg in left:
            if pg not in released:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg)))
                released.append(pg)
        if time.monotonic() > deadline:
            raise RuntimeError(f"placement groups {left} are still alive {timeout_s:.0f} s after their removal; "
                               "`ray status` shows what holds them")
        time.sleep(0.1)
    return released


def _close_trials(cfg: PipelineConfig, p: Plan, grid, experiment_id: str, parent_id: str) -> list[dict]:
    """One row per trial; every child MLflow run ends FINISHED, FAILED or KILLED (+ ``kvpop.early_stopped``)."""
    import mlflow

    client = mlflow.MlflowClient(cfg.tracking_uri())
    children = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                                  max_results=10000)
    by_trial = {r.data.tags.get("kvpop.trial_id"): r for r in children}
    rows = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or next(  # a trial that never reported: its id is in its directory name
            (t for t in by_trial if t and t in Path(result.path).name), Path(result.path).name)
        overrides = trial_overrides(result.config)
        steps = int(metrics.get("step", 0))
        error = None if result.error is None else (str(result.error).strip().splitlines() or [""])[0]
        run = by_trial.get(trial_id)
        if error:
            status = "FAILED"
        elif steps >= p.cfg.sweep.steps:
            status = "FINISHED"
        else:
            status = "KILLED"  # stopped by ASHA before its last step
        early = status == "KILLED"
        if run is not None:
            if run.info.status != status:
                client.set_terminated(run.info.run_id, status)
            client.set_tag(run.info.run_id, "kvpop.early_stopped", str(early).lower())
            if error:
                client.set_tag(run.info.run_id, "kvpop.error", error[:5000])
        rows.append({"trial_id": trial_id, "run_id": run.info.run_id if run else None,
                     "variant": variant_label(overrides), "overrides": overrides, "status": status,
                     "early_stopped": early, "steps": steps, "error": error,
                     "metrics": {k: metrics[k] for k in ("loss", "ret_loss", "kl", "boundary_acc", "tokens_per_s")
                                 if isinstance(metrics.get(k), (int, float))}})
    return rows
