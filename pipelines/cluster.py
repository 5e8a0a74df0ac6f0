"""Joining or starting the Ray cluster every stage runs on (NOTES.md: Ray on a 2-core box).

* ``ray.address`` set (or ``RAY_ADDRESS`` in the environment): join that cluster.
* otherwise: start a local one with ``ray.num_cpus`` *logical* CPUs — on purpose more than a 2-core box has, because
  a Ray Train worker group fed by Ray Data deadlocks when the workers hold every CPU and Data's tasks never start.
* A driver that already called ``ray.init`` (a test session, a job script) is left as it is.

Ray Data's no-progress guard (``ray.no_progress_timeout_s``) makes a stuck pipeline fail instead of hanging.
"""
from __future__ import annotations

import os

from pipelines.config import PipelineConfig, env_home


def ensure_ray(cfg: PipelineConfig) -> None:
    import ray

    os.environ.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", str(cfg.ray.no_progress_timeout_s))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        env = {**env_home(cfg), "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S": str(cfg.ray.no_progress_timeout_s)}
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
        if address:
            ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
        else:
            ray.init(num_cpus=cfg.ray.num_cpus, runtime_env={"env_vars": env}, log_to_driver=True)
    from ray.data import DataContext

    context = DataContext.get_current()
    context.execution_no_progress_timeout_s = float(cfg.ray.no_progress_timeout_s)
