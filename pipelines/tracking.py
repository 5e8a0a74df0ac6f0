"""The few MLflow calls every stage shares.

The store is sqlite under the KVpop home (``mlflow ui --backend-store-uri sqlite:///…/mlflow.db``). Experiments are
created by the driver with an absolute artifact location: created inside a Ray worker they would land under
``/tmp/ray/session_*``, which vanishes (docs/ENVIRONMENT.md).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

from pipelines.config import PipelineConfig
from pipelines.models import REPO_ROOT

COMMIT_ID = re.compile(r"^[0-9a-f]{7,40}$")
# the tag MLflow's fluent API sets from a git checkout; runs made with the client get it from git_commit()
COMMIT_TAG = "mlflow.source.git.commit"


def git_commit(root: Path = REPO_ROOT) -> str:
    """``$KVPOP_COMMIT`` if set (a copy of the tree without ``.git``, e.g. on a rented GPU machine: the script that
    ships the tree sets it), else HEAD's commit id, else "0000000" (unknown)."""
    if COMMIT_ID.match(os.environ.get("KVPOP_COMMIT", "")):
        return os.environ["KVPOP_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "0000000"
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and COMMIT_ID.match(commit) else "0000000"


# The experiment's kind ("Machine learning": runs, not GenAI traces). MLflow 3.17's UI picks its view from
# ?workflowType=machine_learning (or its "Model training" toggle) instead, so jobs.pipeline prints that link too.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, tuple, dict)) else value
    return flat


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Held while a process first opens a sqlite store: MLflow creates and migrates the schema on first open, and two
    processes doing that at once on a new file fail ("Online migration expected to match one row …": the fourth GPU
    session lost a part to it). Other stores (a server) need no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


TRACKING_ENV = "MLFLOW_TRACKING_URI"  # a cluster's MLflow server, chosen by the user (PipelineConfig.tracking_uri)


def setup(cfg: PipelineConfig) -> str:
    """Point MLflow at the config's store and make sure the experiment exists; returns its id."""
    import mlflow

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = cfg.tracking_uri()
    chosen = os.environ.get(TRACKING_ENV)
    mlflow.set_tracking_uri(uri)
    # MLflow also writes the URI into $MLFLOW_TRACKING_URI, which cfg.tracking_uri() reads as the user's choice: a
    # later config (another home) in this process, or a child process, would then use this config's store
    if chosen is None:
        os.environ.pop(TRACKING_ENV, None)
    else:
        os.environ[TRACKING_ENV] = chosen
    with _store_lock(uri):  # the first query opens (creates, migrates) the store; it is cached afterwards
        experiment = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    if experiment is not None:
        if experiment.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before the tag was set here
            mlflow.MlflowClient(uri).set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id
    artifacts = (cfg.home_dir() / "mlartifacts" / cfg.tracking.experiment).resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    try:
        return mlflow.create_experiment(cfg.tracking.experiment, artifact_location=artifacts.as_uri(),
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # created concurrently by another process
        return mlflow.get_experiment_by_name(cfg.tracking.experiment).experiment_id


@contextlib.contextmanager
def run(cfg: PipelineConfig, run_name: str, *, stage: str, nested: bool = False, run_id: str | None = None,
        tags: dict | None = None, log_config: bool = True) -> Iterator[Any]:
    """An MLflow run for one stage, with the whole config as params (``section.key``) and the stage as a tag.

    ``run_id`` resumes an existing run (a restarted training keeps its metric history in one run).
    """
    import mlflow

    experiment_id = setup(cfg)
    with mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name, experiment_id=experiment_id,
                          nested=nested, tags={"kvpop.stage": stage, "kvpop.config": cfg.name, **(tags or {})}) as active:
        if log_config and run_id is None:
            params = _flatten(cfg.to_dict())
            items = list(params.items())
            for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
                mlflow.log_params(dict(items[start:start + 100]))
        yield active


def create_run(cfg: PipelineConfig, run_name: str, *, stage: str, parent_run_id: str | None = None,
               tags: dict | None = None, log_config: bool = True) -> str:
    """A new run made with the client, not the fluent API (no process-global active run: safe inside Ray actors and
    their threads, e.g. one Tune trial); nested under ``parent_run_id`` if given. Returns its id; end it with
    ``MlflowClient.set_terminated``."""
    import mlflow
    from mlflow.entities import Param

    experiment_id = setup(cfg)
    client = mlflow.MlflowClient(cfg.tracking_uri())
    all_tags = {"kvpop.stage": stage, "kvpop.config": cfg.name, **(tags or {})}
    if (commit := git_commit()) != "0000000":  # what the fluent API's git context would have tagged
        all_tags.setdefault(COMMIT_TAG, commit)
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run_id = client.create_run(experiment_id, run_name=run_name, tags=all_tags).info.run_id
    if log_config:
        items = [Param(k, str(v)) for k, v in _flatten(cfg.to_dict()).items()]
        for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            client.log_batch(run_id, params=items[start:start + 100])
    return run_id


def find_run(cfg: PipelineConfig, run_name: str, stage: str) -> str | None:
    """The id of the latest run with this name and stage (to resume it), if any."""
    import mlflow

    experiment_id = setup(cfg)
    runs = mlflow.search_runs([experiment_id], filter_string=f"tags.mlflow.runName = '{run_name}' and "
                              f"tags.`kvpop.stage` = '{stage}'", order_by=["start_time DESC"], max_results=1,
                              output_format="list")
    return runs[0].info.run_id if runs else None
