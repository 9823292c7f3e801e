"""Health check before a long job: every device's matmul, and collective bandwidth over every mesh axis.

Bandwidths follow nccl-tests' definitions. For a message of S bytes per device (the larger of a collective's input
and output buffers) taking t seconds on an axis of n devices: algbw = S / t, and the bus bandwidth, which is
comparable across collectives and axis sizes, is busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for
all-gather, reduce-scatter and all-to-all. Every collective's result is also checked for the right values.

Made for GPU nodes: bfloat16 matmuls of 8192 (not launch overhead) and collectives up to 1 GiB by default on GPUs;
absolute bounds from the hardware file (``check.hardware``, or the shipped file matching the devices): a device
below ``check.min_peak_fraction`` of ``peak_flops`` fails, so does a node whose GPUs are all throttled; an axis
below ``check.min_link_fraction`` of its link (NVLink inside a node, the NIC across nodes) fails. Attribution: when
an axis is slow or wrong, per-node sub-checks (each node's devices alone) and per-pair sub-checks (neighbouring
nodes two by two) find the node to blame; every process whose node is to blame prints
``check: exclude hosts: <node>`` (the Slurm node name), which ``launch/slurm.sbatch`` turns into ``--exclude``.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import Config
from jaxtrain.errors import ConfigError
from jaxtrain.mesh import build_mesh

BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n}


@dataclass
class Measurement:
    axis: str
    op: str
    size_bytes: int
    seconds: float
    correct: bool
    n: int

    @property
    def algbw(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * BUS_FACTOR[self.op](self.n)


def _collective(op: str, axis: str):
    """Per-device body for shard_map: x is this device's float32 [count] buffer filled with its axis index + 1."""
    if op == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if op == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if op == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def _expected(op: str, n: int, count: int, index: int) -> np.ndarray:
    """What device ``index`` (position along the axis) must hold after ``op`` on inputs ``index + 1``."""
    total = n * (n + 1) / 2
    if op == "all-reduce":
        return np.full(count, total, np.float32)
    if op == "reduce-scatter":
        return np.full(count // n, total, np.float32)
    blocks = np.repeat(np.arange(1, n + 1, dtype=np.float32), count // n)  # block j came from device j
    return blocks if op == "all-to-all" else np.repeat(np.arange(1, n + 1, dtype=np.float32), count)


def measure_collective(mesh, axis: str, op: str, size_bytes: int, iters: int, sync: bool = True) -> Measurement:
    """``op`` over mesh ``axis`` with ``size_bytes`` per device. ``sync=False`` for sub-meshes that only some
    processes take part in (a global barrier would wait for the others)."""
    n = mesh.shape[axis]
    # Input elements per device: the message is the larger buffer (all-gather's output is n times its input).
    count = max(n, size_bytes // 4 // (n if op == "all-gather" else 1) // n * n)
    spec = P(mesh.axis_names)  # every device its own [count] block
    sharding = NamedSharding(mesh, spec)
    position = {ax: i for i, ax in enumerate(mesh.axis_names)}[axis]

    def fill(index):
        device_pos = np.unravel_index(index[0].start // count, mesh.devices.shape)
        return np.full(count, device_pos[position] + 1, np.float32)

    x = jax.make_array_from_callback((mesh.devices.size * count,), sharding, fill)
    f = jax.jit(jax.shard_map(_collective(op, axis), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    out = f(x).block_until_ready()
    correct = True
    for shard in out.addressable_shards:
        device_pos = np.unravel_index(list(mesh.devices.flat).index(shard.device), mesh.devices.shape)
        want = _expected(op, n, count, int(device_pos[position]))
        correct &= bool(np.array_equal(np.asarray(shard.data), want))
    if sync:
        multihost_utils.sync_global_devices(f"check {axis} {op} {size_bytes}")
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(x)
    out.block_until_ready()
    seconds = (time.perf_counter() - t0) / iters
    message = count * 4 * (n if op == "all-gather" else 1)
    return Measurement(axis, op, message, seconds, correct, n)


def measure_matmuls(size: int, iters: int, dtype=jnp.float32, rounds: int = 3) -> list[tuple[str, float, float]]:
    """(device, GFLOP/s, max relative error against float64) for each device this process holds.

    Inputs are [size, size] in ``dtype`` (float32 accumulation). The error is measured on the first 64 output rows
    against a float64 product of the same (rounded) inputs, which keeps the host's reference cheap at size 8192.
    The rate is each device's best of ``rounds`` interleaved rounds, so that a passing load on the host (emulated
    CPU devices share its cores) does not single out whichever device it happened to hit.
    """
    rng = np.random.default_rng(0)
    a = np.asarray(jnp.asarray(rng.standard_normal((size, size), np.float32), dtype))  # rounded to dtype
    b = np.asarray(jnp.asarray(rng.standard_normal((size, size), np.float32), dtype))
    rows = min(size, 64)
    ref = a[:rows].astype(np.float64) @ b.astype(np.float64)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    inputs = {d: (jax.device_put(a, d), jax.device_put(b, d)) for d in jax.local_devices()}
    errors = {d: float(np.max(np.abs(np.asarray(f(x, y)[:rows], np.float64) - ref)) / np.max(np.abs(ref)))
              for d, (x, y) in inputs.items()}
    best = dict.fromkeys(inputs, 0.0)
    for _ in range(rounds):
        for d, (x, y) in inputs.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                r = f(x, y)
            r.block_until_ready()
            best[d] = max(best[d], 2 * size**3 / ((time.perf_counter() - t0) / iters) / 1e9)
    return [(str(d), best[d], errors[d]) for d in inputs]


def node_name() -> str:
    """This process's node as the scheduler names it (SLURMD_NODENAME, what --exclude takes), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _hardware(cfg: Config, device_kind: str):
    """The hardware file to bound against: check.hardware (its device_kind must match: exit 2 otherwise), else the
    shipped file whose device_kind matches, else None (CPU: relative bounds only)."""
    from jaxtrain import hardware

    if cfg.check.hardware is None:
        return hardware.for_device_kind(device_kind)
    hw = hardware.load_hardware(cfg.check.hardware)
    if hw.device_kind and hw.device_kind.lower() not in device_kind.lower():
        raise ConfigError(f"check.hardware={cfg.check.hardware!r} describes {hw.device_kind} devices but this job "
                          f"has {device_kind!r}; pick the hardware file of these devices")
    return hw


def _nodes() -> list[list[int]]:
    """Process indices grouped by node (processes of one node share its name), nodes in order of first process."""
    name = np.frombuffer(node_name().encode()[:64].ljust(64, b"\0"), np.uint8)
    names = np.asarray(multihost_utils.process_allgather(name)).reshape(jax.process_count(), 64)
    groups: dict[str, list[int]] = {}
    for p in range(jax.process_count()):
        groups.setdefault(bytes(names[p]).rstrip(b"\0").decode(), []).append(p)
    return [groups[k] for k in groups]


def _sub_mesh(nodes: list[list[int]]):
    """A 2-D mesh ("node", "local") over the devices of the given nodes (lists of process indices), a row each."""
    from jax.sharding import Mesh

    procs = {p for node in nodes for p in node}
    devices = [d for d in jax.devices() if d.process_index in procs]
    return Mesh(np.array(devices).reshape(len(nodes), -1), ("node", "local"))


def attribute(op: str, size_bytes: int, iters: int, bound_gbps: float, crosses_hosts: bool) -> tuple[bool, str]:
    """Whether this process's node is to blame for a slow or wrong ``op``, and the evidence, in words.

    Within nodes: each node runs ``op`` over its own devices at once; a node that is wrong or below ``bound_gbps``
    is to blame. Across nodes: each pair of ring neighbours (0,1), (1,2), ..., (last,0) runs it over the "node"
    axis; a node is to blame when both of its pairs failed (with 2 nodes, the one pair names both). Every process
    calls this with the same arguments; it takes part only in the sub-meshes that hold its devices.
    """
    nodes = _nodes()
    me = next(i for i, procs in enumerate(nodes) if jax.process_index() in procs)

    def bad(group, axis):
        m = measure_collective(_sub_mesh(group), axis, op, size_bytes, iters, sync=False)
        return (not m.correct) or (bound_gbps > 0 and m.busbw < bound_gbps), m

    if not crosses_hosts:
        if jax.device_count() // len(nodes) < 2:
            return False, "one device per node: nothing to split"
        flag, m = bad([nodes[me]], "local")
        return flag, (f"{op} inside node {node_name()}: {m.busbw:.3g} GB/s, values {'ok' if m.correct else 'WRONG'}"
                      f"{' (bad)' if flag else ''}")
    if len(nodes) < 2:
        return False, "a single node"
    ring = [(0, 1)] if len(nodes) == 2 else [(i, (i + 1) % len(nodes)) for i in range(len(nodes))]
    mine = []
    for a, b in ring:  # in ring order; a node waits only for its neighbours, so the pairs never deadlock
        if me in (a, b):
            flag, m = bad([nodes[a], nodes[b]], "node")
            mine.append((b if a == me else a, flag, m))
    words = "; ".join(f"with {other}: {m.busbw:.3g} GB/s, values {'ok' if m.correct else 'WRONG'}"
                      f"{' (bad)' if flag else ''}" for other, flag, m in mine)
    return all(flag for _, flag, _ in mine), f"{op} between node {me} ({node_name()}) and its neighbours: {words}"


RERUNS = 4


def reproduce(mesh, axis: str, op: str, size_bytes: int, platform: str) -> str:
    """Re-run a collective that returned wrong values ``RERUNS`` times before anything is blamed.

    Wrong every time: a reproducible fault of the devices or link, attributed to a node like a slow link. Wrong
    only sometimes: an intermittent fault, on CPU that of the collective library (gloo's reduce-scatter corrupts the
    end of rank 0's chunk from ~4 MiB, jax-ml/jax#40830), reported as such and not pinned on the hardware.
    """
    wrong = sum(not measure_collective(mesh, axis, op, size_bytes, 1).correct for _ in range(RERUNS))
    wrong = int(np.max(multihost_utils.process_allgather(np.array([wrong]))))
    if wrong == RERUNS:
        return f"reproducible: {op} over {axis} was wrong in {RERUNS} of {RERUNS} re-runs"
    library = ("gloo, the CPU collective library (jax-ml/jax#40830)" if platform == "cpu"
               else "the collective library or driver")
    return (f"intermittent: {op} over {axis} was wrong in {wrong} of {RERUNS} re-runs: a fault of {library}, "
            "not of a slow or broken link; the hardware is not blamed")


def verdict(failures: list[str]) -> tuple[bool, int]:
    """One verdict for the whole job: (passed, processes that failed), the same on every process."""
    failed = int(np.sum(multihost_utils.process_allgather(np.array([bool(failures)]))))
    return failed == 0, failed


def _any_process(flag: bool) -> bool:
    """True if ``flag`` is true on any process: every process must take the same branch before a sub-check."""
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def run(cfg: Config) -> list[str]:
    """Run the check, print tables (process 0) and, on every process whose node is to blame, the line
    ``check: exclude hosts: <node>``. Returns this process's failures (empty: healthy)."""
    mesh, shape = build_mesh(cfg)
    c, main = cfg.check, jax.process_index() == 0
    device = jax.devices()[0]
    gpu = device.platform != "cpu"
    hw = _hardware(cfg, device.device_kind)
    size = c.matmul_size or (8192 if gpu else 1024)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    sizes_mb = c.sizes_mb or ([16, 256, 1024] if gpu else [0.25, 4, 16])
    failures, blamed = [], []
    say = print if main else (lambda *a, **k: None)
    say(f"mesh {shape.label}; {jax.process_count()} process(es), {mesh.devices.size} {device.device_kind} "
        f"device(s); hardware file: {hw.name if hw else 'none (relative bounds only)'}\n")

    matmuls = measure_matmuls(size, c.iters, dtype)
    median = statistics.median(r[1] for r in matmuls)
    floor = c.min_peak_fraction * hw.peak_flops / 1e9 if hw else 0.0
    say(f"matmul {size}x{size} {jnp.dtype(dtype).name} (process {jax.process_index()}'s devices"
        f"{f'; peak {hw.peak_flops / 1e12:.0f} TFLOP/s, bound {floor / 1e3:.0f}' if hw else ''})")
    say("| device | GFLOP/s | max rel. error |\n| --- | --- | --- |")
    tolerance = 1e-3 if dtype == jnp.float32 else 2e-2  # bfloat16 output rounding is 2^-8 of each element
    for dev, rate, err in matmuls:
        say(f"| {dev} | {rate:.1f} | {err:.1e} |")
        if err > tolerance:
            failures.append(f"device {dev} on {node_name()}: matmul error {err:.1e} against the float64 reference")
        if rate < c.min_matmul_fraction * median:
            failures.append(f"device {dev} on {node_name()}: matmul {rate:.1f} GFLOP/s is below "
                            f"check.min_matmul_fraction={c.min_matmul_fraction} of the median {median:.1f}")
        if rate < floor:  # absolute: a node whose GPUs are all throttled fails too
            failures.append(f"device {dev} on {node_name()}: matmul {rate:.1f} GFLOP/s is below "
                            f"check.min_peak_fraction={c.min_peak_fraction} of {hw.name}'s peak")
    if failures:
        blamed.append("matmul on this node's devices")

    sizes = [int(mb * 2**20) for mb in sizes_mb]
    for ax_i, axis in enumerate(mesh.axis_names):
        n = mesh.shape[axis]
        if n == 1:
            continue
        crosses_hosts = shape.dcn[ax_i] > 1
        bound, why = c.min_busbw_gbps, "check.min_busbw_gbps"
        if not bound and hw:  # the link this axis runs over: the NIC across nodes, NVLink inside one
            link = hw.inter_node_bandwidth if crosses_hosts else hw.intra_node_bandwidth
            bound, why = c.min_link_fraction * link / 1e9, f"check.min_link_fraction={c.min_link_fraction} of " \
                f"{hw.name}'s {'inter' if crosses_hosts else 'intra'}-node link"
        say(f"\naxis {axis}: {n} devices{' (crosses hosts)' if crosses_hosts else ''}"
            f"{f'; bound {bound:.2f} GB/s' if bound else ''}")
        say("| collective | size | time | algbw GB/s | busbw GB/s | values |\n| --- | --- | --- | --- | --- | --- |")
        for op in BUS_FACTOR:
            m, wrong = None, False
            for nbytes in sizes:
                m = measure_collective(mesh, axis, op, nbytes, c.iters)
                say(f"| {op} | {m.size_bytes / 2**20:.2f} MiB | {m.seconds * 1e3:.3f} ms | {m.algbw:.3g} | "
                    f"{m.busbw:.3g} | {'ok' if m.correct else 'WRONG'} |")
                if _any_process(not m.correct):  # every process joins the re-runs
                    verdict = reproduce(mesh, axis, op, nbytes, device.platform)
                    say(f"check: {verdict}")
                    if not m.correct:
                        failures.append(f"axis {axis}: {op} of {m.size_bytes} bytes returned wrong values; {verdict}")
                    wrong = wrong or verdict.startswith("reproducible")
            assert m is not None  # sizes is never empty
            slow = bool(bound) and m.busbw < bound
            if slow:
                failures.append(f"axis {axis}: {op} bus bandwidth {m.busbw:.3g} GB/s at {m.size_bytes / 2**20:.2f} "
                                f"MiB is below {bound:.2f} GB/s ({why})")
            if _any_process(wrong or slow):  # all processes agree before the sub-checks, which they all join
                guilty, evidence = attribute(op, sizes[-1], c.iters, bound, crosses_hosts)
                print(f"check: {evidence}")
                if guilty:
                    blamed.append(f"{op} over axis {axis}")
    if blamed:
        print(f"check: node {node_name()} is to blame for: {'; '.join(blamed)}")
        print(f"check: exclude hosts: {node_name()}", flush=True)
    return failures
