"""Pipeline schedules (GPipe and 1F1B) vs FSDP on 8 emulated CPU devices: step time, the compiled step's
temporaries and the bubble for stage = 1 and the ``--stages`` (fsdp filling the rest), V = 1 and 2, at several
microbatch counts of a fixed microbatch size (``--rows`` sequences, so the global batch grows with the
microbatches). Prints a Markdown table; asserts nothing.

    python benchmarks/pipeline_bench.py [--steps N] [--warmup N] [--microbatches 4 16 64] [--rows 8]
        [--stages 4] [--schedules gpipe 1f1b] [--virtual 1 2] [key=value ...]

Stage 1 is plain FSDP over 8 devices with the same microbatches accumulated (train.accumulate as configured), so each
row of one microbatch count does the same arithmetic on the same global batch. Every row compiles the real train step
(jaxtrain.train.step.setup + Step.compile), reads the per-device temporaries from XLA's memory analysis, then runs the
compiled step on device-resident state (Layout.init_state) and one random int32 batch placed with the batch sharding:
warm-up steps, then the median of the timed ones, each waited for.

CPU figures say how the schedule's shape costs here (emulated devices share the host's cores, so the bubble is not idle
time as it would be on accelerators: a GPipe stage's idle iterations still run its chunk on garbage, see
jaxtrain/parallel/pipeline.py, where a 1F1B stage skips them; 1F1B recomputes each pass's forward in its backward); they
are no forecast for GPUs.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.parallel import pipeline  # noqa: E402
from jaxtrain.train import step as step_lib  # noqa: E402

# A tiny float32 model; microbatches of --rows sequences (a multiple of 8, so that they divide over fsdp = 8).
BASE = ["model.n_layers=8", "model.dtype=float32", "model.param_dtype=float32", "data.seq_len=32",
        "data.source=synthetic"]


def measure(stages: int, microbatches: int, virtual: int, schedule: str, rows: int, steps: int, warmup: int,
            extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"run.dir={tmp}/run", *BASE, f"mesh.ici.stage={stages}",
                                 f"mesh.ici.fsdp={8 // stages}", f"train.microbatches={microbatches}",
                                 f"train.global_batch={rows * microbatches}", f"train.virtual_stages={virtual}",
                                 f"train.pipeline_schedule={schedule}", *extra])
    ts = step_lib.setup(cfg, jax.devices()[:8])
    step, _, compile_s = ts.compile(ts.layout.abstract_state, with_eval=False)
    temp = step.memory_analysis().temp_size_in_bytes
    state = ts.layout.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.global_batch,
                                                                         cfg.data.seq_len + 1), dtype=np.int32)
    batch = jax.device_put(tokens, ts.layout.batch_sharding)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"stages": stages, "microbatches": microbatches, "virtual": virtual, "mesh": ts.layout.shape.label,
            "schedule": schedule if stages > 1 else "-",
            "bubble": pipeline.bubble_fraction(stages, microbatches, virtual) if stages > 1 else 0.0,
            "step_ms": statistics.median(times) * 1e3, "temp_mb": temp / 2**20, "compile_s": compile_s,
            "loss": float(metrics["loss"])}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2], help="train.virtual_stages values")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, key=value")
    args = parser.parse_args(argv)
    runs = [(1, m, 1, "gpipe") for m in args.microbatches]
    runs += [(s, m, v, sched) for s in args.stages for v in args.virtual for sched in args.schedules
             for m in args.microbatches]
    load_before, t_start = os.getloadavg(), time.perf_counter()
    rows = []
    for stages, micro, virtual, schedule in runs:
        r = measure(stages, micro, virtual, schedule, args.rows, args.steps, args.warmup, args.overrides)
        print(f"# {r['mesh']} {r['schedule']} M={micro} V={virtual}: {r['step_ms']:.1f} ms, temp "
              f"{r['temp_mb']:.2f} MB, compile {r['compile_s']:.1f} s", file=sys.stderr, flush=True)
        rows.append(r)
    rows.sort(key=lambda r: (r["stages"], r["virtual"], r["schedule"], r["microbatches"]))
    print(f"\n{jax.device_count()} x {jax.devices()[0].device_kind} (emulated), jax {jax.__version__}; "
          f"{' '.join(BASE + args.overrides)}; microbatches of {args.rows} sequences; median of {args.steps} steps "
          f"after {args.warmup} warm-up\n")
    print("| stage | mesh | schedule | microbatches | V | bubble | step ms | temp MB | compile s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['stages']} | {r['mesh']} | {r['schedule']} | {r['microbatches']} | {r['virtual']} | "
              f"{r['bubble']:.3f} | {r['step_ms']:.1f} | {r['temp_mb']:.2f} | {r['compile_s']:.1f} |")
    load_after = os.getloadavg()
    print(f"\nload average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
          f"{', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs; "
          f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
