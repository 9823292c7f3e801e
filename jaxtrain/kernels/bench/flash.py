"""Benchmark flash attention: ``python -m jaxtrain.kernels.bench.flash [--out DIR] [--smoke]``.

For bfloat16, head dims 64 and 128, GQA groups (--groups: query heads per kv head), masks (--masks: causal
without segments, causal within documents of random lengths (mean DOC_MEAN, or seq/4 if less), none) and
sequence lengths 1k..16k at a constant number of tokens per batch (batch = tokens // seq), the shipped models'
head dim and group first, it times forward and forward+backward of each implementation, reports TFLOP/s
(forward 4·B·S²·H·D, halved when causal; backward 2.5x forward, so forward+backward is 3.5x) and the largest error
against a float32 XLA reference (largest absolute difference of the output, and of dq, dk, dv up to
--grad-check-max-seq). Implementations:

  pallas      this repository's Pallas kernel (jaxtrain.kernels.flash.pallas)
  triton      this repository's Triton kernel through jax-triton (jaxtrain.kernels.flash.triton)
  xla         jax.nn.dot_product_attention(implementation="xla")
  cudnn       jax.nn.dot_product_attention(implementation="cudnn")
  jax_pallas  JAX's bundled Pallas attention op (jax.experimental.pallas.ops.gpu.attention.mha), a peer

Each (implementation, shape) runs in isolation: a failure (out of memory, unsupported, missing package) is
recorded in its row and the rest go on. Results are printed as a table and written as Markdown and CSV to --out
(rewritten after every row, so a crash keeps what was measured), with each row's TFLOP/s over cuDNN's for the same
shape (fwd_vs_cudnn, fwdbwd_vs_cudnn); --jsonl appends the rows of each shape as JSON lines once it is done.
Document masking reaches XLA and cuDNN as a boolean [batch, 1, seq, seq] mask (jax.nn.dot_product_attention takes
no segment ids) and the flash kernels as segment ids; its FLOPs are counted as causal attention's.
The full sweep is sized for one GPU call of under 10 minutes (--time-budget stops starting new rows when spent).
On a machine without a GPU it refuses, unless --smoke: tiny sizes, Pallas kernels in interpret mode, so that the
code path is exercised on CPU (the numbers then mean nothing).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels import flash_attention, mha_reference

IMPLS = ("pallas", "triton", "xla", "cudnn", "jax_pallas")
COLUMNS = ("impl", "dtype", "batch", "seq", "heads", "kv_heads", "head_dim", "causal", "doc_mask", "status",
           "fwd_ms", "fwd_tflops", "fwdbwd_ms", "fwdbwd_tflops", "fwd_vs_cudnn", "fwdbwd_vs_cudnn", "max_err_fwd",
           "max_err_grad")
DOC_MEAN = 1024  # mean document length of the document-masking shapes (lengths drawn uniformly in 1..2*DOC_MEAN)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    doc_mask: bool = False  # causal attention within documents (segment ids): FLOPs still counted as causal

    def fwd_flops(self) -> float:
        flops = 4.0 * self.batch * self.seq * self.seq * self.heads * self.head_dim
        return flops / 2 if self.causal else flops


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def segments(shape: Shape):
    """int32 [batch, seq] document ids (lengths uniform in 1..2*mean, mean DOC_MEAN or seq/4 if less: several
    documents per row at any seq; seeded), or None without doc_mask."""
    if not shape.doc_mask:
        return None
    rng = np.random.default_rng(0)
    mean = max(1, min(DOC_MEAN, shape.seq // 4))
    rows = []
    for _ in range(shape.batch):
        lengths = rng.integers(1, 2 * mean + 1, size=shape.seq)
        rows.append(np.repeat(np.arange(shape.seq), lengths)[:shape.seq])
    return jnp.asarray(np.stack(rows), jnp.int32)


def attention_fn(impl: str, shape: Shape, interpret: bool):
    """(q, k, v) -> out for one implementation; raises if it cannot run here."""
    seg = segments(shape)
    if impl == "pallas":
        return functools.partial(flash_attention, causal=shape.causal, segment_ids=seg, impl="pallas",
                                 interpret=interpret)
    if impl == "triton":
        return functools.partial(flash_attention, causal=shape.causal, segment_ids=seg, impl="triton")
    if impl in ("xla", "cudnn"):
        # jax.nn.dot_product_attention takes no segment ids: documents become a boolean mask [batch, 1, seq, seq].
        mask = None if seg is None else (seg[:, None, :, None] == seg[:, None, None, :])
        return functools.partial(jax.nn.dot_product_attention, mask=mask, is_causal=shape.causal,
                                 implementation=impl)
    if shape.doc_mask:
        raise ValueError(f"{impl} is not run with document masking")
    if impl == "jax_pallas":
        with warnings.catch_warnings():  # jax 0.11 deprecates this module in favour of tokamax
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as peer

        group = shape.heads // shape.kv_heads
        # Its defaults need seq to be a multiple of 128 (forward) and of 32 (backward); clamp for --smoke.
        blocks = peer.BlockSizes(block_q=min(128, shape.seq), block_k=min(128, shape.seq), block_q_dkv=32,
                                 block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)

        def run(q, k, v):
            # The peer has no grouped-query support: it gets k and v repeated (only when kv_heads < heads).
            if group > 1:
                k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            return peer.mha(q, k, v, None, sm_scale=shape.head_dim**-0.5, causal=shape.causal,
                            block_sizes=blocks, interpret=interpret)

        return run
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def _time(fn, args, iters: int) -> float:
    """Median wall time in ms of ``fn(*args)`` after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def make_inputs(shape: Shape, dtype, seed: int = 0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (shape.batch, shape.seq, shape.heads, shape.head_dim), dtype)
    k = jax.random.normal(kk, (shape.batch, shape.seq, shape.kv_heads, shape.head_dim), dtype)
    v = jax.random.normal(kv, (shape.batch, shape.seq, shape.kv_heads, shape.head_dim), dtype)
    do = jax.random.normal(kd, q.shape, dtype)
    return q, k, v, do


def _fwd_bwd(fn):
    def run(q, k, v, do):
        out, pull = jax.vjp(fn, q, k, v)
        return (out, *pull(do))

    return jax.jit(run)


@functools.lru_cache(maxsize=1)
def _reference(shape: Shape, dtype_name: str, with_grads: bool):
    """Float32 XLA reference of the same (rounded) inputs: out, and dq, dk, dv when asked."""
    q, k, v, do = (x.astype(jnp.float32) for x in make_inputs(shape, jnp.dtype(dtype_name)))
    ref = functools.partial(mha_reference, causal=shape.causal, segment_ids=segments(shape))
    if with_grads:
        return jax.device_get(_fwd_bwd(ref)(q, k, v, do))
    return (jax.device_get(jax.jit(ref)(q, k, v)),)


def _max_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float32) - want)))


def bench_one(impl: str, shape: Shape, dtype, *, iters: int, interpret: bool, grad_check_max_seq: int) -> dict:
    row = dict(impl=impl, dtype=jnp.dtype(dtype).name, batch=shape.batch, seq=shape.seq, heads=shape.heads,
               kv_heads=shape.kv_heads, head_dim=shape.head_dim, causal=shape.causal, doc_mask=shape.doc_mask,
               status="ok")
    try:
        fn = attention_fn(impl, shape, interpret)
        q, k, v, do = make_inputs(shape, dtype)
        fwd = jax.jit(fn)
        both = _fwd_bwd(fn)
        row["fwd_ms"] = _time(fwd, (q, k, v), iters)
        row["fwdbwd_ms"] = _time(both, (q, k, v, do), iters)
        flops = shape.fwd_flops()
        row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
        row["fwdbwd_tflops"] = 3.5 * flops / (row["fwdbwd_ms"] * 1e-3) / 1e12
        check_grads = shape.seq <= grad_check_max_seq
        want = _reference(shape, row["dtype"], check_grads)
        got = jax.device_get(both(q, k, v, do)) if check_grads else (jax.device_get(fwd(q, k, v)),)
        row["max_err_fwd"] = _max_err(got[0], want[0])
        if check_grads:
            row["max_err_grad"] = max(_max_err(g, w) for g, w in zip(got[1:], want[1:]))
    except Exception as e:  # noqa: BLE001 - one implementation's failure must not stop the others
        message = " ".join(f"{type(e).__name__}: {e}".split())
        row["status"] = "error: " + message[:300]
        if os.environ.get("BENCH_TRACEBACKS"):
            traceback.print_exc()
    return row


def _versus_cudnn(rows: list[dict]) -> None:
    """Each row's TFLOP/s over cuDNN's for the same shape (rows: one shape's), where cuDNN ran."""
    base = next((r for r in rows if r["impl"] == "cudnn" and r["status"] == "ok"), None)
    for r in rows:
        if base is not None and r["status"] == "ok":
            r["fwd_vs_cudnn"] = r["fwd_tflops"] / base["fwd_tflops"]
            r["fwdbwd_vs_cudnn"] = r["fwdbwd_tflops"] / base["fwdbwd_tflops"]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def write_reports(rows: list[dict], out_dir: str, header: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "flash_attention_bench.csv")
    md_path = os.path.join(out_dir, "flash_attention_bench.md")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in COLUMNS})
    with open(md_path, "w") as f:
        f.write(f"# Flash attention benchmark\n\n{header}\n\n")
        f.write("| " + " | ".join(COLUMNS) + " |\n")
        f.write("|" + "---|" * len(COLUMNS) + "\n")
        for row in rows:
            f.write("| " + " | ".join(_fmt(row.get(c)).replace("|", "/") for c in COLUMNS) + " |\n")
    return csv_path, md_path


def print_table(rows: list[dict]) -> None:
    cols = ("impl", "batch", "seq", "head_dim", "kv_heads", "causal", "doc_mask", "fwd_ms", "fwd_tflops",
            "fwdbwd_ms", "fwdbwd_tflops", "fwdbwd_vs_cudnn", "max_err_fwd", "max_err_grad", "status")
    table = [[_fmt(r.get(c)) for c in cols] for r in rows]
    table = [[cell if len(cell) <= 60 else cell[:57] + "..." for cell in line] for line in table]
    widths = [max(len(c), *(len(line[i]) for line in table)) if table else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


def tile_skip_report(segments: np.ndarray, head_dims=(64, 128)) -> list[dict]:
    """Document masking: how many causal tiles each kernel computes over ``segments`` (int [windows, seq], the
    segment ids of packed documents) when tiles whose query and key documents differ are skipped; tiles are the
    bfloat16 defaults. The caller reads the documents (``benchmarks/tile_skip.py``: the embedded corpus)."""
    from jaxtrain.kernels.flash import tiling

    rows = []
    for d in head_dims:
        for kind in tiling.KINDS:
            launch = tiling.default_launch(kind, jnp.bfloat16, d)
            computed, causal_tiles, all_tiles = tiling.tiles_computed(segments, launch.block_q, launch.block_k,
                                                                      causal=True)
            rows.append(dict(head_dim=d, kernel=kind, tiles=f"{launch.block_q}x{launch.block_k}",
                             computed=computed, causal_tiles=causal_tiles,
                             fraction_of_causal=computed / causal_tiles, fraction_of_all=computed / all_tiles))
            print(f"  d={d:<4} {kind:<5} tiles {launch.block_q}x{launch.block_k}: {computed} of {causal_tiles} "
                  f"causal tiles computed ({100 * computed / causal_tiles:.1f}%; {100 * computed / all_tiles:.1f}% "
                  "of all tiles)")
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxtrain.kernels.bench.flash", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for flash_attention_bench.{md,csv}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode: exercise the code on CPU")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--seq-lens", default=None, help="comma-separated (default 1024,2048,4096,8192,16384)")
    p.add_argument("--head-dims", default=None, help="comma-separated (default 64,128)")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--tokens", type=int, default=None, help="tokens per batch, batch*seq (default 16384)")
    p.add_argument("--model-dim", type=int, default=None, help="heads = model_dim // head_dim (default 2048)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads of every shape (default: from --groups)")
    p.add_argument("--groups", default="1", help="comma-separated GQA groups (query heads per kv head), e.g. 4,1,8")
    p.add_argument("--masks", default=None, help="comma-separated causal (no segments), doc (causal within "
                   "documents), full (no mask); default from --causal")
    p.add_argument("--jsonl", default=None, help="append each row as a JSON line to this file once its shape is done")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per measurement (default 10)")
    p.add_argument("--grad-check-max-seq", type=int, default=4096,
                   help="compare gradients with the float32 reference up to this seq (its S x S memory grows)")
    p.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds; rows not started when it is spent are recorded as skipped")
    return p.parse_args(argv)


def _sweep(args) -> dict:
    """The sweep's settings: the command line over the defaults (tiny ones with --smoke); SystemExit on bad masks or
    implementations."""
    defaults: dict[str, Any]
    if args.smoke:
        defaults = dict(seq_lens="64", head_dims="64", tokens=128, model_dim=128, iters=1)
    else:
        defaults = dict(seq_lens="1024,2048,4096,8192,16384", head_dims="64,128", tokens=16384, model_dim=2048,
                        iters=10)
    sweep: dict[str, Any] = dict(
        seq_lens=[int(x) for x in (args.seq_lens or defaults["seq_lens"]).split(",")],
        head_dims=[int(x) for x in (args.head_dims or defaults["head_dims"]).split(",")],
        tokens=args.tokens or defaults["tokens"], model_dim=args.model_dim or defaults["model_dim"],
        iters=args.iters or defaults["iters"])
    sweep["masks"] = (args.masks.split(",") if args.masks else
                      {"both": ["causal", "full"], "true": ["causal"], "false": ["full"]}[args.causal])
    if set(sweep["masks"]) - {"causal", "doc", "full"}:
        raise SystemExit(f"jaxtrain.kernels.bench.flash: --masks {args.masks!r} must be a comma-separated subset of "
                         "causal,doc,full")
    sweep["groups"] = [int(x) for x in args.groups.split(",")]
    sweep["impls"] = [x for x in args.impls.split(",") if x]
    unknown = sorted(set(sweep["impls"]) - set(IMPLS))
    if unknown:
        raise SystemExit(f"jaxtrain.kernels.bench.flash: unknown implementation(s) {unknown}; expected {list(IMPLS)}")
    return sweep


def _shapes(sweep: dict, kv_heads: int | None) -> list[Shape]:
    """Every (head dim, GQA group, mask, seq) of the sweep at its tokens per batch, the shipped models' (head dim,
    group) first, so that a --time-budget cut loses the least useful rows: 1b (64, 4), 7b (128, 1), 70b (128, 8),
    125m (64, 1)."""
    shapes = []
    for d in sweep["head_dims"]:
        heads = max(1, sweep["model_dim"] // d)
        for group in sweep["groups"]:
            for mask in sweep["masks"]:
                for s in sweep["seq_lens"]:
                    if heads % group == 0:
                        shapes.append(Shape(batch=max(1, sweep["tokens"] // s), seq=s, heads=heads,
                                            kv_heads=kv_heads or heads // group, head_dim=d,
                                            causal=mask != "full", doc_mask=mask == "doc"))
    shipped = [(64, 4), (128, 1), (128, 8), (64, 1)]
    shapes.sort(key=lambda sh: shipped.index((sh.head_dim, sh.heads // sh.kv_heads))
                if (sh.head_dim, sh.heads // sh.kv_heads) in shipped else len(shipped))
    return shapes


def _run_shape(shape: Shape, rows: list[dict], args, sweep: dict, header: str, start: float, interpret: bool):
    """Run every implementation on one shape, appending its rows to ``rows`` (reports rewritten after each)."""
    d, s = shape.head_dim, shape.seq
    first = len(rows)
    for impl in sweep["impls"]:
        if time.perf_counter() - start > args.time_budget:
            row = dict(impl=impl, dtype="bfloat16", batch=shape.batch, seq=s, heads=shape.heads,
                       kv_heads=shape.kv_heads, head_dim=d, causal=shape.causal,
                       doc_mask=shape.doc_mask, status=f"skipped: --time-budget {args.time_budget:.0f}s spent")
        else:
            row = bench_one(impl, shape, jnp.bfloat16, iters=sweep["iters"], interpret=interpret,
                            grad_check_max_seq=args.grad_check_max_seq)
        rows.append(row)
        # Rewritten after every row: a crash that takes the process down keeps what was measured.
        write_reports(rows, args.out, header)
        print(f"  {impl:<10} d={d:<4} g={shape.heads // shape.kv_heads} causal={shape.causal!s:<5} "
              f"doc={shape.doc_mask!s:<5} seq={s:<6} "
              f"{_fmt(row.get('fwd_ms'))} ms / {_fmt(row.get('fwdbwd_ms'))} ms  {row['status'][:100]}",
              flush=True)
    _versus_cudnn(rows[first:])
    write_reports(rows, args.out, header)
    if args.jsonl:
        import json

        with open(args.jsonl, "a") as f:
            for row in rows[first:]:
                f.write(json.dumps(dict(section="bench", **row)) + "\n")
    _reference.cache_clear()  # free the S x S-sized reference before the next shape


def main(argv=None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    gpu = _has_gpu()
    if not gpu and not args.smoke:
        raise SystemExit("jaxtrain.kernels.bench.flash: no GPU visible to JAX (backend: "
                         f"{jax.default_backend()}); the sweep is meant for a GPU. Use --smoke to exercise the "
                         "code path on CPU with tiny sizes in interpret mode.")
    sweep = _sweep(args)
    header = (f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
              f"dtype bfloat16, {sweep['tokens']} tokens per batch, model dim {sweep['model_dim']}, median of "
              f"{sweep['iters']} iterations"
              + (", SMOKE MODE (interpret, tiny sizes: timings are meaningless)" if args.smoke else ""))
    print(header, flush=True)
    start = time.perf_counter()
    rows: list[dict] = []
    for shape in _shapes(sweep, args.kv_heads):
        _run_shape(shape, rows, args, sweep, header, start, interpret=not gpu)
    print()
    print_table(rows)
    csv_path, md_path = write_reports(rows, args.out, header)
    print(f"\nwrote {md_path} and {csv_path} in {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
