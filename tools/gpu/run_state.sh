#!/usr/bin/env bash
# bash tools/gpu/run_state.sh TARBALL — the runs' state in $KVPOP_HOME as one tarball, what a later session restores
# into an empty home to resume (session.sh part recipe; device_poll.sh's backup): the MLflow store, each
# run's Ray Train snapshot and its checkpoints (Ray refuses a snapshot whose checkpoint is missing), and each final
# model there is. Fails where the home holds no checkpoint.
set -eu
tarball=$(realpath -m "${1:?usage: run_state.sh TARBALL}")
cd "${KVPOP_HOME:?}"
tar czf "$tarball" mlflow.db runs/*/checkpoint_manager_snapshot.json runs/*/checkpoint_[0-9]* \
  $(ls -d runs/*/final_model 2>/dev/null)
