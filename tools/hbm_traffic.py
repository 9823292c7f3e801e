"""Where a compiled train step's memory traffic goes, read off XLA:GPU's optimized HLO (no GPU needed).

    python tools/hbm_traffic.py BF16.hlo FP8.hlo [--json]

Each HLO file is ``Compiled.as_text()`` of a step (``tools/collective_dtypes.py --hlo FILE`` writes XLA:GPU's from
a deviceless compile). Every kernel the step launches (a fusion, a library call, a stand-alone op), times the trip
counts of the loops around it, is put in one class, and its bytes read and written are summed per class:

- ``gemm bf16`` / ``gemm f8``: GEMM fusions and cuBLAS calls (f8 when an operand is float8);
- ``attention``: cuDNN's fused attention calls;
- ``f8 cast``: kernels whose output is float8 and that hold no GEMM (the quantisation of an operand), ``f8 cast +
  amax`` when the same kernel also reduces (XLA fused the next amax or the scale into it);
- ``amax``: reductions of max(|x|) to a few numbers (a current scale's pass over its tensor);
- ``slices``: kernels that only copy slices in or out of a loop's stacked buffers (dynamic-slice,
  dynamic-update-slice);
- ``other``: everything else (norms, activations, softmax pieces, the optimizer, casts between 16 and 32 bits).

Bytes are counted as a kernel would move them: a fused parameter read only through (dynamic-)slices counts the
slices, the buffer a dynamic-update-slice writes into counts only its update; operands are counted once per kernel.
A kernel's reads and writes both go to HBM unless they stay in the L2 cache, so these are an upper bound on its
traffic and the same bound for every program compared. Collectives are left out (tools/collective_dtypes.py counts
them).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jaxtrain.planner.cost.hlo import (  # noqa: E402
    HloModule,
    Instr,
    array_bytes,
    called,
    fused_computation,
    multiplicities,
    parse_hlo,
)

# Ops that launch nothing (or only wait for what another op launched).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "fusion-done", "copy-done", "async-done",
         "async-update", "add-dependency"}
_COLLECTIVE = re.compile(r"^(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all"
                         r"|send|recv|collective-broadcast)")
_SLICES = {"dynamic-slice", "dynamic-update-slice", "slice", "parameter", "constant", "bitcast", "tuple",
           "get-tuple-element", "copy", "reshape", "broadcast", "compare", "select", "add", "subtract", "clamp"}
_F8 = ("f8e4m3fn", "f8e5m2")
CLASSES = ("gemm bf16", "gemm f8", "attention", "f8 cast", "f8 cast + amax", "amax", "slices", "other")


def _body(module: HloModule, comp: str, seen: set[str] | None = None) -> list[Instr]:
    """Every instruction of a fused computation and of what it calls (reducers), once."""
    seen = set() if seen is None else seen
    out: list[Instr] = []
    for ins in module.comps.get(comp, []):
        out.append(ins)
        for callee in called(ins):  # a fusion's body, a reducer's computation
            if callee not in seen:
                seen.add(callee)
                out += _body(module, callee, seen)
    return out


def _param_read(module: HloModule, param: Instr) -> int:
    """Bytes a fused computation's parameter costs: the slices taken of it when slices are all it feeds, nothing
    when it is only the buffer a dynamic-update-slice writes into, else all of it."""
    users = module.users.get(param.name, [])
    if users and all(u.opcode in ("dynamic-slice", "slice") and u.operands[0] == param.name for u in users):
        return sum(array_bytes(u.shape) for u in users)
    if users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == param.name for u in users):
        return 0
    return array_bytes(param.shape)


def _written(module: HloModule, comp: str, ins: Instr) -> int:
    """Bytes a kernel writes: its outputs, a dynamic-update-slice's update only."""
    root = module.root(comp)
    if root is None:
        return array_bytes(ins.shape)
    outs = [module.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    total = 0
    for out in outs:
        if out.opcode == "dynamic-update-slice":
            total += array_bytes(module.by_name[out.operands[1]].shape)
        else:
            total += array_bytes(out.shape)
    return total


def _classify(module: HloModule, ins: Instr, body: list[Instr]) -> str:
    ops = {b.opcode for b in body}
    f8_in = any(any(t in (module.by_name[o].shape if o in module.by_name else "") for t in _F8) for o in ins.operands)
    if ins.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        name = target.group(1) if target else ""
        if "fmha" in name:
            return "attention"
        if "gemm" in name or "matmul" in name:
            return "gemm f8" if f8_in else "gemm bf16"
        return "other"
    if ops & {"dot", "convolution", "scaled-dot"}:
        return "gemm f8" if f8_in or any(t in b.shape for b in body if b.opcode == "parameter" for t in _F8) \
            else "gemm bf16"
    if any(t in ins.shape for t in _F8):
        return "f8 cast + amax" if "reduce" in ops else "f8 cast"
    if "reduce" in ops and "abs" in ops and "maximum" in ops and array_bytes(ins.shape) <= 4096:
        return "amax"
    if ops <= _SLICES and ops & {"dynamic-slice", "dynamic-update-slice", "slice"}:
        return "slices"
    return "other"


def kernel_traffic(module: HloModule, ins: Instr) -> tuple[str, int, int]:
    """(class, bytes read, bytes written) of one launched kernel."""
    name = fused_computation(ins)
    if ins.opcode in ("fusion", "fusion-start") and name:
        body = _body(module, name)
        params = [b for b in module.comps.get(name, []) if b.opcode == "parameter"]
        return _classify(module, ins, body), sum(_param_read(module, p) for p in params), _written(module, name, ins)
    read = sum(array_bytes(module.by_name[o].shape) for o in dict.fromkeys(ins.operands) if o in module.by_name)
    return _classify(module, ins, [ins]), read, array_bytes(ins.shape)


def traffic(text: str) -> dict[str, dict[str, float]]:
    """HLO text -> {class: {"kernels": launches per step, "read_gb": .., "written_gb": ..}}, loops' trip counts
    included; the kernels inside fusions are their fusion's."""
    module = parse_hlo(text)
    runs, _ = multiplicities(module)
    fused = {c for instrs in module.comps.values() for i in instrs if i.opcode in ("fusion", "fusion-start")
             for c in [fused_computation(i)] if c}
    table: dict[str, collections.Counter] = {c: collections.Counter() for c in CLASSES}
    for comp, instrs in module.comps.items():
        times = runs.get(comp, 0)
        if comp in fused or not times:
            continue
        for ins in instrs:
            if ins.opcode in _FREE or _COLLECTIVE.match(ins.opcode):
                continue
            cls, read, written = kernel_traffic(module, ins)
            table[cls].update({"kernels": times, "read": read * times, "written": written * times})
    return {c: {"kernels": t["kernels"], "read_gb": t["read"] / 1e9, "written_gb": t["written"] / 1e9}
            for c, t in table.items()}


def _markdown(names: list[str], tables: list[dict]) -> str:
    head = "| class | " + " | ".join(f"{n}: kernels | {n}: read + written GB" for n in names) + " |"
    lines = [head, "| --- |" + " ---: | ---: |" * len(names)]
    for cls in (*CLASSES, "total"):
        cells = []
        for t in tables:
            rows = t.values() if cls == "total" else [t[cls]]
            k = sum(r["kernels"] for r in rows)
            gb = sum(r["read_gb"] + r["written_gb"] for r in rows)
            cells.append(f"{k:,} | {gb:,.1f}")
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hlo", nargs="+", help="optimized HLO text files (Compiled.as_text())")
    p.add_argument("--json", action="store_true", help="print every figure as JSON instead of a table")
    args = p.parse_args(argv)
    tables = []
    for path in args.hlo:
        with open(path) as f:
            tables.append(traffic(f.read()))
    names = [os.path.splitext(os.path.basename(h))[0] for h in args.hlo]
    print(json.dumps(dict(zip(names, tables)), indent=1) if args.json else _markdown(names, tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
