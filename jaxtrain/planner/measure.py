"""The hardware at hand: the CPU measured (emulated devices have no datasheet), an accelerator recognised by its
device kind among the shipped hardware descriptions (``jaxtrain.hardware``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxtrain import hardware
from jaxtrain.errors import ConfigError
from jaxtrain.hardware import Hardware

# ASSUMPTION for the CPU at hand, like the GPU files' compute_efficiency: the fraction of the best measured matmul
# rate that XLA's CPU code sustains over a whole transformer step (small matmuls, softmax, elementwise work). On this
# project's 2-core machine the tiny model runs ~39 GFLOP/s on one device against 180-310 GFLOP/s for plain matmuls.
# `jaxtrain sweep` prints the measured / predicted ratio that checks it.
CPU_COMPUTE_EFFICIENCY = 0.2


def hardware_at_hand(devices: list, mem_fraction: float | None) -> Hardware:
    """CPU: measured. Accelerators: the shipped description whose device_kind matches, with the real memory."""
    dev = devices[0]
    if dev.platform == "cpu":
        return measure_cpu(devices)
    hw = hardware.for_device_kind(dev.device_kind)
    if hw is None:
        raise ConfigError(f"no hardware description matches device kind {dev.device_kind!r}; pass --hardware "
                          f"({', '.join(hardware.known_hardware())})")
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:  # the allocator's pool, already net of the memory fraction
        return dataclasses.replace(hw, hbm_bytes=float(stats["bytes_limit"]), mem_fraction=mem_fraction or 1.0)
    return dataclasses.replace(hw, mem_fraction=mem_fraction or hardware.gpu_mem_fraction())


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
    # Across processes every one must run the collective equally often: a count, not each process's own clock (a
    # process that stopped earlier would leave the others blocked in a psum it never joins).
    spans = len({d.process_index for d in devices}) > 1
    return _best_time(lambda: psum(x).block_until_ready(), seconds, times=PSUM_TIMES if spans else None)


PSUM_TIMES = 20  # all-reduces timed when the devices span processes


def _best_time(fn: Callable[[], Any], seconds: float, times: int | None = None, at_least: int = 1) -> float:
    """The fastest of ``fn``'s runs after a warm-up: for ``seconds`` (and at least ``at_least`` runs), or exactly
    ``times`` runs."""
    fn()  # compile and warm up
    best, t_end, done = float("inf"), time.perf_counter() + seconds, 0
    while (done < times) if times is not None else (time.perf_counter() < t_end or done < at_least):
        t0 = time.perf_counter()
        fn()
        best, done = min(best, time.perf_counter() - t0), done + 1
    return best


SIZED_ROWS = (16, 64, 256, 512, 1024)  # rows per device at which measure_sized times the model's matmul


def measure_sized(devices: list, k: int, n: int, dtype: str = "float32", *, rows=SIZED_ROWS,
                  seconds: float = 0.2) -> tuple[tuple[tuple[float, float], ...], float]:
    """(matmul_rows, layer_overhead_s) measured on ``devices``, all at once as a step runs them
    (``Hardware.matmul_rows``, ``Hardware.layer_overhead_s``).

    - matmul_rows: a (rows, k) x (k, n) matmul on every device at once (``k, n``: the model's d_model and d_ff),
      at each of ``rows`` per device; each rate over the rate at ``calibration.REFERENCE_ROWS`` (the rows of the
      matmul that measured ``peak_flops``, whose k and n effects ``compute_efficiency`` already carries);
    - layer_overhead_s: the gradient of a scan over layers of nine chained 8 x 8 matmuls (a layer's q, k, v, o,
      two attention and three MLP matmuls) on every device, timed at 33 and 1 layers; the slope per layer is
      the fixed cost of a layer's iteration, its FLOPs negligible."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxtrain.planner.calibration import REFERENCE_ROWS

    mesh = Mesh(np.array(devices), ("x",))
    split, whole = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
    dt = jnp.dtype(dtype)
    matmul = jax.jit(lambda x, w: x @ w)
    w = jax.device_put(jnp.full((k, n), 0.01, dt), whole)
    # At least three calls each: a large matmul gets as many samples as a small one's first three (one or two, best
    # of, had made the table swing from run to run on the loaded machine).
    rates = []
    for m in rows:
        x = jax.device_put(jnp.full((len(devices) * m, k), 0.01, dt), split)
        best = _best_time(functools.partial(lambda a: matmul(a, w).block_until_ready(), x), seconds, at_least=3)
        rates.append((float(m), 2 * m * k * n / best))
    top = dict(rates).get(float(REFERENCE_ROWS)) or max(r for _, r in rates)

    def loss(ws, x):
        def layer(h, wl):
            for j in range(wl.shape[0]):
                h = jnp.tanh(h @ wl[j])
            return h, None
        return jax.lax.scan(layer, x, ws)[0].sum()

    grad = jax.jit(jax.grad(loss))
    x = jax.device_put(jnp.full((len(devices) * 8, 8), 0.1, dt), split)
    t: dict[int, float] = {}
    for layers in (1, 33):
        ws = jax.device_put(jnp.full((layers, 9, 8, 8), 0.1, dt), whole)
        t[layers] = _best_time(functools.partial(lambda a: grad(a, x).block_until_ready(), ws), seconds, at_least=3)
    return tuple((m, r / top) for m, r in rates), max(0.0, (t[33] - t[1]) / 32)
