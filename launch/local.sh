#!/usr/bin/env bash
# Start N processes of `python -m jaxtrain ARGS...` on this machine as one multi-process JAX job.
#
#   launch/local.sh N train run.dir=/tmp/m runtime.cpu_devices=4 mesh.dcn.data=2 mesh.ici.fsdp=4
#
# Process i gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i, and process
# 0's coordination service listens on loopback only (JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:<port>; JAX alone would
# listen on every interface, [::]:<port>); its output lines are prefixed with "[i] ". SIGINT/SIGTERM are forwarded to every process (they stop at a step they agree on
# and checkpoint it). If any process fails, the others are stopped and the launcher exits with the failing status.
# PYTHON (default python3) picks the interpreter; GRACE_S (default 20) is how long stopped processes get before
# SIGKILL. Gloo's "[Gloo] Rank i is connected to j peer ranks" lines (printed by the C++ library on every CPU job's
# start, one per process and peer group) are dropped: they say nothing a user can act on. Ctrl-C stops the job as it
# stops one process: every process checkpoints the step they agree on and exits 75 (stopped before train.steps;
# not a failure: the others are left to finish), and so does the launcher.
#
# On a GPU host each process gets its own GPUs: the G GPUs this shell sees (CUDA_VISIBLE_DEVICES, else
# `nvidia-smi -L`; JAXTRAIN_LOCAL_GPUS=G overrides) are split into N equal blocks, and process i gets
# JAX_LOCAL_DEVICE_IDS=<block i> (JAX's own variable: the process creates, and preallocates memory on, those GPUs
# only). Without this every process would open every GPU and preallocate 75% of each. N must divide G.
set -u
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/local.sh N COMMAND [ARGS...]   (N >= 1 processes of python -m jaxtrain COMMAND ARGS...)" >&2
  exit 2
fi
n=$1; shift
python=${PYTHON:-python3}
grace=${GRACE_S:-20}
# Environment values are data, never code: bash would evaluate GRACE_S inside $(( )) below.
if ! [[ "$grace" =~ ^[0-9]+$ ]]; then
  echo "launch/local.sh: GRACE_S=$grace must be a whole number of seconds" >&2
  exit 2
fi
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

if [ -n "${JAXTRAIN_LOCAL_GPUS:-}" ]; then
  gpus=$JAXTRAIN_LOCAL_GPUS
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
elif command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
else
  gpus=0
fi
if ! [[ "$gpus" =~ ^[0-9]+$ ]] || { [ "$gpus" -gt 0 ] && [ $((gpus % n)) -ne 0 ]; }; then
  echo "launch/local.sh: $n processes cannot share $gpus GPUs equally; use N dividing the GPU count" >&2
  exit 2
fi

# Each process's output filter: drops gloo's connection lines and prefixes the rest with "[i] ". Gloo prints its line
# from one thread per device, piece by piece (`<<` by `<<`) into the C library's buffer, which is flushed at each
# thread's end of line: the pieces of several threads interleave, so a line can end in another thread's
# "[Gloo] Rank " and the next start with its "2 is connected to ...". Dropped: lines made of those pieces only, whole
# messages anywhere (also inside a Python line written between two flushes), and pieces trailing a line from a
# "[Gloo] Rank " on. Also dropped: JAX's "preemption_notifier.cc:...] SIGTERM caught at ..." (it says SIGTERM for a
# Ctrl-C too, which jaxtrain passes on as SIGTERM; each process says itself what it received). It ignores SIGINT and
# SIGTERM: Ctrl-C in a terminal signals the whole foreground process group, filters included, and a filter that died
# would leave its process writing into a closed pipe (a broken-pipe exit instead of the clean stop the signal asks
# for). A filter ends when its process's output closes.
gloo_piece='(\[Gloo\] Rank ?|[0-9]+| ?is connected to ?| ?peer ranks\. ?| ?Expected number of connected peer ranks is : ?)'
gloo_line='\[Gloo\] Rank [0-9]+ is connected to [0-9]+ peer ranks\. Expected number of connected peer ranks is : [0-9]+'
prefix() {
  trap '' INT TERM
  exec sed -u -E -e "/^$gloo_piece+\$/d" -e '/preemption_notifier\.cc:[0-9]+\] SIGTERM caught at /d' \
    -e '/\[Gloo\] Rank/{' -e "s/$gloo_line//g" -e "s/\[Gloo\] Rank ?$gloo_piece*\$//" -e '/^[[:space:]]*$/d' -e '}' \
    -e "s/^/[$1] /"
}

pids=()
for ((i = 0; i < n; i++)); do
  ids=${JAX_LOCAL_DEVICE_IDS:-}
  if [ "$gpus" -gt 0 ]; then
    per=$((gpus / n))
    ids=$(seq -s, $((i * per)) $((i * per + per - 1)))
  fi
  JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$port \
    JAX_NUM_PROCESSES=$n JAX_PROCESS_ID=$i JAX_LOCAL_DEVICE_IDS=$ids \
    "$python" -u -m jaxtrain "$@" > >(prefix "$i") 2>&1 &
  pids+=($!)
done

forward() {
  for pid in "${pids[@]}"; do kill -"$1" "$pid" 2>/dev/null; done
}
trap 'forward TERM' TERM
trap 'forward INT' INT

stop_all() {  # TERM, then KILL whatever is left after the grace period
  forward TERM
  local deadline=$((SECONDS + grace))
  while [ $SECONDS -lt $deadline ]; do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && return
    sleep 0.2
  done
  forward KILL
}

status=0
early=0  # a process exited 75 (jaxtrain.errors.EXIT_PREEMPTED): it saved and stopped early, as its peers will
live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
  wait -n -p done_pid "${live[@]}" 2>/dev/null
  rc=$?
  if [ -z "${done_pid:-}" ]; then
    # Interrupted by a forwarded signal, or the remaining children were already reaped (they ended together):
    # keep only the ones still running.
    next=()
    for pid in "${live[@]}"; do kill -0 "$pid" 2>/dev/null && next+=("$pid"); done
    live=("${next[@]}")
    continue
  fi
  next=()
  for pid in "${live[@]}"; do [ "$pid" != "$done_pid" ] && next+=("$pid"); done
  live=("${next[@]}")
  if [ $rc -eq 75 ]; then
    early=1
  elif [ $rc -ne 0 ] && [ $status -eq 0 ]; then
    for ((i = 0; i < n; i++)); do [ "${pids[$i]}" = "$done_pid" ] && idx=$i; done
    echo "launch/local.sh: process ${idx:-?} exited with status $rc; stopping the others" >&2
    status=$rc
    stop_all
  fi
  unset done_pid
done
wait  # let the output prefixers flush
[ $status -eq 0 ] && [ $early -eq 1 ] && status=75
exit $status
