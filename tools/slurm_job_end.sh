#!/usr/bin/env bash
# A Slurm trigger program: reports a job's end as a training event (references/events.md), also
# when the job's own exit trap could not run (its node died). Set it per job, as the SlurmUser:
#   strigger --set --jobid JOB --fini --program /path/to/megatron-core-training/tools/slurm_job_end.sh
# Slurm runs it on the controller's host with the job id as its argument. The run is the one the
# job's comment names (render writes it there), else the job's working folder. The job's nodes
# (its NodeList, e.g. gpu[03-04]) go with the event: a resume after a node failure leaves them out.
# MEGATRON_SKILL_EVENTS_URL, _TOKEN and _SECRET (or _SECRET_FILE) come from the controller's
# environment; without them the event is only recorded in the run directory.
set -u
usage() {
  sed -n '2,9s/^# \{0,1\}//p' "$0"
  echo "usage: slurm_job_end.sh JOB_ID"
}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  ''|-*) usage >&2; exit 2 ;;
esac
job=$1
info=$(scontrol show job "$job" 2>/dev/null) || exit 0
field() { printf '%s\n' "$info" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1; }
comment=$(field Comment)
workdir=$(field WorkDir)
run_id=$(basename "$workdir")
# A script render wrote names its run (megatron-skill:RUN_ID:RUN_DIR) in the job's comment.
case "$comment" in
  megatron-skill:*:/*) rest=${comment#megatron-skill:}; run_id=${rest%%:*}; workdir=${rest#*:} ;;
esac
state=$(field JobState)
nodes=$(field NodeList)
code=$(field ExitCode)  # STATUS:SIGNAL
restarts=$(field Restarts)  # the attempt Slurm's requeues are at (0 for the first)
status=${code%%:*}
signal=${code##*:}
if [ "${signal:-0}" != 0 ]; then status=$((128 + signal)); fi
case "$state" in
  NODE_FAIL) failure=node_failure ;;
  TIMEOUT|CANCELLED|PREEMPTED|DEADLINE) failure=killed ;;
  *) failure= ;;
esac
# A job Slurm ended (a failed node, the time limit) can carry status 0: it did not finish.
if [ "$state" != COMPLETED ] && [ "${status:-0}" = 0 ]; then status=1; fi
details="{\"message\": \"Slurm job $job: $state\"${failure:+, \"failure\": \"$failure\"}}"
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python3}" "$here/emit_event.py" send --end --exit-code "${status:-1}" --emitter scheduler \
  --scheduler slurm --job-id "$job" ${restarts:+--attempt "$restarts"} --run-id "$run_id" --run-dir "$workdir" \
  ${nodes:+--nodes "$nodes"} \
  --log "$workdir/logs/train.log" --details "$details"
