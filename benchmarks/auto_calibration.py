"""Does `check`'s calibration help mesh.auto's estimate? Measured on 8 emulated CPU devices.

For a config (default: the tiny one) and a few layouts (remat none, one microbatch), the step is estimated twice
with the figures ``mesh.auto`` takes (``auto.hardware_for``): without a calibration (everything measured at hand)
and with the calibration file ``jaxtrain check runtime.cpu_devices=8`` wrote (``--calibration``; without it the
check runs first, in a subprocess, into a temporary run directory). Then each layout's step is measured the way
the trial measures (``trial.measure``: ``--passes`` passes back and forth, ``--steps`` steps each, the fastest
counts), all in this one process so that the three figures of a layout share the machine's load.

    python benchmarks/auto_calibration.py [--calibration FILE] [--layouts "fsdp8,data8,data2 fsdp4,fsdp4 tensor2"]
                                          [--steps 6] [--passes 2] [key=value ...]

Prints a markdown table: per layout the two estimates, the measured step and each estimate's error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.planner.auto import choose as auto  # noqa: E402
from jaxtrain.planner.auto import space, trial  # noqa: E402
from jaxtrain.planner.search import meshes as search  # noqa: E402


def check(run_dir: str) -> str:
    """``jaxtrain check`` on 8 CPU devices into ``run_dir``; the calibration file it wrote."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "jaxtrain", "check", "runtime.cpu_devices=8", f"run.dir={run_dir}"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return os.path.join(run_dir, "calibration.json")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calibration", help="a calibration file of 8 CPU devices (default: run `check` first)")
    p.add_argument("--layouts", default="fsdp8,data8,data2 fsdp4,fsdp4 tensor2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores shared)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.calibration or check(os.path.join(tmp, "check"))
        cfg = load_config(None, [f"run.dir={tmp}/run", "runtime.cpu_devices=8", "mesh.auto=true", *args.overrides])
        devices = jax.devices()
        plain, calibrated = auto.hardware_for(cfg, devices).hw, auto.hardware_for(cfg, devices, path).hw
        print(f"peak_flops {plain.peak_flops / 1e9:.2f} GFLOP/s a device at hand, {calibrated.peak_flops / 1e9:.2f} "
              f"from {path}; model efficiency at hand {[(r, t, round(e, 3)) for r, t, e in plain.model_efficiency]}, "
              f"with the calibration {[(r, t, round(e, 3)) for r, t, e in calibrated.model_efficiency]}", flush=True)
        by_label = {c.shape.label: c for c in space.candidates(cfg, len(devices), 1, ("none",), [1])}
        cands = [by_label[label] for label in args.layouts.split(",")]
        exes, est = {}, {}
        for cand in cands:
            step = search._step(cand.apply(cfg), cand.shape, devices)
            train, seconds = search.compile_train_step(step)
            exes[cand], comp = (step, train), search.reading(step, train, seconds)
            est[cand] = [search.candidate_result(cand.apply(cfg), cand.shape, hw, comp)["est_step_seconds"]
                         for hw in (plain, calibrated)]
        measured = trial.measure(cfg, cands, devices, args.steps, exes, passes=args.passes)
    print("\n| layout | estimate, no calibration | estimate, calibrated | measured | error, no calibration | "
          "error, calibrated |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for cand in cands:
        (a, b), m = est[cand], measured[cand]
        print(f"| {cand.label} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {m * 1e3:.1f} ms | {(a / m - 1) * 100:+.0f}% | "
              f"{(b / m - 1) * 100:+.0f}% |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
