#!/usr/bin/env bash
# The first minutes on a GPU node (1 or 8 GPUs, jax 0.11), in one call of under 9 minutes:
#   1. versions and devices;
#   2. the flash-attention tests compiled and run on the GPU (values and gradients against a float64 reference:
#      float32 / bfloat16, GQA, segments, odd lengths; both impls);
#   3. forward and forward+backward TFLOP/s of ours (pallas, triton), cuDNN and XLA: bfloat16, head dim 128,
#      seq 2k-16k, causal and not (python -m kernels.bench);
#   4. 20 training steps of configs/1b.yaml with each attention impl: step time, tokens/s, MFU.
# Every section runs under its own time limit and a failure is reported without stopping the others; the exit
# status is the number of failed sections.
#
# usage: benchmarks/gpu_check.sh [--smoke] [--out DIR] [--wheels DIR]
#   --smoke   on a CPU: the same sections at toy sizes (interpret-mode kernels, the tiny model), to check the
#             script end to end; its numbers mean nothing
#   --out     where reports go (default: a new temporary directory)
#   --wheels  a directory of wheels to install first with pip --no-index (jax-triton is not on the GPU image)
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
OUT=""
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT="${2:?--out needs a directory}"; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'; valid: --smoke, --out DIR, --wheels DIR" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
  echo "gpu_check.sh: --wheels '$WHEELS' is not a directory" >&2; exit 2
fi
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$OUT" || { echo "gpu_check.sh: cannot create --out '$OUT'" >&2; exit 2; }
PY="${PYTHON:-python3}"
FAILED=0
START=$(date +%s)

section() { echo; echo "== $1 ($(( $(date +%s) - START )) s elapsed)"; }
# run LIMIT_S NAME CMD...: a section's command under a time limit; its failure is counted, not fatal.
run() {
  local limit="$1" name="$2"; shift 2
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    FAILED=$((FAILED + 1))
    [ "$rc" -eq 124 ] && echo "!! $name: stopped after its ${limit} s limit" || echo "!! $name: exit status $rc"
  fi
}

if [ -n "$WHEELS" ]; then
  section "installing wheels from $WHEELS"
  run 60 "wheels" "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$WHEELS"/*.whl
fi

section "versions and devices"
run 60 "versions" "$PY" - <<'EOF'
import importlib, platform
import jax
print(f"python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}")
for name in ("jaxlib", "triton", "jax_triton", "flax", "optax"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{name}: not importable ({type(e).__name__}: {e})")
devices = jax.devices()
print(f"{len(devices)} device(s): {devices[0].device_kind}" + (f" x{len(devices)}" if len(devices) > 1 else ""))
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

section "kernel tests on the device (values and gradients vs float64)"
if [ "$SMOKE" = 1 ]; then
  # No GPU: the GPU cases skip; the document-masking and remat tests run the kernels in interpret mode.
  run 900 "kernel tests" "$PY" -m pytest -q -p no:cacheprovider tests/test_flash_attention.py \
    -k "test_gpu_values_and_grads or test_document_mask_skips or test_remat_policy"
else
  run 150 "kernel tests" "$PY" -m pytest -q -p no:cacheprovider tests/test_flash_attention.py \
    -k "test_gpu_values_and_grads or test_document_mask_skips or test_remat_policy"
fi

section "attention TFLOP/s: ours (pallas, triton), cuDNN, XLA; bfloat16, head dim 128"
if [ "$SMOKE" = 1 ]; then
  run 900 "benchmark" "$PY" -m kernels.bench --smoke --causal true --impls pallas,triton,xla,cudnn \
    --out "$OUT/bench"
else
  run 200 "benchmark" "$PY" -m kernels.bench --head-dims 128 --seq-lens 2048,4096,8192,16384 --causal both \
    --impls pallas,triton,cudnn,xla --iters 5 --grad-check-max-seq 4096 --time-budget 170 --out "$OUT/bench"
fi

section "training steps with each attention impl"
NDEV=$("$PY" -c "import jax; print(jax.device_count())" 2>/dev/null || echo 1)
if [ "$SMOKE" = 1 ]; then
  TRAIN=(train.steps=3 train.log_every=1 model.head_dim=32)  # the built-in tiny config; flash needs head dim >= 32
  LIMIT=900  # a shared 2-core CI machine can take minutes for a tiny model's compile
else
  # 4 sequences of 4096 tokens per GPU; no evaluation before the end; the one checkpoint at the last step is
  # written outside the timed steps and deleted after each run.
  TRAIN=(--config configs/1b.yaml train.steps=20 train.log_every=5 "train.global_batch=$((4 * NDEV))")
  LIMIT=100
fi
for impl in xla cudnn pallas triton; do
  echo "-- model.attention=$impl"
  if [ "$SMOKE" = 1 ] && { [ "$impl" = cudnn ] || [ "$impl" = triton ]; }; then
    echo "skipped in --smoke: model.attention=$impl needs a GPU"; continue
  fi
  run "$LIMIT" "train $impl" "$PY" -m jaxtrain train "${TRAIN[@]}" train.eval_every=0 train.eval_batches=1 \
    checkpoint.resume=never checkpoint.every=0 "model.attention=$impl" "run.dir=$OUT/train-$impl" \
    > "$OUT/train-$impl.log" 2>&1
  tail -n 3 "$OUT/train-$impl.log"
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

section "done: $FAILED section(s) failed; reports in $OUT"
exit "$FAILED"
