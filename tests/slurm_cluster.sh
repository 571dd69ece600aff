#!/usr/bin/env bash
# Start a one-node Slurm cluster on localhost (munge, slurmctld, slurmd) for the tests.
# Usage: tests/slurm_cluster.sh start|stop. Needs root and Debian's slurmctld, slurmd, munge.
set -euo pipefail
STATE=${SLURM_TEST_STATE:-/tmp/megatron-skill-slurm}
CONF=/etc/slurm/slurm.conf

start() {
  mkdir -p "$STATE"/{spool,ctld,log} /run/munge /var/log/munge /var/lib/munge
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  [ -s /etc/munge/munge.key ] || mungekey --create >/dev/null 2>&1 || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force 2>/dev/null || /usr/sbin/munged --force
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2/1024*0.9)}' /proc/meminfo)
  cat > "$CONF" <<CONF
ClusterName=skilltest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
  pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
  for _ in $(seq 1 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then echo "slurm: up on $host" >&2; return 0; fi
    scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm: did not come up; see $STATE/log" >&2
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
}

"${1:-start}"
