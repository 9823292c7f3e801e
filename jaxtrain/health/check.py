"""Health check before a long job: every device's matmul, and collective bandwidth over every mesh axis.

Bandwidths follow nccl-tests' definitions. For a message of S bytes per device (the larger of a collective's input
and output buffers) taking t seconds on an axis of n devices: algbw = S / t, and the bus bandwidth, which is
comparable across collectives and axis sizes, is busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for
all-gather, reduce-scatter and all-to-all. Every collective's result is also checked for the right values, on the
devices (only one flag per device comes back to the host).

Bounds come from the hardware file (``check.hardware``, else the shipped file listing the devices' exact
``device_kind``; none: measured and reported, nobody excluded): a device below ``check.min_peak_fraction`` of
``peak_flops`` misses, so does one below ``check.min_matmul_fraction`` of the job's median; an axis below
``check.min_link_fraction`` of its link misses: the intra-node link when every group of devices along the axis sits on
one host (processes grouped by host name, so one process per GPU is judged against NVLink), the NIC otherwise.
Buffers are made on the devices, one per axis at the judged size (:func:`health_verdict.judged_size_bytes`), reused
by every collective and size. Attribution: when an axis misses, per-node sub-checks (each node's devices alone) and
per-pair sub-checks (neighbouring nodes two by two) find the node to blame. The verdict over all nodes is
:func:`jaxtrain.health.verdict.decide`; process 0 prints ``check: exclude hosts: <host,...>`` (Slurm node names),
which ``launch/slurm.sbatch`` turns into ``--exclude``. The network NCCL chose on each node: :mod:`.fabric`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from jaxtrain.cluster.links import BUS_FACTOR, Measurement, node_name
from jaxtrain.config import Config
from jaxtrain.errors import ConfigError
from jaxtrain.health import fabric
from jaxtrain.health.verdict import (
    BOUND,
    FABRIC,
    WRONG,
    Decision,
    Finding,
    axis_crosses_hosts,
    decide,
    judged_size_bytes,
    matmul_findings,
)
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.planner.cost import calibration


def _counts(op: str, n: int, size_bytes: int) -> tuple[int, int]:
    """(input, output) float32 elements per device for ``op`` on an axis of ``n`` with a ``size_bytes`` message
    (the larger buffer: all-gather's output, reduce-scatter's input)."""
    msg = max(n, size_bytes // 4 // n * n)
    return {"all-gather": (msg // n, msg), "reduce-scatter": (msg, msg // n)}.get(op, (msg, msg))


def _collective(op: str, axis: str, count_in: int):
    """Per-device body for shard_map: the first ``count_in`` elements of this device's buffer (its axis index + 1)."""
    ops = {"all-reduce": lambda x: jax.lax.psum(x, axis),
           "all-gather": lambda x: jax.lax.all_gather(x, axis, tiled=True),
           "reduce-scatter": lambda x: jax.lax.psum_scatter(x, axis, tiled=True),
           "all-to-all": lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)}
    return lambda x: ops[op](x[:count_in])


BLOCKS = ("all-gather", "all-to-all")  # results made of blocks j = j + 1; the others hold the sum everywhere


def _values_ok(n: int):
    """Per-device body for shard_map: whether ``y`` ([count] float32) is what every device must hold after a
    collective on inputs ``axis index + 1``: block j (of n) equal to j + 1 when ``blocks`` (a traced bool, so that
    one compiled program serves every collective whose result has this shape), else n(n+1)/2 everywhere."""

    def body(y, blocks):
        pattern = (jnp.arange(y.shape[0]) // max(1, y.shape[0] // n) + 1).astype(jnp.float32)
        return jnp.all(y == jnp.where(blocks, pattern, n * (n + 1) / 2))[None]

    return body


class AxisBuffer:
    """One float32 buffer per device, filled on the devices with the device's index along ``axis`` + 1, large
    enough for every message size: every collective and size on the axis reads a prefix of it."""

    def __init__(self, mesh, axis: str, max_bytes: int):
        self.mesh, self.axis, self.n = mesh, axis, mesh.shape[axis]
        self.spec = P(mesh.axis_names)  # every device its own block
        self.count = max(_counts(op, self.n, max_bytes)[0] for op in BUS_FACTOR)
        fill = jax.shard_map(lambda: jnp.full(self.count, jax.lax.axis_index(axis) + 1, jnp.float32), mesh=mesh,
                             in_specs=(), out_specs=self.spec, check_vma=False)
        self.x = jax.jit(fill)()
        self.programs: dict = {}  # (op, size) -> the collective, jitted
        # One value check for all: compiled once per result shape (all-reduce, all-gather and all-to-all share one).
        self.values_ok = jax.jit(jax.shard_map(_values_ok(self.n), mesh=mesh, in_specs=(self.spec, P()),
                                               out_specs=self.spec, check_vma=False))

    def measure(self, op: str, size_bytes: int, iters: int, sync: bool = True) -> Measurement:
        """``op`` over the axis with ``size_bytes`` per device: values checked on the devices, then ``iters`` timed
        runs. ``sync=False`` for sub-meshes that only some processes take part in (a global barrier would wait for
        the others)."""
        n, axis, spec = self.n, self.axis, self.spec
        count_in, count_out = _counts(op, n, size_bytes)
        if (op, size_bytes) not in self.programs:  # compiled once: the re-runs of a wrong result reuse it
            self.programs[op, size_bytes] = jax.jit(jax.shard_map(
                _collective(op, axis, count_in), mesh=self.mesh, in_specs=spec, out_specs=spec, check_vma=False))
        f = self.programs[op, size_bytes]
        flags = self.values_ok(f(self.x), jnp.bool_(op in BLOCKS))
        correct = all(bool(np.asarray(s.data)[0]) for s in flags.addressable_shards)
        if sync:
            multihost_utils.sync_global_devices(f"check {axis} {op} {size_bytes}")
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(self.x)
        out.block_until_ready()
        return Measurement(axis, op, count_out * 4 if op == "all-gather" else count_in * 4,
                           (time.perf_counter() - t0) / iters, correct, n)


def measure_collective(mesh, axis: str, op: str, size_bytes: int, iters: int, sync: bool = True) -> Measurement:
    """``op`` over mesh ``axis`` with ``size_bytes`` per device, on a buffer of its own."""
    return AxisBuffer(mesh, axis, size_bytes).measure(op, size_bytes, iters, sync)


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


def allgather_json(obj) -> list:
    """``obj`` (JSON-able) from every process, in process order."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    width = int(np.max(multihost_utils.process_allgather(np.array([data.size]))))
    buf = np.zeros(width, np.uint8)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), width)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def _hardware(cfg: Config, device_kind: str):
    """The hardware file to bound against: check.hardware (it must list this device kind: exit 2 otherwise), else
    the shipped file listing it exactly, else None (unknown kind: measured and reported, nobody excluded)."""
    from jaxtrain.config import hardware

    if cfg.check.hardware is None:
        return hardware.for_device_kind(device_kind)
    hw = hardware.load_hardware(cfg.check.hardware)
    if hw.kinds and not hw.covers(device_kind):
        raise ConfigError(f"check.hardware={cfg.check.hardware!r} describes {', '.join(map(repr, hw.kinds))} devices "
                          f"but this job has {device_kind!r}; pick the hardware file of these devices (or add the kind "
                          "to its device_kinds)")
    return hw


def _nodes(hosts: list[str]) -> list[list[int]]:
    """Process indices grouped by host name (``hosts`` per process), nodes in order of first process."""
    groups: dict[str, list[int]] = {}
    for p, name in enumerate(hosts):
        groups.setdefault(name, []).append(p)
    return list(groups.values())


def device_hosts(mesh, shape, hosts: list[str]) -> np.ndarray:
    """The mesh's device array with each device replaced by its host's name. One process emulates
    ``shape.num_nodes`` nodes with contiguous groups of its devices (``build_mesh``): those count as hosts here."""
    if jax.process_count() == 1:
        ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
        return np.vectorize(lambda i: f"{hosts[0]}#{i}")(shape.node_of(ids))
    return np.vectorize(lambda d: hosts[d.process_index])(mesh.devices)


def _sub_mesh(nodes: list[list[int]]):
    """A 2-D mesh ("node", "local") over the devices of the given nodes (lists of process indices), a row each."""
    from jax.sharding import Mesh

    procs = {p for node in nodes for p in node}
    devices = [d for d in jax.devices() if d.process_index in procs]
    return Mesh(np.array(devices).reshape(len(nodes), -1), ("node", "local"))


def attribute(op: str, size_bytes: int, iters: int, bound_gbps: float, crosses_hosts: bool,
              hosts: list[str]) -> tuple[bool | None, str]:
    """Whether this process's node is to blame for a slow or wrong ``op`` (None: nothing to split), and the
    evidence, in words.

    Within nodes: each node runs ``op`` over its own devices at once; a node that is wrong or below ``bound_gbps``
    is to blame. Across nodes: each pair of ring neighbours (0,1), (1,2), ..., (last,0) runs it over the "node"
    axis; a node is to blame when both of its pairs failed (with 2 nodes, the one pair names both). Every process
    calls this with the same arguments; it takes part only in the sub-meshes that hold its devices.
    """
    nodes = _nodes(hosts)
    me = next(i for i, procs in enumerate(nodes) if jax.process_index() in procs)

    def bad(group, axis):
        m = AxisBuffer(_sub_mesh(group), axis, size_bytes).measure(op, size_bytes, iters, sync=False)
        return (not m.correct) or (bound_gbps > 0 and m.busbw < bound_gbps), m

    if not crosses_hosts:
        if jax.device_count() // len(nodes) < 2:
            return None, "one device per node: nothing to split"
        flag, m = bad([nodes[me]], "local")
        return flag, (f"{op} inside node {node_name()}: {m.busbw:.3g} GB/s, values {'ok' if m.correct else 'WRONG'}"
                      f"{' (bad)' if flag else ''}")
    if len(nodes) < 2:
        return None, "a single node"
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


def reproduce(buffer: AxisBuffer, op: str, size_bytes: int, platform: str) -> str:
    """Re-run a collective that returned wrong values ``RERUNS`` times before anything is blamed.

    Wrong every time: a reproducible fault of the devices or link, attributed to a node like a slow link. Wrong
    only sometimes: an intermittent fault, on CPU that of the collective library (gloo's reduce-scatter corrupts the
    end of rank 0's chunk from ~4 MiB, jax-ml/jax#40830), reported as such and not pinned on the hardware.
    """
    wrong = sum(not buffer.measure(op, size_bytes, 1).correct for _ in range(RERUNS))
    wrong = int(np.max(multihost_utils.process_allgather(np.array([wrong]))))
    axis = buffer.axis
    if wrong == RERUNS:
        return f"reproducible: {op} over {axis} was wrong in {RERUNS} of {RERUNS} re-runs"
    library = ("gloo, the CPU collective library (jax-ml/jax#40830)" if platform == "cpu"
               else "the collective library or driver")
    return (f"intermittent: {op} over {axis} was wrong in {wrong} of {RERUNS} re-runs: a fault of {library}, "
            "not of a slow or broken link; the hardware is not blamed")


def _any_process(flag: bool) -> bool:
    """True if ``flag`` is true on any process: every process must take the same branch before a sub-check."""
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def default_sizes(gpu: bool, link_rate: float | None) -> list[int]:
    """Message sizes in bytes when check.sizes_mb is unset: CPU 0.25/4/16 MiB; GPU only the size the link's bound
    is judged at (256 MiB for a link no hardware file describes): each size costs 6 compiles per axis, and compiles,
    not transfers, are the check's time on GPUs (docs/health-check.md)."""
    if not gpu:
        return [2**18, 2**22, 2**24]
    return [judged_size_bytes(link_rate) if link_rate else 2**28]


@dataclass
class _Job:
    """What every part of the check reads: the config, the mesh, this process's first device, the hardware file
    that bounds the devices (None: measured and reported, nobody excluded), every process's host name, and the
    matmul dtype."""

    cfg: Config
    mesh: Any
    shape: Any  # the mesh's MeshShape
    device: Any
    hw: Any  # a config.hardware.Hardware, or None
    hosts: list[str]  # per process
    dtype: Any

    @property
    def main(self) -> bool:
        return jax.process_index() == 0

    @property
    def gpu(self) -> bool:
        return self.device.platform != "cpu"

    @property
    def me(self) -> str:
        return self.hosts[jax.process_index()]

    def say(self, *args, **kwargs) -> None:
        """Print on process 0 only (every process measures, one reports)."""
        if self.main:
            print(*args, **kwargs)


@dataclass(frozen=True)
class _AxisPlan:
    """One mesh axis to check: its size, whether it crosses hosts, the bus bandwidth it must reach (0: no bound)
    and the setting that says so, and the message sizes to measure."""

    axis: str
    n: int
    crosses: bool
    bound: float
    why: str
    sizes: list[int]


def run(cfg: Config) -> Decision:
    """Run the check; process 0 prints the tables, the verdict and ``check: exclude hosts: <host,...>`` when nodes
    are to be excluded. Returns the job's decision (the same on every process)."""
    # On GPUs, NCCL's INIT/NET lines into run.dir, set before the first collective: NCCL reads NCCL_DEBUG* once.
    nccl_log = None if jax.devices()[0].platform == "cpu" else fabric.start_logging(cfg.run.dir, node_name())
    job = _start(cfg)
    findings, calib_rate = _check_matmuls(job)
    calib_axes: dict[str, dict] = {}
    grid = device_hosts(job.mesh, job.shape, job.hosts)
    for ax_i, axis in enumerate(job.mesh.axis_names):
        if job.mesh.shape[axis] == 1:
            continue
        found, entry = _check_axis(job, _axis_plan(job, grid, ax_i, axis))
        findings += found
        if entry is not None:
            calib_axes[axis] = entry
    findings += _check_fabric(job, nccl_log)
    return _decide(job, findings, calib_rate, calib_axes)


def _check_fabric(job: _Job, nccl_log: str | None) -> list[Finding]:
    """The network NCCL chose on each node (:mod:`.fabric`), a line per node from process 0; an InfiniBand or EFA
    node on TCP sockets (check.fabric) is this process's finding, with the likely cause from its filesystem."""
    if nccl_log is None:
        job.say(f"\n{fabric.NOT_APPLICABLE}")
        return []
    transport, log = fabric.read_transport(fabric.log_files(nccl_log, os.getpid()))
    reason = fabric.fallback(job.cfg.check.fabric, transport, fabric.probe(), log)
    rows = allgather_json([job.me, *transport.__dict__.values(), log or nccl_log])
    job.say(f"\nfabric (check.fabric={job.cfg.check.fabric}; NCCL's 'Using network' and NET/* lines):")
    for line in fabric.node_lines(rows):
        job.say(line)
    return [Finding(job.me, f"NCCL transport (check.fabric={job.cfg.check.fabric})", FABRIC, reason)] if reason else []


def _start(cfg: Config) -> _Job:
    """The mesh, the devices, their hardware file and every process's host; process 0 says what it checks."""
    mesh, shape = build_mesh(cfg)
    device = jax.devices()[0]
    gpu = device.platform != "cpu"
    hw = _hardware(cfg, device.device_kind)
    hosts = allgather_json(node_name())  # per process
    job = _Job(cfg, mesh, shape, device, hw, hosts, jnp.bfloat16 if gpu else jnp.float32)
    from jaxtrain.config import hardware

    known = (f"hardware file: {hw.name}" if hw else f"hardware file: none lists device kind {device.device_kind!r} "
             f"(shipped: {', '.join(hardware.known_device_kinds())}): measured and reported, nobody excluded")
    job.say(f"mesh {shape.label}; {jax.process_count()} process(es) on {len(set(hosts))} host(s), "
            f"{mesh.devices.size} {device.device_kind} device(s); {known}\n")
    return job


def _check_matmuls(job: _Job) -> tuple[list[Finding], float]:
    """Every device's matmul, judged against the job's median and the hardware's peak. Returns the findings
    (process 0's; every process judged the same gathered rows) and the matmul rate per device for the calibration
    (GFLOP/s)."""
    c, hw, dtype = job.cfg.check, job.hw, job.dtype
    size = c.matmul_size or (8192 if job.gpu else 1024)
    floor = c.min_peak_fraction * hw.peak_flops / 1e9 if hw else 0.0
    mine = [(job.me, *row) for row in measure_matmuls(size, c.iters, dtype)]
    rows = [tuple(r) for proc in allgather_json(mine) for r in proc]
    tolerance = 1e-3 if dtype == jnp.float32 else 2e-2  # bfloat16 output rounding is 2^-8 of each element
    median, found = matmul_findings(rows, tolerance=tolerance, min_fraction_of_median=c.min_matmul_fraction,
                                    floor_gflops=floor, floor_words=f"check.min_peak_fraction={c.min_peak_fraction} "
                                    f"of {hw.name if hw else ''}'s peak")
    # Emulated CPU devices share the host's cores: each device's share when all compute at once is what a step sees.
    calib_rate = median / (len(jax.local_devices()) if not job.gpu else 1)
    job.say(f"matmul {size}x{size} {jnp.dtype(dtype).name}, median {median:.1f} GFLOP/s"
            f"{f'; peak {hw.peak_flops / 1e12:.0f} TFLOP/s, bound {floor / 1e3:.0f}' if hw else ''}")
    job.say("| device | GFLOP/s | max rel. error | host |\n| --- | --- | --- | --- |")
    for host, dev, rate, err in rows:
        job.say(f"| {dev} | {rate:.1f} | {err:.1e} | {host} |")
    return (found if job.main else []), calib_rate


def _axis_plan(job: _Job, grid: np.ndarray, ax_i: int, axis: str) -> _AxisPlan:
    """Axis ``axis`` (index ``ax_i`` of the mesh; ``grid``: :func:`device_hosts`): its link, bound and sizes."""
    c, hw = job.cfg.check, job.hw
    crosses = bool(axis_crosses_hosts(grid, ax_i))
    link_name = "inter" if crosses else "intra"
    link = (hw.inter_node_bandwidth if crosses else hw.intra_node_bandwidth) if hw else None
    bound, why = c.min_busbw_gbps, "check.min_busbw_gbps"
    if not bound and link:  # the link this axis runs over: the NIC across nodes, NVLink inside one
        bound = c.min_link_fraction * link / 1e9
        why = f"check.min_link_fraction={c.min_link_fraction} of {hw.name}'s {link_name}-node link"
    sizes = [int(mb * 2**20) for mb in c.sizes_mb] if c.sizes_mb else default_sizes(job.gpu, link)
    return _AxisPlan(axis, job.mesh.shape[axis], crosses, bound, why, sizes)


def _check_axis(job: _Job, plan: _AxisPlan) -> tuple[list[Finding], dict | None]:
    """Every collective over one axis at every size: its table, the findings against its bound (attributed to a
    node where one is to blame), and its calibration entry (all-reduce's bus rate and latency)."""
    job.say(f"\naxis {plan.axis}: {plan.n} devices{' (crosses hosts)' if plan.crosses else ' (inside a host)'}"
            f"{f'; bound {plan.bound:.2f} GB/s ({plan.why})' if plan.bound else ''}")
    job.say("| collective | size | time | algbw GB/s | busbw GB/s | values |\n| --- | --- | --- | --- | --- | --- |")
    buffer = AxisBuffer(job.mesh, plan.axis, max(plan.sizes))
    findings: list[Finding] = []
    entry = None
    for op in BUS_FACTOR:
        m, wrong, words, points = _measure_op(job, buffer, op, plan.sizes)
        if op == "all-reduce":  # the planner's rings: bus rate at the largest size, latency from two sizes
            latency, _ = calibration.latency_and_rate(points)
            entry = calibration.axis_entry(plan.n, plan.crosses, m.busbw, latency)
        findings += _judge_op(job, plan, op, m, wrong, words)
    del buffer  # its memory back before the next axis
    return findings, entry


def _measure_op(job: _Job, buffer: AxisBuffer, op: str,
                sizes: list[int]) -> tuple[Measurement, bool, str, list[tuple[int, float]]]:
    """``op`` at every size, a table row each; a wrong result re-run (:func:`reproduce`) by every process. Returns
    the largest size's measurement, whether the values were reproducibly wrong and in what words, and the
    (bytes, seconds) points."""
    m, wrong, words = None, False, ""
    points = []
    for nbytes in sizes:
        m = buffer.measure(op, nbytes, job.cfg.check.iters)
        points.append((m.size_bytes, m.seconds))
        job.say(f"| {op} | {m.size_bytes / 2**20:.2f} MiB | {m.seconds * 1e3:.3f} ms | {m.algbw:.3g} | "
                f"{m.busbw:.3g} | {'ok' if m.correct else 'WRONG'} |")
        if _any_process(not m.correct):  # every process joins the re-runs
            verdict = reproduce(buffer, op, nbytes, job.device.platform)
            job.say(f"check: {verdict}")
            if verdict.startswith("reproducible"):
                wrong, words = True, f"{op} of {m.size_bytes} bytes returned wrong values; {verdict}"
    assert m is not None  # sizes is never empty
    return m, wrong, words, points


def _judge_op(job: _Job, plan: _AxisPlan, op: str, m: Measurement, wrong: bool, words: str) -> list[Finding]:
    """This process's finding for ``op`` over the axis (at most one): wrong values or a bus bandwidth below the
    bound, blamed on this process's node by the sub-checks (:func:`attribute`), or standing as it is when they
    blame none."""
    slow = bool(plan.bound) and m.busbw < plan.bound
    if slow and not wrong:
        words = (f"{op} bus bandwidth {m.busbw:.3g} GB/s at {m.size_bytes / 2**20:.2f} MiB is below "
                 f"{plan.bound:.2f} GB/s ({plan.why})")
    if not _any_process(wrong or slow):  # all processes agree before the sub-checks, which they all join
        return []
    guilty, evidence = attribute(op, max(plan.sizes), job.cfg.check.iters, plan.bound, plan.crosses, job.hosts)
    print(f"check: {evidence}")
    blamed = _any_process(bool(guilty))
    # Sub-checks that blame a node decide; none blamed (or nothing to split): each direct miss stands.
    if not (guilty or (not blamed and (wrong or slow))):
        return []
    kind = WRONG if wrong else BOUND
    return [Finding(job.me, f"{op} over axis {plan.axis} ({plan.why if kind == BOUND else 'values'})", kind,
                    f"axis {plan.axis}: {words or evidence}")]


def _decide(job: _Job, findings: list[Finding], calib_rate: float, calib_axes: dict[str, dict]) -> Decision:
    """Every process's findings gathered and judged over the job's hosts; process 0 writes the calibration and says
    the verdict (``check: exclude hosts: ...`` when nodes are to be excluded)."""
    c, hosts, device = job.cfg.check, job.hosts, job.device
    everything = [Finding(*f) for proc in allgather_json([list(f.__dict__.values()) for f in findings])
                  for f in proc]
    unique = list({(f.host, f.check): f for f in everything}.values())  # several processes of one host
    job_hosts = list(dict.fromkeys(hosts))
    decision = decide(job_hosts, unique, known_hardware=job.hw is not None, misfit_fraction=c.bound_misfit_fraction,
                      max_exclude_fraction=c.max_exclude_fraction)
    if job.main:
        path = calibration.write(os.path.join(job.cfg.run.dir, calibration.FILE), device_kind=device.device_kind,
                                 platform=device.platform, devices=job.mesh.devices.size, hosts=len(set(hosts)),
                                 matmul_gflops={jnp.dtype(job.dtype).name: calib_rate}, axes=calib_axes,
                                 origin=calibration.origin(device.platform, device.device_kind,
                                                           processes=jax.process_count(),
                                                           local_devices=len(jax.local_devices()), host=hosts[0]))
        job.say(f"check: calibration (matmul rate, each axis' bus bandwidth and latency) written to {path}; "
                "`jaxtrain plan --calibration` and mesh.auto read it")
    for line in decision.misfits + decision.notes:
        job.say(f"check: {line}")
    for host in decision.exclude:
        blamed = "; ".join(f.check for f in decision.failures if f.host == host)
        job.say(f"check: node {host} is to blame for: {blamed}")
    if decision.exclude:
        job.say(f"check: exclude hosts: {','.join(decision.exclude)}", flush=True)
    return decision
