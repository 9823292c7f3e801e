"""Which dtype each collective of a compiled train step moves, from XLA:GPU's own compile (no GPU needed).

    JAXTRAIN_GPU_COMPILER=/tmp/xla-gpu/bin/python python tools/collective_dtypes.py --config 1b --nodes 1 \
        mesh.ici.fsdp=8

compiles the step as ``plan`` does (deviceless XLA:GPU, the hardware's GPU target, ``--nodes`` x 8 GPUs), keeps the
optimized HLO (``--hlo FILE``) and prints, per collective kind and element type, the bytes each device's collectives
move in one step as the planner counts them (loop trip counts included): an all-gather's gathered output, a
reduce-scatter's input, an all-reduce's buffer. It answers "are the FSDP all-gathers moving float32 master weights
or the compute dtype?" from the program itself (docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jaxtrain.planner.cost import collectives as hlo_collectives  # noqa: E402
from jaxtrain.planner.cost.hlo import array_bytes, element_shape, multiplicities, parse_hlo  # noqa: E402


def _dtype(shape: str) -> str:
    return shape.split("[", 1)[0].lstrip("(")


def bytes_by_dtype(text: str, n_devices: int) -> dict[tuple[str, str], int]:
    """{(kind, element type): bytes per device per step} of an XLA:GPU module's collectives, counted as the planner
    counts them (``planner.cost.collectives.Collective``: an all-gather's gathered output, the input of a
    reduce-scatter, all-to-all or permute, each array an all-reduce reduces), loop trip counts included."""
    module = parse_hlo(text)
    times, _ = multiplicities(module)
    total: collections.Counter = collections.Counter()
    for comp, n in times.items():
        for ins in module.comps.get(comp, []):
            kind = hlo_collectives.collective_kind(ins.opcode)
            if kind is None:
                continue
            if kind == "all-reduce":
                for idx, _ in hlo_collectives.elements_of(module, ins):
                    shape = element_shape(ins, idx)
                    total[(kind, _dtype(shape))] += array_bytes(shape) * n
                continue
            group = hlo_collectives.replica_groups(ins.attrs, n_devices).shape[1] if kind == "all-gather" else 1
            for operand in ins.operands:
                shape = module.by_name[operand].shape
                total[(kind, _dtype(shape))] += array_bytes(shape) * group * n
    return dict(total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--hardware", default="h100-8x")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--hlo", help="keep the optimized HLO here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from jaxtrain.config import load_config
    from jaxtrain.config.hardware import load_hardware
    from jaxtrain.errors import ConfigError
    from jaxtrain.planner.xla_gpu import deviceless

    if args.nodes < 1:
        print(f"collective_dtypes: --nodes {args.nodes} is not valid; give a node count >= 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        hw = load_hardware(args.hardware)
    except ConfigError as e:
        print(f"collective_dtypes: {e}", file=sys.stderr)
        return 2

    compiler, why = deviceless.find_compiler()
    if compiler is None:
        print(f"collective_dtypes: no XLA:GPU compiler ({why})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        hlo = args.hlo or os.path.join(tmp, "step.hlo")
        deviceless.compile_layout(compiler, cfg, hw.gpu_target, args.nodes, hw.devices_per_node, hlo_path=hlo,
                                  timeout=3600)
        with open(hlo) as f:
            found = bytes_by_dtype(f.read(), args.nodes * hw.devices_per_node)
    print(f"{args.config} {' '.join(args.overrides)} on {args.nodes} x {hw.devices_per_node} ({hw.gpu_target}), "
          "XLA:GPU, per device per step:")
    print("| collective | dtype | GB |\n| --- | --- | ---: |")
    for (kind, dtype), n in sorted(found.items()):
        print(f"| {kind} | {dtype} | {n / 1e9:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
