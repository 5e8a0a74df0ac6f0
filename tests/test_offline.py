"""Offline for real: every entry point sets the offline variables before a Hugging Face library is imported, so a hub
name as ``data.source`` fails at once with one line and not a single network attempt; workers, submitted jobs and
the local head get the same variables."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.config import REPO_ROOT
from pipelines.offline import OFFLINE_ENV

# Runs a module as `python -m` would, with every TCP/UDP connect and name lookup beyond loopback recorded (one line
# each in $NET_LOG) and refused — like a machine without network, and loud about it.
NO_NETWORK = """
import os, runpy, socket, sys
LOG, LOCAL = os.environ["NET_LOG"], ("localhost", "127.0.0.1", "::1", None)

def record(what):
    with open(LOG, "a") as f:
        f.write(what + "\\n")
    raise OSError(f"network disabled by the test: {what}")

real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
        record(f"connect {address}")
    return real_connect(self, address)

def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
        record(f"connect_ex {address}")
    return real_connect_ex(self, address)

def getaddrinfo(host, *args, **kwargs):
    if host not in LOCAL:
        record(f"getaddrinfo {host}")
    return real_getaddrinfo(host, *args, **kwargs)

socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
module, sys.argv = sys.argv[1], sys.argv[1:]
if module == "-c":
    exec(sys.argv[1])
else:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _without_network(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, list[str], float]:
    """Run ``argv`` (a module and its arguments, or ``-c CODE``) under :data:`NO_NETWORK` with none of the offline
    variables set; returns the process, the network attempts, and the wall time."""
    log = tmp_path / "network.log"
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    env.update(NET_LOG=str(log), KVPOP_HOME=str(tmp_path / "home"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", NO_NETWORK, *argv], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    attempts = log.read_text().splitlines() if log.exists() else []
    return proc, attempts, time.monotonic() - start


@pytest.mark.pretrained  # the tiny teacher uses SmolLM2's tokenizer
def test_hub_source_fails_at_once_with_zero_network_attempts(tiny_setup, tmp_path):
    proc, attempts, elapsed = _without_network(
        tmp_path, "jobs.precompute", "--set", f"model.path={tiny_setup / 'teacher'}",
        "--set", "data.source=someorg/somedataset")
    assert attempts == [], attempts
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvpop precompute: error: data.source 'someorg/somedataset' is not a local file or "
                               "folder, and a hub dataset name is read only from the local Hugging Face cache")
    assert elapsed < 120, elapsed  # imports included; nothing waits on a network (it took 28 s of retries before)


def test_the_python_api_is_offline_too(tiny_setup, tmp_path):
    """``from pipelines import …`` (no CLI) sets the offline variables before transformers and datasets load: a hub
    name as data source fails with zero network attempts."""
    code = ("from pipelines import data\nfrom pipelines.config import load_config\n"
            f"cfg = load_config(None, ['model.path={tiny_setup / 'teacher'}', 'data.source=someorg/somedataset'])\n"
            "try:\n    data.load_sequences(cfg, 'train', data.load_tokenizer(cfg))\nexcept Exception as err:\n"
            "    print(type(err).__name__)\n")
    proc, attempts, _ = _without_network(tmp_path, "-c", code)
    assert attempts == [], attempts
    assert proc.returncode == 0 and "ConfigError" in proc.stdout, proc.stdout + proc.stderr


def test_the_probe_sees_a_hub_lookup_when_offline_is_set_too_late(tmp_path):
    """The control that shows the test above can fail: ``huggingface_hub`` imported before ``HF_HUB_OFFLINE`` is set
    (what ``jobs/_cli.py`` used to do) goes to the network for a hub name."""
    code = ("import os, huggingface_hub.constants  # as transformers and datasets do on import\n"
            "os.environ['HF_HUB_OFFLINE'] = '1'\n"
            "try:\n    huggingface_hub.HfApi().dataset_info('someorg/somedataset')\nexcept Exception:\n    pass\n")
    from urllib.parse import urlparse

    from huggingface_hub import constants

    _, attempts, _ = _without_network(tmp_path, "-c", code)
    hub = urlparse(constants.ENDPOINT).hostname
    assert attempts and all(hub in a for a in attempts), attempts


def test_every_entry_point_names_the_same_offline_variables():
    """The CLIs' process (jobs/__init__), the workers' runtime env (pipelines/cluster), submitted jobs
    (infra/runtime_env.yaml), the local head (infra/local.sh), cluster nodes and the KubeRay job."""
    import jobs  # noqa: F401  (importing the package is what sets them)

    assert OFFLINE_ENV == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    assert all(os.environ[k] == v for k, v in OFFLINE_ENV.items())
    infra = REPO_ROOT / "infra"
    assert OFFLINE_ENV.items() <= yaml.safe_load((infra / "runtime_env.yaml").read_text())["env_vars"].items()
    kuberay = yaml.safe_load((infra / "kuberay-rayjob.yaml").read_text())
    assert OFFLINE_ENV.items() <= yaml.safe_load(kuberay["spec"]["runtimeEnvYAML"])["env_vars"].items()
    for script in ("local.sh", "cluster.yaml"):
        text = (infra / script).read_text()
        assert all(f"{k}={v}" in text for k, v in OFFLINE_ENV.items()), script
