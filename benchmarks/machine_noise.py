"""How steady is this machine? Two probes that bound what a CPU timing comparison can resolve here.

1. A fixed NumPy matmul (three 1024 x 1024 float32 products) timed 5 times every 2 s for --seconds: the fastest
   of each 5, as a range and a median (nothing of jaxtrain involved).
2. The trial of ``mesh.auto`` (``trial.measure``, 6 steps) repeated --repeats times over the same four tiny-config
   layouts (data2 fsdp4, data4 fsdp2, fsdp8 and data8, remat save_matmuls, on 8 emulated CPU devices), at 2 and
   at 6 passes: how often each comes out fastest, and the range of each one's measured step.

    python benchmarks/machine_noise.py [--seconds 60] [--repeats 10]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = ["data2 fsdp4", "data4 fsdp2", "fsdp8", "data8"]


def matmul_probe(seconds: float) -> list[float]:
    a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    out, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ a, a @ a, a @ a
            times.append(time.perf_counter() - t0)
        out.append(min(times))
        time.sleep(1.5)
    return out


def trial_probe(repeats: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from jaxtrain.config import load_config
    from jaxtrain.planner.auto import space, trial

    cfg = load_config(None, ["runtime.cpu_devices=8", "mesh.auto=true"])
    devices = jax.devices()[:8]
    by_key = {(c.shape.label, c.remat): c for c in space.candidates(cfg, 8, 1, microbatches=[1])}
    cands = [by_key[m, "save_matmuls"] for m in LAYOUTS]
    exes: dict = {}
    trial.measure(cfg, cands, devices, 2, exes)  # compile and warm up
    for passes in (2, 6):
        wins: collections.Counter = collections.Counter()
        steps: dict = {c: [] for c in cands}
        for _ in range(repeats):
            t = trial.measure(cfg, cands, devices, 6, exes, passes=passes)
            wins[min(cands, key=t.get).shape.label] += 1
            for c in cands:
                steps[c].append(t[c])
        print(f"trial, {passes} passes, {repeats} repeats: fastest " + ", ".join(
            f"{m} {wins[m]}x" for m in LAYOUTS) + "; each one's step " + ", ".join(
            f"{c.shape.label} {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f} ms" for c, v in steps.items()), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    best = matmul_probe(args.seconds)
    print(f"matmul, fastest of 5 every 2 s for {args.seconds:.0f} s: {min(best) * 1e3:.1f}-{max(best) * 1e3:.1f} ms, "
          f"median {np.median(best) * 1e3:.1f} ms ({len(best)} groups)", flush=True)
    trial_probe(args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
