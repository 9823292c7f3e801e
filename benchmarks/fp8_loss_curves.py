"""FP8 training against BF16 on the CPU: the same runs (data, seed, steps) with each ``model.fp8`` recipe, their
losses side by side.

    python benchmarks/fp8_loss_curves.py [--configs tiny,18m] [--recipes none,tensorwise,rowwise,delayed]
        [--steps tiny=300,18m=200] [--every 50] [--dtype bfloat16] [--dir DIR]

Each run is ``python -m jaxtrain train`` in a process of its own (one CPU device, compute ``--dtype``, parameters
float32, the embedded corpus, train.seed 0, the config's learning-rate schedule over the run's steps), its losses
read from ``metrics.jsonl`` (every 10 steps). XLA:CPU emulates float8 (each float8 dot is converted to float32 after
compiling), so the numbers are FP8's and the times are not. Prints, per config, a markdown table of the loss at every
``--every`` steps for each recipe, the mean over the last 50 steps and the final evaluation loss, then the largest
gap of each recipe to ``none`` over all logged steps (relative) and the step it is at.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "tiny": [],  # the built-in tiny config: 0.82M parameters, 16 x 128 tokens a step
    # benchmarks/auto_layout.py's 18M config (d_model 384, 8 layers, 8 / 4 heads, d_ff 1536), 8 x 64 tokens a step
    "18m": ["model.d_model=384", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=1536",
            "train.global_batch=8", "data.seq_len=64"],
}


def _args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/fp8_loss_curves.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,18m")
    p.add_argument("--recipes", default="none,tensorwise,rowwise,delayed")
    p.add_argument("--steps", default="tiny=300,18m=200", help="config=steps, comma-separated")
    p.add_argument("--every", type=int, default=50, help="table rows every N steps")
    p.add_argument("--dtype", default="bfloat16", help="model.dtype of every run")
    p.add_argument("--dir", default=None, help="where the runs go (default: a new temporary directory)")
    args = p.parse_args(argv)
    args.steps = dict(kv.split("=") for kv in args.steps.split(","))
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS or c not in args.steps]
    if unknown:
        p.exit(2, f"fp8_loss_curves: config(s) {unknown} need an entry in CONFIGS and --steps\n")
    return args


def run(config: str, recipe: str, steps: int, dtype: str, root: str) -> dict:
    """One training run; its logged losses (step -> loss), final eval loss and wall seconds."""
    run_dir = os.path.join(root, f"{config}-{recipe}")
    cmd = [sys.executable, "-m", "jaxtrain", "train", *CONFIGS[config], f"model.fp8={recipe}",
           f"model.dtype={dtype}", "model.param_dtype=float32", f"train.steps={steps}", f"train.decay_steps={steps}",
           "train.log_every=10", f"train.eval_every={steps}", "checkpoint.every=0", "checkpoint.resume=never",
           "data.threads=0", f"run.dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{config} {recipe}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    losses = {r["step"]: r["loss"] for r in records}
    evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
    return dict(losses=losses, eval=evals[-1] if evals else None, seconds=seconds)


def table(config: str, runs: dict[str, dict], every: int) -> list[str]:
    recipes = list(runs)
    steps = sorted(runs[recipes[0]]["losses"])
    shown = [s for s in steps if s == 1 or s % every == 0 or s == steps[-1]]
    lines = [f"| {config}: step | " + " | ".join(recipes) + " |", "| ---: |" + " ---: |" * len(recipes)]
    for s in shown:
        lines.append(f"| {s} | " + " | ".join(f"{runs[r]['losses'][s]:.4f}" for r in recipes) + " |")
    tail = [s for s in steps if s > steps[-1] - 50]
    lines.append("| mean, last 50 steps | " + " | ".join(
        f"{sum(runs[r]['losses'][s] for s in tail) / len(tail):.4f}" for r in recipes) + " |")
    lines.append("| final eval loss | " + " | ".join(
        f"{runs[r]['eval']:.4f}" if runs[r]["eval"] is not None else "-" for r in recipes) + " |")
    lines.append("| wall seconds | " + " | ".join(f"{runs[r]['seconds']:.0f}" for r in recipes) + " |")
    if "none" in runs:
        base = runs["none"]["losses"]
        for r in recipes:
            if r == "none":
                continue
            gaps = {s: runs[r]["losses"][s] / base[s] - 1 for s in steps}
            worst = max(gaps, key=lambda s: abs(gaps[s]))
            late = [abs(gaps[s]) for s in steps if s > steps[-1] // 2]
            lines.append(f"- {config} {r}: largest gap to none {100 * gaps[worst]:+.2f}% at step {worst}; "
                         f"second half of the run: at most {100 * max(late):.2f}%")
    return lines


def main(argv=None) -> int:
    args = _args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="fp8_loss_curves.")
    print(f"runs in {root}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    out = []
    for config in args.configs.split(","):
        runs = {}
        for recipe in args.recipes.split(","):
            runs[recipe] = run(config, recipe, int(args.steps[config]), args.dtype, root)
            print(f"{config} {recipe}: {runs[recipe]['seconds']:.0f} s, last loss "
                  f"{runs[recipe]['losses'][max(runs[recipe]['losses'])]:.4f}", flush=True)
        out += table(config, runs, args.every) + [""]
    print(f"load average {os.getloadavg()[0]:.1f} at the end\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
