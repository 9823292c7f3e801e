"""Mixture of experts on emulated CPU devices: the tiny MoE model (configs/tiny-moe.yaml: 8 experts of width 192,
top 2) against the dense tiny model with the same active parameters (configs/tiny.yaml: one MLP of width 384), on
the same meshes; and how much of an expert-parallel step the all-to-all takes. Prints a Markdown table; asserts
nothing.

    python benchmarks/moe_bench.py [--steps N] [--warmup N] [--rows NAME ...] [key=value ...]

Each row compiles the real train step (jaxtrain.train.step.setup + Step.compile), reads the per-device arguments and
temporaries from XLA's memory analysis, runs warm-up steps and then the timed ones on device-resident state and one
random batch (median reported, each step waited for), and finally traces two more steps with the profiler: the
share of each device's busy time spent in each kind of collective (on emulated devices that includes waiting at the
collective's rendezvous for the slowest of the devices, which share the host's cores).

On CPU ``jax.lax.ragged_dot`` is a masked dense matmul over all of a device's experts (docs/moe.md), so an MoE layer
with E local experts costs E x its real FLOPs there; expert parallelism over 8 devices leaves one expert each.
"""

import argparse
import collections
import glob
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.models.flops import count_params  # noqa: E402
from jaxtrain.train import step as step_lib  # noqa: E402

FLOAT32 = ["model.dtype=float32", "model.param_dtype=float32", "data.source=synthetic"]
ROWS = {  # name -> (shipped config, devices, overrides)
    "dense, 1 device": ("tiny", 1, ["mesh.ici.fsdp=1"]),
    "moe, 1 device": ("tiny-moe", 1, ["mesh.ici.fsdp=1"]),
    "dense, fsdp 8": ("tiny", 8, ["mesh.ici.fsdp=8"]),
    "moe, fsdp 8 (no expert parallelism)": ("tiny-moe", 8, ["mesh.ici.fsdp=8"]),
    "dense, data 8": ("tiny", 8, ["mesh.ici.fsdp=1", "mesh.ici.data=8"]),
    "moe, expert 8, all_to_all": ("tiny-moe", 8, ["mesh.ici.fsdp=1", "mesh.ici.expert=8",
                                                  "model.moe.dispatch=all_to_all"]),
    "moe, expert 8, all_gather": ("tiny-moe", 8, ["mesh.ici.fsdp=1", "mesh.ici.expert=8",
                                                  "model.moe.dispatch=all_gather"]),
    "moe, expert 4 x fsdp 2, all_to_all": ("tiny-moe", 8, ["mesh.ici.fsdp=2", "mesh.ici.expert=4",
                                                           "model.moe.dispatch=all_to_all"]),
}
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def collective_share(step, state, batch) -> dict[str, float]:
    """Share of the devices' busy time (first to last op of each device's step) in each collective kind, from a
    profile of two steps."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(2):
                state, metrics = step(state, batch)
                jax.block_until_ready((state, metrics))
        events = json.load(gzip.open(glob.glob(os.path.join(tmp, "plugins/profile/*/perfetto_trace.json.gz"))[0]))
    spent, span = collections.Counter(), {}
    for e in events["traceEvents"]:
        a = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in a or "train_step" not in a.get("hlo_module", ""):
            continue
        key = (a.get("device_ordinal"), a.get("run_id"))
        lo, hi = span.get(key, (math.inf, 0.0))
        span[key] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
        op = a["hlo_op"].split(".")[0].replace("_", "-").removesuffix("-start").removesuffix("-done")
        if op in COLLECTIVES:
            spent[op] += e["dur"]
    busy = sum(hi - lo for lo, hi in span.values())
    return {k: v / busy for k, v in spent.items()} if busy else {}


def measure(name: str, steps: int, warmup: int, extra: list[str]) -> dict:
    config, devices, overrides = ROWS[name]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, [f"run.dir={tmp}/run", *FLOAT32, *overrides, *extra])
    ts = step_lib.setup(cfg, jax.devices()[:devices])
    step, _, compile_s = ts.compile(ts.layout.abstract_state, with_eval=False)
    mem = step.memory_analysis()
    state = ts.layout.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, ts.layout.batch_shape, dtype=np.int32)
    batch = jax.device_put(tokens, ts.layout.batch_sharding)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    share = collective_share(step, state, batch) if devices > 1 else {}
    median = statistics.median(times)
    counts = count_params(cfg.model)
    return {"name": name, "mesh": ts.layout.shape.label, "params_m": counts["total"] / 1e6,
            "active_m": counts["active"] / 1e6, "step_ms": median * 1e3,
            "tokens_per_s": cfg.train.global_batch * cfg.data.seq_len / median,
            "args_mb": mem.argument_size_in_bytes / 2**20, "temp_mb": mem.temp_size_in_bytes / 2**20,
            "compile_s": compile_s, "loss": float(metrics["loss"]), "share": share}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="NAME")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, key=value")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {len(jax.devices())} emulated CPU devices, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; {args.steps} timed steps after {args.warmup} warm-up; float32")
    print("| model, mesh | params (active) | step ms | tokens/s | args MiB | temp MiB | collectives' share of the "
          "step | compile s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name in args.rows:
        r = measure(name, args.steps, args.warmup, args.overrides)
        share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(r["share"].items(), key=lambda kv: -kv[1]))
        print(f"| {r['name']} | {r['params_m']:.2f}M ({r['active_m']:.2f}M) | {r['step_ms']:.0f} | "
              f"{r['tokens_per_s']:,.0f} | {r['args_mb']:.1f} | {r['temp_mb']:.1f} | {share or '-'} | "
              f"{r['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
