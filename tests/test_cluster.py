"""pipelines.cluster: which cluster a stage joins, the reachability probe that replaces Ray's minutes of retrying with
one ConfigError, and what the workers' runtime env carries (the home and the offline variables)."""
from __future__ import annotations

import os
import socket

import pytest

from pipelines import cluster
from pipelines.cluster import CONNECT_TIMEOUT_S, check_address, explicit_address
from pipelines.config import ConfigError, load_config
from pipelines.offline import OFFLINE_ENV


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _cfg(address: str = "", home: str = "/tmp/kvpop-test-home"):
    return load_config(None, [f"home={home}", *([f"ray.address={address}"] if address else [])])


@pytest.fixture
def listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_config_wins_over_the_environment(no_ray_address, monkeypatch):
    assert explicit_address(_cfg()) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert explicit_address(_cfg()) == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert explicit_address(_cfg("10.0.0.2:6379")) == ("10.0.0.2:6379", "ray.address")


def test_an_answering_address_passes(no_ray_address, listener):
    check_address(_cfg(f"127.0.0.1:{listener}"))
    check_address(_cfg(f"ray://127.0.0.1:{listener}"))  # Ray Client form: the same probe


@pytest.mark.parametrize("address", ["auto", "local", ""])
def test_rays_own_choices_are_not_probed(no_ray_address, monkeypatch, address):
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("probed"))
    check_address(_cfg(address))


def test_refused_connection_fails_at_once(no_ray_address):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"ray.address=127.0.0.1:{closed}: no Ray cluster there \(Connection "
                                          rf"refused, 0\.\d s\): start it \(infra/local.sh start\) or fix ray.address"):
        check_address(_cfg(f"127.0.0.1:{closed}"))


def test_silent_address_fails_after_the_timeout(no_ray_address, monkeypatch):
    """A host that drops packets: the probe gives up after ``timeout`` seconds (a patched connect that times out)."""
    seen = {}

    def silent(address, timeout):
        seen["timeout"] = timeout
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(ConfigError, match=rf"no answer within {CONNECT_TIMEOUT_S:g} s"):
        check_address(_cfg("203.0.113.7:6379"))
    assert seen["timeout"] == CONNECT_TIMEOUT_S


@pytest.mark.parametrize("address, message", [
    ("http://127.0.0.1:8265", "is a dashboard \\(jobs API\\) URL: give the cluster's GCS address"),
    ("127.0.0.1", "is not host:port"),
    ("127.0.0.1:port", "is not host:port"),
])
def test_malformed_addresses_say_what_to_give(no_ray_address, address, message):
    with pytest.raises(ConfigError, match=message):
        check_address(_cfg(address))


def test_workers_get_the_home_and_the_offline_variables(no_ray_address, monkeypatch, tmp_path):
    """``ensure_ray``'s runtime env (a patched ``ray.init`` records it): the driver's home and directory and every
    offline variable, but none that a submitted job's runtime env already sets (Ray refuses to merge a repeated
    key)."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cluster, "_recorded_cluster", lambda: None)
    monkeypatch.delenv(cluster.JOB_CONFIG_ENV, raising=False)
    cluster.ensure_ray(_cfg(home=str(tmp_path)))
    env = calls[0]["runtime_env"]["env_vars"]
    assert calls[0]["address"] == "local" and env["KVPOP_HOME"] == str(tmp_path)
    assert env["KVPOP_WORKDIR"] == os.getcwd()  # where a config's relative paths are read from
    assert OFFLINE_ENV.items() <= env.items()

    monkeypatch.setenv(cluster.JOB_CONFIG_ENV, '{"runtime_env": {"env_vars": {"HF_DATASETS_OFFLINE": "1"}}}')
    cluster.ensure_ray(_cfg(home=str(tmp_path)))
    assert "HF_DATASETS_OFFLINE" not in calls[1]["runtime_env"]["env_vars"]


def test_a_recorded_local_cluster_is_joined_as_auto(no_ray_address, monkeypatch, tmp_path):
    """``address="auto"`` is the form with which Ray picks up this machine's token for a token-auth head."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cluster, "_recorded_cluster", lambda: "192.0.2.1:6379")
    cluster.ensure_ray(_cfg(home=str(tmp_path)))
    assert calls[0]["address"] == "auto"


LISTENERS = """
import json, sys
import psutil, ray
from pipelines import cluster
from pipelines.config import load_config

cluster.ensure_ray(load_config(None, [f"home={sys.argv[1]}"]))
assert ray.data.range(8).map(lambda row: {"id": row["id"] + 1}).sum("id") == 36  # the cluster works
me = psutil.Process()
print(json.dumps(sorted({(p.name(), c.laddr.ip, c.laddr.port) for p in [me, *me.children(recursive=True)]
                         for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})))
"""


@pytest.mark.ray
@pytest.mark.slow
def test_the_cluster_a_driver_starts_listens_on_loopback_only(no_ray_address, tmp_path):
    """Its Prometheus endpoints (autoscaler monitor, dashboard, dashboard agent) answer without a token: no server of
    it may be reachable from the network. In its own process: the test session may hold a cluster already."""
    import ipaddress
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env["RAY_TMPDIR"] = short = tempfile.mkdtemp(prefix="kvpop-", dir="/tmp")  # never a `ray start` record of
    try:                                                                         # this machine's (a short path:
        done = subprocess.run([sys.executable, "-c", LISTENERS, str(tmp_path)], env=env,  # Ray's sockets live there)
                              capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    listeners = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(listeners) >= 5  # GCS, raylet, dashboard, agents, workers
    exposed = [entry for entry in listeners
               if not ipaddress.ip_address(entry[1].removeprefix("::ffff:")).is_loopback]
    assert exposed == []


@pytest.mark.parametrize("terminal", [True, False])
def test_ray_datas_progress_bars_only_on_a_terminal(no_ray_address, monkeypatch, tmp_path, terminal):
    import io

    import ray
    from ray.data import DataContext

    class Stderr(io.StringIO):
        def isatty(self):
            return terminal

    context = DataContext.get_current()
    monkeypatch.setattr(context, "enable_progress_bars", True)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # joined already: only the Data context changes
    monkeypatch.setattr("sys.stderr", Stderr())
    cluster.ensure_ray(_cfg(home=str(tmp_path)))
    assert DataContext.get_current().enable_progress_bars is terminal
