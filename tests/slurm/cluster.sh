#!/usr/bin/env bash
# A Slurm cluster on 127.0.0.1 for tests: `cluster.sh start DIR [GPUS] [NODES]` / `cluster.sh stop DIR`.
#
# Needs Debian's slurmctld, slurmd and slurm-client (22.05; .ci/run installs them) and root. Everything lives under
# DIR; stop kills exactly the daemons start launched, by their pid files.
#
# GPUS (default 8) stand-in GPUs are described to Slurm as GRES (gres.conf `Name=gpu File=DIR/dev/nvidia[0-N]`,
# character devices made with mknod, or plain files where mknod is not allowed). Without cgroups (task/none) Slurm
# does not fence the files, but its gres/gpu plugin still allocates them and sets CUDA_VISIBLE_DEVICES and
# SLURM_GPUS_ON_NODE per step and task exactly as on a GPU node, which is what the tests check.
# The node declares 16 CPUs (SlurmdParameters=config_overrides lets slurmd accept more than the machine has) so that
# 8 tasks per node fit without --overcommit.
# Partitions: `debug` (default), and `low`/`high` for preemption: a job in `high` preempts (requeues) one in `low`
# after the low partition's GraceTime; SlurmctldParameters=preempt_send_user_signal (Slurm 22.05's spelling; later
# releases: PreemptParameters=send_user_signal) makes Slurm send the job's --signal at preemption time.
# AuthInfo=cred_expire=10: a requeued job waits the credential lifetime before it may start again (default 120 s,
# two minutes of every requeue test for nothing). KillWait=5: a task that ignores SIGTERM (a frozen one) is killed
# after 5 s instead of 30.
#
# NODES=2: two Slurm nodes on this one machine, each with its own slurmd (Slurm's "multiple slurmd" mode: one
# NodeName per daemon, all with NodeHostname=this host, NodeAddr=127.0.0.1 and their own Port, started as
# `slurmd -N NAME`; Debian's 22.05 build allows it, seen here). The nodes are named after this host (as in the
# one-node cluster) and `localhost`: names that resolve to this machine anywhere, because JAX's coordinator address
# is the first node's name (Slurm sorts them: `localhost` is node 0). Each node has GPUS stand-in GPUs (the same
# files) and 16 CPUs; each daemon has its own spool directory, pid file and log (%n in slurm.conf: the node's name).
set -euo pipefail
cmd=$1; dir=$(realpath -m "$2"); gpus=${3:-8}; nodes=${4:-1}
conf=$dir/slurm.conf
case "$nodes" in
  1) names=("$(hostname -s)") ;;
  2) names=("$(hostname -s)" localhost) ;;
  *) echo "cluster.sh: NODES=$nodes must be 1 or 2" >&2; exit 2 ;;
esac
case "$cmd" in
start)
  mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/dev"
  for ((g = 0; g < gpus; g++)); do
    [ -e "$dir/dev/nvidia$g" ] || mknod "$dir/dev/nvidia$g" c 1 3 2>/dev/null || touch "$dir/dev/nvidia$g"
  done
  node=${names[0]}
  all=$(IFS=,; echo "${names[*]}")
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 / nodes ))
  : > "$dir/gres.conf"
  for name in "${names[@]}"; do
    echo "NodeName=$name Name=gpu File=$dir/dev/nvidia[0-$((gpus - 1))]" >> "$dir/gres.conf"
  done
  slurmd_port=$((18000 + RANDOM % 1000))
  cat > "$conf" <<CONF
ClusterName=jaxtrain-test
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
AuthInfo=cred_expire=10
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
GresTypes=gpu
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
SchedulerParameters=sched_interval=2
KillWait=5
ReturnToService=2
SlurmctldPort=$((17000 + RANDOM % 1000))
SlurmdPort=$slurmd_port
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
JobCompType=jobcomp/none
CONF
  for ((i = 0; i < nodes; i++)); do
    port=
    ((nodes == 1)) || port=" NodeHostname=$(hostname -s) Port=$((slurmd_port + i))"
    echo "NodeName=${names[i]}$port NodeAddr=127.0.0.1 CPUs=16 RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN" >> "$conf"
  done
  cat >> "$conf" <<CONF
PartitionName=debug Nodes=$all Default=YES MaxTime=INFINITE State=UP
PartitionName=low Nodes=$all MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=high Nodes=$all MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
  export SLURM_CONF=$conf
  slurmctld -f "$conf"
  for name in "${names[@]}"; do
    mkdir -p "$dir/spool/$name"
    if ((nodes == 1)); then slurmd -f "$conf"; else slurmd -f "$conf" -N "$name"; fi
  done
  for _ in $(seq 100); do
    idle=$(sinfo -h -N -p debug -o %T 2>/dev/null | grep -cE '^idle' || true)
    [ "$idle" -eq "$nodes" ] && { echo "slurm up: $conf"; exit 0; }
    sleep 0.2
  done
  echo "slurm did not come up; logs:" >&2; tail -n 20 "$dir"/log/*.log >&2; exit 1
  ;;
stop)
  for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  ;;
*) echo "usage: cluster.sh start DIR [GPUS] [NODES] | stop DIR" >&2; exit 2 ;;
esac
