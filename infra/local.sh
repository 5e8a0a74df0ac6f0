#!/usr/bin/env bash
# A local Ray head (token authentication on) and an MLflow server on loopback, started and stopped by PID.
#
#   infra/local.sh start    # Ray head (dashboard/jobs API on 127.0.0.1:8265) + `mlflow server` on 127.0.0.1:5001
#   infra/local.sh status
#   infra/local.sh stop
#
# Then, from the repository root (clients pass the token: RAY_AUTH_MODE=token, and the token from ~/.ray/auth_token):
#   RAY_AUTH_MODE=token .venv/bin/ray job submit --address http://127.0.0.1:8265 --working-dir . \
#     --runtime-env infra/runtime_env.yaml -- python -m jobs.pipeline
# (a plain `.venv/bin/python -m jobs.<stage>` on this machine joins the running head too: pipelines/cluster.py).
#
# Security. Ray's token authentication stays on (RAY_AUTH_MODE=token): the dashboard, the jobs API, the dashboard
# agent's job endpoint and every gRPC service (GCS, raylet, object manager, workers, Ray Client) refuse a request
# without the token — with auth off, a POST to the agent's job endpoint on the host's address ran any shell command.
# Ray binds the dashboard to 127.0.0.1 (--dashboard-host) but its node services to the host's address (it replaces
# a loopback node IP by that address), so the token, not the bind address, is what guards them; the Prometheus
# metrics endpoints, which need no token, are turned off (below). The token is Ray's own:
# $RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (which a local `ray.init()` also uses),
# generated here (mode 600) when missing. MLflow listens on 127.0.0.1 only.
#
# The head runs as `ray start --head --block` in its own session; `stop` sends SIGTERM to that one PID, which drains
# and stops the processes it started — never `ray stop`, which would stop every Ray instance of this user on the
# machine (a test session's, another checkout's). It then forgets the head's address in Ray's
# <temp dir>/ray_current_cluster, which a later `ray.init()` would otherwise try to join.
#
# Environment: KVPOP_HOME (default <repo>/.kvpop; exported to the head, so every submitted job finds the same models,
# shards, runs and MLflow store), RAY_NUM_CPUS (default 4: logical CPUs, oversubscribed on purpose — docs/ENVIRONMENT.md: a Ray
# Train worker group fed by Ray Data deadlocks when it holds every CPU), ports: RAY_PORT (GCS, 6379),
# RAY_DASHBOARD_PORT (jobs API, 8265), RAY_CLIENT_PORT (10001), RAY_DASHBOARD_AGENT_PORT (52365), MLFLOW_PORT (5001;
# `mlflow ui` keeps its default 5000); PYTHON (default <repo>/.venv/bin/python). Waits up to START_TIMEOUT seconds
# (90) for both to answer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
export KVPOP_HOME=${KVPOP_HOME:-$root/.kvpop}
run=$KVPOP_HOME/run
py=${PYTHON:-$root/.venv/bin/python}
bin=$(dirname "$py")
gcs_port=${RAY_PORT:-6379}
dash_port=${RAY_DASHBOARD_PORT:-8265}
client_port=${RAY_CLIENT_PORT:-10001}
agent_port=${RAY_DASHBOARD_AGENT_PORT:-52365}
mlflow_port=${MLFLOW_PORT:-5001}
timeout=${START_TIMEOUT:-90}
export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
# Prometheus endpoints need no token and listen on every interface: the agents' exporter has a switch; the dashboard's
# and the autoscaler's have none, and an impossible port makes their start fail (logged once), leaving nothing there.
export RAY_enable_metrics_collection=0 DASHBOARD_METRIC_PORT=-1 AUTOSCALER_METRIC_PORT=-1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # pipelines/offline.py
# no Serve here: the head stops at once on SIGTERM instead of draining the node for 30 s
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
export PATH="$bin:$PATH"  # a job's entrypoint `python -m jobs.…` must find this interpreter, not the system one

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

answers='import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError:
    pass  # an HTTP status (401 without the token) is an answer'
wait_http() {  # wait_http URL PIDFILE NAME: until URL answers, the process dies, or the timeout
  local deadline=$((SECONDS + timeout))
  until "$py" -c "$answers" "$1" 2>/dev/null; do
    if ! alive "$2"; then echo "$3 exited during start-up (log: ${2%.pid}.log)" >&2; return 1; fi
    if [ $SECONDS -ge $deadline ]; then echo "$3 did not answer on $1 within ${timeout}s (log: ${2%.pid}.log)" >&2; return 1; fi
    sleep 1
  done
}

token_from=  # where the head's token comes from, for the start message
ensure_token() {  # the token Ray reads (see the header); a missing default or RAY_AUTH_TOKEN_PATH file is generated
  if [ -n "${RAY_AUTH_TOKEN:-}" ]; then token_from='$RAY_AUTH_TOKEN'; return 0; fi
  local file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
  if [ ! -s "$file" ]; then
    (umask 077 && mkdir -p "$(dirname "$file")" &&
      "$py" -c "import secrets; print(secrets.token_hex(32), end='')" >"$file")
    echo "generated a Ray auth token in $file"
  fi
  chmod 600 "$file"
  token_from=$file
}

start() {
  mkdir -p "$run"
  ensure_token
  if alive "$run/ray.pid"; then echo "ray head already running (pid $(cat "$run/ray.pid"))"; else
    # the head in the foreground (--block) of its own session (setsid): its PID owns every process it starts
    setsid "$bin/ray" start --head --block --port="$gcs_port" \
      --dashboard-host=127.0.0.1 --dashboard-port="$dash_port" --ray-client-server-port="$client_port" \
      --dashboard-agent-listen-port="$agent_port" --num-cpus="${RAY_NUM_CPUS:-4}" --disable-usage-stats \
      >"$run/ray.log" 2>&1 </dev/null &
    echo $! >"$run/ray.pid"
    echo "127.0.0.1:$gcs_port" >"$run/ray.address"
  fi
  if alive "$run/mlflow.pid"; then echo "mlflow already running (pid $(cat "$run/mlflow.pid"))"; else
    mkdir -p "$KVPOP_HOME/mlartifacts"
    # job execution off and one worker: answers in ~11 s and exits cleanly (docs/ENVIRONMENT.md)
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$bin/mlflow" server --workers 1 --host 127.0.0.1 \
      --port "$mlflow_port" --backend-store-uri "sqlite:///$KVPOP_HOME/mlflow.db" \
      --default-artifact-root "$KVPOP_HOME/mlartifacts" >"$run/mlflow.log" 2>&1 </dev/null &
    echo $! >"$run/mlflow.pid"
  fi
  wait_http "http://127.0.0.1:$dash_port/api/version" "$run/ray.pid" "ray head" || { stop; exit 1; }
  echo "ray head: http://127.0.0.1:$dash_port (GCS port $gcs_port, pid $(cat "$run/ray.pid"), log $run/ray.log)"
  echo "  token auth on: clients set RAY_AUTH_MODE=token and read the token from $token_from"
  wait_http "http://127.0.0.1:$mlflow_port/health" "$run/mlflow.pid" "mlflow" || { stop; exit 1; }
  echo "mlflow: http://127.0.0.1:$mlflow_port (pid $(cat "$run/mlflow.pid"), log $run/mlflow.log)"
}

stop_pid() {  # stop_pid PIDFILE NAME [group]: SIGTERM the PID (or its process group), wait, then SIGKILL what is left
  local pid target
  [ -f "$1" ] || return 0
  pid=$(cat "$1")
  target=$pid; [ "${3:-}" = group ] && target=-$pid
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "$target" 2>/dev/null || true
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    echo "$2 stopped (pid $pid)"
  fi
  kill -KILL -- "-$pid" 2>/dev/null || true  # stragglers of its session (setsid: the PID is the group id)
  rm -f "$1"
}

stop() {
  stop_pid "$run/mlflow.pid" mlflow group  # gunicorn/uvicorn workers too
  # the head's own SIGTERM handler drains the node and stops every process it started (ray start --block)
  stop_pid "$run/ray.pid" "ray head"
  if [ -f "$run/ray.address" ]; then
    "$py" - "$(cat "$run/ray.address")" <<'EOF'
import sys
from ray._common.utils import get_ray_address_file, reset_ray_address
try:
    recorded = open(get_ray_address_file(None)).read().strip()
except OSError:
    recorded = None
if recorded and recorded.rsplit(":", 1)[-1] == sys.argv[1].rsplit(":", 1)[-1]:
    reset_ray_address(None)  # only ours: another `ray start` recorded since stays
EOF
    rm -f "$run/ray.address"
  fi
}

status() {
  if alive "$run/ray.pid"; then echo "ray head: pid $(cat "$run/ray.pid"), http://127.0.0.1:$dash_port"; else echo "ray head: not running"; fi
  if alive "$run/mlflow.pid"; then echo "mlflow: pid $(cat "$run/mlflow.pid"), http://127.0.0.1:$mlflow_port"; else echo "mlflow: not running"; fi
}

case "${1:-}" in start) start;; stop) stop;; status) status;; *) echo "usage: $0 start|stop|status" >&2; exit 2;; esac
