"""The rates the planner's step model takes (``jaxtrain/configs/hardware/measured/``): dense GEMM FLOP/s per dtype at
the 1B's and Llama 3.1 8B's projection shapes, and the HBM bandwidth of an elementwise pass.
``python benchmarks/gpu_rates.py [--smoke] [--iters N]``; one JSON line per figure (``"kind": "rate"``).

- ``gemm``: ``[m, k] x [k, n]`` at ``bfloat16`` (forward, and forward + backward: the value and both operands'
  gradients, 3 GEMMs of 2 m k n FLOPs), and ``float8`` (e4m3 x e4m3 -> bfloat16, forward only: the tensor-core
  rate ``model.fp8``'s projections can reach before quantisation's own passes; ``f8_gemm``: whether the compiled
  program kept the GEMM in float8); m = 16,384 tokens (4 x 4096);
- ``hbm``: ``y = x * c`` over a 4 GiB bfloat16 array, bytes read + written over the time.

Median of ``--iters`` timed calls after one warm-up; ``--smoke``: toy sizes (on a CPU: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# (name, m, k, n): tokens x in -> out of the projections the planner prices, largest share of the step first
SHAPES = [("1b mlp up/gate", 16384, 2048, 8192), ("1b mlp down", 16384, 8192, 2048),
          ("1b output (vocab)", 16384, 2048, 128256), ("1b q/o", 16384, 2048, 2048), ("1b k/v", 16384, 2048, 512),
          ("8b mlp up/gate", 16384, 4096, 14336), ("8b q/o", 16384, 4096, 4096)]
SMOKE_SHAPES = [("toy", 64, 32, 48)]
HBM_BYTES = 4 << 30


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _time(fn, *args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` (blocked on) over ``iters`` calls after a warm-up."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rows(shapes, iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    key = jax.random.PRNGKey(0)
    for name, m, k, n in shapes:
        a = jax.random.normal(key, (m, k), jnp.bfloat16)
        b = jax.random.normal(key, (k, n), jnp.bfloat16) / k ** 0.5
        g = jnp.ones((m, n), jnp.bfloat16)
        flops = 2.0 * m * k * n
        fwd = jax.jit(lambda x, y: x @ y)
        both = jax.jit(jax.value_and_grad(lambda x, y, w: jnp.vdot((x @ y).astype(jnp.float32), w), argnums=(0, 1)))
        row = dict(kind="rate", what="gemm", shape=name, m=m, k=k, n=n, dtype="bfloat16")
        t = _time(fwd, a, b, iters=iters)
        row.update(fwd_ms=round(t * 1e3, 3), fwd_tflops=_sig(flops / t / 1e12))
        t = _time(both, a, b, g, iters=iters)
        row.update(fwdbwd_ms=round(t * 1e3, 3), fwdbwd_tflops=_sig(3 * flops / t / 1e12))
        rows.append(row)
        print(json.dumps(row), flush=True)
        fp8 = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.bfloat16))
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        t = _time(fp8, a8, b8, iters=iters)
        # Whether XLA kept the GEMM in float8 (a cuBLASLt FP8 call or a Triton GEMM on f8 operands), not upcast it
        text = fp8.lower(a8, b8).compile().as_text() or ""
        row = dict(kind="rate", what="gemm", shape=name, m=m, k=k, n=n, dtype="float8",
                   fwd_ms=round(t * 1e3, 3), fwd_tflops=_sig(flops / t / 1e12),
                   f8_gemm="$f8" in text or ("__triton_gemm" in text and "f8e4m3fn" in text))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def hbm_row(nbytes: int, iters: int) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    scale = jax.jit(lambda v: v * jnp.bfloat16(1.0001))
    t = _time(scale, x, iters=iters)
    row = dict(kind="rate", what="hbm", bytes=nbytes, ms=round(t * 1e3, 3), gb_per_s=_sig(2 * nbytes / t / 1e9))
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_rates.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="toy sizes (CPU)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per figure (default 10)")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.exit(2, f"gpu_rates: --iters {args.iters} must be >= 1\n")
    import jax

    dev = jax.devices()[0]
    print(json.dumps(dict(kind="rate", what="device", device_kind=dev.device_kind, platform=dev.platform,
                          jax=jax.__version__)), flush=True)
    hbm_row(1 << 20 if args.smoke else HBM_BYTES, args.iters)
    gemm_rows(SMOKE_SHAPES if args.smoke else SHAPES, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
