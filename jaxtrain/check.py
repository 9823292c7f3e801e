"""Health check before a long job: every device's matmul, and collective bandwidth over every mesh axis.

Bandwidths follow nccl-tests' definitions. For a message of S bytes per device (the larger of a collective's input
and output buffers) taking t seconds on an axis of n devices: algbw = S / t, and the bus bandwidth, which is
comparable across collectives and axis sizes, is busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for
all-gather, reduce-scatter and all-to-all. Every collective's result is also checked for the right values.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.config import Config
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


def measure_collective(mesh, axis: str, op: str, size_bytes: int, iters: int) -> Measurement:
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
    multihost_utils.sync_global_devices(f"check {axis} {op} {size_bytes}")
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(x)
    out.block_until_ready()
    seconds = (time.perf_counter() - t0) / iters
    message = count * 4 * (n if op == "all-gather" else 1)
    return Measurement(axis, op, message, seconds, correct, n)


def measure_matmuls(size: int, iters: int, rounds: int = 3) -> list[tuple[str, float, float]]:
    """(device, GFLOP/s, max relative error against float64) for each device this process holds.

    The rate is each device's best of ``rounds`` interleaved rounds, so that a passing load on the host (emulated
    CPU devices share its cores) does not single out whichever device it happened to hit.
    """
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((size, size), np.float32), rng.standard_normal((size, size), np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    f = jax.jit(jnp.matmul)
    inputs = {d: (jax.device_put(a, d), jax.device_put(b, d)) for d in jax.local_devices()}
    errors = {d: float(np.max(np.abs(np.asarray(f(x, y), np.float64) - ref)) / np.max(np.abs(ref)))
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


def run(cfg: Config) -> list[str]:
    """Run the check, print tables (process 0), return the failures (empty: healthy)."""
    mesh, shape = build_mesh(cfg)
    c, main = cfg.check, jax.process_index() == 0
    failures = []
    say = print if main else (lambda *a, **k: None)
    say(f"mesh {shape.label}; {jax.process_count()} process(es), {mesh.devices.size} "
        f"{jax.devices()[0].device_kind} device(s)\n")

    matmuls = measure_matmuls(c.matmul_size, c.iters)
    median = statistics.median(r[1] for r in matmuls)
    say(f"matmul {c.matmul_size}x{c.matmul_size} float32 (process {jax.process_index()}'s devices)")
    say("| device | GFLOP/s | max rel. error |\n| --- | --- | --- |")
    for device, rate, err in matmuls:
        say(f"| {device} | {rate:.1f} | {err:.1e} |")
        if err > 1e-3:
            failures.append(f"device {device}: matmul error {err:.1e} against the float64 reference")
        if rate < c.min_matmul_fraction * median:
            failures.append(f"device {device}: matmul {rate:.1f} GFLOP/s is below check.min_matmul_fraction="
                            f"{c.min_matmul_fraction} of the median {median:.1f}")

    sizes = [int(mb * 2**20) for mb in c.sizes_mb]
    for ax_i, axis in enumerate(mesh.axis_names):
        n = mesh.shape[axis]
        if n == 1:
            continue
        crosses = " (crosses hosts)" if shape.dcn[ax_i] > 1 else ""
        say(f"\naxis {axis}: {n} devices{crosses}")
        say("| collective | size | time | algbw GB/s | busbw GB/s | values |\n| --- | --- | --- | --- | --- | --- |")
        for op in BUS_FACTOR:
            m = None
            for size in sizes:
                m = measure_collective(mesh, axis, op, size, c.iters)
                say(f"| {op} | {m.size_bytes / 2**20:.2f} MiB | {m.seconds * 1e3:.3f} ms | {m.algbw:.2f} | "
                    f"{m.busbw:.2f} | {'ok' if m.correct else 'WRONG'} |")
                if not m.correct:
                    failures.append(f"axis {axis}: {op} of {m.size_bytes} bytes returned wrong values")
            if c.min_busbw_gbps and m.busbw < c.min_busbw_gbps:
                failures.append(f"axis {axis}: {op} bus bandwidth {m.busbw:.2f} GB/s at {m.size_bytes / 2**20:.2f} "
                                f"MiB is below check.min_busbw_gbps={c.min_busbw_gbps}")
    return failures
