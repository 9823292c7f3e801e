"""Start-up of ``python -m jaxtrain train``: from process start to the first step, by phase, first run and rerun.

    python benchmarks/startup.py [--repeats 3] [key=value ...]      # default: the tiny config on one CPU device

Each run is a fresh ``python -m jaxtrain train train.steps=2`` process with its own run.dir (nothing to resume);
the phases are read off the moments its lines reach stdout (unbuffered), relative to the moment it was started:

- imports: ``python -c "import jaxtrain.commands.train, jaxtrain.loop"`` minus ``python -c pass`` (measured apart);
- set-up: up to the "compiling the train and eval steps" line (interpreter, imports, config, mesh, layout, data);
- compile: to the "compiled in" line (train and eval steps);
- first step: to the "step 1/2" line (restore or initialise, data pipeline, the step, its metrics);
- total: process start to the first step's line.

"first run" uses an empty compile cache (``runtime.compile_cache`` = a fresh directory), "rerun" the same command
again with that cache filled: its compile phase is loading the cached programs. ``--reference-seconds`` is the time
of the comparable MaxText run the ratio is taken against (default 12.3 s: the ~7.4 s measured here before this
benchmark existed were ~0.6x of it, issue 25; MaxText is not installed here). The median of ``--repeats`` runs is
printed, with the machine's load average, which dominates these figures on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKS = (("set-up", "compiling the train and eval steps"), ("compile", "compiled in"), ("first step", "step 1/"))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wall(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=REPO)
    return time.perf_counter() - t0


def import_seconds() -> float:
    """Seconds the train command's imports add to a bare interpreter's start."""
    return _wall("import jaxtrain.cli, jaxtrain.commands.train, jaxtrain.loop") - _wall("pass")


def run_phases(run_dir: str, cache: str, overrides: list[str]) -> dict[str, float]:
    """Seconds since process start at which each of :data:`MARKS` appeared, as phase durations, and the total."""
    cmd = [sys.executable, "-m", "jaxtrain", "train", "train.steps=2", f"run.dir={run_dir}",
           f"runtime.compile_cache={cache}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    seen: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        for name, mark in MARKS:
            if name not in seen and mark in line:
                seen[name] = time.perf_counter() - t0
    if proc.wait() or len(seen) < len(MARKS):
        raise SystemExit(f"train failed or printed no {[n for n, _ in MARKS if n not in seen]} (rc {proc.returncode})")
    phases, before = {}, 0.0
    for name, _ in MARKS:
        phases[name], before = seen[name] - before, seen[name]
    phases["total"] = before
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference-seconds", type=float, default=12.3,
                   help="the comparable MaxText run's process start to first step (default 12.3 s, see the docstring)")
    p.add_argument("overrides", nargs="*", default=["runtime.cpu_devices=1"])
    args = p.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    imports = statistics.median(import_seconds() for _ in range(args.repeats))
    rows: dict[str, list[dict]] = {"first run": [], "rerun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            cache = os.path.join(tmp, f"cache{i}")
            rows["first run"].append(run_phases(os.path.join(tmp, f"first{i}"), cache, args.overrides))
            rows["rerun"].append(run_phases(os.path.join(tmp, f"rerun{i}"), cache, args.overrides))
            cached = len(os.listdir(cache)) if os.path.isdir(cache) else 0
            print(f"repeat {i + 1}: first {rows['first run'][-1]['total']:.2f} s, rerun "
                  f"{rows['rerun'][-1]['total']:.2f} s, {cached} programs in the compile cache", flush=True)
    print(f"\nimports (train command, measured apart): {imports:.2f} s")
    names = [n for n, _ in MARKS] + ["total"]
    print(f"{'':10} " + " ".join(f"{n:>11}" for n in names) + "  vs reference")
    for kind, runs in rows.items():
        med = {n: statistics.median(r[n] for r in runs) for n in names}
        print(f"{kind:10} " + " ".join(f"{med[n]:>9.2f} s" for n in names)
              + f"  {med['total'] / args.reference_seconds:.2f}x of {args.reference_seconds:g} s")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
