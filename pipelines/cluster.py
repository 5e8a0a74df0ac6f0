"""Joining or starting the Ray cluster every stage runs on (docs/ENVIRONMENT.md: Ray on a 2-core box).

* ``ray.address`` set (or ``RAY_ADDRESS`` in the environment, as in a job started by ``ray job submit``): join that
  cluster — once :func:`check_address` has seen its GCS port accept a TCP connection. ``ray.init`` on an address
  where nothing listens retries for minutes with nothing but warnings; the probe turns that into one
  :class:`ConfigError` within :data:`CONNECT_TIMEOUT_S` seconds. The CLIs probe before any stage writes anything.
  A cluster that requires Ray's token admits this driver only with ``RAY_AUTH_MODE=token`` and the token in its
  environment (Ray turns token mode on by itself only for ``auto``); a refusal is a :class:`ConfigError` saying so.
* otherwise, a cluster that ``ray start`` recorded on this machine (``infra/local.sh start``) and that answers: join
  it as ``address="auto"``, the one form with which Ray picks up this machine's token (``~/.ray/auth_token``) when
  that cluster requires one; none (or a stale record of a stopped one): start a local one with ``ray.num_cpus``
  *logical* CPUs — on purpose more than a 2-core box has, because a Ray Train worker group fed by Ray Data deadlocks
  when the workers hold every CPU and Data's tasks never start.
* A driver that already called ``ray.init`` (a test session, a job script) is left as it is.

Workers get the driver's home, its directory (a config's relative paths: :func:`pipelines.config.config_path`) and
:data:`pipelines.offline.OFFLINE_ENV` in their runtime env. Inside a submitted job, environment variables the job's
runtime env already sets are not passed again: Ray refuses to merge a driver's runtime env that repeats a key of the
job's (``Failed to merge the Job's runtime env``).

A cluster this driver starts listens on the loopback interface only (:func:`_start_local`): its node IP is
127.0.0.1, so that no server of it — Prometheus ``/metrics`` of the autoscaler monitor, the dashboard and its agent
answer without a token — is reachable from the network. A cluster other machines join is ``infra/local.sh``'s.

Ray Data draws its progress bars only on a terminal: when stderr is a file or a pipe they are off.

Ray Data's no-progress guard (``ray.no_progress_timeout_s``) makes a stuck pipeline fail instead of hanging.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from unittest import mock

from pipelines.config import ConfigError, PipelineConfig, env_home
from pipelines.offline import OFFLINE_ENV

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray in a submitted job's driver
CONNECT_TIMEOUT_S = 10.0


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


def _accepts(host: str, port: int, timeout: float) -> str | None:
    """None if ``host:port`` accepts a TCP connection within ``timeout`` seconds, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as err:
        return err.strerror or type(err).__name__


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
    return address if _accepts(host, int(port), 1.0) is None else None


def explicit_address(cfg: PipelineConfig) -> tuple[str, str] | None:
    """``(address, where it came from)`` when the config or the environment names the cluster to join."""
    if cfg.ray.address:
        return cfg.ray.address, "ray.address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None


def check_address(cfg: PipelineConfig, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`ConfigError` unless the cluster named by ``ray.address`` / ``RAY_ADDRESS`` (if any) answers.

    ``auto`` and ``local`` are Ray's own choices and are not probed; ``host:port`` and ``ray://host:port`` must accept
    a TCP connection within ``timeout`` seconds.
    """
    named = explicit_address(cfg)
    if named is None or named[0] in ("auto", "local"):
        return
    address, source = named
    if address.startswith(("http://", "https://")):
        raise ConfigError(f"{source}={address} is a dashboard (jobs API) URL: give the cluster's GCS address "
                          f"host:port (e.g. 127.0.0.1:6379), or submit the CLI with `ray job submit --address "
                          f"{address}`")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{source}={address} is not host:port (e.g. 127.0.0.1:6379)")
    start = time.monotonic()
    reason = _accepts(host.strip("[]"), int(port), timeout)
    if reason is not None:
        raise ConfigError(f"{source}={address}: no Ray cluster there ({reason}, {time.monotonic() - start:.1f} s): "
                          f"start it (infra/local.sh start) or fix {source}")


def ensure_ray(cfg: PipelineConfig) -> None:
    import ray

    os.environ.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", str(cfg.ray.no_progress_timeout_s))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        env = {**env_home(cfg), **OFFLINE_ENV,
               "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S": str(cfg.ray.no_progress_timeout_s)}
        taken = _job_env_keys()
        runtime_env = {"env_vars": {k: v for k, v in env.items() if k not in taken}}
        check_address(cfg)
        named = explicit_address(cfg)
        if named is not None:
            address, source = named
            try:
                ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
            except ConnectionError as err:  # it answers TCP but refused this driver, typically for want of a token
                raise ConfigError(f"{source}={address}: the cluster there did not let this driver join ({err}); if "
                                  f"it requires Ray's token, set RAY_AUTH_MODE=token and give the token "
                                  f"(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") from None
        elif _recorded_cluster() is not None:
            ray.init(address="auto", runtime_env=runtime_env, log_to_driver=True)
        else:  # "local": never the stale record of a stopped `ray start` cluster
            _start_local(cfg, runtime_env)
    from ray.data import DataContext

    context = DataContext.get_current()
    context.execution_no_progress_timeout_s = float(cfg.ray.no_progress_timeout_s)
    if not sys.stderr.isatty():  # a log file or pipe: its cursor-up progress bars are hundreds of lines of noise
        context.enable_progress_bars = False


LOOPBACK = "127.0.0.1"
# Ray's single-machine mode (its default on macOS and Windows): node IP = loopback. Elsewhere ray.init turns a node IP
# of 127.0.0.1 into the machine's reachable address, and the servers bind to that, or to every interface.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _start_local(cfg: PipelineConfig, runtime_env: dict) -> None:
    """Start this driver's own one-node cluster, every server of it on :data:`LOOPBACK`."""
    import ray
    from ray._private import ray_constants

    os.environ[SINGLE_MACHINE_ENV] = "0"  # the processes ray.init starts read it when they import ray
    with mock.patch.object(ray_constants, "ENABLE_RAY_CLUSTER", False):  # this process imported ray already
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, runtime_env=runtime_env, log_to_driver=True,
                 _node_ip_address=LOOPBACK)


def require_resources(what: str, cpus: float, gpus: float = 0.0) -> None:
    """``what`` asks for ``cpus`` CPUs and ``gpus`` GPUs of the joined cluster: they must fit, with at least one CPU
    left for Ray Data, whose tasks would otherwise never start (the Train + Data deadlock of docs/ENVIRONMENT.md)."""
    import ray

    resources = ray.cluster_resources()
    have_cpus, have_gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    if cpus >= have_cpus:
        raise ConfigError(f"{what} = {cpus:g} CPUs leaves none of the cluster's {have_cpus:g} to Ray Data, which "
                          f"would hang: lower them or raise ray.num_cpus (logical CPUs may exceed the cores)")
    if gpus > have_gpus:
        raise ConfigError(f"{what} needs {gpus:g} GPUs; the cluster has {have_gpus:g}: lower them, or use CPUs")
