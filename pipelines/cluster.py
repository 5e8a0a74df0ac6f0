"""Joining or starting the Ray cluster every stage runs on (NOTES.md: Ray on a 2-core box).

* ``ray.address`` set (or ``RAY_ADDRESS`` in the environment, as in a job started by ``ray job submit``): join that
  cluster.
* otherwise, a cluster that ``ray start`` recorded on this machine (``infra/local.sh start``) and that answers: join
  it; none (or a stale record of a stopped one): start a local one with ``ray.num_cpus`` *logical* CPUs — on purpose
  more than a 2-core box has, because a Ray Train worker group fed by Ray Data deadlocks when the workers hold every
  CPU and Data's tasks never start.
* A driver that already called ``ray.init`` (a test session, a job script) is left as it is.

Inside a submitted job, environment variables the job's runtime env already sets are not passed again: Ray refuses
to merge a driver's runtime env that repeats a key of the job's (``Failed to merge the Job's runtime env``).

Ray Data's no-progress guard (``ray.no_progress_timeout_s``) makes a stuck pipeline fail instead of hanging.
"""
from __future__ import annotations

import json
import os
import socket

from pipelines.config import ConfigError, PipelineConfig, env_home

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray in a submitted job's driver


def _job_env_keys() -> set[str]:
    """The env var names a submitted job's runtime env sets (empty outside a job)."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return set()
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return set()
    return set((runtime_env.get("env_vars") or {}).keys())


def _recorded_cluster() -> str | None:
    """The GCS address ``ray start`` recorded on this machine, if that cluster still accepts connections."""
    try:
        from ray._common.utils import get_ray_address_file

        path = get_ray_address_file(None)
    except Exception:  # pragma: no cover - a Ray without this helper
        path = "/tmp/ray/ray_current_cluster"
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return address
    except OSError:
        return None


def ensure_ray(cfg: PipelineConfig) -> None:
    import ray

    os.environ.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", str(cfg.ray.no_progress_timeout_s))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        env = {**env_home(cfg), "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S": str(cfg.ray.no_progress_timeout_s)}
        taken = _job_env_keys()
        runtime_env = {"env_vars": {k: v for k, v in env.items() if k not in taken}}
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or _recorded_cluster()
        if address:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        else:  # "local": never the stale record of a stopped `ray start` cluster
            ray.init(address="local", num_cpus=cfg.ray.num_cpus, runtime_env=runtime_env, log_to_driver=True)
    from ray.data import DataContext

    context = DataContext.get_current()
    context.execution_no_progress_timeout_s = float(cfg.ray.no_progress_timeout_s)


def require_resources(what: str, cpus: float, gpus: float = 0.0) -> None:
    """``what`` asks for ``cpus`` CPUs and ``gpus`` GPUs of the joined cluster: they must fit, with at least one CPU
    left for Ray Data, whose tasks would otherwise never start (the Train + Data deadlock of NOTES.md)."""
    import ray

    resources = ray.cluster_resources()
    have_cpus, have_gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    if cpus >= have_cpus:
        raise ConfigError(f"{what} = {cpus:g} CPUs leaves none of the cluster's {have_cpus:g} to Ray Data, which "
                          f"would hang: lower them or raise ray.num_cpus (logical CPUs may exceed the cores)")
    if gpus > have_gpus:
        raise ConfigError(f"{what} needs {gpus:g} GPUs; the cluster has {have_gpus:g}: lower them, or use CPUs")
