#!/usr/bin/env bash
# The first minutes on a GPU node (1 or 8 GPUs, jax 0.11), in one call: under 9 minutes (--budget, default 520 s,
# the kill grace of a cut section included) with set-up, every section under its own limit (cut to what the budget
# leaves), ordered by value:
#   0. set-up: carried wheels installed (--wheels), everything imported, versions, driver/plugin verdict; stops in
#      seconds, naming what is missing, if anything the sections need is not importable or no GPU is visible;
#   1. the ~1B model's train step (configs/1b.yaml, 4 x 4096 tokens per GPU, remat save_matmuls): step time,
#      tokens/s, MFU with model.attention=auto (cuDNN) and the flash kernels (triton, pallas)
#      (benchmarks/gpu_step.py: no data pipeline, no evaluation, no checkpoint);
#   2. the flash-attention tests on the GPU (values and gradients against float64, both impls);
#   3. the attention benchmark (python -m jaxtrain.kernels.bench): head dims 64/128, GQA groups 1/4/8, causal without and with
#      document masking; pallas, triton, cuDNN, XLA; TFLOP/s and the ratio to cuDNN;
#   4. the rest: the 1B step with XLA attention; `jaxtrain train` end to end (125m, each attention impl).
# Each section appends one JSON line to OUT/results.jsonl the moment it ends (section, status, seconds, figures),
# so a section cut by its limit loses only itself. Exit status: the number of failed sections (3 for a failed
# set-up, 2 for bad arguments).
#
# usage: benchmarks/gpu_check.sh [--smoke] [--out DIR] [--wheels DIR] [--budget S]
#        benchmarks/gpu_check.sh --fetch-wheels DIR
#   --smoke         on a CPU: the same sections at toy sizes (interpret-mode kernels, the tiny model), to check the
#                   script end to end; its numbers mean nothing
#   --out           where reports go (default: a new temporary directory)
#   --wheels        wheels to install first (pip --no-index --no-deps into a private target): what the GPU image
#                   lacks, fetched beforehand with --fetch-wheels
#   --budget        seconds for the whole run, set-up included (default 520; --smoke: 3000)
#   --fetch-wheels  on a machine with a package registry: download into DIR the wheels the GPU image lacks for
#                   Python 3.12 / manylinux x86_64 (grain and its array-record and portpicker, jax-triton 0.3.1,
#                   tensorboardX) and exit
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

SMOKE=0
OUT=""
WHEELS=""
FETCH=""
BUDGET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT="${2:?--out needs a directory}"; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift ;;
    --fetch-wheels) FETCH="${2:?--fetch-wheels needs a directory}"; shift ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'; valid: --smoke, --out DIR, --wheels DIR, --budget S," \
            "--fetch-wheels DIR" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"

# The wheels the GPU image (Python 3.12, jax 0.11.2 + CUDA 13 plugin, flax, optax, orbax, triton 3.6, numpy,
# pyyaml, safetensors, prometheus-client, matplotlib, tensorboard, etils, psutil, ...) lacks: grain and the two of
# its requirements the image does not have, jax-triton (0.3.1: the last that takes triton 3.6), tensorboardX.
GPU_WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 jax-triton==0.3.1 tensorboardX==2.6.5)
if [ -n "$FETCH" ]; then
  mkdir -p "$FETCH" || { echo "gpu_check.sh: cannot create --fetch-wheels '$FETCH'" >&2; exit 2; }
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$FETCH" "${GPU_WHEELS[@]}" || { echo "gpu_check.sh: pip download failed" >&2; exit 1; }
  ls -l "$FETCH"/*.whl
  du -ch "$FETCH"/*.whl | tail -n 1
  exit 0
fi
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
  echo "gpu_check.sh: --wheels '$WHEELS' is not a directory" >&2; exit 2
fi
if [ -z "$BUDGET" ]; then BUDGET=$([ "$SMOKE" = 1 ] && echo 3000 || echo 520); fi
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check.sh: --budget '$BUDGET' must be whole seconds" >&2; exit 2 ;; esac
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$OUT" || { echo "gpu_check.sh: cannot create --out '$OUT'" >&2; exit 2; }
RESULTS="$OUT/results.jsonl"
FAILED=0
START=$(date +%s)

elapsed() { echo $(( $(date +%s) - START )); }
section() { echo; echo "== $1 ($(elapsed) s elapsed)"; }
# record NAME STATUS SECONDS [JSON object of figures]: one line of results.jsonl.
record() {
  local extra="${4:-}"; [ -n "$extra" ] || extra='{}'
  "$PY" - "$RESULTS" "$1" "$2" "$3" "$extra" "$(elapsed)" <<'EOF'
import json, sys
path, name, status, seconds, extra, elapsed = sys.argv[1:]
try:
    extra = json.loads(extra)
except ValueError:
    extra = {"output": extra[-500:]}
with open(path, "a") as f:
    f.write(json.dumps({"section": name, "status": status, "seconds": int(seconds), "elapsed": int(elapsed),
                        **extra}) + "\n")
EOF
}
# run LIMIT NAME CMD...: a section under min(LIMIT, what the budget leaves); its failure is counted, not fatal;
# its stdout is kept in OUT/NAME.log and shown; the last JSON line it prints becomes its figures.
run() {
  local limit="$1" name="$2"; shift 2
  local left=$(( BUDGET - $(elapsed) - 5 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "!! $name: skipped, the ${BUDGET} s budget is spent"; record "$name" skipped 0; return
  fi
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? seconds=$(( $(date +%s) - t0 ))
  tail -n 15 "$OUT/$name.log"
  local figures; figures=$(grep '^{' "$OUT/$name.log" | tail -n 1)
  if [ "$rc" -eq 0 ]; then
    record "$name" ok "$seconds" "$figures"
  else
    FAILED=$((FAILED + 1))
    local why="exit status $rc"; [ "$rc" -eq 124 ] && why="stopped after its ${limit} s limit"
    echo "!! $name: $why"
    record "$name" "failed: $why" "$seconds" "$figures"
  fi
}

section "set-up: wheels, imports, versions and devices"
SITE="$OUT/site"
if [ -n "$WHEELS" ]; then
  if ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl; then
    echo "!! set-up: installing the wheels in '$WHEELS' failed"; record setup "failed: wheels" "$(elapsed)"; exit 3
  fi
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" - "$SMOKE" <<'EOF'
import importlib, platform, sys
smoke = sys.argv[1] == "1"
needed = ["jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "grain", "tensorboardX", "numpy", "yaml",
          "safetensors", "ml_dtypes", "prometheus_client", "matplotlib", "pytest", "jaxtrain", "kernels"]
if not smoke:
    needed += ["triton", "jax_triton"]
missing = []
for name in needed:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - name every missing module, then stop
        missing.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
if missing:
    sys.exit("missing: " + "; ".join(missing) + " (carry their wheels: benchmarks/gpu_check.sh --fetch-wheels DIR "
             "on a machine with a registry, then --wheels DIR)")
import jax
print(f"python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}")
for name in ("jaxlib", "triton", "jax_triton", "flax", "optax", "grain"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: {type(e).__name__}")
devices = jax.devices()
print(f"{len(devices)} device(s): {devices[0].device_kind}" + (f" x{len(devices)}" if len(devices) > 1 else ""))
if not smoke and devices[0].platform != "gpu":
    sys.exit(f"no GPU visible to JAX (backend {jax.default_backend()}): see `python -m jaxtrain env` below")
EOF
then
  echo "!! set-up failed: see the line above"; "$PY" -m jaxtrain env | tail -n 4
  record setup failed "$(elapsed)"; exit 3
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -m jaxtrain env | tail -n 4
record setup ok "$(elapsed)" "$("$PY" -m jaxtrain env --json 2>/dev/null | tail -n 1)"
NDEV=$("$PY" -c "import jax; print(jax.device_count())" 2>/dev/null || echo 1)

if [ "$SMOKE" = 1 ]; then
  STEP=(--config tiny --steps 2 --rows-per-device 2 model.head_dim=32)  # flash needs head dim >= 32
  STEP_LIMIT=900
else
  STEP=(--config 1b --steps 10 --rows-per-device 4)
  STEP_LIMIT=100
fi
section "1B train step: step time, tokens/s, MFU (auto = cuDNN, then the flash kernels)"
for impl in auto triton pallas; do
  if [ "$SMOKE" = 1 ] && [ "$impl" != auto ]; then
    # triton needs a GPU; pallas's step is exercised on CPU by train-pallas below (interpreted, slow).
    echo "skipped in --smoke: the $impl step"; record "step-$impl" "skipped: --smoke" 0
    continue
  fi
  run "$STEP_LIMIT" "step-$impl" "$PY" benchmarks/gpu_step.py "${STEP[@]}" "model.attention=$impl"
done

section "kernel tests on the device (values and gradients vs float64)"
run "$([ "$SMOKE" = 1 ] && echo 900 || echo 100)" "kernel-tests" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_flash_attention.py -k "test_gpu_values_and_grads or test_document_mask_skips or test_remat_policy"

section "attention TFLOP/s: pallas, triton, cuDNN, XLA; head dims 64/128, GQA 1/4/8, causal and document masks"
if [ "$SMOKE" = 1 ]; then
  run 900 "bench" "$PY" -m jaxtrain.kernels.bench --smoke --masks causal,doc --groups 2 --impls cudnn,pallas,triton,xla \
    --out "$OUT/bench" --jsonl "$RESULTS"
else
  run 130 "bench" "$PY" -m jaxtrain.kernels.bench --head-dims 64,128 --groups 4,1,8 --masks causal,doc --seq-lens 4096 \
    --impls cudnn,pallas,triton,xla --iters 5 --grad-check-max-seq 0 --time-budget 115 --out "$OUT/bench" \
    --jsonl "$RESULTS"
fi

section "the rest: the 1B step with XLA attention; training steps with each attention impl (jaxtrain train)"
if [ "$SMOKE" = 1 ]; then
  echo "skipped in --smoke: the xla step (step-auto was XLA on CPU)"; record step-xla "skipped: --smoke" 0
else
  run 70 "step-xla" "$PY" benchmarks/gpu_step.py "${STEP[@]}" model.attention=xla
fi
if [ "$SMOKE" = 1 ]; then
  TRAIN=(train.steps=3 train.log_every=1 model.head_dim=32)  # the built-in tiny config
  LIMIT=900  # a shared 2-core CI machine can take minutes for a tiny model's compile
else
  TRAIN=(--config configs/125m.yaml train.steps=10 train.log_every=5 "train.global_batch=$((8 * NDEV))")
  LIMIT=60
fi
for impl in xla cudnn pallas triton; do
  echo "-- model.attention=$impl"
  if [ "$SMOKE" = 1 ] && { [ "$impl" = cudnn ] || [ "$impl" = triton ]; }; then
    echo "skipped in --smoke: model.attention=$impl needs a GPU"; continue
  fi
  run "$LIMIT" "train-$impl" "$PY" -m jaxtrain train "${TRAIN[@]}" train.eval_every=0 train.eval_batches=1 \
    checkpoint.resume=never checkpoint.every=0 "model.attention=$impl" "run.dir=$OUT/train-$impl"
  rm -rf "$OUT/train-$impl/checkpoints"
done
"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
print(f"{'attention':10} {'status':8} {'compile s':>9} {'step ms':>8} {'tokens/s':>10} {'MFU':>6}")
for impl in ("xla", "cudnn", "pallas", "triton"):
    path = os.path.join(out, f"train-{impl}", "summary.json")
    if not os.path.isfile(os.path.join(out, f"train-{impl}.log")):
        print(f"{impl:10} {'not run':8}")
        continue
    if not os.path.isfile(path):
        print(f"{impl:10} {'failed':8} (see {out}/train-{impl}.log)")
        continue
    s = json.load(open(path))
    mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "-"
    print(f"{impl:10} {'ok':8} {s['compile_seconds']:9.1f} {1e3 * s['step_seconds']['median']:8.1f} "
          f"{s['tokens_per_second']:10.0f} {mfu:>6}")
EOF

section "done: $FAILED section(s) failed in $(elapsed) s; reports in $OUT (results.jsonl: one line per section)"
exit "$FAILED"
