#!/usr/bin/env bash
# A one-node Slurm cluster on 127.0.0.1 for tests: `cluster.sh start DIR` / `cluster.sh stop DIR`.
# Needs Debian's slurmctld, slurmd and slurm-client (.ci/run installs them) and root. Everything lives under DIR;
# stop kills exactly the daemons start launched, by their pid files.
set -euo pipefail
cmd=$1; dir=$(realpath -m "$2")
conf=$dir/slurm.conf
case "$cmd" in
start)
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  node=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
  cat > "$conf" <<CONF
ClusterName=jaxtrain-test
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldPort=$((17000 + RANDOM % 1000))
SlurmdPort=$((18000 + RANDOM % 1000))
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
JobCompType=jobcomp/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  export SLURM_CONF=$conf
  slurmctld -f "$conf"
  slurmd -f "$conf"
  for _ in $(seq 100); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^idle' && { echo "slurm up: $conf"; exit 0; }
    sleep 0.2
  done
  echo "slurm did not come up; logs:" >&2; tail -n 20 "$dir"/log/*.log >&2; exit 1
  ;;
stop)
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  ;;
*) echo "usage: cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
