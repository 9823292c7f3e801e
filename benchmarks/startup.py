"""Start-up of ``python -m jaxtrain train``: from process start to the first step, by phase, first run and rerun.

    python benchmarks/startup.py [--repeats 3] [key=value ...]      # default: the tiny config on one CPU device

Each run is a fresh ``python -m jaxtrain train train.steps=2`` process with its own run.dir (nothing to resume);
the phases are read off the moments its lines reach stdout (unbuffered), relative to the moment it was started:

- imports: ``python -c "import jaxtrain.commands.train, jaxtrain.train.loop"`` minus ``python -c pass``
  (measured apart);
- set-up: up to the "compiling the train step" line (interpreter, imports, config, mesh, layout, data);
- compile: to the "compiled in" line (the train step; the eval step is compiled at the first evaluation, after
  step 1);
- first step: to the "step 1/2" line (restore or initialise, data pipeline, the step, its metrics);
- total: process start to the first step's line.

"first run" uses an empty compile cache (``runtime.compile_cache`` = a fresh directory), "rerun" the same command
again with that cache filled: its compile phase is loading the cached programs. The median of ``--repeats`` runs is
printed, with the machine's load average, which dominates these figures on a shared 2-core machine.

The ratio is taken against MaxText's own train command running the same job, measured in the same way and
interleaved with jaxtrain's runs (same load): ``--maxtext PYTHON`` names the interpreter of an environment where
``pip install 'maxtext[tpu]==0.2.5'`` was done (Python >= 3.12; the tpu extra is the one that brings jax and its
CPU backend: 235 packages, about 5 minutes). Its job (:func:`maxtext_args`) has the config's shapes (width, heads,
head dim, MLP width, layers, vocabulary, sequence length, batch per device, tied embeddings, float32), synthetic
data, no checkpointing, ``hardware=cpu`` with ``skip_jax_distributed_system`` (one process),
``remat_policy=minimal`` (its least recomputation; jaxtrain's ``model.remat=none``) and ``jax_cache_dir`` = a fresh
directory for its first run, the same one for its rerun; its first step is its ``completed step: 0`` line. MaxText
runs on the jax of its own environment (0.12.0.1 with Python 3.12 here), jaxtrain on this interpreter's. Without
``--maxtext`` the ratio is against ``--reference-seconds`` (12.3 s: an estimate from an earlier round, never measured
beside jaxtrain; it does not carry across machines or loads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKS = (("set-up", "compiling the train step"), ("compile", "compiled in"), ("first step", "step 1/"))


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
    return _wall("import jaxtrain.cli, jaxtrain.commands.train, jaxtrain.train.loop") - _wall("pass")


def seconds_to_marks(cmd: list[str], marks: Sequence[tuple[str, str]], env: dict, cwd: str) -> dict[str, float]:
    """Seconds from starting ``cmd`` until each mark's text first appears in its output ({name: seconds}); exits
    with the output's tail when the command fails or a mark never appears."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    seen: dict[str, float] = {}
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        for name, mark in marks:
            if name not in seen and mark in line:
                seen[name] = time.perf_counter() - t0
    if proc.wait() or len(seen) < len(marks):
        raise SystemExit(f"{cmd[0]} {cmd[1:3]} failed or printed no {[n for n, _ in marks if n not in seen]} "
                         f"(rc {proc.returncode}):\n" + "".join(tail))
    return seen


def run_phases(run_dir: str, cache: str, overrides: list[str]) -> dict[str, float]:
    """Seconds since process start at which each of :data:`MARKS` appeared, as phase durations, and the total."""
    cmd = [sys.executable, "-m", "jaxtrain", "train", "train.steps=2", f"run.dir={run_dir}",
           f"runtime.compile_cache={cache}", *overrides]
    seen = seconds_to_marks(cmd, MARKS, _env(), REPO)
    phases, before = {}, 0.0
    for name, _ in MARKS:
        phases[name], before = seen[name] - before, seen[name]
    phases["total"] = before
    return phases


MAXTEXT_FIRST_STEP = "completed step: 0"


def maxtext_base_yml(python: str) -> str:
    """The base.yml of the maxtext package installed for ``python``."""
    where = subprocess.run([python, "-c", "import importlib.util as u; "
                            "print(u.find_spec('maxtext').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return os.path.join(where, "configs", "base.yml")


def maxtext_args(base_yml: str, overrides: list[str], cache: str, out: str) -> list[str]:
    """MaxText's train arguments (after ``python -m``) for the job jaxtrain runs with ``overrides``: the shapes are
    read off jaxtrain's config."""
    from jaxtrain.config import load_config  # the config module alone: no JAX import in the benchmark's process

    cfg = load_config(None, overrides)
    m, devices = cfg.model, cfg.runtime.cpu_devices or 1
    return ["maxtext.trainers.pre_train.train", base_yml,
            "run_name=startup", f"base_output_directory={out}", "dataset_type=synthetic", "steps=2",
            "enable_checkpointing=false", "hardware=cpu", "skip_jax_distributed_system=true",
            f"jax_cache_dir={cache}", "remat_policy=minimal",
            f"base_emb_dim={m.d_model}", f"base_num_query_heads={m.n_heads}", f"base_num_kv_heads={m.n_kv_heads}",
            f"head_dim={m.resolved_head_dim}", f"base_mlp_dim={m.d_ff}", f"base_num_decoder_layers={m.n_layers}",
            f"vocab_size={m.vocab_size}", f"max_target_length={cfg.data.seq_len}",
            f"per_device_batch_size={cfg.train.global_batch // devices}",
            f"logits_via_embedding={str(m.tie_embeddings).lower()}", "dtype=float32",
            f"weight_dtype={m.param_dtype}"]


def run_maxtext(cmd: list[str]) -> float:
    """Seconds from process start to MaxText's first step line."""
    env = {**_env(), "PYTHONPATH": ""}
    return seconds_to_marks(cmd, [("first step", MAXTEXT_FIRST_STEP)], env, tempfile.gettempdir())["first step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference-seconds", type=float, default=12.3,
                   help="without --maxtext: MaxText's process start to first step (default 12.3 s, an estimate)")
    p.add_argument("--maxtext", metavar="PYTHON",
                   help="an interpreter with maxtext[tpu] installed: measure MaxText's run interleaved with jaxtrain's")
    p.add_argument("overrides", nargs="*", default=["runtime.cpu_devices=1"])
    args = p.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    imports = statistics.median(import_seconds() for _ in range(args.repeats))
    base_yml = maxtext_base_yml(args.maxtext) if args.maxtext else ""
    rows: dict[str, list[dict]] = {"first run": [], "rerun": []}
    maxtext: dict[str, list[float]] = {"first run": [], "rerun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            if args.maxtext:  # before jaxtrain's pair in odd repeats, after it in even ones: neither always first
                mt_cache = os.path.join(tmp, f"mt-cache{i}")
                mt = [[args.maxtext, "-m", *maxtext_args(base_yml, args.overrides, mt_cache,
                                                         os.path.join(tmp, f"mt{i}{k}"))] for k in ("a", "b")]
            cache = os.path.join(tmp, f"cache{i}")
            for turn in ("maxtext", "jaxtrain") if i % 2 == 0 else ("jaxtrain", "maxtext"):
                if turn == "jaxtrain":
                    rows["first run"].append(run_phases(os.path.join(tmp, f"first{i}"), cache, args.overrides))
                    rows["rerun"].append(run_phases(os.path.join(tmp, f"rerun{i}"), cache, args.overrides))
                elif args.maxtext:
                    maxtext["first run"].append(run_maxtext(mt[0]))
                    maxtext["rerun"].append(run_maxtext(mt[1]))
            cached = len(os.listdir(cache)) if os.path.isdir(cache) else 0
            print(f"repeat {i + 1}: first {rows['first run'][-1]['total']:.2f} s, rerun "
                  f"{rows['rerun'][-1]['total']:.2f} s, {cached} programs in the compile cache"
                  + (f"; MaxText first {maxtext['first run'][-1]:.2f} s, rerun {maxtext['rerun'][-1]:.2f} s "
                     f"(ratios {rows['first run'][-1]['total'] / maxtext['first run'][-1]:.2f}x, "
                     f"{rows['rerun'][-1]['total'] / maxtext['rerun'][-1]:.2f}x)" if args.maxtext else ""), flush=True)
    print(f"\nimports (train command, measured apart): {imports:.2f} s")
    names = [n for n, _ in MARKS] + ["total"]
    print(f"{'':10} " + " ".join(f"{n:>11}" for n in names) + ("  vs MaxText (measured)" if args.maxtext
                                                               else "  vs reference"))
    for kind, runs in rows.items():
        med = {n: statistics.median(r[n] for r in runs) for n in names}
        ref = statistics.median(maxtext[kind]) if args.maxtext else args.reference_seconds
        print(f"{kind:10} " + " ".join(f"{med[n]:>9.2f} s" for n in names)
              + f"  {med['total'] / ref:.2f}x of {ref:.2f} s")
    if args.maxtext:  # the ratio of each repeat's runs, taken under one load, is steadier than that of medians
        print("MaxText    " + "  ".join(f"{kind} {statistics.median(v):.2f} s" for kind, v in maxtext.items()))
        print("median of the repeats' ratios: " + ", ".join(
            f"{kind} {statistics.median(r['total'] / m for r, m in zip(rows[kind], maxtext[kind])):.2f}x"
            for kind in rows))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
