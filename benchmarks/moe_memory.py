"""The memory closed forms of MoE layouts (``planner/cost/memory.py``) against the compiled step: few-layer stacks of
the released shapes at global batch 16 x 4096 on 8 H100s, compiled as ``plan --hardware h100-8x`` compiles them
(bfloat16, the Pallas flash kernel and grouped matmul, XLA:CPU with the plan's flags), the table of
docs/planning.md ("Closed forms and the layout search on MoE models"). Asserts nothing.

    python benchmarks/moe_memory.py                      # every layout, XLA:CPU (about 4 minutes on 2 cores)
    python benchmarks/moe_memory.py --only d3f8 --peak 25  # one layout and XLA:CPU's 25 largest buffers at its peak
    JAXTRAIN_GPU_COMPILER=/tmp/xla-gpu/bin/python python benchmarks/moe_memory.py --xla-gpu   # and XLA:GPU's

``--peak`` reads XLA's own breakdown of the buffers live at the peak (the ``*-live-range.txt`` file
``--xla_dump_to`` writes): how each term of the closed forms was found.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ["train.global_batch=16", "model.remat=full", "train.microbatches=2", "model.dtype=bfloat16",
        "model.attention=pallas", "mesh.ici.expert=1", "mesh.dcn.fsdp=1", "mesh.dcn.data=1", "mesh.ici.fsdp=1",
        "mesh.ici.data=1"]
MIXTRAL, QWEN = ("mixtral-8x7b", ["model.n_layers=2"]), ("qwen3-30b-a3b", ["model.n_layers=2"])
DEEPSEEK = ("deepseek-v3", ["model.n_layers=3", "model.moe.first_dense=1"])
LAYOUTS = {  # name: (config, overrides)
    "m2e8mb1": (MIXTRAL, ["mesh.ici.expert=8", "train.microbatches=1"]),
    "m2e8": (MIXTRAL, ["mesh.ici.expert=8"]),
    "m2f2e4": (MIXTRAL, ["mesh.ici.expert=4", "mesh.ici.fsdp=2"]),
    "m2e8none": (MIXTRAL, ["mesh.ici.expert=8", "train.microbatches=1", "model.remat=none"]),
    "m2f8": (MIXTRAL, ["mesh.ici.fsdp=8"]),
    "m2f4e2": (MIXTRAL, ["mesh.ici.expert=2", "mesh.ici.fsdp=4"]),
    "m4e8": (("mixtral-8x7b", ["model.n_layers=4"]), ["mesh.ici.expert=8"]),
    "m4e8sm": (("mixtral-8x7b", ["model.n_layers=4"]), ["mesh.ici.expert=8", "model.remat=save_matmuls"]),
    "m4f8": (("mixtral-8x7b", ["model.n_layers=4"]), ["mesh.ici.fsdp=8"]),
    "q2e8": (QWEN, ["mesh.ici.expert=8"]),
    "q2e4t2": (QWEN, ["mesh.ici.expert=4", "mesh.ici.tensor=2"]),
    "q2f8mb1": (QWEN, ["mesh.ici.fsdp=8", "train.microbatches=1"]),
    "q2f8": (QWEN, ["mesh.ici.fsdp=8"]),
    "d3e8": (DEEPSEEK, ["mesh.ici.expert=8"]),
    "d3e4t2": (DEEPSEEK, ["mesh.ici.expert=4", "mesh.ici.tensor=2"]),
    "d3f2e4": (DEEPSEEK, ["mesh.ici.expert=4", "mesh.ici.fsdp=2"]),
    "d3f8": (DEEPSEEK, ["mesh.ici.fsdp=8"]),
    "d4e8": (("deepseek-v3", ["model.n_layers=4", "model.moe.first_dense=1"]), ["mesh.ici.expert=8"]),
}


def peak_buffers(dump: str, top: int) -> list[tuple[int, str, str]]:
    """(bytes, name, shape) of the ``top`` largest buffers live at XLA:CPU's peak, from a ``--xla_dump_to`` dir."""
    def newest(pattern: str) -> str:  # the last compile's (each compile writes its own numbered files)
        return open(max(glob.glob(f"{dump}/{pattern}"), key=os.path.getmtime)).read()

    from jaxtrain.planner.cost.hlo import parse_hlo

    live = newest("*train_step*after_optimizations-live-range.txt")
    instrs = parse_hlo(newest("*train_step*after_optimizations.txt")).by_name
    found = []
    for line in live.split("Stack trace breakdown for peak usage", 1)[1].splitlines():
        m = re.search(r"── (.*) \([\d.]+%, total: [\d ]+ bytes, current: ([\d ]+) bytes", line)
        if m and int(m.group(2).replace(" ", "")):
            name = m.group(1)  # an instruction's, or a tuple element's ("param.7{15}"), or a JAX op_name
            ins = instrs.get(name.split("{")[0])
            found.append((int(m.group(2).replace(" ", "")), name, ins.shape if ins else ""))
    return sorted(found, reverse=True)[:top]


def compare(name: str, gpu, devices) -> dict:
    """Compiled and closed-form memory per device (bytes) of layout ``name`` on XLA:CPU (and XLA:GPU with ``gpu``)."""
    from jaxtrain.config import load_config
    from jaxtrain.parallel.dims import MeshShape
    from jaxtrain.parallel.layout import resolve_auto
    from jaxtrain.planner.cost import memory
    from jaxtrain.planner.search.meshes import compile_step

    (config, model), mesh = LAYOUTS[name]
    cfg = resolve_auto(load_config(config, [*BASE, *model, *mesh]), "gpu", 8)
    shape = MeshShape.resolve(cfg.mesh, 8)
    cpu = compile_step(cfg, shape, devices)
    row = {"layout": name, "config": config, "overrides": " ".join([*model, *mesh]),
           "cpu": cpu.memory_bytes, "cpu_closed": memory.memory_estimate(cfg, shape, "xla-cpu")}
    if gpu is not None:
        row["gpu"] = gpu.read(cfg, shape, cpu).memory_bytes
        row["gpu_closed"] = memory.memory_estimate(cfg, shape, "xla-gpu")
    return row


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), help="these layouts only")
    p.add_argument("--xla-gpu", action="store_true", help="also XLA:GPU's deviceless compile (JAXTRAIN_GPU_COMPILER)")
    p.add_argument("--peak", type=int, default=0, metavar="N", help="print the N largest buffers at XLA:CPU's peak")
    p.add_argument("--json", action="store_true", help="one JSON object a layout (bytes) instead of the table")
    a = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="moe-memory-") if a.peak else None
    if dump:  # before JAX starts: XLA reads its flags once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                                   "--xla_dump_hlo_module_re=train_step").strip()
    from jaxtrain.config.hardware import load_hardware
    from jaxtrain.planner.search.target import _compile_only_devices
    from jaxtrain.planner.xla_gpu import deviceless

    devices = _compile_only_devices(8, None)  # the plan's XLA:CPU flags and 8 CPU devices
    gpu = deviceless.for_plan(load_hardware("h100-8x"), 1, "auto")[0] if a.xla_gpu else None
    if a.xla_gpu and gpu is None:
        sys.exit("no XLA:GPU compiler found: set JAXTRAIN_GPU_COMPILER (docs/planning.md)")
    if not a.json:
        print("| layout | config | overrides | closed form CPU GB | XLA:CPU GB | ratio |"
              + (" closed form GPU GB | XLA:GPU GB | ratio |" if gpu else ""))
        print("| --- | --- | --- | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if gpu else ""), flush=True)
    for name in a.only or LAYOUTS:
        r = compare(name, gpu, devices)
        if a.json:
            print(json.dumps(r), flush=True)
            continue
        cells = [r["layout"], r["config"], r["overrides"], f"{r['cpu_closed'] / 1e9:.1f}", f"{r['cpu'] / 1e9:.1f}",
                 f"{r['cpu_closed'] / r['cpu']:.2f}"]
        if gpu:
            cells += [f"{r['gpu_closed'] / 1e9:.1f}", f"{r['gpu'] / 1e9:.1f}", f"{r['gpu_closed'] / r['gpu']:.2f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
        if dump:
            for size, buf, shape in peak_buffers(dump, a.peak):
                print(f"    {size / 1e9:7.2f} GB  {shape or '-':40s} {buf[-90:]}")


if __name__ == "__main__":
    main(sys.argv[1:])
