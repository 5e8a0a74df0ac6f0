#!/usr/bin/env bash
# A local Ray head and an MLflow server on loopback, started and stopped by PID.
#
#   infra/local.sh start    # Ray head (dashboard/jobs on 127.0.0.1:8265) + `mlflow server` on 127.0.0.1:5000
#   infra/local.sh status
#   infra/local.sh stop
#
# Then: RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . --runtime-env infra/runtime_env.yaml \
#         -- python -m jobs.pipeline
# Environment: KVPOP_HOME (default <repo>/.kvpop), RAY_NUM_CPUS (default 4: logical CPUs, oversubscribed on purpose —
# NOTES.md: a Ray Train worker group fed by Ray Data deadlocks when it holds every CPU), MLFLOW_PORT (5000).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
export KVPOP_HOME=${KVPOP_HOME:-$root/.kvpop}
run=$KVPOP_HOME/run
mkdir -p "$run"
py=${PYTHON:-$root/.venv/bin/python}
bin=$(dirname "$py")
port=${MLFLOW_PORT:-5000}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}

start() {
  if [ -f "$run/ray.started" ]; then echo "ray head already started (infra/local.sh stop first)"; else
    "$bin/ray" start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --dashboard-port=8265 \
      --num-cpus="${RAY_NUM_CPUS:-4}" --disable-usage-stats >"$run/ray.log" 2>&1
    touch "$run/ray.started"
    echo "ray head: http://127.0.0.1:8265 (log $run/ray.log)"
  fi
  if [ -f "$run/mlflow.pid" ] && kill -0 "$(cat "$run/mlflow.pid")" 2>/dev/null; then echo "mlflow already running"; else
    # job execution off and one worker: answers in ~11 s and exits cleanly (NOTES.md)
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$bin/mlflow" server --workers 1 --host 127.0.0.1 --port "$port" \
      --backend-store-uri "sqlite:///$KVPOP_HOME/mlflow.db" --default-artifact-root "$KVPOP_HOME/mlartifacts" \
      >"$run/mlflow.log" 2>&1 &
    echo $! >"$run/mlflow.pid"
    echo "mlflow: http://127.0.0.1:$port (pid $(cat "$run/mlflow.pid"), log $run/mlflow.log)"
  fi
}

stop() {
  if [ -f "$run/mlflow.pid" ]; then
    pid=$(cat "$run/mlflow.pid")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true  # its process group: gunicorn workers too
    rm -f "$run/mlflow.pid"; echo "mlflow stopped"
  fi
  if [ -f "$run/ray.started" ]; then "$bin/ray" stop --force >/dev/null 2>&1 || true; rm -f "$run/ray.started"; echo "ray stopped"; fi
}

status() {
  [ -f "$run/ray.started" ] && "$bin/ray" status 2>/dev/null | head -20 || echo "ray: not started here"
  if [ -f "$run/mlflow.pid" ] && kill -0 "$(cat "$run/mlflow.pid")" 2>/dev/null; then echo "mlflow: pid $(cat "$run/mlflow.pid")"; else echo "mlflow: not running"; fi
}

case "${1:-}" in start) start;; stop) stop;; status) status;; *) echo "usage: $0 start|stop|status" >&2; exit 2;; esac
