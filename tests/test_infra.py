"""infra/: the local stack (``infra/local.sh``) refuses what comes without Ray's token and listens beyond loopback only
where a token is required; the token holder submits jobs (a whole pipeline, whose metrics the MLflow server then
serves over REST); the cluster manifests put Ray, the dashboard and MLflow behind authentication."""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipelines.config import REPO_ROOT

LOCAL_SH = str(REPO_ROOT / "infra" / "local.sh")
RAY = str(Path(sys.executable).parent / "ray")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
# One real method per gRPC service Ray runs: an unauthenticated call must come back UNAUTHENTICATED, not OK.
GRPC_METHODS = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetSystemConfig",
                "/ray.rpc.ObjectManagerService/Push", "/ray.rpc.ReporterService/GetTraceback",
                "/ray.rpc.RayletDriver/ClusterInfo", "/ray.rpc.CoreWorkerService/GetObjectStatus")


def _free_ports(count: int) -> list[int]:
    """Free TCP ports between Ray's worker ports (10002-19999) and the kernel's ephemeral range (32768+ here): the
    ports Ray's own processes and every outgoing connection take come from those two ranges, so a port chosen here
    stays free until the stack binds it. (Chosen from the ephemeral range, a dashboard port was taken in between by
    a process of the other pytest worker's cluster, and the stack's HTTP checks read gRPC bytes.)"""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    first_ephemeral = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    draw = random.SystemRandom()  # not the tests' seeded generator: another run on this machine draws other ports
    ports: list[int] = []
    while len(ports) < count:
        port = draw.randint(20000, max(20000 + 10 * count, first_ephemeral - 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _request(url: str, payload: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    """(HTTP status, body) of a GET, or a POST of ``payload`` as JSON; no credentials."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _get(url: str, payload: dict | None = None) -> dict:
    status, body = _request(url, payload)
    assert status == 200, (url, status, body[:500])
    return json.loads(body)


@dataclass
class Stack:
    env: dict  # what local.sh and the token-holding clients run with
    home: Path
    dashboard: int
    agent: int
    mlflow: int
    started: str  # local.sh start's output

    def pids(self) -> dict[str, int]:
        return {name: int((self.home / "run" / f"{name}.pid").read_text()) for name in ("ray", "mlflow")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``infra/local.sh start`` on free ports with its own home and token file; stopped by PID at the end (also when
    a test fails)."""
    root = tmp_path_factory.mktemp("stack")
    gcs, dashboard, client, agent, mlflow_port = _free_ports(5)
    # Ray's temp dir of its own (short: Ray's socket paths live under it), so that the address `ray start` records
    # there is not the machine's /tmp/ray/ray_current_cluster, which a driver of a test running beside this module
    # (pytest-xdist) would then join instead of starting its own cluster
    ray_tmp = tempfile.mkdtemp(prefix="kvpop-ray-")
    env = {**os.environ, "KVPOP_HOME": str(root / "home"), "RAY_PORT": str(gcs), "RAY_DASHBOARD_PORT": str(dashboard),
           "RAY_CLIENT_PORT": str(client), "RAY_DASHBOARD_AGENT_PORT": str(agent), "MLFLOW_PORT": str(mlflow_port),
           "PYTHON": sys.executable, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "ray_token"),
           "RAY_TMPDIR": ray_tmp}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    try:
        started = subprocess.run([LOCAL_SH, "start"], env=env, capture_output=True, text=True, timeout=240)
        assert started.returncode == 0, started.stdout + started.stderr
        yield Stack(env, root / "home", dashboard, agent, mlflow_port, started.stdout)
    finally:
        subprocess.run([LOCAL_SH, "stop"], env=env, capture_output=True, text=True, timeout=240)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _host_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (where a remote client would knock)."""
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


def test_token_file_is_private_and_start_says_how_to_pass_it(stack):
    token = Path(stack.env["RAY_AUTH_TOKEN_PATH"])
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) == 64
    assert "RAY_AUTH_MODE=token" in stack.started and str(token) in stack.started


def test_unauthenticated_job_submission_is_refused(stack, tmp_path):
    """The dashboard's jobs API and the dashboard agent's job endpoint (on every address it listens on) answer 401 to
    a submission without the token, and the command does not run."""
    marker = tmp_path / "ran"
    job = {"entrypoint": f"touch {marker}", "submission_id": "kvpop-unauthenticated"}
    targets = [f"http://127.0.0.1:{stack.dashboard}/api/jobs/"]
    targets += [f"http://{host}:{stack.agent}/api/job_agent/jobs/" for host in ["127.0.0.1", *_host_addresses()]]
    for url in targets:
        try:
            status, body = _request(url, job, timeout=10)
        except OSError:  # refused outright: as good
            continue
        assert status in (401, 403), (url, status, body[:300])
    no_token = {k: v for k, v in stack.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    listed = subprocess.run([RAY, "job", "list", "--address", f"http://127.0.0.1:{stack.dashboard}"], env=no_token,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode != 0 and "Authentication" in listed.stdout + listed.stderr
    time.sleep(2)
    assert not marker.exists()


def test_the_token_holder_runs_a_job_with_tasks(stack):
    """The documented client (RAY_AUTH_MODE=token + the token file): a job whose driver joins the cluster and runs a
    task on a worker."""
    code = "import ray; ray.init(); print('answer', ray.get(ray.remote(lambda: 6 * 7).remote()))"
    job = subprocess.run([RAY, "job", "submit", "--address", f"http://127.0.0.1:{stack.dashboard}", "--",
                          sys.executable, "-c", code], env=stack.env, capture_output=True, text=True, timeout=300)
    log = job.stdout + job.stderr
    assert job.returncode == 0 and "answer 42" in log, log[-3000:]


def _unauthenticated_answer(host: str, port: int) -> str | None:
    """What a request without the token gets from ``host:port``: None if it is refused (HTTP 401/403, gRPC
    UNAUTHENTICATED) or nothing listens any more, else what came back."""
    import http.client

    import grpc

    try:
        status, _ = _request(f"http://{host}:{port}/", timeout=5)
        return None if status in (401, 403) else f"HTTP {status}"
    except urllib.error.URLError as err:
        if isinstance(err.reason, ConnectionRefusedError):
            return None
    except (http.client.HTTPException, ConnectionError):  # not HTTP/1: a gRPC (HTTP/2) server
        pass
    codes = []
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        for method in GRPC_METHODS:
            try:
                channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)(b"", timeout=5)
                codes.append("OK")
            except grpc.RpcError as err:
                codes.append(err.code().name)
    finally:
        channel.close()
    return None if "UNAUTHENTICATED" in codes and "OK" not in codes else f"gRPC {codes}"


def test_nothing_listens_beyond_loopback_without_authentication(stack):
    """Every listening socket of the processes local.sh started (the head's session, workers included, and MLflow's)
    is on loopback, or refuses a request without the token."""
    import psutil

    sessions = {name: os.getsid(pid) for name, pid in stack.pids().items()}
    listening = []  # (session, process name, ip, port)
    for proc in psutil.process_iter(["name"]):
        try:
            sid = os.getsid(proc.pid)
            if sid in sessions.values():
                listening += [(sid, proc.info["name"], c.laddr.ip, c.laddr.port)
                              for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.Error, ProcessLookupError):  # gone meanwhile
            continue
    assert {"gcs_server", "raylet"} <= {name for _, name, _, _ in listening}, listening
    mlflow = [(ip, port) for sid, _, ip, port in listening if sid == sessions["mlflow"]]
    assert mlflow and all(ip in LOOPBACK for ip, _ in mlflow), mlflow
    open_ports = []
    for _, name, ip, port in listening:
        if ip not in LOOPBACK:
            host = ip.removeprefix("::ffff:")
            answer = _unauthenticated_answer("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)
            if answer is not None:
                open_ports.append((name, ip, port, answer))
    assert not open_ports, f"listening beyond loopback without authentication: {open_ports}"


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.pretrained  # the tiny teacher uses SmolLM2's tokenizer
def test_job_submit_runs_the_pipeline_and_mlflow_serves_the_eval_metrics(stack, tiny_setup, tmp_path):
    tracking = f"http://127.0.0.1:{stack.mlflow}"
    config = tmp_path / "tiny.yaml"  # the home comes from the head's KVPOP_HOME, the store is the server
    config.write_text(yaml.safe_dump({
        "name": "tiny-job", "model": {"path": str(tiny_setup / "teacher")},
        "data": {"source": str(tiny_setup / "docs.jsonl"), "seq_len": 64, "num_sequences": 4, "eval_sequences": 2},
        "budget": {"sink": 4, "window": 8, "topk": 16},
        "precompute": {"windows": [8], "top_k": 8, "sequences_per_shard": 2, "num_cpus_per_actor": 1},
        "train": {"scorer": "mlp", "steps": 2, "batch_size": 2, "num_workers": 1, "cpus_per_worker": 1,
                  "checkpoint_every": 2},
        "eval": {"budgets": [28, 20], "compression_ratios": [], "policies": ["dense", "streaming", "kvpop"],
                 "tasks": ["niah_single"], "task_samples": 1, "task_contexts": [128], "task_min_dense": 0.0,
                 "generation_prompts": 0, "max_new_tokens": 4, "batch_size": 2, "generation_batch_size": 2},
        "tracking": {"uri": tracking, "experiment": "jobs"}}))
    job = subprocess.run([RAY, "job", "submit", "--address", f"http://127.0.0.1:{stack.dashboard}",
                          "--working-dir", str(REPO_ROOT), "--runtime-env", "infra/runtime_env.yaml", "--",
                          "python", "-m", "jobs.pipeline", "--config", str(config)],
                         cwd=REPO_ROOT, env=stack.env, capture_output=True, text=True, timeout=480)
    log = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in log, log[-5000:]
    assert "[kvpop] 3/3 evaluate" in log
    assert list((stack.home / "targets").iterdir()) and list((stack.home / "runs").iterdir())  # the head's home

    # the MLflow server (on loopback, started by local.sh) serves the evaluate stage's metrics over REST
    api = f"{tracking}/api/2.0/mlflow"
    experiment = _get(f"{api}/experiments/get-by-name?experiment_name=jobs")["experiment"]
    assert f"open {tracking}/#/experiments/{experiment['experiment_id']}?workflowType=machine_learning" in log
    runs = _get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]],
                                       "filter": "tags.`kvpop.stage` = 'evaluate'"})["runs"]
    assert len(runs) == 1 and runs[0]["info"]["status"] == "FINISHED"
    metrics = {m["key"]: m["value"] for m in runs[0]["data"]["metrics"]}
    assert metrics["dense.B28.top1_agreement"] == 1.0
    for key in ("kvpop.B28.kl", "kvpop.B20.top1_agreement", "streaming.B20.token_acc", "kvpop.B20.recall_exact"):
        assert key in metrics, sorted(metrics)
    query = urllib.parse.urlencode({"run_id": runs[0]["info"]["run_id"], "metric_key": "kvpop.B20.kl"})
    history = _get(f"{api}/metrics/get-history?{query}")["metrics"]
    assert len(history) == 1 and history[0]["value"] == metrics["kvpop.B20.kl"] > 0
    train_runs = _get(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]],
                                             "filter": "tags.`kvpop.stage` = 'train'"})["runs"]
    assert {m["key"] for m in train_runs[0]["data"]["metrics"]} >= {"loss", "ret_loss", "kl", "boundary_acc"}


def test_stop_ends_both_by_pid(stack):
    """Last in this module: ``local.sh stop`` ends the head and the server it started (the fixture's stop is then a
    no-op)."""
    pids = stack.pids()
    stopped = subprocess.run([LOCAL_SH, "stop"], env=stack.env, capture_output=True, text=True, timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "ray head stopped" in stopped.stdout and "mlflow stopped" in stopped.stdout
    time.sleep(1)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for url in (f"http://127.0.0.1:{stack.dashboard}/api/version", f"http://127.0.0.1:{stack.mlflow}/health"):
        with pytest.raises(OSError):  # both gone
            urllib.request.urlopen(url, timeout=2)
    assert not (stack.home / "run" / "ray.pid").exists() and not (stack.home / "run" / "mlflow.pid").exists()


# --------------------------------------------------------------------------------------------- cluster manifests
def _commands(node: dict) -> str:
    return "\n".join(node) if isinstance(node, list) else str(node)


def test_the_uploaded_working_dir_stays_far_under_rays_request_limit():
    """``ray job submit --working-dir . --runtime-env infra/runtime_env.yaml`` zips what Ray's own walk keeps (its
    excludes and .gitignore) and the job server refuses a body over 100 MiB (HTTP 413: a results folder in the tree
    once passed it). The files it keeps, uncompressed, stay under Ray's size warning (half its
    limit)."""
    from ray._private.runtime_env.packaging import PACKAGE_SIZE_WARNING, _dir_travel, _get_excludes

    excludes = yaml.safe_load((REPO_ROOT / "infra" / "runtime_env.yaml").read_text())["excludes"]
    sizes = []
    _dir_travel(REPO_ROOT, [_get_excludes(REPO_ROOT, excludes)],
                lambda path: sizes.append(path.stat().st_size if path.is_file() else 0), include_gitignore=True)
    assert 100 < len(sizes) and sum(sizes) < min(PACKAGE_SIZE_WARNING, 50 * 2 ** 20), f"{sum(sizes)} bytes"


def test_cluster_launcher_keeps_ray_and_mlflow_behind_authentication():
    cluster = yaml.safe_load((REPO_ROOT / "infra" / "cluster.yaml").read_text())
    starts = _commands(cluster["head_start_ray_commands"]) + "\n" + _commands(cluster["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=disabled" not in (REPO_ROOT / "infra" / "cluster.yaml").read_text()
    for line in starts.splitlines():
        if "ray start" in line:
            assert "kvpop.env" in line, line  # every node starts Ray with RAY_AUTH_MODE=token and the token
    assert "--dashboard-host=0.0.0.0" not in starts  # the dashboard stays on the head's loopback (ray dashboard)
    mlflow = next(line for line in starts.splitlines() if "mlflow server" in line)
    assert "--app-name basic-auth" in mlflow
    secrets = _commands(cluster["head_setup_commands"])
    for key in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN=", "MLFLOW_TRACKING_USERNAME=", "MLFLOW_TRACKING_PASSWORD=",
                "MLFLOW_FLASK_SERVER_SECRET_KEY="):
        assert key in secrets, key
    assert "umask 077" in secrets


def test_kuberay_job_keeps_ray_and_mlflow_behind_authentication():
    job = yaml.safe_load((REPO_ROOT / "infra" / "kuberay-rayjob.yaml").read_text())
    spec = job["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"], *[g["template"] for g in spec["workerGroupSpecs"]],
            job["spec"]["submitterPodTemplate"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            if container["name"] == "mlflow":
                assert "--app-name" in container["command"] and "basic-auth" in container["command"]
                for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
                    assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "kvpop-auth", key
                continue
            assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "kvpop-auth", container["name"]
            if container["name"] != "submitter":
                assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kvpop-auth"
