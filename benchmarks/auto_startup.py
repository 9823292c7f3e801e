"""What mesh.auto costs before the first step: `train` with and without it, cold and again, on emulated CPU devices.

For each checkout given (``--repos``, default this one; another one, say the main branch's, compares code
versions in the same run and under the same load), three commands of ``python -m jaxtrain train`` with
``train.steps=1``, each in a new run directory: without ``mesh.auto`` (the config's own mesh), with it on an empty
user cache (``XDG_CACHE_HOME`` a new directory: nothing compiled, timed or read before), and with it again in
another run directory on the cache the cold run left. The commands of all checkouts alternate (one kind at a time,
checkout after checkout), so that a machine whose load drifts weighs on each alike. Each run's seconds from start to
its first step's line, and what mesh.auto's summary line says it spent (the figures, the search, the trial).

    python benchmarks/auto_startup.py [--repos PATH[,PATH]] [--devices 8] [key=value ...]

Prints a markdown table, one row per checkout and kind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("without mesh.auto", "mesh.auto, empty cache", "mesh.auto again, another run.dir")


def first_step(repo: str, args: list[str], xdg: str) -> tuple[float, str]:
    """(seconds from start to the line of step 1, the whole output) of ``python -m jaxtrain train ARGS`` run from
    ``repo`` with ``XDG_CACHE_HOME=xdg``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(PYTHONPATH=repo, XDG_CACHE_HOME=xdg, PYTHONUNBUFFERED="1")
    t0, seen = time.perf_counter(), None
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", *args], cwd=repo, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = []
    for line in proc.stdout:  # type: ignore[union-attr]
        out.append(line)
        if seen is None and line.startswith("step 1/"):
            seen = time.perf_counter() - t0
    if proc.wait() != 0 or seen is None:
        raise RuntimeError(f"{repo}: train {' '.join(args)} failed:\n{''.join(out)[-3000:]}")
    return seen, "".join(out)


def parts(output: str) -> str:
    """mesh.auto's own account of its time, where its summary line (or the older 'searched ... in') is there."""
    found = re.search(r"mesh\.auto: ([\d.]+ s in all: .*)", output)
    if found:
        return found.group(1)
    found = re.search(r"searched \d+ candidates in ([\d.]+) s: .*?(\d+) compiled, (\d+) from the cache", output)
    if not found:
        return ""
    return f"the search {found.group(1)} s ({found.group(2)} compiled, {found.group(3)} from the cache)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repos", default=ROOT, help="checkouts to compare, comma-separated")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    repos = args.repos.split(",")
    common = [f"runtime.cpu_devices={args.devices}", "train.steps=1", *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, kind in enumerate(KINDS):
            for i, repo in enumerate(repos):
                load = os.getloadavg()[0]
                extra = [] if k == 0 else ["mesh.auto=true"]
                xdg = os.path.join(tmp, f"xdg{i}" if k else f"plain{i}")
                seconds, out = first_step(repo, [*common, *extra, f"run.dir={tmp}/run{i}-{k}"], xdg)
                rows.append((repo, kind, seconds, load, parts(out)))
                print(f"{repo}: {kind}: first step after {seconds:.1f} s (load {load:.1f}) {parts(out)}", flush=True)
    print("\n| checkout | run | first step after | load average at its start | mesh.auto's own account |\n"
          "| --- | --- | ---: | ---: | --- |")
    for repo, kind, seconds, load, said in rows:
        print(f"| {repo} | {kind} | {seconds:.1f} s | {load:.1f} | {said} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
