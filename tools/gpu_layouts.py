"""The shipped layouts compiled for the GPUs they are meant for, without a GPU: ``python tools/gpu_layouts.py``.

Every layout the README and docs present (1B, 7B, 70B; data, fsdp, tensor, stage with both schedules, context) is
planned as a user would plan it, ``python -m jaxtrain plan --config C --hardware h100-8x --nodes N OVERRIDES
--json``, one process per layout: with a GPU compiler installed (``JAXTRAIN_GPU_COMPILER`` or a CUDA jax plugin in
this Python; docs/planning.md) each plan compiles the step with XLA:CPU (the CPU-derived figures) and with XLA:GPU
(the figures it reports), and checks the GPU program (attention kernel, no S x S scores, no float32 GEMM, the
collectives). Prints a markdown table: memory per device from both, their ratio, XLA:GPU's collective bytes, the
attention the program runs, violations, seconds. ``--ci`` runs the layouts ``tests/test_gpu_compile.py`` compiles
(the slow test), ``--only NAME,...`` some; ``--jsonl FILE`` appends each plan's row, ``--table FILE`` prints the
table of such a file.

Run: ``JAXTRAIN_GPU_COMPILER=/path/to/python3.12-with-jax[cuda12] python tools/gpu_layouts.py`` (about 30 minutes
on 2 cores for the whole table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Layout:
    name: str
    config: str
    overrides: tuple[str, ...]
    nodes: int  # of the hardware file's nodes (8 GPUs each)
    where: str  # the page that presents it
    ci: bool = False  # compiled by the slow test (tests/test_gpu_compile.py)
    hardware: str = "h100-8x"


PP_1B = ("mesh.ici.stage=2", "mesh.ici.fsdp=4", "train.microbatches=16", "train.virtual_stages=2")
LAYOUTS = [
    Layout("1b fsdp8", "1b", ("mesh.ici.fsdp=8", "train.microbatches=8"), 1, "planning.md", ci=True),
    Layout("1b data2 fsdp2 tensor2", "1b", ("mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2",
                                            "train.microbatches=8"), 1, "README.md", ci=True),
    Layout("1b stage2 fsdp4 V2 GPipe", "1b", PP_1B, 1, "parallelism.md", ci=True),
    Layout("1b stage2 fsdp4 V2 1F1B", "1b", (*PP_1B, "train.pipeline_schedule=1f1b"), 1, "parallelism.md",
           ci=True),
    Layout("1b context4 fsdp2 (4096 tokens)", "1b", ("mesh.ici.fsdp=2", "mesh.ici.context=4", "train.global_batch=2"),
           1, "long-context.md", ci=True),
    Layout("7b fsdp8", "7b", ("mesh.ici.fsdp=8", "train.microbatches=16"), 1, "planning.md"),
    Layout("7b tensor8", "7b", ("mesh.ici.fsdp=1", "mesh.ici.tensor=8", "train.microbatches=16"), 1,
           "parallelism.md"),
    Layout("7b HSDP: fsdp8 | dcn data8", "7b", ("mesh.ici.fsdp=8", "mesh.dcn.data=8"), 8, "README.md, planning.md",
           ci=True),
    Layout("7b FSDP 64: fsdp8 | dcn fsdp8", "7b", ("mesh.ici.fsdp=8", "mesh.dcn.fsdp=8"), 8, "planning.md"),
    Layout("7b 128k: context8 | dcn fsdp8", "7b", ("data.seq_len=131072", "mesh.ici.fsdp=1", "mesh.ici.context=8",
                                                   "mesh.dcn.fsdp=8", "train.global_batch=8", "model.remat=full"),
           8, "long-context.md"),
    Layout("70b FSDP 64 (16 mb sharded)", "70b", ("mesh.ici.fsdp=8", "mesh.dcn.fsdp=8", "train.microbatches=16",
                                                 "train.accumulate=sharded"), 8, "planning.md", ci=True),
    Layout("70b TP4 FSDP2 | dcn PP8 1F1B", "70b", ("mesh.ici.tensor=4", "mesh.ici.fsdp=2", "mesh.dcn.stage=8",
                                                    "train.microbatches=256", "train.pipeline_schedule=1f1b"),
           8, "README.md, planning.md", ci=True),
    Layout("70b TP8 | dcn PP8 1F1B", "70b", ("mesh.ici.tensor=8", "mesh.ici.fsdp=1", "mesh.dcn.stage=8",
                                              "train.microbatches=256", "train.pipeline_schedule=1f1b"),
           8, "planning.md"),
    Layout("70b TP8 | dcn PP8 GPipe 32 mb", "70b", ("mesh.ici.tensor=8", "mesh.ici.fsdp=1", "mesh.dcn.stage=8",
                                                      "train.microbatches=32"), 8, "parallelism.md"),
    # The released shapes people fine-tune (huggingface.md): one node for the dense 7-8B, 8 x 8 for Qwen3-30B-A3B.
    *(Layout(f"{name} fsdp8 (32 mb sharded)", name, ("mesh.ici.fsdp=8", "train.microbatches=32",
                                                      "train.accumulate=sharded"), 1, "planning.md")
      for name in ("qwen2.5-7b", "qwen3-8b", "mistral-7b")),
    Layout("qwen3-30b-a3b expert8 | dcn fsdp8", "qwen3-30b-a3b", ("mesh.ici.expert=8", "mesh.dcn.fsdp=8",
                                                                  "train.microbatches=8"), 8, "planning.md"),
]


def plan(layout: Layout, timeout: float) -> dict:
    """``jaxtrain plan --json`` of one layout (its own process); the row of the table."""
    cmd = [sys.executable, "-m", "jaxtrain", "plan", "--config", layout.config, "--hardware", layout.hardware,
           "--nodes", str(layout.nodes), *layout.overrides, "--json"]
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    row = {"name": layout.name, "where": layout.where, "command": " ".join(cmd[1:]), "seconds": time.time() - t0}
    if proc.returncode:
        return {**row, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    out = json.loads(proc.stdout)
    # A GPipe layout that does not fit is planned with 1F1B too (docs/planning.md): the row is the schedule asked for.
    schedule = "1f1b" if "train.pipeline_schedule=1f1b" in layout.overrides else "gpipe"
    c = next(r for r in out["candidates"] if r.get("schedule") in (None, schedule))
    gpu = c.get("xla_gpu") or {}
    cpu = c.get("cpu_derived") or {}
    return {**row, "figures": c.get("figures", "xla-cpu"), "memory": c["memory_bytes_per_device"],
            "cpu_memory": cpu.get("memory_bytes_per_device"), "fits": c["fits"],
            "collective_bytes": c["collective_bytes"], "cpu_collective_bytes": cpu.get("collective_bytes"),
            "attention": gpu.get("attention"), "stand_in": gpu.get("stand_in"),
            "attention_calls": gpu.get("attention_calls"), "violations": gpu.get("violations"),
            "xla_gpu_error": c.get("xla_gpu_error"), "gpu_compile_seconds": c["compile_seconds"],
            "cpu_compile_seconds": cpu.get("compile_seconds"), "usable": c["memory"]["usable"],
            "notes": out["notes"]}


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def table(rows: list[dict]) -> str:
    lines = ["| layout | nodes | attention | XLA:GPU GiB | CPU-derived GiB | CPU / GPU | fits | "
             "XLA:GPU collectives GB (ag / rs / ar / permute / a2a) | checks | GPU / CPU compile s |",
             "|---|---:|---|---:|---:|---:|---|---|---|---:|"]
    for r in rows:
        r = {**r, "name": r["name"].replace("|", "\\|")}  # a mesh label's ici | dcn, inside a markdown cell
        if "error" in r or r.get("figures") != "xla-gpu":
            why = r.get("error") or r.get("xla_gpu_error") or "no GPU compiler"
            lines.append(f"| {r['name']} | | | | {_gib(r.get('memory'))} | | | | {why} | |")
            continue
        cb = r["collective_bytes"]
        kinds = " / ".join(f"{cb[k] / 1e9:.1f}" for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                            "collective-permute", "all-to-all"))
        checks = "; ".join(r["violations"]) or "ok"
        lines.append(f"| {r['name']} | {r['command'].split('--nodes ')[1].split()[0]} | {r['attention']} | "
                     f"{_gib(r['memory'])} | {_gib(r['cpu_memory'])} | {r['cpu_memory'] / r['memory']:.2f} | "
                     f"{'yes' if r['fits'] else 'no'} | {kinds} | {checks} | "
                     f"{r['gpu_compile_seconds']:.0f} / {r['cpu_compile_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="only the layouts the slow test compiles")
    ap.add_argument("--only", help="comma-separated layout names (none holds a comma)")
    ap.add_argument("--jsonl", help="append each row as a JSON line to this file")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--table", help="print the table of the rows in this --jsonl file (the last row of each layout)")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            last = {r["name"]: r for r in map(json.loads, f)}
        print(table([last[x.name] for x in LAYOUTS if x.name in last]))
        return
    chosen = [x for x in LAYOUTS if (not args.ci or x.ci) and (not args.only or x.name in args.only.split(","))]
    rows = []
    for layout in chosen:
        row = plan(layout, args.timeout)
        rows.append(row)
        print(f"{layout.name}: {row.get('figures', 'error')} {_gib(row.get('memory'))} GiB, cpu-derived "
              f"{_gib(row.get('cpu_memory'))} GiB, {row['seconds']:.0f} s {row.get('error') or ''}", file=sys.stderr,
              flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
