"""The hardware at hand: the CPU measured (emulated devices have no datasheet), an accelerator recognised by its
device kind among the shipped hardware descriptions (``jaxtrain.config.hardware``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxtrain.config import hardware
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import Axis, MeshShape

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


def host_ram() -> float:
    """The host's physical memory in bytes: what emulated CPU devices share (``Hardware.hbm_bytes`` x devices)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_at_hand(devices: list) -> float:
    """``hardware_at_hand(devices, None).usable_bytes`` without timing anything (CPU: the RAM's share a device)."""
    if devices[0].platform == "cpu":
        return host_ram() / len(devices)
    return hardware_at_hand(devices, None).usable_bytes


def measure_cpu(devices: list, *, seconds: float = 0.5) -> Hardware:
    """The CPU at hand as "hardware": a measured f32 matmul rate, copy bandwidth and all-reduce link (rate, latency).

    Emulated CPU devices share the host's cores and memory, so each gets 1/n of the measured matmul and copy rates
    (the copy measured on all of them at once) and of the RAM; the links are measured with an all-reduce.
    """
    import jax
    import jax.numpy as jnp

    n = len(devices)
    dev = devices[0]
    a = jax.device_put(jnp.ones((512, 512), jnp.float32), dev)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * 512 ** 3 / _best_time(lambda: matmul(a).block_until_ready(), seconds)
    # 32 MiB a device, beyond the caches, on every device at once: the devices share the host's memory system, and
    # a step's elementwise work (the optimizer's update) runs on all of them together.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    big = jax.device_put(jnp.ones((n, 8 * 1024 * 1024), jnp.float32),
                         NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x")))
    scale = jax.jit(lambda x: x * 1.0001)
    bandwidth = 2 * big.nbytes / _best_time(lambda: scale(big).block_until_ready(), seconds)  # read + write
    # The links measured with the collective itself, as `check` measures GPUs' (an all-reduce's bus rate and fixed
    # cost): on this project's CPUs an all-reduce moved its bytes 4-6x faster than the elementwise copy above. Within
    # a process over its own devices; across processes (gloo) over all of them.
    local = [d for d in devices if d.process_index == jax.process_index()]
    latency, intra = _all_reduce_link(local, seconds) if len(local) > 1 else (0.0, bandwidth / n)
    latency, inter = _all_reduce_link(devices, seconds) if len(local) < n else (latency, intra)
    return cpu_hardware(devices, peak_flops=flops / n, hbm_bandwidth=bandwidth / n, intra_node_bandwidth=intra,
                        inter_node_bandwidth=inter, collective_latency=latency)


CPU_TIMED = ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "collective_latency")


def cpu_hardware(devices: list, *, peak_flops: float, hbm_bandwidth: float, intra_node_bandwidth: float,
                 inter_node_bandwidth: float, collective_latency: float) -> Hardware:
    """The description of the CPU ``devices`` with the figures :func:`measure_cpu` timed (``CPU_TIMED``, per
    device), each device's share of the host's RAM and ``CPU_COMPUTE_EFFICIENCY``."""
    n, kind = len(devices), devices[0].device_kind
    return Hardware(name="cpu (measured)", device=f"emulated {kind} devices sharing one host", peak_flops=peak_flops,
                    hbm_bytes=host_ram() / n, hbm_bandwidth=hbm_bandwidth, devices_per_node=n,
                    intra_node_bandwidth=intra_node_bandwidth, inter_node_bandwidth=inter_node_bandwidth,
                    compute_efficiency=CPU_COMPUTE_EFFICIENCY, device_kind=kind, collective_latency=collective_latency)


LINK_SIZES = (16, 4 * 1024 * 1024)  # bytes a device at which _all_reduce_link times the all-reduce


def _all_reduce_link(devices: list, seconds: float) -> tuple[float, float]:
    """(fixed seconds per collective, bytes/s a device sends) of an all-reduce over ``devices``: timed at the two
    ``LINK_SIZES`` a device, the line through them (``calibration.latency_and_rate``) over the ring's 2 (n - 1) / n
    bytes per byte reduced."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxtrain.planner.cost.calibration import latency_and_rate

    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=PartitionSpec("x"),
                                 out_specs=PartitionSpec("x")))
    # Across processes every one must run the collective equally often: a count, not each process's own clock (a
    # process that stopped earlier would leave the others blocked in a psum it never joins).
    spans = len({d.process_index for d in devices}) > 1
    points = []
    for size in LINK_SIZES:
        x = jax.device_put(jnp.ones((n, size // 4), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
        t = _best_time(functools.partial(lambda v: psum(v).block_until_ready(), x), seconds,
                       times=PSUM_TIMES if spans else None)
        points.append((2 * size * (n - 1) / n, t))
    latency, rate = latency_and_rate(points)
    return latency or 0.0, rate


PSUM_TIMES = 20  # all-reduces timed when the devices span processes


def _best_time(fn: Callable[[], Any], seconds: float, times: int | None = None, at_least: int = 1,
               warm_up: bool = True) -> float:
    """The fastest of ``fn``'s runs after a warm-up (``warm_up``): for ``seconds`` (and at least ``at_least`` runs),
    or exactly ``times`` runs."""
    if warm_up:
        fn()  # compile and warm up
    best, t_end, done = float("inf"), time.perf_counter() + seconds, 0
    while (done < times) if times is not None else (time.perf_counter() < t_end or done < at_least):
        t0 = time.perf_counter()
        fn()
        best, done = min(best, time.perf_counter() - t0), done + 1
    return best


def back_and_forth(items: Sequence, rounds: int) -> Iterator[tuple[int, Any]]:
    """(round, item) over ``rounds`` passes through ``items``, every other pass reversed: timings taken this way
    share a machine whose speed moves over seconds (this project's CPUs: a fixed matmul's best of five ranged over
    41-74 ms within one idle minute) instead of the slow seconds falling on whichever ran then."""
    for r in range(rounds):
        for item in (items if r % 2 == 0 else reversed(items)):
            yield r, item


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

    from jaxtrain.planner.cost.calibration import REFERENCE_ROWS

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


def measure_model(cfg, devices: list, hw: Hardware, points,
                  progress: Callable[[str], None] = lambda msg: None) -> tuple[tuple[str, int, float], ...]:
    """The model's own step measured, for ``Hardware.model_efficiency``: (remat policy, tensor, efficiency) for each
    (remat policy, tensor) of ``points``, against ``hw``'s peak, matmul rate by rows and layer overhead
    (:func:`model_seconds`, then :func:`model_efficiency`)."""
    return model_efficiency(cfg, len(devices), hw, points, model_seconds(cfg, devices, points, progress))


def model_efficiency(cfg, n: int, hw: Hardware, points, seconds) -> tuple[tuple[str, int, float], ...]:
    """(remat policy, tensor, efficiency) of each of ``points`` whose step :func:`model_seconds` timed at
    ``seconds`` on ``n`` devices: the efficiency at which ``cost.compute_seconds`` gives that time back for the
    layout the point stands for, against ``hw``'s peak, matmul rate by rows and layer overhead."""
    from jaxtrain.planner.cost import model as cost

    out = []
    for (remat, t), best in zip(points, seconds, strict=True):
        _, _, ref, shape = _point(cfg, n, remat, t)
        out.append((remat, t, cost.measured_efficiency(ref, shape, hw, best)))
    return tuple(out)


def model_seconds(cfg, devices: list, points, progress: Callable[[str], None] = lambda msg: None) -> tuple[float, ...]:
    """The fastest run of the model's step at each (remat policy, tensor) of ``points`` on ``devices``.

    The model of ``cfg`` (resolved: ``layout.resolve_auto``) runs its forward, loss and backward on every device of
    ``devices`` at once, each on its own ``ceil(global_batch x tensor / devices)`` sequences with its own copy of a
    tensor-th of the model (heads, kv heads, MLP width and vocabulary over tensor, as the default rules split them):
    the compute of a step whose batch is split over devices / tensor, without collectives or the optimizer (priced
    apart). The best of a few runs, in rounds back and forth over the points, becomes an efficiency
    (``cost.measured_efficiency`` on that layout), so that attention, the elementwise work, the embedding and a
    tensor split's narrower matmuls at this model's shapes are measured where a constant efficiency would guess them
    (on this project's CPUs the efficiency of the tiny and an 18M config differed by 2x). ``progress``: a line
    after each round."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxtrain.models.moe import make_model

    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    runs = []  # per point: a run of its step that frees its inputs
    for remat, t in points:
        rows, local, _, _ = _point(cfg, n, remat, t)
        # Every logical axis replicated: each device holds the whole local model.
        with jax.set_mesh(Mesh(np.array(devices[:1]), ("x",))), nnx.logical_axis_rules(
                [(k, None) for k in cfg.mesh.rules]):
            graphdef, abstract = nnx.split(nnx.eval_shape(lambda c=local: make_model(c, rngs=nnx.Rngs(0))))

        def one(params, batch, graphdef=graphdef):
            def loss(p):
                logits = nnx.merge(graphdef, p)(batch[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).sum()
            grads = jax.grad(loss)(params)  # kept alive by the sum below (XLA would drop an unused gradient)
            return sum(g.sum() for g in jax.tree.leaves(grads)).reshape(1)

        step = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("x")),
                                     out_specs=PartitionSpec("x"), check_vma=False))

        def run(seconds, warm_up, step=step, abstract=abstract, rows=rows):
            # The inputs live for this run only: a point's copy of the model per device is not held through the
            # others' (one point at a time in memory, as the trial holds one training state).
            params = jax.device_put(jax.tree.map(lambda a: np.full(a.shape, 0.01, a.dtype), abstract),
                                    NamedSharding(mesh, PartitionSpec()))
            tokens = jax.device_put(np.zeros((n * rows, cfg.data.seq_len + 1), np.int32),
                                    NamedSharding(mesh, PartitionSpec("x")))
            return _best_time(lambda: step(params, tokens).block_until_ready(), seconds, at_least=2, warm_up=warm_up)

        runs.append(run)
    best = [float("inf")] * len(runs)  # each point's fastest run over the rounds
    t0 = time.perf_counter()
    for k, (r, i) in enumerate(back_and_forth(range(len(runs)), MODEL_ROUNDS), 1):
        best[i] = min(best[i], runs[i](MODEL_SECONDS / MODEL_ROUNDS, warm_up=r == 0))
        if k % len(runs) == 0:
            progress(f"mesh.auto: the model's step, round {r + 1}/{MODEL_ROUNDS} ({time.perf_counter() - t0:.1f} s)")
    return tuple(best)


def _point(cfg, n: int, remat: str, t: int):
    """(sequences per device, the model one device runs, the config of the layout it stands for, that layout's
    mesh) of :func:`measure_model`'s point (``remat``, tensor ``t``) on ``n`` devices: each device runs a tensor-th
    of the model (heads, kv heads, MLP width and vocabulary) on its share of the batch over devices / tensor, one
    microbatch."""
    m = cfg.model
    rows = -(-cfg.train.global_batch * t // n)
    local = dataclasses.replace(m, remat=remat, n_heads=m.n_heads // t, n_kv_heads=m.n_kv_heads // t,
                                d_ff=m.d_ff // t, head_dim=m.resolved_head_dim,
                                moe=dataclasses.replace(m.moe, d_ff=m.expert_d_ff // t),
                                vocab_size=m.vocab_size // t if m.vocab_size % t == 0 else m.vocab_size)
    ref = dataclasses.replace(cfg, model=dataclasses.replace(m, remat=remat), train=dataclasses.replace(
        cfg.train, global_batch=rows * n // t, microbatches=1))
    return rows, local, ref, MeshShape.of({Axis.FSDP: n // t, Axis.TENSOR: t})


def model_bytes(cfg, n: int, points) -> float:
    """The most bytes one of ``n`` devices holds while :func:`measure_model` times one of ``points`` (one at a time):
    its copy of the point's model and the gradient, the activations the backward keeps (``memory.activation_bytes``'
    estimate for the layout the point stands for) and its share of the host's copy of the weights."""
    import jax.numpy as jnp

    from jaxtrain.models.flops import count_params
    from jaxtrain.planner.cost import memory

    need = 0.0
    for remat, t in points:
        _, local, ref, shape = _point(cfg, n, remat, t)
        weights = count_params(local)["total"] * jnp.dtype(local.param_dtype).itemsize
        need = max(need, weights * (2 + 1 / n) + memory.activation_bytes(ref, shape)[1])
    return need


def sized_bytes(k: int, n: int, dtype: str, rows=SIZED_ROWS) -> float:
    """The bytes one device holds while :func:`measure_sized` times its largest matmul: the (k, n) weight, the
    (rows, k) input and the (rows, n) output."""
    import jax.numpy as jnp

    return float((k * n + max(rows) * (k + n)) * jnp.dtype(dtype).itemsize)


MODEL_SECONDS = 0.3  # measure_model's timing per point, beyond its at least 2 runs a round (and a first warm-up)
MODEL_ROUNDS = 3  # passes over the points, alternating direction


def model_points(cfg, n_devices: int, remats) -> list[tuple[str, int]]:
    """The (remat policy, tensor) points :func:`measure_model` times for a search over ``n_devices``: every policy
    without tensor parallelism, and remat none at each tensor size that splits the heads, kv heads and MLP
    (``cost.efficiency`` carries the policies' ratios over to those)."""
    m = cfg.model
    tensors = [t for t in range(2, n_devices + 1) if n_devices % t == 0 and m.n_heads % t == 0
               and m.n_kv_heads % t == 0 and m.d_ff % t == 0]
    return [(r, 1) for r in remats] + [("none", t) for t in tensors]
