"""Plan a mesh before paying for it: memory, collectives and an estimated step time for each candidate mesh.

For every candidate layout the real train step is lowered and compiled ahead of time for that many devices
(emulated CPU devices will do) from abstract shapes, so nothing is allocated. From the compiled program:

- memory per device: parameter and optimizer-state shards (exact, from the abstract state's shardings) and the
  compiler's temporary buffers (``Compiled.memory_analysis()``);
- collectives (``Compiled.as_text()``): kind, bytes, and the mesh axes their replica groups span. A collective
  inside the scanned layer loop runs once per layer: bytes are multiplied by the loops' known trip counts;
- an estimated step time: model FLOPs over (peak x efficiency), ring/bus-bandwidth communication time per link
  class (NVLink within a node, the network between nodes), and the memory-bound optimizer update.

The program compiled on CPU is the GPU's program before two of XLA's GPU-only collective passes; the analysis
applies their effect (see :func:`collectives`), because the CPU pipeline does not run them:

- ReduceScatterCreator: an all-reduce whose every use takes a 1/n slice becomes a reduce-scatter (FSDP gradients);
- AllReduceReassociate: ``all-reduce(a) + all-reduce(b)`` over the same devices becomes one all-reduce (the input
  gradients of q/k/v, and of gate/up, under tensor parallelism).

A compiled program depends only on the axis sizes (data, fsdp, tensor); how each axis splits into intra-node (ici)
and inter-node (dcn) parts only changes which physical devices its logical ids are, so it is compiled once per
sizes and analysed for every split.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from jaxtrain.config import MESH_AXES, Config, ConfigError, check_divisibility
from jaxtrain.mesh import MeshShape, resolve_shape
from jaxtrain.metrics import train_flops_per_token
from jaxtrain.model import count_params

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
HARDWARE_DIR = Path(__file__).resolve().parent.parent / "configs" / "hardware"
# JAX's GPU allocator takes this fraction of HBM unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: a step must
# fit in that pool, not in the whole HBM.
JAX_DEFAULT_MEM_FRACTION = 0.75


# ---------------------------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class Hardware:
    """One device's rates and the node it sits in. Bandwidths are per device and per direction (bytes/s)."""

    name: str
    device: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    compute_efficiency: float
    device_kind: str = ""
    mem_fraction: float = 1.0  # the part of hbm_bytes a step may use (allocator pool)
    # Fixed cost of one collective, whatever its size. Measured for the CPU at hand; 0 (bandwidth only) for the
    # shipped GPU files, which carry datasheet numbers only.
    collective_latency: float = 0.0

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * self.mem_fraction


_HW_FLOATS = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
              "compute_efficiency")
# ASSUMPTION for the CPU at hand, like the GPU files' compute_efficiency: the fraction of the best measured matmul
# rate that XLA's CPU code sustains over a whole transformer step (small matmuls, softmax, elementwise work). On this
# project's 2-core machine the tiny model runs ~39 GFLOP/s on one device against 180-310 GFLOP/s for plain matmuls.
# `jaxtrain sweep` prints the measured / predicted ratio that checks it.
CPU_COMPUTE_EFFICIENCY = 0.2


def known_hardware() -> list[str]:
    """Names of the hardware descriptions shipped in ``configs/hardware``."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name: str) -> Hardware:
    """A shipped hardware description by name (``h100-8x``) or a path to a YAML file of the same form."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(known_hardware())} "
                          "(or a path to a .yaml file)")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ConfigError(f"hardware file {str(path)!r} has unknown keys: {', '.join(unknown)}")
    missing = sorted(k for k in (*_HW_FLOATS, "devices_per_node") if k not in raw)
    if missing:
        raise ConfigError(f"hardware file {str(path)!r} lacks: {', '.join(missing)}")
    values = dict(raw, name=str(raw.get("name", path.stem)), device=str(raw.get("device", path.stem)))
    try:
        for k in (*_HW_FLOATS, "mem_fraction", "collective_latency"):
            if k in values:  # PyYAML reads "989e12" (no sign in the exponent) as a string
                values[k] = float(values[k])
        values["devices_per_node"] = int(values["devices_per_node"])
    except (TypeError, ValueError):
        raise ConfigError(f"hardware file {str(path)!r}: numeric fields must be numbers") from None
    hw = Hardware(**values)
    if min(hw.peak_flops, hw.hbm_bytes, hw.hbm_bandwidth, hw.intra_node_bandwidth, hw.inter_node_bandwidth,
           hw.compute_efficiency, hw.devices_per_node) <= 0:
        raise ConfigError(f"hardware file {str(path)!r}: every number must be > 0")
    return hw


def gpu_mem_fraction() -> float:
    """The HBM fraction JAX's allocator will own on the training machine (XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75)."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        return float(raw) if raw else JAX_DEFAULT_MEM_FRACTION
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a number") from None


def measure_cpu(devices: list, *, seconds: float = 0.5) -> Hardware:
    """The CPU at hand as "hardware": a measured f32 matmul rate, copy bandwidth and collective latency.

    Emulated CPU devices share the host's cores and memory, so each gets 1/n of the measured rates and of the RAM;
    collectives between them are memory copies, so both link classes run at the per-device memory bandwidth.
    """
    import jax
    import jax.numpy as jnp

    n = len(devices)
    dev = devices[0]
    a = jax.device_put(jnp.ones((512, 512), jnp.float32), dev)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * 512 ** 3 / _best_time(lambda: matmul(a).block_until_ready(), seconds)
    big = jax.device_put(jnp.ones((8 * 1024 * 1024,), jnp.float32), dev)  # 32 MiB: beyond the caches
    scale = jax.jit(lambda x: x * 1.0001)
    bandwidth = 2 * big.nbytes / _best_time(lambda: scale(big).block_until_ready(), seconds)  # read + write
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name="cpu (measured)", device=f"emulated {dev.device_kind} devices sharing one host",
                    peak_flops=flops / n, hbm_bytes=ram / n, hbm_bandwidth=bandwidth / n, devices_per_node=n,
                    intra_node_bandwidth=bandwidth / n, inter_node_bandwidth=bandwidth / n,
                    compute_efficiency=CPU_COMPUTE_EFFICIENCY, device_kind=dev.device_kind,
                    collective_latency=_psum_latency(devices, seconds) if n > 1 else 0.0)


def _psum_latency(devices: list, seconds: float) -> float:
    """Seconds for one all-reduce of a few bytes over ``devices`` (a step's many small collectives pay this)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("x",))
    x = jax.device_put(jnp.ones((len(devices), 4), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=PartitionSpec("x"),
                                 out_specs=PartitionSpec("x")))
    return _best_time(lambda: psum(x).block_until_ready(), seconds)


def _best_time(fn: Callable[[], Any], seconds: float) -> float:
    fn()  # compile and warm up
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------------------------------------------------------
# Candidate meshes


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, parts - 1)]


def with_shape(cfg: Config, shape: MeshShape) -> Config:
    """``cfg`` with its mesh set to ``shape`` (all six sizes explicit)."""
    ici = dataclasses.replace(cfg.mesh.ici, **dict(zip(MESH_AXES, shape.ici)))
    dcn = dataclasses.replace(cfg.mesh.dcn, **dict(zip(MESH_AXES, shape.dcn)))
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, ici=ici, dcn=dcn))


def enumerate_shapes(cfg: Config, n_devices: int, nodes: int) -> list[MeshShape]:
    """All meshes over ``n_devices`` on ``nodes`` nodes that the model and batch allow.

    Each node's devices form the ici part (its product is the devices per node) and the dcn parts multiply to the
    node count. Tensor parallelism stays inside a node (dcn tensor = 1): its per-layer activation all-reduces
    would otherwise cross the network. Raises ConfigError saying why when nothing is valid.
    """
    per_node = _devices_per_node(n_devices, nodes)
    shapes, reasons = [], {}
    for ici in _factorizations(per_node, 3):
        for dcn_df in _factorizations(nodes, 2):
            shape = MeshShape(ici=ici, dcn=(*dcn_df, 1))
            try:
                check_divisibility(cfg, shape.axis_sizes)
            except ConfigError as e:
                reasons.setdefault(str(e), shape)
                continue
            shapes.append(shape)
    if not shapes:
        why = "; ".join(f"{mesh_label(s)}: {msg}" for msg, s in list(reasons.items())[:3])
        raise ConfigError(f"no valid mesh over {n_devices} device(s) on {nodes} node(s): {why}")
    return shapes


def _devices_per_node(n_devices: int, nodes: int) -> int:
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes} must be >= 1")
    if n_devices < 1:
        raise ConfigError(f"cannot plan for {n_devices} devices")
    if n_devices % nodes:
        raise ConfigError(f"{n_devices} device(s) cannot be split evenly into {nodes} node(s)")
    return n_devices // nodes


def given_shape(cfg: Config, n_devices: int, nodes: int) -> MeshShape:
    """The config's own mesh over ``n_devices`` (the -1 axis filled), checked against the node count."""
    shape = resolve_shape(cfg.mesh, n_devices)
    check_divisibility(cfg, shape.axis_sizes)
    _devices_per_node(n_devices, nodes)
    if math.prod(shape.dcn) != nodes:
        raise ConfigError(f"mesh.dcn sizes multiply to {math.prod(shape.dcn)} but the plan is for {nodes} node(s); "
                          f"set --nodes {math.prod(shape.dcn)} or change mesh.dcn")
    return shape


def mesh_label(shape: MeshShape) -> str:
    """Short human label: ``fsdp8``, ``data2 fsdp2 tensor2``, ``fsdp8 | dcn data8``."""
    ici = " ".join(f"{a}{s}" for a, s in zip(MESH_AXES, shape.ici) if s > 1) or "one-device"
    dcn = " ".join(f"{a}{s}" for a, s in zip(MESH_AXES, shape.dcn) if s > 1)
    return f"{ici} | dcn {dcn}" if dcn else ici


def mesh_dict(shape: MeshShape) -> dict:
    """The JSON form: total axis sizes, and their intra-node (ici) and inter-node (dcn) parts."""
    return {**shape.axis_sizes, "ici": dict(zip(MESH_AXES, shape.ici)), "dcn": dict(zip(MESH_AXES, shape.dcn))}


# ---------------------------------------------------------------------------------------------------------------
# HLO text: a small parser for what the analysis needs (instructions, users, called computations)

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY_RE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_CALLED_RE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Ops that only move or re-type a value: an all-reduce seen through them is still that all-reduce.
_PASS = {"bitcast", "copy", "reshape", "transpose", "convert"}
# Elementwise ops a gradient may pass through between its all-reduce and the slice that shards it.
_ELEMENTWISE = _PASS | {"add", "subtract", "multiply", "divide", "negate"}


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    comp: str
    operands_text: str = ""  # the raw operand list; for parameter(N) it is N
    is_root: bool = False


@dataclass
class HloModule:
    comps: dict[str, list[Instr]]
    entry: str
    by_name: dict[str, Instr]
    users: dict[str, list[Instr]]
    callers: dict[str, list[Instr]]  # computation -> instructions that call it

    def root(self, comp: str) -> Instr | None:
        return next((i for i in self.comps.get(comp, []) if i.is_root), None)

    def fusion_caller(self, comp: str) -> Instr | None:
        """The fusion instruction that calls ``comp``, when exactly one does."""
        calls = [c for c in self.callers.get(comp, []) if c.opcode == "fusion"]
        return calls[0] if len(calls) == 1 else None

    def param(self, comp: str, index: int) -> Instr | None:
        for ins in self.comps[comp]:
            if ins.opcode == "parameter" and ins.operands_text == str(index):
                return ins
        return None


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _parse_instr(line: str, comp: str) -> Instr | None:
    body = line.strip()
    is_root = body.startswith("ROOT ")
    if is_root:
        body = body[5:]
    name, sep, rest = body.partition(" = ")
    if not sep or not name.startswith("%"):
        return None
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = _balanced(rest, paren)
    operands_text = rest[paren + 1:close - 1]
    return Instr(name[1:], shape, opcode, re.findall(r"%([\w.\-]+)", operands_text), rest[close:], comp,
                 operands_text.strip(), is_root)


def parse_hlo(text: str) -> HloModule:
    """Computations and instructions of an HLO module's text (``Compiled.as_text()``)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line[0].isspace():
            if line.rstrip().endswith("{"):
                header = line.split()
                is_entry = header[0] == "ENTRY"
                current = header[1 if is_entry else 0].lstrip("%")
                comps[current] = []
                if is_entry:
                    entry = current
            else:
                current = None  # the closing brace
            continue
        if current is not None:
            ins = _parse_instr(line, current)
            if ins is not None:
                comps[current].append(ins)
    by_name = {i.name: i for instrs in comps.values() for i in instrs}
    users: dict[str, list[Instr]] = {}
    callers: dict[str, list[Instr]] = {}
    for ins in by_name.values():
        for op in ins.operands:
            users.setdefault(op, []).append(ins)
        for callee in _called(ins):
            callers.setdefault(callee, []).append(ins)
    return HloModule(comps, entry, by_name, users, callers)


def _called(ins: Instr) -> list[str]:
    names = [m.group(2) for m in _CALLED_RE.finditer(ins.attrs)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    if branches:
        names += re.findall(r"%([\w.\-]+)", branches.group(1))
    return names


def array_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple counts all its elements)."""
    total = 0
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _elements(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY_RE.findall(shape))


def multiplicities(module: HloModule) -> tuple[dict[str, int], list[str]]:
    """How many times each computation runs per call of the entry, from the while loops' known trip counts.

    Returns the counts and the names of loops whose trip count XLA did not know (counted once: a lower bound).
    """
    counts: dict[str, int] = {}
    unknown: list[str] = []

    def visit(comp: str, times: int) -> None:
        counts[comp] = counts.get(comp, 0) + times
        for ins in module.comps.get(comp, []):
            if ins.opcode == "while":
                trip = _TRIP_RE.search(ins.attrs)
                if trip is None:
                    unknown.append(ins.name)
                n = int(trip.group(1)) if trip else 1
                body = re.search(r"\bbody=%([\w.\-]+)", ins.attrs).group(1)
                visit(body, times * n)
            elif ins.opcode == "call":  # a call's body is its to_apply
                for callee in _called(ins):
                    visit(callee, times)
            elif ins.opcode != "fusion":  # fusions hold no collectives; skip their (many) bodies
                for callee in _called(ins):  # async wrappers, conditional branches (each counted: an upper bound)
                    if not re.search(rf"\b(to_apply|condition)=%{re.escape(callee)}\b", ins.attrs):
                        visit(callee, times)  # to_apply of a reduce or collective is its reduction function

    visit(module.entry, 1)
    return counts, unknown


# -- replica groups ----------------------------------------------------------------------------------------------


def replica_groups(attrs: str, n_devices: int) -> np.ndarray:
    """The replica groups of a collective as an int array [groups, group_size] of logical device ids.

    Handles the three printed forms: explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)`` and mesh axes
    ``mesh['a'=2,'b'=4] {'b'}`` (optionally with sub-axes ``'b':(1)2``).
    """
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return np.arange(n_devices)[None, :]
    text = attrs[m.end():]
    if text.startswith("{"):
        inner = text[:_balanced(text, 0)]
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


# -- collectives -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective of the step, after the GPU rewrites. ``bytes`` is per execution and device: the reduced buffer
    (all-reduce), the gathered output (all-gather), the input (reduce-scatter, all-to-all, collective-permute)."""

    kind: str
    bytes: int
    count: int  # executions per step (loop trip counts multiplied in)
    groups: np.ndarray = dataclasses.field(compare=False)  # [groups, size] logical device ids; permute: pairs
    op_name: str = ""

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


def collectives(hlo_text: str, mesh_sizes: tuple[int, ...], param_axes: frozenset[str] = frozenset()
                ) -> tuple[list[Collective], list[str]]:
    """The collectives of a compiled step, with trip counts, after applying XLA's GPU collective rewrites.

    ``mesh_sizes``: the (data, fsdp, tensor) sizes the step was compiled for (logical device ids are positions in
    that mesh); ``param_axes``: the mesh axes parameters are sharded over, which is where a gradient all-reduce
    followed by a partial slice splits (see :func:`_split_group`). Returns the collectives and the names of while
    loops with unknown trip counts (their bodies counted once).
    """
    n_devices = math.prod(mesh_sizes)
    module = parse_hlo(hlo_text)
    mult, unknown = multiplicities(module)
    found: list[Collective] = []
    all_reduce_elements: list[tuple[Instr, int, str, int]] = []  # (instr, element index, value name, executions)
    for comp, times in mult.items():
        for ins in module.comps.get(comp, []):
            op = ins.opcode.removesuffix("-start")
            if op not in KINDS and op != "ragged-all-to-all":
                continue
            op = "all-to-all" if op == "ragged-all-to-all" else op
            op_name = _op_name(ins)
            if op == "all-reduce":
                for idx, value in _elements_of(module, ins):
                    all_reduce_elements.append((ins, idx, value, times))
                continue
            operand_bytes = sum(array_bytes(module.by_name[o].shape) for o in ins.operands if o in module.by_name)
            if op == "collective-permute":
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", ins.attrs)
                groups = np.array([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0))]) \
                    if pairs else np.zeros((0, 2), int)
                found.append(Collective(op, operand_bytes, times, groups, op_name))
                continue
            groups = replica_groups(ins.attrs, n_devices)
            size = operand_bytes * groups.shape[1] if op == "all-gather" else operand_bytes
            found.append(Collective(op, size, times, groups, op_name))
    found += _rewrite_all_reduces(module, all_reduce_elements, mesh_sizes, param_axes)
    return found, unknown


def _op_name(ins: Instr) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def _elements_of(module: HloModule, ins: Instr) -> list[tuple[int, str]]:
    """(element index, the value that carries it) for an all-reduce: itself, or its get-tuple-elements.

    An asynchronous all-reduce-start (GPU) delivers its result through its all-reduce-done."""
    done = [u for u in module.users.get(ins.name, []) if u.opcode == "all-reduce-done"]
    value = done[0] if done else ins
    if not ins.shape.startswith("("):
        return [(0, value.name)]
    by_index: dict[int, str] = {}
    for user in module.users.get(value.name, []):
        if user.opcode == "get-tuple-element":
            by_index.setdefault(int(re.search(r"index=(\d+)", user.attrs).group(1)), user.name)
    n_elements = len(_ARRAY_RE.findall(ins.shape))
    return [(i, by_index.get(i, value.name)) for i in range(n_elements)]  # an unused element still moves


def _rewrite_all_reduces(module: HloModule, elements, mesh_sizes: tuple[int, ...], param_axes: frozenset[str]
                         ) -> list[Collective]:
    """All-reduce elements -> collectives, as XLA's GPU passes leave them: reassociable ones merged
    (AllReduceReassociate), ones whose every use takes a 1/n slice made reduce-scatters (ReduceScatterCreator), and
    ones sliced 1/k with k < n split into a reduce-scatter over k devices and an all-reduce of the 1/k shard over
    the rest (AllReduceSplitter, on by default on GPU: the hybrid-sharded gradient's pattern)."""
    n_devices = math.prod(mesh_sizes)
    key_of = {value: i for i, (_, _, value, _) in enumerate(elements)}
    groups = [replica_groups(ins.attrs, n_devices) for ins, _, _, _ in elements]
    group_key = [tuple(sorted(tuple(sorted(g)) for g in grp.tolist())) for grp in groups]
    parent = list(range(len(elements)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # AllReduceReassociate: an add whose two operands are (sets of) all-reduces over the same devices.
    memo: dict[str, int | None] = {}

    def source(name: str) -> int | None:
        if name in memo:
            return memo[name]
        memo[name] = None  # cycle guard
        result = None
        if name in key_of:
            result = key_of[name]
        else:
            ins = module.by_name.get(name)
            # Through a dynamic-slice too: add(slice(all-reduce a), slice(all-reduce b)) is what
            # ReduceScatterReassociate merges once both became reduce-scatters.
            if ins is not None and ins.opcode in _PASS | {"dynamic-slice"} and ins.operands:
                result = source(ins.operands[0])
            elif ins is not None and ins.opcode == "parameter":
                result = _through_fusion_param(module, ins, source)
            elif ins is not None and ins.opcode == "fusion":  # e.g. a wrapped convert: follow its root inside
                callee = re.search(r"\bcalls=%([\w.\-]+)", ins.attrs)
                root = module.root(callee.group(1)) if callee else None
                result = source(root.name) if root is not None else None
            elif ins is not None and ins.opcode == "add" and len(ins.operands) == 2:
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
    for i in range(len(elements)):
        sets.setdefault(find(i), []).append(i)
    out = []
    for members in sets.values():
        fractions = {_sliced_fraction(module, elements[i][2], _elements(_element_shape(*elements[i][:2])), {})
                     for i in members}
        k = fractions.pop() if len(fractions) == 1 else None
        # Merged all-reduces move one buffer: the largest member (they share a shape when reassociated).
        best = max(members, key=lambda i: array_bytes(_element_shape(*elements[i][:2])) * elements[i][3])
        ins, idx, _, times = elements[best]
        size, grp, name = array_bytes(_element_shape(ins, idx)), groups[best], _op_name(ins)
        split = _split_group(grp, mesh_sizes, param_axes, k) if k and 1 < k < grp.shape[1] else None
        if k == grp.shape[1]:
            out.append(Collective("reduce-scatter", size, times, grp, name))
        elif split is not None:
            out.append(Collective("reduce-scatter", size, times, split[0], name))
            out.append(Collective("all-reduce", size // k, times, split[1], name))
        else:
            out.append(Collective("all-reduce", size, times, grp, name))
    return out


def _split_group(groups: np.ndarray, mesh_sizes: tuple[int, ...], param_axes: frozenset[str], k: int
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """Split replica groups spanning several mesh axes into (groups over the axes of size k that shard the
    parameters, groups over the remaining axes); None if no such axes multiply to exactly k."""
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


def _element_shape(ins: Instr, idx: int) -> str:
    if not ins.shape.startswith("("):
        return ins.shape
    return [f"{d}[{s}]" for d, s in _ARRAY_RE.findall(ins.shape)][idx]


def _through_fusion_param(module: HloModule, param: Instr, follow: Callable[[str], Any]):
    """A fused computation's parameter -> what ``follow`` says about the operand its (single) caller passes."""
    call = module.fusion_caller(param.comp)
    if call is None:
        return None
    index = int(param.operands_text)
    return follow(call.operands[index]) if index < len(call.operands) else None


def _sliced_fraction(module: HloModule, name: str, elements: int, memo: dict) -> int | None:
    """k when every use of value ``name`` ends, through elementwise ops and fusion boundaries, in a slice of
    ``elements / k`` elements (ReduceScatterCreator's pattern); None otherwise."""
    if name in memo:
        return memo[name]
    memo[name] = None
    found: set[int | None] = set()
    users = module.users.get(name, [])
    ins = module.by_name.get(name)
    call = module.fusion_caller(ins.comp) if ins is not None and ins.is_root else None
    if call is not None:  # a fused computation's result: its uses are the fusion's uses outside
        found.add(_sliced_fraction(module, call.name, elements, memo))
    elif not users:
        return None
    for user in users:
        if user.opcode in ("dynamic-slice", "slice") and user.operands[0] == name:
            sliced = _elements(user.shape)
            found.add(elements // sliced if sliced and elements % sliced == 0 and sliced < elements else None)
        elif user.opcode in _ELEMENTWISE and _elements(user.shape) == elements:
            found.add(_sliced_fraction(module, user.name, elements, memo))
        elif user.opcode == "fusion":
            callee = re.search(r"\bcalls=%([\w.\-]+)", user.attrs)
            for pos, op in enumerate(user.operands):
                if op == name and callee:
                    param = module.param(callee.group(1), pos)
                    found.add(_sliced_fraction(module, param.name, elements, memo) if param else None)
        else:
            found.add(None)
    result = found.pop() if len(found) == 1 else None
    memo[name] = result
    return result


# ---------------------------------------------------------------------------------------------------------------
# Link traffic and the step-time model


def _sub_coordinates(shape: MeshShape, ids: np.ndarray) -> np.ndarray:
    """Logical device ids -> [..., 6] coordinates (dcn_data, ici_data, dcn_fsdp, ici_fsdp, dcn_tensor, ici_tensor).

    A logical id is a position in the (data, fsdp, tensor) mesh; within each axis the dcn index is the major part
    (``mesh.build_mesh`` lays devices out so), hence dcn = coord // ici and ici = coord % ici.
    """
    totals = [i * d for i, d in zip(shape.ici, shape.dcn)]
    coords = np.stack(np.unravel_index(ids, totals), axis=-1)
    ici = np.array(shape.ici)
    return np.stack([coords // ici, coords % ici], axis=-1).reshape(*ids.shape, 6)


def group_span(shape: MeshShape, groups: np.ndarray) -> tuple[int, int, list[str]]:
    """(a, b, axes): a group's devices per node (a) and nodes (b), and the mesh axes it runs over, e.g.
    ``["fsdp", "data(dcn)"]``."""
    if groups.size == 0:
        return 1, 1, []
    sub = _sub_coordinates(shape, groups)  # [groups, size, 6]
    varies = (sub != sub[:, :1]).any(axis=(0, 1))
    names = []
    for k, ax in enumerate(MESH_AXES):
        dcn, ici = varies[2 * k], varies[2 * k + 1]
        if ici and dcn:
            names.append(f"{ax}(ici+dcn)")
        elif dcn:
            names.append(f"{ax}(dcn)")
        elif ici:
            names.append(ax)
    node_ids = sub[..., 0::2]  # the dcn coordinates name a node
    b = max(len({tuple(r) for r in g}) for g in node_ids)
    return groups.shape[1] // b, b, names


def link_bytes(kind: str, size: float, a: int, b: int, crosses: bool) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one device sends for one collective of ``size`` bytes over a group of ``a``
    devices per node x ``b`` nodes, done hierarchically as NCCL's rings do (within nodes first, then across):

    - all-gather / reduce-scatter: size (a-1)/a within, (size/a) (b-1)/b across;
    - all-reduce = reduce-scatter + all-gather: twice that;
    - all-to-all: each device sends size/n to each other device, (n-a) of them on other nodes;
    - collective-permute: the whole buffer, across nodes when the pair is split.
    """
    n = a * b
    if kind in ("all-gather", "reduce-scatter"):
        return size * (a - 1) / a, size / a * (b - 1) / b
    if kind == "all-reduce":
        return 2 * size * (a - 1) / a, 2 * size / a * (b - 1) / b
    if kind == "all-to-all":
        return size * (a - 1) / n, size * (n - a) / n
    if kind == "collective-permute":
        return (0.0, size) if crosses else (size, 0.0)
    raise ValueError(kind)


def remat_factor(cfg: Config) -> float:
    """Hardware FLOPs / model FLOPs: rematerialisation recomputes (part of) the forward pass in the backward."""
    m, seq = cfg.model, cfg.data.seq_len
    if m.remat == "full":
        return 4 / 3  # forward + backward (2x forward) + the forward again
    if m.remat == "save_matmuls":  # weight matmuls saved; attention's S x S matmuls (batched dots) recomputed
        attention_fwd = m.n_layers * 2 * 2 * seq * m.n_heads * m.resolved_head_dim / 2
        return 1 + attention_fwd / train_flops_per_token(m, seq)
    return 1.0


def _optimizer_bytes_moved(params_bytes: float, opt_bytes: float) -> float:
    """Bytes the AdamW update reads and writes per device: gradients, parameters and moments in, the three out."""
    return 2 * (params_bytes + opt_bytes) + params_bytes


@dataclass
class Estimate:
    compute_s: float
    optimizer_s: float
    ici_s: float
    dcn_s: float
    ici_bytes: float
    dcn_bytes: float

    @property
    def serial_s(self) -> float:
        """No overlap: compute, then every collective, then the update."""
        return self.compute_s + self.ici_s + self.dcn_s + self.optimizer_s

    @property
    def overlap_s(self) -> float:
        """Perfect overlap: the slowest of compute and each link class (NVLink and network are separate hardware)."""
        return max(self.compute_s, self.ici_s, self.dcn_s) + self.optimizer_s


def estimate(cfg: Config, shape: MeshShape, hw: Hardware, colls: list[Collective], params_bytes: float,
             opt_bytes: float) -> tuple[Estimate, list[dict]]:
    """Step-time estimate of one mesh, and its collectives summarised by (kind, axes)."""
    n = math.prod(shape.ici) * math.prod(shape.dcn)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    flops = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens / n * remat_factor(cfg)
    compute_s = flops / (hw.peak_flops * hw.compute_efficiency)
    ici_bytes = dcn_bytes = ici_latency = dcn_latency = 0.0
    summary: dict[tuple[str, str], dict] = {}
    for c in colls:
        a, b, axes = group_span(shape, c.groups)
        within, across = link_bytes(c.kind, c.total_bytes, a, b, crosses=b > 1)
        ici_bytes += within
        dcn_bytes += across
        if b > 1:
            dcn_latency += c.count * hw.collective_latency
        else:
            ici_latency += c.count * hw.collective_latency
        key = (c.kind, "+".join(axes) or "-")
        row = summary.setdefault(key, {"kind": c.kind, "axes": axes, "crosses_nodes": b > 1, "bytes": 0, "count": 0,
                                       "intra_node_bytes": 0.0, "inter_node_bytes": 0.0})
        row["bytes"] += c.total_bytes
        row["count"] += c.count
        row["intra_node_bytes"] += within
        row["inter_node_bytes"] += across
    est = Estimate(compute_s=compute_s,
                   optimizer_s=_optimizer_bytes_moved(params_bytes, opt_bytes) / hw.hbm_bandwidth,
                   ici_s=ici_bytes / hw.intra_node_bandwidth + ici_latency,
                   dcn_s=dcn_bytes / hw.inter_node_bandwidth + dcn_latency,
                   ici_bytes=ici_bytes, dcn_bytes=dcn_bytes)
    return est, sorted(summary.values(), key=lambda r: -r["bytes"])


# ---------------------------------------------------------------------------------------------------------------
# Compiling and planning


@dataclass
class Compiled:
    """What one compile of the step gives, independent of how the axes split over nodes."""

    params_bytes: int
    opt_bytes: int
    temp_bytes: int
    memory_bytes: int  # arguments + temporaries + outputs not aliased to (donated) arguments
    collectives: list[Collective]
    unknown_loops: list[str]
    compile_s: float


def state_bytes(trainer) -> tuple[int, int]:
    """Per-device bytes of the parameter shards and of the optimizer-state shards (largest shard per leaf)."""
    import jax

    params = opt = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.abstract_state)[0]:
        shard = leaf.sharding.shard_shape(leaf.shape)
        size = math.prod(shard) * np.dtype(leaf.dtype).itemsize
        if jax.tree_util.keystr(path).startswith("['model']"):
            params += size
        else:
            opt += size
    return params, opt


def param_axes(trainer) -> frozenset[str]:
    """The mesh axes that some parameter is sharded over (from the abstract state's shardings)."""
    import jax

    axes = set()
    for leaf in jax.tree.leaves(trainer.abstract_state["model"]):
        for entry in leaf.sharding.spec:
            axes.update(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a)
    return frozenset(axes)


def compile_step(cfg: Config, shape: MeshShape, devices: list) -> Compiled:
    """Lower and compile the real train step for ``shape`` from abstract shapes (nothing is allocated)."""
    from jaxtrain.train import build_trainer

    trainer = build_trainer(with_shape(cfg, shape), devices)
    params, opt = state_bytes(trainer)
    train, _, seconds = trainer.compile(trainer.abstract_state)
    mem = train.memory_analysis()
    total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    colls, unknown = collectives(train.as_text(), tuple(shape.axis_sizes.values()), param_axes(trainer))
    return Compiled(params, opt, mem.temp_size_in_bytes, total, colls, unknown, seconds)


def candidate_result(cfg: Config, shape: MeshShape, hw: Hardware, comp: Compiled) -> dict:
    """One row of the plan (the JSON contract's keys plus details)."""
    est, summary = estimate(cfg, shape, hw, comp.collectives, comp.params_bytes, comp.opt_bytes)
    by_kind = {k: 0 for k in KINDS}
    for c in comp.collectives:
        by_kind[c.kind] += c.total_bytes
    return {
        "mesh": mesh_dict(shape),
        "label": mesh_label(shape),
        "memory_bytes_per_device": comp.memory_bytes,
        "memory": {"params": comp.params_bytes, "optimizer": comp.opt_bytes, "temp": comp.temp_bytes,
                   "usable": hw.usable_bytes},
        "collective_bytes": by_kind,
        "intra_node_bytes_per_device": est.ici_bytes,
        "inter_node_bytes_per_device": est.dcn_bytes,
        "collectives": summary,
        "est_step_seconds": est.serial_s,
        "est_step_seconds_overlap": est.overlap_s,
        "time": {"compute": est.compute_s, "intra_node": est.ici_s, "inter_node": est.dcn_s,
                 "optimizer": est.optimizer_s},
        "fits": comp.memory_bytes <= hw.usable_bytes,
        "compile_seconds": comp.compile_s,
        "unknown_trip_count_loops": comp.unknown_loops,
    }


def plan(cfg: Config, shapes: list[MeshShape], hw: Hardware, devices: list,
         progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Compile each distinct axis-size combination once and report every shape, fastest estimate first.

    A shape whose parameter and optimizer shards alone exceed the usable memory is not compiled (it cannot fit
    whatever the activations) and is listed under ``pruned``.
    """
    from jaxtrain.train import build_trainer

    by_sizes: dict[tuple[int, ...], list[MeshShape]] = {}
    for s in shapes:
        by_sizes.setdefault(tuple(s.axis_sizes.values()), []).append(s)
    results, pruned = [], []
    for i, (sizes, group) in enumerate(by_sizes.items(), 1):
        params, opt = state_bytes(build_trainer(with_shape(cfg, group[0]), devices))
        if params + opt > hw.usable_bytes:
            for s in group:
                pruned.append({"mesh": mesh_dict(s), "label": mesh_label(s), "state_bytes_per_device": params + opt,
                               "reason": f"parameters + optimizer state alone take {params + opt:,} bytes per "
                                         f"device > {hw.usable_bytes:,.0f} usable"})
            progress(f"[{i}/{len(by_sizes)}] {mesh_label(group[0])}: pruned, state alone does not fit")
            continue
        t0 = time.perf_counter()
        comp = compile_step(cfg, group[0], devices)
        progress(f"[{i}/{len(by_sizes)}] data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]}: compiled in "
                 f"{time.perf_counter() - t0:.1f} s")
        results += [candidate_result(cfg, s, hw, comp) for s in group]
    results.sort(key=lambda r: r["est_step_seconds"])
    return {"candidates": results, "pruned": pruned}


def hardware_dict(hw: Hardware) -> dict:
    return dataclasses.asdict(hw)


# ---------------------------------------------------------------------------------------------------------------
# Text report


def _bytes(x: float) -> str:
    """Decimal units, as datasheets and link rates use them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _rate(x: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _sec(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _report_row(rank: int, r: dict) -> list[str]:
    cb, mem, t = r["collective_bytes"], r["memory"], r["time"]
    return [str(rank), r["label"], _bytes(mem["params"]), _bytes(mem["optimizer"]), _bytes(mem["temp"]),
            _bytes(r["memory_bytes_per_device"]), "yes" if r["fits"] else "NO", _bytes(cb["all-reduce"]),
            _bytes(cb["all-gather"]), _bytes(cb["reduce-scatter"]), _bytes(cb["all-to-all"] + cb["collective-permute"]),
            _bytes(r["intra_node_bytes_per_device"]), _bytes(r["inter_node_bytes_per_device"]), _sec(t["compute"]),
            _sec(t["intra_node"] + t["inter_node"]), _sec(r["est_step_seconds"]), _sec(r["est_step_seconds_overlap"])]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned text table; collective columns that are zero in every row are left out."""
    keep = [i for i, h in enumerate(header)
            if not (h in ("all-reduce", "all-gather", "reduce-scatter", "a2a+permute")
                    and all(r[i] in ("0 B", "") for r in rows))]
    header, rows = [header[i] for i in keep], [[r[i] for i in keep] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def format_report(cfg: Config, hw: Hardware, n_devices: int, nodes: int, result: dict) -> str:
    """The ranked table printed by ``jaxtrain plan``."""
    from jaxtrain.train import compute_dtype

    m = cfg.model
    tokens = cfg.train.global_batch * cfg.data.seq_len
    lines = [
        f"model: {count_params(m)['total'] / 1e6:,.1f}M parameters ({m.param_dtype}), compute "
        f"{compute_dtype(m.dtype).name}, attention {m.attention}, remat {m.remat}; {tokens:,} tokens/step "
        f"(global_batch {cfg.train.global_batch} x seq_len {cfg.data.seq_len}, {cfg.train.microbatches} "
        "microbatch(es))",
        f"hardware: {hw.name}: {n_devices} devices ({hw.device}) on {nodes} node(s); peak "
        f"{_rate(hw.peak_flops, 'FLOP/s')} x efficiency {hw.compute_efficiency:g}; memory {_bytes(hw.hbm_bytes)} x "
        f"{hw.mem_fraction:g} usable at {_rate(hw.hbm_bandwidth, 'B/s')}; links "
        f"{_rate(hw.intra_node_bandwidth, 'B/s')} in a node, {_rate(hw.inter_node_bandwidth, 'B/s')} between nodes "
        "(per device, each way)"
        + (f"; {hw.collective_latency * 1e6:.0f} us per collective" if hw.collective_latency else ""),
        "",
    ]
    lines += _table(["#", "mesh (ici | dcn)", "params", "optimizer", "temp", "total", "fits", "all-reduce",
                     "all-gather", "reduce-scatter", "a2a+permute", "in-node", "x-node", "compute", "comm", "step",
                     "overlapped"],
                    [_report_row(rank, r) for rank, r in enumerate(result["candidates"], 1)] +
                    [["-", p["label"], "", "", "", f"> {_bytes(p['state_bytes_per_device'])}", "NO"] + [""] * 8 +
                     ["pruned", ""] for p in result["pruned"]])
    lines.append("")
    lines += [
        "Memory per device: parameter and optimizer shards (exact), the compiler's temporaries (memory_analysis); "
        f"total = arguments + temporaries + non-donated outputs; fits: total <= {hw.mem_fraction:g} x memory.",
        "Collective bytes per device and step, loop trip counts included; in-node / x-node: bytes each device sends "
        "within its node / to other nodes (hierarchical rings).",
        "step = compute + comm + optimizer update (no overlap); overlap = max(compute, in-node, x-node) + update. "
        f"Compute = model FLOPs x remat {remat_factor(cfg):.3g} / (peak x {hw.compute_efficiency:g}).",
    ]
    if result["pruned"]:
        lines.append("pruned: parameters + optimizer state alone exceed the usable memory, so not compiled.")
    unknown = sorted({n for r in result["candidates"] for n in r["unknown_trip_count_loops"]})
    if unknown:
        lines.append(f"warning: loops with unknown trip counts counted once: {', '.join(unknown)}")
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
