#!/usr/bin/env bash
# bash /tmp/repo/tools/gpu/device_poll.sh SECONDS — on the device machine, after device_go.sh: wait up to SECONDS
# (less once session.sh has written "done"), print the progress and each log's last lines, then bring /tmp/r back
# through $OUT in 15 MB parts (r.tar.partaa, …; here: `cat r.tar.parta? | tar xf -`). While the session runs, a
# backup of the runs in $KVPOP_HOME goes with it (kvhome_backup.tgz, `python -m jobs.state export`: what part recipe's own
# tarball holds): if the machine is lost, the next session passes it as RECIPE_STATE and resumes from its last
# checkpoint.
[ -e "${GPU_DIR:-/tmp/gpu}/env.sh" ] || { echo "MACHINE GONE: a fresh machine, nothing installed"; exit 3; }
# a poll is a fresh shell: the stack's site folder (PYTHONPATH), for the backup's `python -m jobs.state export`
source "${GPU_DIR:-/tmp/gpu}/env.sh"
home=${KVPOP_HOME:-/tmp/kvhome}
end=$(($(date +%s) + ${1:?usage: device_poll.sh SECONDS}))
finished() { grep -q "^done " /tmp/r/progress.log 2>/dev/null; }
while [ "$(date +%s)" -lt "$end" ] && ! finished; do sleep 5; done
cat /tmp/r/progress.log /tmp/r/*/progress.log 2>/dev/null; date +%T
for f in /tmp/r/*.log /tmp/r/*/*.log; do
  [ -e "$f" ] && { echo "== $f"; tail -c 700 "$f" | tr '\r' '\n' | grep -v '^\s*$' | tail -4; }
done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
# the session's own tarballs hold the state once it is done: no stale backup beside them
if finished; then rm -f /tmp/r/kvhome_backup.tgz
elif ls -d "$home"/runs/*/checkpoint_[0-9]* > /dev/null 2>&1; then
  (cd "$(dirname "$0")/../.." && KVPOP_HOME=$home python -m jobs.state export --out /tmp/r/kvhome_backup.tgz)
fi
cd /tmp/r && tar cf - --exclude='./.unpack.lock' . | split -b 15M - "${OUT:?}/r.tar.part"
ls -la "$OUT"
