"""jaxtrain's FP8 train steps compiled with XLA:GPU for 8 x H100 on a machine without a GPU: do the projections
multiply in float8 (cuBLASLt FP8 calls or Triton FP8 GEMM fusions, with their scales), and what does a device need
against the BF16 step.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu /tmp/xla-gpu/bin/python benchmarks/fp8_gpu_compile.py \
        [--configs 1b,7b] [--recipes none,tensorwise,rowwise,delayed] [--gemms triton,cublas] [--rows 1]

Needs Python 3.12 with ``pip install "jax[cuda12]==0.11.2" flax optax orbax-checkpoint grain`` (the CUDA plugin
compiles for a GPU target without one; the two variables keep it from looking for a driver). The target is
``benchmarks/h100_target.txtpb``: XLA's H100 SXM figures with the CUDA and cuDNN versions, without which XLA's GEMM
rewriter refuses FP8 ("FP8 Custom Calls require CUDA 12.0 or newer") and computes in 16 bits. No autotuning without a
device (``--xla_gpu_autotune_level=0``): the GEMM configurations are placeholders, so the program says which GEMMs
are float8, not how fast they are. ``--gemms cublas`` sets ``--xla_gpu_enable_triton_gemm=false`` (cuBLAS(Lt) calls
instead of Triton fusions); each GEMM path runs in a process of its own, since XLA reads its flags once.

Each row: the step (fsdp over the 8 GPUs, ``--rows`` sequences of the config's length per GPU, bfloat16, cuDNN
attention, the config's remat), compile seconds, the float8 GEMMs by kind (forward e4m3 x e4m3, input gradient e5m2
x e4m3, weight gradient e4m3 x e5m2) and the 16-bit ones, the scales (cuBLASLt: scale operands other than 1; Triton:
scalars fused into the GEMM), the verdict of ``jaxtrain.planner.xla_gpu.fp8_gemms.fp8_problems`` (16-bit GEMMs are
allowed over the vocabulary (the output projection) and with batch dimensions (attention) only), and the memory per
device (``Compiled.memory_analysis``: arguments + temporaries + outputs not aliased) against the BF16 step's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
TARGET = os.path.join(REPO, "benchmarks", "h100_target.txtpb")
GEMM_FLAGS = {"triton": "", "cublas": "--xla_gpu_enable_triton_gemm=false"}


def _args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/fp8_gpu_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1b,7b")
    p.add_argument("--recipes", default="none,tensorwise,rowwise,delayed")
    p.add_argument("--gemms", default="triton,cublas", help="GEMM paths: triton (XLA's default), cublas")
    p.add_argument("--rows", type=int, default=1, help="sequences per GPU and step")
    p.add_argument("--target", default=TARGET, help="XLA GPU target config (protobuf text)")
    p.add_argument("--hlo-dir", default=None, help="write each compiled program's HLO text here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [g for g in args.gemms.split(",") if g not in GEMM_FLAGS]
    if bad:
        p.exit(2, f"fp8_gpu_compile: unknown --gemms {bad}; valid: {', '.join(GEMM_FLAGS)}\n")
    return args


def compile_one(config: str, recipe: str, rows: int, target: str, hlo_dir: str | None) -> dict:
    """One train step compiled for 8 x H100 (topology devices): its GEMMs and memory."""
    import jax
    from jax.experimental import topologies

    from jaxtrain.config import load_config
    from jaxtrain.parallel.layout import compiled_need
    from jaxtrain.planner.xla_gpu import fp8_gemms
    from jaxtrain.train.step import setup

    with open(target) as f:
        topo = topologies.get_topology_desc("h100", "cuda", target_config=f.read(), topology="1x1x8")
    cfg = load_config(config, ["model.dtype=bfloat16", "model.attention=cudnn", "mesh.ici.fsdp=8",
                               f"train.global_batch={8 * rows}", "train.microbatches=1", f"model.fp8={recipe}",
                               "run.dir=/tmp/fp8_gpu_compile"])
    t0 = time.perf_counter()
    step = setup(cfg, list(topo.devices))
    lay = step.layout
    with lay.scope():
        compiled = jax.jit(step.train_step, in_shardings=(lay.state_sharding, lay.batch_sharding),
                           out_shardings=(lay.state_sharding, None), donate_argnums=0
                           ).lower(lay.abstract_state, lay.abstract_batch()).compile()
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{config}-{recipe}.hlo.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(hlo_dir, f"{config}-{recipe}.gemms.hlo.txt"), "w") as f:
            f.write(excerpt(text))
    gemms = fp8_gemms.find_gemms(text)
    vocab = cfg.model.vocab_size
    problems = fp8_gemms.fp8_problems(gemms, lambda g: g.batched or vocab in sum(g.dims, ()))
    need = compiled_need(compiled)
    return dict(config=config, recipe=recipe, compile_s=round(seconds, 1), gemms=fp8_gemms.summary(gemms),
                scales=sorted({g.scales for g in gemms if g.fp8}), problems=problems if recipe != "none" else [],
                wide_projection_gemms=len(problems) if recipe == "none" else None,
                bytes_per_device=need.total if need else None, temp_bytes=need.temporaries if need else None)


def excerpt(text: str) -> str:
    """The lines of a compiled module that ``fp8_gemms`` reads, for tests/golden/: the module's name, whole
    computations that hold a dot, and elsewhere the GEMM calls (cuBLAS custom calls, Triton GEMM fusions) with the
    operands a cuBLAS call takes beside its matrices (its scales), metadata and frontend attributes dropped. Every
    line kept is one XLA printed, less those attributes."""
    import re

    from jaxtrain.planner.cost.hlo import fused_computation, parse_hlo

    module = parse_hlo(text)
    keep_comps = {c for c, instrs in module.comps.items() if any(i.opcode == "dot" for i in instrs)}
    keep_names: set[str] = set()

    def trace(name: str, depth: int = 0) -> None:  # what an operand came from (converts: the upcast check)
        ins = module.by_name.get(name)
        if ins is None or depth > 8 or name in keep_names:
            return
        keep_names.add(name)
        if ins.opcode == "parameter" and (caller := module.fusion_caller(ins.comp)) is not None:
            if ins.operands_text.isdigit() and int(ins.operands_text) < len(caller.operands):
                trace(caller.operands[int(ins.operands_text)], depth + 1)
        elif ins.opcode == "fusion" and (called := fused_computation(ins)):
            keep_comps.add(called)
        elif ins.opcode in ("convert", "bitcast", "transpose", "copy", "reshape", "broadcast", "multiply"):
            for op in ins.operands:
                trace(op, depth + 1)

    for ins in list(module.by_name.values()):
        if (ins.opcode == "custom-call" and "__cublas$" in ins.attrs) or '"kind":"__triton' in ins.attrs:
            keep_names.add(ins.name)
            for op in ins.operands if ins.opcode == "custom-call" else ():
                trace(op)
        elif ins.opcode == "dot":
            for op in ins.operands:
                trace(op)
    out, comp, header = [], None, None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            out.append(line.split(",")[0])
        elif line and not line[0].isspace() and line.rstrip().endswith("{"):
            parts = line.split()
            comp = parts[1 if parts[0] == "ENTRY" else 0].lstrip("%")
            header = line
            if comp in keep_comps:
                out.append(line)
        elif line.startswith("}"):
            if comp in keep_comps or header is None:
                out.append(line)
            comp, header = None, None
        elif comp is not None:
            name = line.strip().removeprefix("ROOT ").split(" ", 1)[0].lstrip("%")
            if comp in keep_comps or name in keep_names:
                if header is not None and comp not in keep_comps:
                    out.append(header)
                    header = None
                out.append(re.sub(r", (metadata|frontend_attributes)=\{[^{}]*\}", "", line))
    return "\n".join(out) + "\n"


def worker(args) -> int:
    for config in args.configs.split(","):
        for recipe in args.recipes.split(","):
            try:
                row = compile_one(config, recipe, args.rows, args.target, args.hlo_dir)
            except Exception as e:  # noqa: BLE001 -- a failed compile is a row of the table
                row = dict(config=config, recipe=recipe, error=" ".join(str(e).split())[:300])
            print(json.dumps(dict(row, gemm_path=args.worker)), flush=True)
    return 0


def _row(r: dict, bf16: dict[tuple[str, str], float]) -> str:
    if "error" in r:
        return f"| {r['config']} | {r['recipe']} | {r['gemm_path']} | failed: {r['error'][:120]} | | | | | |"
    g = r["gemms"]

    def count(lhs: str, rhs: str) -> int:
        return sum(n for k, n in g.items() if f" {lhs} x {rhs} " in f" {k.split(' ', 1)[1]} ")

    f8 = f"{count('f8e4m3fn', 'f8e4m3fn')} / {count('f8e5m2', 'f8e4m3fn')} / {count('f8e4m3fn', 'f8e5m2')}"
    wide = sum(n for k, n in g.items() if "f8" not in k)
    engines = sorted({k.split(" ")[0] for k in g if "f8" in k}) or ["-"]
    verdict = "ok" if not r["problems"] else "; ".join(r["problems"])[:100]
    if r["recipe"] == "none":
        verdict = "(baseline)"
    mem = r["bytes_per_device"] / 2**30
    base = bf16.get((r["config"], r["gemm_path"]))
    ratio = f" ({mem / base:.3f}x)" if base and r["recipe"] != "none" else ""
    return (f"| {r['config']} | {r['recipe']} | {r['gemm_path']} | {r['compile_s']} | {f8} | {wide} | "
            f"{', '.join(engines)} {r['scales'] or ''} | {verdict} | {mem:.2f} GiB{ratio} |")


def main(argv=None) -> int:
    args = _args(argv)
    if args.worker:
        return worker(args)
    rows = []
    for path in args.gemms.split(","):
        env = dict(os.environ, XLA_FLAGS=f"--xla_gpu_autotune_level=0 {GEMM_FLAGS[path]}".strip())
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--configs", args.configs,
               "--recipes", args.recipes, "--rows", str(args.rows), "--target", args.target]
        if args.hlo_dir:
            cmd += ["--hlo-dir", os.path.join(args.hlo_dir, path)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
    bf16 = {(r["config"], r["gemm_path"]): r["bytes_per_device"] / 2**30 for r in rows
            if r["recipe"] == "none" and "error" not in r}
    print("| config | model.fp8 | GEMMs | compile s | float8 GEMMs fwd / dgrad / wgrad | 16-bit GEMMs | engine "
          "[scales] | check | memory per device (vs BF16) |")
    print("| --- | --- | --- | ---: | --- | ---: | --- | --- | ---: |")
    for r in rows:
        print(_row(r, bf16))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
