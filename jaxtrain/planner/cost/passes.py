"""XLA:GPU's collective passes that XLA:CPU does not run, re-created on the parsed HLO.

The program the planner compiles on CPU is the GPU's program before these passes; their effect on the bytes each
device sends is applied here, one function per pass, named after it:

- :func:`all_reduce_reassociate` (AllReduceReassociate, and ReduceScatterReassociate once both sides became
  reduce-scatters): ``all-reduce(a) + all-reduce(b)`` over the same devices becomes one all-reduce (the input
  gradients of q/k/v, and of gate/up, under tensor parallelism);
- :func:`reduce_scatter_creator` (ReduceScatterCreator): an all-reduce whose every use takes a 1/n slice becomes a
  reduce-scatter (FSDP gradients);
- :func:`all_reduce_splitter` (AllReduceSplitter): an all-reduce whose uses take a 1/k slice, k < n, becomes a
  reduce-scatter over the k devices that shard the parameter and an all-reduce of the 1/k shard over the rest (the
  hybrid-sharded gradient's pattern).

:func:`collectives` is the entry point: HLO text -> the collectives the GPU would run. XLA:GPU's own program (a
GPU at hand, or the deviceless compile of ``planner/xla_gpu/deviceless.py``) has had these passes already: it is read
as it states its collectives (``compiled_for_cpu=False``), never rewritten again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxtrain.parallel.dims import MESH_AXES
from jaxtrain.planner.cost.collectives import AllReduceElement, Collective, replica_groups, stated_collectives
from jaxtrain.planner.cost.hlo import (
    HloModule,
    Instr,
    UnknownLoop,
    elements,
    fused_computation,
    op_name,
    parse_hlo,
)

# Ops that only move or re-type a value: an all-reduce seen through them is still that all-reduce.
_PASS = {"bitcast", "copy", "reshape", "transpose", "convert"}
# Elementwise ops a gradient may pass through between its all-reduce and the slice that shards it.
_ELEMENTWISE = _PASS | {"add", "subtract", "multiply", "divide", "negate"}


def collectives(hlo_text: str, mesh_sizes: tuple[int, ...], param_axes: frozenset[str] = frozenset(),
                compiled_for_cpu: bool = True) -> tuple[list[Collective], list[UnknownLoop]]:
    """The collectives of a compiled step, with trip counts, after applying XLA's GPU collective rewrites
    (``compiled_for_cpu``; False: the text is XLA:GPU's, whose collectives are taken as stated).

    ``mesh_sizes``: the sizes of the ``MESH_AXES`` (data, stage, fsdp, tensor) the step was compiled for (logical
    device ids are positions in that mesh); ``param_axes``: the mesh axes parameters are sharded over, which is where
    a gradient all-reduce followed by a partial slice splits (:func:`all_reduce_splitter`). Returns the collectives
    and the while loops with unknown trip counts (their bodies counted once).
    """
    if len(mesh_sizes) != len(MESH_AXES):  # the splitter names axes by position
        raise ValueError(f"mesh_sizes {mesh_sizes} must give the size of each of {MESH_AXES}")
    module = parse_hlo(hlo_text)
    stated = stated_collectives(module, math.prod(mesh_sizes), cpu=compiled_for_cpu)
    if compiled_for_cpu:
        colls = stated.others + _rewrite_all_reduces(module, stated.all_reduces, mesh_sizes, param_axes)
    else:
        n_devices = math.prod(mesh_sizes)
        colls = stated.others + [Collective("all-reduce", e.bytes, e.count, replica_groups(e.ins.attrs, n_devices),
                                            op_name(e.ins)) for e in stated.all_reduces]
    # Replica groups of one device move nothing (XLA:GPU's AllReduceSimplifier removes such all-reduces; XLA:CPU
    # keeps them, e.g. a psum over a mesh axis of size 1 where a shard_map's transpose reduces over it).
    return [c for c in colls if c.kind == "collective-permute" or c.groups.shape[1] > 1], stated.unknown_loops


def _rewrite_all_reduces(module: HloModule, elems: list[AllReduceElement], mesh_sizes: tuple[int, ...],
                         param_axes: frozenset[str]) -> list[Collective]:
    """All-reduce elements -> collectives, as the GPU passes leave them."""
    n_devices = math.prod(mesh_sizes)
    groups = [replica_groups(e.ins.attrs, n_devices) for e in elems]
    out = []
    for members in all_reduce_reassociate(module, elems, groups):
        # Merged all-reduces move one buffer: the largest member (they share a shape when reassociated).
        best = max(members, key=lambda i: elems[i].bytes * elems[i].count)
        e, grp = elems[best], groups[best]
        size, name = e.bytes, op_name(e.ins)
        k = reduce_scatter_creator(module, [elems[i] for i in members])
        split = all_reduce_splitter(grp, mesh_sizes, param_axes, k) if k and 1 < k < grp.shape[1] else None
        if k == grp.shape[1]:
            out.append(Collective("reduce-scatter", size, e.count, grp, name))
        elif split is not None and k:
            out.append(Collective("reduce-scatter", size, e.count, split[0], name))
            out.append(Collective("all-reduce", size // k, e.count, split[1], name))
        else:
            out.append(Collective("all-reduce", size, e.count, grp, name))
    return out


# -- AllReduceReassociate ------------------------------------------------------------------------------------------


def all_reduce_reassociate(module: HloModule, elems: list[AllReduceElement], groups: list[np.ndarray]
                           ) -> list[list[int]]:
    """Sets of all-reduce elements (indices into ``elems``) that become one all-reduce: those added together
    (through data movement, dynamic slices and fusion boundaries) over the same replica groups."""
    key_of = {e.value: i for i, e in enumerate(elems)}
    group_key = [tuple(sorted(tuple(sorted(g)) for g in grp.tolist())) for grp in groups]
    parent = list(range(len(elems)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    memo: dict[str, int | None] = {}

    def source(name: str) -> int | None:
        if name in memo:
            return memo[name]
        memo[name] = None  # cycle guard
        result = None
        ins = module.by_name.get(name)
        if name in key_of:
            result = key_of[name]
        elif ins is None:
            result = None
        # Through a dynamic-slice too: add(slice(all-reduce a), slice(all-reduce b)) is what
        # ReduceScatterReassociate merges once both became reduce-scatters.
        elif ins.opcode in _PASS | {"dynamic-slice"} and ins.operands:
            result = source(ins.operands[0])
        elif ins.opcode == "parameter":
            result = _through_fusion_param(module, ins, source)
        elif ins.opcode == "fusion":  # e.g. a wrapped convert: follow its root inside
            callee = fused_computation(ins)
            root = module.root(callee) if callee else None
            result = source(root.name) if root is not None else None
        elif ins.opcode == "add" and len(ins.operands) == 2:
            a, b = source(ins.operands[0]), source(ins.operands[1])
            if a is not None and b is not None and group_key[a] == group_key[b]:
                parent[find(a)] = find(b)
                result = find(b)
        memo[name] = result
        return result

    for ins in module.by_name.values():
        if ins.opcode == "add":
            source(ins.name)
    sets: dict[int, list[int]] = {}
    for i in range(len(elems)):
        sets.setdefault(find(i), []).append(i)
    return list(sets.values())


def _through_fusion_param(module: HloModule, param: Instr, follow: Callable[[str], Any]):
    """A fused computation's parameter -> what ``follow`` says about the operand its (single) caller passes."""
    call = module.fusion_caller(param.comp)
    if call is None:
        return None
    index = int(param.operands_text)
    return follow(call.operands[index]) if index < len(call.operands) else None


# -- ReduceScatterCreator ------------------------------------------------------------------------------------------


def reduce_scatter_creator(module: HloModule, members: list[AllReduceElement]) -> int | None:
    """k when every use of the (merged) all-reduce takes a slice of 1/k of it: k = group size makes it a
    reduce-scatter; 1 < k < group size is :func:`all_reduce_splitter`'s case. None when the uses disagree or some
    use needs the whole reduced value."""
    fractions = {_sliced_fraction(module, e.value, elements(e.shape), {}) for e in members}
    return fractions.pop() if len(fractions) == 1 else None


def _sliced_fraction(module: HloModule, name: str, n_elements: int, memo: dict) -> int | None:
    """k when every use of value ``name`` ends, through elementwise ops and fusion boundaries, in a slice of
    ``n_elements / k`` elements; None otherwise."""
    if name in memo:
        return memo[name]
    memo[name] = None
    found: set[int | None] = set()
    users = module.users.get(name, [])
    ins = module.by_name.get(name)
    call = module.fusion_caller(ins.comp) if ins is not None and ins.is_root else None
    if call is not None:  # a fused computation's result: its uses are the fusion's uses outside
        found.add(_sliced_fraction(module, call.name, n_elements, memo))
    elif not users:
        return None
    for user in users:
        if user.opcode in ("dynamic-slice", "slice") and user.operands[0] == name:
            sliced = elements(user.shape)
            found.add(n_elements // sliced if sliced and n_elements % sliced == 0 and sliced < n_elements else None)
        elif user.opcode in _ELEMENTWISE and elements(user.shape) == n_elements:
            found.add(_sliced_fraction(module, user.name, n_elements, memo))
        elif user.opcode == "fusion":
            callee = fused_computation(user)
            for pos, op in enumerate(user.operands):
                if op == name and callee:
                    param = module.param(callee, pos)
                    found.add(_sliced_fraction(module, param.name, n_elements, memo) if param else None)
        else:
            found.add(None)
    result = found.pop() if len(found) == 1 else None
    memo[name] = result
    return result


# -- AllReduceSplitter ---------------------------------------------------------------------------------------------


def all_reduce_splitter(groups: np.ndarray, mesh_sizes: tuple[int, ...], param_axes: frozenset[str], k: int
                        ) -> tuple[np.ndarray, np.ndarray] | None:
    """Split replica groups spanning several mesh axes into (groups over the axes of size k that shard the
    parameters: the reduce-scatter, groups over the remaining axes: the all-reduce of the shard); None if no such
    axes multiply to exactly k."""
    coords = np.stack(np.unravel_index(groups, mesh_sizes), axis=-1)  # [groups, size, axes]
    spans = [len(np.unique(coords[0, :, ax])) for ax in range(len(mesh_sizes))]
    varying = [ax for ax in range(len(mesh_sizes)) if spans[ax] > 1]
    if math.prod(spans[ax] for ax in varying) != groups.shape[1]:
        return None  # not a full product of axes: leave it an all-reduce
    scatter = [ax for ax in varying if MESH_AXES[ax] in param_axes]
    if math.prod(spans[ax] for ax in scatter) != k:
        return None
    rest = [ax for ax in varying if ax not in scatter]
    return _regroup(groups, coords, rest), _regroup(groups, coords, scatter)


def _regroup(groups: np.ndarray, coords: np.ndarray, fixed: list[int]) -> np.ndarray:
    """Sub-groups of each group: the members that share their coordinates on the ``fixed`` axes."""
    out = []
    for g, c in zip(groups, coords):
        keys = [tuple(row[fixed]) for row in c]
        for key in dict.fromkeys(keys):
            out.append([d for d, kk in zip(g, keys) if kk == key])
    return np.array(out)
