"""Collectives as the compiled program states them: kind, bytes per device, executions per step (loop trip counts
multiplied in) and replica groups. Pure text in, data out, like :mod:`jaxtrain.planner.cost.hlo` which it reads with.

Both the synchronous collectives XLA:CPU emits (``all-gather(...)``) and the asynchronous forms XLA:GPU emits count
once: ``all-reduce-start`` / ``all-reduce-done`` and the other ``*-start`` / ``*-done`` pairs at the ``-start``, a
collective wrapped in an ``async-start`` computation inside the computation it calls.

XLA:CPU has no 16-bit collectives: its bfloat16 normalisation (and AllReducePromotion for all-reduces) widens every
bf16 / f16 collective to f32 between two converts it inserts. XLA:GPU moves them in 16 bits, so such an operand
(:func:`widened_by_cpu`) counts at half its f32 size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import numpy as np

from jaxtrain.planner.cost.hlo import (
    ARRAY_RE,
    HloModule,
    Instr,
    UnknownLoop,
    array_bytes,
    balanced,
    element_shape,
    fused_computation,
    multiplicities,
    op_name,
)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collective_kind(opcode: str) -> str | None:
    """The collective an opcode performs: ``all-gather`` and ``all-gather-start`` both say all-gather; ``-done``
    halves and non-collectives say None."""
    op = opcode.removesuffix("-start")
    op = "all-to-all" if op == "ragged-all-to-all" else op
    return op if op in KINDS else None


# -- replica groups ----------------------------------------------------------------------------------------------


def replica_groups(attrs: str, n_devices: int) -> np.ndarray:
    """The replica groups of a collective as an int array [groups, group_size] of logical device ids.

    Handles the three printed forms: explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)`` and mesh axes
    ``mesh['a'=2,'b'=4] {'b'}`` (optionally with sub-axes ``'b':(1)2``). No ``replica_groups``, or an empty list:
    one group of all devices.
    """
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return np.arange(n_devices)[None, :]
    text = attrs[m.end():]
    if text.startswith("{"):
        inner = text[:balanced(text, 0)]
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", inner[1:-1])]
        groups = [g for g in groups if g]
        return np.array(groups) if groups else np.arange(n_devices)[None, :]
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        g, s = int(iota.group(1)), int(iota.group(2))
        return _iota(iota.group(3), iota.group(4)).reshape(g, s)
    # mesh['a'=2,'b'=4] {'b'}, or with a device order: mesh[...], device_ids=([2,4]T(1,0)) {...} or (0,2,1,3)
    mesh = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((?:\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,\s]+))\))?"
                    r"\s*\{([^}]*)\}", text)
    if mesh:
        axes, dims, perm, explicit, grouped = mesh.groups()
        devices = _iota(dims, perm) if dims else np.array([int(x) for x in explicit.split(",")]) if explicit else None
        return _mesh_axes_groups(axes, devices, grouped)
    raise RuntimeError(f"unrecognised replica_groups in HLO: {text[:120]!r}")


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    arr = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        arr = arr.transpose([int(p) for p in perm.split(",")])
    return arr.reshape(-1)


def _mesh_axes_groups(axes_text: str, devices: np.ndarray | None, group_text: str) -> np.ndarray:
    """XLA's MeshAxesReplicaGroupList: reshape the device list to the mesh, group over the named (sub-)axes."""
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", axes_text)]
    sizes = dict(axes)
    if devices is None:
        devices = np.arange(math.prod(sizes.values()))
    refs: dict[str, list[tuple[int, int]]] = {}  # axis -> [(pre_size, size)] of the grouped (sub-)axes
    for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", group_text):
        refs.setdefault(name, []).append((int(pre), int(size)) if pre else (1, sizes[name]))
    reshape, grouped = [], []
    for name, full in axes:
        parts = sorted(refs.get(name, []))
        if not parts:
            reshape.append(full)
            continue
        prefix = 1
        for pre, size in parts:  # split the axis into [pad, sub-axis, pad, sub-axis, ..., rest]
            if pre != prefix:
                reshape.append(pre // prefix)
                prefix = pre
            grouped.append(len(reshape))
            reshape.append(size)
            prefix *= size
        if prefix != full:
            reshape.append(full // prefix)
    others = [i for i in range(len(reshape)) if i not in grouped]
    group_size = math.prod(reshape[i] for i in grouped)
    return devices.reshape(reshape).transpose(others + grouped).reshape(-1, group_size)


# -- operand sizes --------------------------------------------------------------------------------------------------

_NARROW = ("bf16", "f16")


def widened_by_cpu(module: HloModule, name: str) -> bool:
    """Whether value ``name`` (a collective's operand) is a 16-bit value that XLA:CPU widened to f32 for the
    collective: seen through fusion roots, bitcasts and copies, an f32 ``convert`` of a bf16 / f16 value that carries
    no ``op_name`` metadata. The converts XLA inserts (bf16 normalisation, AllReducePromotion) carry none; a cast
    the program states (``astype(jnp.float32)``) carries its JAX op_name and is moved in f32 on GPU too."""
    ins = module.by_name.get(name)
    for _ in range(32):  # a chain of fusion roots and bitcasts, not a loop
        if ins is None:
            return False
        if ins.opcode == "fusion":
            callee = fused_computation(ins)
            ins = module.root(callee) if callee else None
        elif ins.opcode in ("bitcast", "copy") and ins.operands:
            ins = module.by_name.get(ins.operands[0])
        else:
            break
    if ins is None or ins.opcode != "convert" or not ins.shape.startswith("f32[") or op_name(ins) or not ins.operands:
        return False
    source = module.by_name.get(ins.operands[0])
    return source is not None and source.shape.startswith(tuple(f"{t}[" for t in _NARROW))


def operand_bytes(module: HloModule, name: str, cpu: bool = True) -> int:
    """Bytes of a collective's operand as XLA:GPU moves it (half its f32 size where XLA:CPU widened it; ``cpu``
    False: the module is XLA:GPU's own, which widens nothing)."""
    ins = module.by_name.get(name)
    if ins is None:
        return 0
    size = array_bytes(ins.shape)
    return size // 2 if cpu and widened_by_cpu(module, name) else size


# -- collectives as stated -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective of the step. ``bytes`` is per execution and device: the reduced buffer (all-reduce), the
    gathered output (all-gather), the input (reduce-scatter, all-to-all, collective-permute)."""

    kind: str
    bytes: int
    count: int  # executions per step (loop trip counts multiplied in)
    groups: np.ndarray = dataclasses.field(compare=False)  # [groups, size] logical device ids; permute: pairs
    op_name: str = ""

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


@dataclass(frozen=True)
class AllReduceElement:
    """One array an all-reduce reduces (a tuple-shaped all-reduce has several), and the value that carries it on:
    the all-reduce itself, its get-tuple-element, or (asynchronous) its all-reduce-done."""

    ins: Instr
    index: int
    value: str
    count: int
    widened: bool = False  # a 16-bit array XLA:CPU reduces in f32 (:func:`widened_by_cpu`): GPU moves half

    @property
    def shape(self) -> str:
        return element_shape(self.ins, self.index)

    @property
    def bytes(self) -> int:
        """Bytes of the reduced array as XLA:GPU moves it."""
        size = array_bytes(self.shape)
        return size // 2 if self.widened else size


@dataclass
class StatedCollectives:
    """What the HLO text states: every collective but all-reduces (final), all-reduce elements (for the GPU
    passes to rewrite), and the loops whose trip count is unknown."""

    others: list[Collective]
    all_reduces: list[AllReduceElement]
    unknown_loops: list[UnknownLoop]


def stated_collectives(module: HloModule, n_devices: int, cpu: bool = True) -> StatedCollectives:
    """The collectives of ``module`` with their executions per step, as the compiled program states them.
    ``cpu``: the module is XLA:CPU's (16-bit collectives it widened count at 16 bits); False: XLA:GPU's own."""
    mult, unknown = multiplicities(module)
    others: list[Collective] = []
    all_reduces: list[AllReduceElement] = []
    for comp, times in mult.items():
        for ins in module.comps.get(comp, []):
            kind = collective_kind(ins.opcode)
            if kind is None:
                continue
            if kind == "all-reduce":
                all_reduces += [AllReduceElement(ins, idx, value, times, cpu and idx < len(ins.operands)
                                                 and widened_by_cpu(module, ins.operands[idx]))
                                for idx, value in elements_of(module, ins)]
                continue
            moved = sum(operand_bytes(module, o, cpu) for o in ins.operands)
            if kind == "collective-permute":
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", ins.attrs)
                groups = np.array([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0))]) \
                    if pairs else np.zeros((0, 2), int)
                others.append(Collective(kind, moved, times, groups, op_name(ins)))
                continue
            groups = replica_groups(ins.attrs, n_devices)
            size = moved * groups.shape[1] if kind == "all-gather" else moved
            others.append(Collective(kind, size, times, groups, op_name(ins)))
    with_collectives = {ins.comp for ins in module.by_name.values() if collective_kind(ins.opcode)}
    unknown = [dataclasses.replace(u, holds_collectives=bool(u.computations & with_collectives)) for u in unknown]
    return StatedCollectives(others, all_reduces, unknown)


def elements_of(module: HloModule, ins: Instr) -> list[tuple[int, str]]:
    """(element index, the value that carries it) for an all-reduce: itself, or its get-tuple-elements.

    An asynchronous all-reduce-start (GPU) delivers its result through its all-reduce-done. XLA:GPU prints its
    shape as ``((operands...), results...)``, e.g. ``((bf16[1024]{0}), bf16[1024]{0})``: the same arrays twice,
    so only the operands' count (the first group) are elements, each counted once."""
    done = [u for u in module.users.get(ins.name, []) if u.opcode == "all-reduce-done"]
    value = done[0] if done else ins
    if not ins.shape.startswith("("):
        return [(0, value.name)]
    by_index: dict[int, str] = {}
    for user in module.users.get(value.name, []):
        index = re.search(r"index=(\d+)", user.attrs)
        if user.opcode == "get-tuple-element" and index:
            by_index.setdefault(int(index.group(1)), user.name)
    shape = ins.shape[1:balanced(ins.shape, 1)] if ins.shape.startswith("((") else ins.shape
    n_elements = len(ARRAY_RE.findall(shape))
    return [(i, by_index.get(i, value.name)) for i in range(n_elements)]  # an unused element still moves
