"""Benchmark the grouped matmul: ``python -m jaxtrain.kernels.bench.gmm [--smoke] [--impls ...] [--routing ...]``.

A mixture-of-experts layer's two grouped GEMMs at Mixtral's size by default (8 experts, top 2, 4 x 4096 tokens per
device, so m = 32768 rows; d_model 4096, d_ff 14336; bfloat16): the gate/up projection [m, d_model] x [experts,
d_model, d_ff] and the down projection [m, d_ff] x [experts, d_ff, d_model]. Rows per expert come from a seeded
draw of top-k routing: ``balanced`` (every expert equally likely) or ``skewed`` (expert e with probability
proportional to 1 / (e + 1): the first takes about a third). Implementations:

  pallas  jaxtrain.kernels.grouped_matmul(impl="pallas"), this repository's Pallas kernels
  triton  jaxtrain.kernels.grouped_matmul(impl="triton"), the Triton-language kernels through jax-triton
  xla     jax.lax.ragged_dot (impl="xla")
  dense   every expert on every row, then a one-hot combine (the einsum a MoE layer without grouped GEMMs runs)

For each it times the forward and the forward + both gradients (median of --iters after a warm-up that compiles),
reports TFLOP/s of the useful work (2 m k n forward, 3x that with the gradients: each row by its own expert only, so
xla's and dense's extra work counts as time, not FLOPs), each row's speed over xla's, and the largest error of the
output and of d_lhs / d_rhs against float32 ragged_dot on the same (rounded) inputs, relative to the largest
reference magnitude. Every row is printed as a JSON line as it ends (what benchmarks/gpu_check.py reads), then a
table. A failing implementation gets its error in its row; the others go on. On a machine without a GPU it refuses,
unless --smoke: tiny sizes, the Pallas kernels in interpret mode, so that the code path runs on CPU (the numbers then
mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels.gmm.api import grouped_matmul, ragged_dot_reference

IMPLS = ("pallas", "triton", "xla", "dense")
ROUTINGS = ("balanced", "skewed")


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def group_sizes(routing: str, tokens: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """int32 [experts], summing to tokens * top_k: each token's top_k distinct experts drawn without replacement
    from the routing's probabilities."""
    weights = np.ones(experts) if routing == "balanced" else 1.0 / np.arange(1, experts + 1)
    rng = np.random.default_rng(seed)
    # Top-k without replacement per token: the k largest of log(w) + Gumbel noise (the Gumbel-top-k trick).
    keys = np.log(weights)[None, :] + rng.gumbel(size=(tokens, experts))
    chosen = np.argsort(-keys, axis=1)[:, :top_k]
    return np.bincount(chosen.ravel(), minlength=experts).astype(np.int32)


def dense_one_hot(lhs, rhs, sizes):
    """Every expert on every row ([experts, m, n]), then each row's own expert picked by a one-hot combine."""
    ends = jnp.cumsum(sizes)
    expert = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # rows past the sum: no expert
    one_hot = jax.nn.one_hot(expert, rhs.shape[0], dtype=lhs.dtype)
    return jnp.einsum("mg,gmn->mn", one_hot, jnp.einsum("mk,gkn->gmn", lhs, rhs))


def _function(impl: str, interpret: bool):
    if impl == "dense":
        return dense_one_hot
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    return lambda lhs, rhs, sizes: grouped_matmul(lhs, rhs, sizes, impl=impl, interpret=interpret and impl == "pallas")


def _value_and_grads(fn):
    def run(lhs, rhs, sizes, d_out):
        out, pull = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return (out, *pull(d_out))

    return jax.jit(run)


def _time(fn, args, iters: int) -> float:
    """Median wall time in ms of ``fn(*args)`` after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def make_inputs(m: int, k: int, n: int, experts: int, dtype, seed: int = 0):
    kl, kr, kd = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(kl, (m, k), dtype)
    rhs = (jax.random.normal(kr, (experts, k, n), jnp.float32) * k**-0.5).astype(dtype)  # outputs of unit scale
    return lhs, rhs, jax.random.normal(kd, (m, n), dtype)


def _rel_err(got, want) -> float:
    want = np.asarray(want, np.float32)
    return float(np.max(np.abs(np.asarray(got, np.float32) - want)) / max(float(np.max(np.abs(want))), 1e-30))


def bench_one(impl: str, shape: dict, inputs, reference, *, iters: int, interpret: bool) -> dict:
    """One implementation on one shape: times, TFLOP/s, errors against ``reference`` (out, d_lhs, d_rhs)."""
    row = dict(kind="gmm", impl=impl, **shape, status="ok")
    try:
        fn = _function(impl, interpret)
        lhs, rhs, sizes, d_out = inputs
        forward = jax.jit(fn)
        both = _value_and_grads(fn)
        row["fwd_ms"] = _time(forward, (lhs, rhs, sizes), iters)
        row["fwdbwd_ms"] = _time(both, (lhs, rhs, sizes, d_out), iters)
        flops = 2.0 * shape["m"] * shape["k"] * shape["n"]
        row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
        row["fwdbwd_tflops"] = 3 * flops / (row["fwdbwd_ms"] * 1e-3) / 1e12
        got = jax.device_get(both(lhs, rhs, sizes, d_out))
        row["max_err_fwd"] = _rel_err(got[0], reference[0])
        row["max_err_grad"] = max(_rel_err(g, w) for g, w in zip(got[1:], reference[1:]))
    except Exception as e:  # noqa: BLE001 - one implementation's failure must not stop the others
        row["status"] = "error: " + " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return row


def shapes(args) -> list[dict]:
    """The sweep's (projection, routing) shapes, gate/up first: m = tokens x top_k rows."""
    m = args.tokens * args.top_k
    out = []
    for routing in args.routing:
        for proj, (k, n) in (("up", (args.d_model, args.d_ff)), ("down", (args.d_ff, args.d_model))):
            if proj in args.projections:
                out.append(dict(projection=proj, routing=routing, m=m, k=k, n=n, experts=args.experts,
                                top_k=args.top_k, dtype=args.dtype))
    return out


def run_shape(shape: dict, args, start: float, interpret: bool) -> list[dict]:
    """Every implementation on one shape; rows printed as JSON lines as they end (the ratios to xla, known once
    every row is in, only in the returned rows and the table)."""
    drawn = group_sizes(shape["routing"], args.tokens, shape["experts"], shape["top_k"])
    lhs, rhs, d_out = make_inputs(shape["m"], shape["k"], shape["n"], shape["experts"], jnp.dtype(shape["dtype"]))
    sizes = jnp.asarray(drawn)
    shape = dict(shape, max_rows=int(drawn.max()), min_rows=int(drawn.min()))
    f32 = [x.astype(jnp.float32) for x in (lhs, rhs)]
    reference = jax.device_get(_value_and_grads(ragged_dot_reference)(*f32, sizes, d_out.astype(jnp.float32)))
    rows = []
    for impl in args.impls:
        if time.perf_counter() - start > args.time_budget:
            row = dict(kind="gmm", impl=impl, **shape, status=f"skipped: --time-budget {args.time_budget:.0f}s spent")
        else:
            row = bench_one(impl, shape, (lhs, rhs, sizes, d_out), reference, iters=args.iters, interpret=interpret)
        rows.append(row)
        print(json.dumps(row), flush=True)  # as it ends: a run cut short keeps the rows it finished
    base = next((r for r in rows if r["impl"] == "xla" and r["status"] == "ok"), None)
    for row in rows:
        if base is not None and row["status"] == "ok":
            row["fwdbwd_vs_xla"] = row["fwdbwd_tflops"] / base["fwdbwd_tflops"]
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ("projection", "routing", "impl", "m", "k", "n", "max_rows", "fwd_ms", "fwd_tflops", "fwdbwd_ms",
            "fwdbwd_tflops", "fwdbwd_vs_xla", "max_err_fwd", "max_err_grad", "status")
    fmt = (lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)[:60])  # noqa: E731
    table = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in table)) if table else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxtrain.kernels.bench.gmm", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode: exercise the code on CPU")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--routing", default="balanced,skewed", help=f"comma-separated subset of {','.join(ROUTINGS)}")
    p.add_argument("--projections", default="up,down", help="comma-separated subset of up,down")
    p.add_argument("--tokens", type=int, default=None, help="tokens per device (default 16384; --smoke 48)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts", type=int, default=None, help="default 8; --smoke 4")
    p.add_argument("--d-model", type=int, default=None, help="default 4096; --smoke 64")
    p.add_argument("--d-ff", type=int, default=None, help="default 14336; --smoke 96")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=None, help="timed iterations per measurement (default 10)")
    p.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds; rows not started when it is spent are recorded as skipped")
    args = p.parse_args(argv)
    small = args.smoke
    args.tokens = args.tokens or (48 if small else 16384)
    args.experts = args.experts or (4 if small else 8)
    args.d_model = args.d_model or (64 if small else 4096)
    args.d_ff = args.d_ff or (96 if small else 14336)
    args.iters = args.iters or (1 if small else 10)
    for name, valid in (("impls", IMPLS), ("routing", ROUTINGS), ("projections", ("up", "down"))):
        chosen = [x for x in getattr(args, name).split(",") if x]
        if not chosen or set(chosen) - set(valid):
            p.exit(2, f"gmm_bench: --{name} {getattr(args, name)!r} must be a comma-separated subset of "
                      f"{','.join(valid)}\n")
        setattr(args, name, chosen)
    if not 1 <= args.top_k <= args.experts or min(args.tokens, args.d_model, args.d_ff) < 1:
        p.exit(2, f"gmm_bench: need 1 <= --top-k <= --experts and positive sizes, got top_k {args.top_k}, "
                  f"experts {args.experts}, tokens {args.tokens}, d_model {args.d_model}, d_ff {args.d_ff}\n")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    gpu = _has_gpu()
    if not gpu and not args.smoke:
        raise SystemExit("jaxtrain.kernels.bench.gmm: no GPU visible to JAX (backend: "
                         f"{jax.default_backend()}); the benchmark is meant for a GPU. Use --smoke to exercise the "
                         "code path on CPU with tiny sizes in interpret mode.")
    print(f"grouped matmul benchmark: jax {jax.__version__}, backend {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), {args.dtype}, {args.tokens} tokens x top {args.top_k} of "
          f"{args.experts} experts, d_model {args.d_model}, d_ff {args.d_ff}, median of {args.iters} iterations"
          + (", SMOKE MODE (interpret, tiny sizes: timings are meaningless)" if args.smoke else ""), flush=True)
    start = time.perf_counter()
    rows = [row for shape in shapes(args) for row in run_shape(shape, args, start, interpret=not gpu)]
    print()
    print_table(rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
