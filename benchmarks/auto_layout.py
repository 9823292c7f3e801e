"""Where does mesh.auto's pick land among the layouts a user could choose by hand? Measured on 8 emulated CPU devices.

For the tiny config and a ~18M-parameter config: hand choices (canonical meshes x remat none/full x microbatches
1/2, as many as --budget-s allows per config, in a fixed order) are compiled and run for --steps steps each in this
process (random tokens, zero-initialised state: the step's work does not depend on the values); each compile's
reading also fills the planner's cache, so the auto search that follows recompiles only what was not measured.
Then, at two memory budgets (ample, and 0.95 x the ample pick's compiled memory so that it no longer fits), the auto
pick is measured too (if it was not) and ranked by measured tokens/s among the hand choices that fit that budget.

    python benchmarks/auto_layout.py [--configs tiny,18m] [--steps 5] [--budget-s 150] [--json FILE]

Prints one markdown table per config and budget, and the auto pick's predicted vs measured step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.planner import auto, search  # noqa: E402
from jaxtrain.planner.measure import measure_cpu  # noqa: E402

CONFIGS = {
    "tiny": [],  # the built-in tiny config: 0.8M parameters, 16 x 128 tokens a step
    "18m": ["model.d_model=384", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=1536",
            "train.global_batch=8", "data.seq_len=64"],
}
MESHES = ["fsdp8", "data8", "data2 fsdp4", "fsdp4 tensor2", "data4 fsdp2", "data2 fsdp2 tensor2", "fsdp2 tensor4"]
ORDER = [("none", 1), ("full", 1), ("none", 2), ("full", 2)]  # every mesh at one setting before the next


def hand_choices(cfg, devices) -> list[auto.Candidate]:
    cands = {(c.shape.label, c.remat, c.microbatches): c
             for c in auto.candidates(cfg, len(devices), 1, remats=("none", "full"), microbatches=[1, 2])}
    return [cands[m, r, k] for r, k in ORDER for m in MESHES if (m, r, k) in cands]


@dataclasses.dataclass
class Measured:
    cand: auto.Candidate
    step_s: float
    memory: int
    est_s: float

    def tokens_per_s(self, cfg) -> float:
        return cfg.train.global_batch * cfg.data.seq_len / self.step_s


def measure(cfg, cand: auto.Candidate, devices, hw, cache_dir: str, steps: int) -> Measured:
    """Compile ``cand``'s train step once: the planner's reading (cached for the search) and the measured steps."""
    c = cand.apply(cfg)
    step = search._step(c, cand.shape, devices)
    train, seconds = search.compile_train_step(step)
    comp = search.reading(step, train, seconds)
    auto.store(auto.cache_path(cache_dir, c, cand.shape, devices), comp)
    lay = step.layout
    state = jax.tree.map(lambda a, s: jax.device_put(np.zeros(a.shape, a.dtype), s), lay.abstract_state,
                         lay.state_sharding)
    rng = np.random.default_rng(0)
    batch = jax.device_put(rng.integers(0, cfg.model.vocab_size, lay.batch_shape, dtype=np.int32),
                           lay.batch_sharding)
    times = []
    for _ in range(steps + 1):  # the first run is a warm-up
        t0 = time.perf_counter()
        state, metrics = train(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    est = search.candidate_result(c, cand.shape, hw, comp)["est_step_seconds"]
    return Measured(cand, statistics.median(times[1:]), comp.memory_bytes, est)


def table(cfg, name: str, measured: list[Measured], pick: Measured, budget: float, label: str) -> tuple[str, dict]:
    fits = sorted((m for m in measured if m.memory <= budget), key=lambda m: m.step_s)
    rank = 1 + sum(m.step_s < pick.step_s for m in fits if m.cand != pick.cand)
    best = fits[0]
    lines = [f"\n### {name}, {label} budget ({budget / 1e6:.1f} MB per device): {len(fits)} hand choices fit",
             "", "| rank | layout | measured step | tokens/s | predicted step | memory | auto |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for i, m in enumerate(fits, 1):
        lines.append(f"| {i} | {m.cand.label} | {m.step_s * 1e3:.1f} ms | {m.tokens_per_s(cfg):,.0f} | "
                     f"{m.est_s * 1e3:.1f} ms | {m.memory / 1e6:.1f} MB | "
                     f"{'**pick**' if m.cand == pick.cand else ''} |")
    over = [m for m in measured if m.memory > budget]
    if over:
        lines.append(f"\nover the budget: {', '.join(f'{m.cand.label} ({m.memory / 1e6:.1f} MB)' for m in over)}")
    gap = pick.step_s / best.step_s - 1
    err = pick.step_s / pick.est_s - 1
    lines.append(f"\nauto pick {pick.cand.label}: rank {rank} of {len(fits)}, {gap * 100:+.1f}% from the best measured "
                 f"({best.cand.label}); predicted {pick.est_s * 1e3:.1f} ms, measured {pick.step_s * 1e3:.1f} ms "
                 f"({err * 100:+.1f}%)")
    return "\n".join(lines), {"config": name, "budget": label, "budget_bytes": budget, "pick": pick.cand.label,
                              "rank": rank, "of": len(fits), "gap_to_best": gap, "predicted_s": pick.est_s,
                              "measured_s": pick.step_s, "best": best.cand.label}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="tiny,18m")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=150.0, help="seconds of hand choices per config")
    p.add_argument("--json", help="write the summary rows here")
    args = p.parse_args()
    devices = jax.devices()[:8]
    print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores shared)", flush=True)
    hw = measure_cpu(devices)
    rows, t_start = [], time.perf_counter()
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(None, [f"run.dir={tmp}/run", "runtime.cpu_devices=8", "mesh.auto=true", *CONFIGS[name]])
            cache = os.path.join(tmp, "cache")
            measured: dict[auto.Candidate, Measured] = {}
            t0 = time.perf_counter()
            for cand in hand_choices(cfg, devices):
                if time.perf_counter() - t0 > args.budget_s and len(measured) >= 2:
                    break
                measured[cand] = m = measure(cfg, cand, devices, hw, cache, args.steps)
                print(f"{name}: {cand.label}: {m.step_s * 1e3:.1f} ms measured, {m.est_s * 1e3:.1f} ms predicted, "
                      f"{m.memory / 1e6:.1f} MB", flush=True)
            budget = None
            for label in ("ample", "tight"):
                big = hw if budget is None else dataclasses.replace(hw, hbm_bytes=budget / (
                    1 - cfg.mesh.auto_memory_margin), mem_fraction=1.0)
                res = auto.search_layout(cfg, devices, big, cache_dir=cache)
                print(auto.format_result(res, top=3), flush=True)
                pick = res.choice.cand
                if pick not in measured:
                    measured[pick] = measure(cfg, pick, devices, hw, cache, args.steps)
                text, row = table(cfg, name, list(measured.values()), measured[pick], res.budget, label)
                row.update(search_s=res.seconds, compiles=res.compiles, cache_hits=res.cache_hits)
                print(text, flush=True)
                rows.append(row)
                budget = measured[pick].memory * 0.95  # the next budget: the ample pick no longer fits
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
