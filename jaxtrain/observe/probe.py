"""The collective-bandwidth probe: a small all-reduce per mesh axis, compiled once and timed every
``observe.collective_probe_every`` steps, judged against the link the axis runs over (``observe.hardware``, else
the shipped hardware file of these devices). It waits for the step in flight, because a timing must.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import log
from jaxtrain.cluster.links import Measurement
from jaxtrain.config import hardware
from jaxtrain.observe.metrics import PrometheusMetrics

PROBE_ITERS = 3


class CollectiveProbe:
    """A small all-reduce per mesh axis (size > 1), compiled once, timed every ``every`` steps.

    Bus bandwidth as in ``jaxtrain.health.check`` (nccl-tests' definition, :class:`jaxtrain.cluster.links.Measurement`):
    the same figure the pre-flight check reports, so the two compare. The expected rate is the link the axis runs
    over in the hardware file (``observe.hardware``, else the shipped file of these devices): the NIC where the axis
    crosses hosts, NVLink inside a node.
    """

    def __init__(self, mesh, shape, cfg, hosts: list[str], metrics: PrometheusMetrics | None):
        o = cfg.observe
        self.every = o.collective_probe_every
        self.fraction = o.min_bandwidth_fraction
        self.metrics = metrics
        self.hosts = hosts
        gpu = mesh.devices.flat[0].platform != "cpu"
        # GPUs: large enough for the bus bandwidth to near its plateau (check measures up to 1 GiB), small
        # enough that its buffers (input and output, kept) cost 0.5 GiB per device.
        size = int((o.probe_mb or (256 if gpu else 1)) * 2**20)
        device_kind = mesh.devices.flat[0].device_kind
        hw = hardware.load_hardware(o.hardware) if o.hardware else hardware.for_device_kind(device_kind)
        self.axes = {}
        spec = P(mesh.axis_names)  # every device its own block
        sharding = NamedSharding(mesh, spec)
        for i, axis in enumerate(mesh.axis_names):
            n = mesh.shape[axis]
            if n == 1:
                continue
            count = max(n, size // 4 // n * n)
            x = jax.make_array_from_callback((mesh.devices.size * count,), sharding,
                                             functools.partial(_ones, count))
            f = jax.jit(jax.shard_map(lambda v, a=axis: jax.lax.psum(v, a), mesh=mesh, in_specs=spec,
                                      out_specs=spec, check_vma=False)).lower(x).compile()
            crosses = shape.dcn[i] > 1
            expected = None if hw is None else (hw.inter_node_bandwidth if crosses else hw.intra_node_bandwidth)
            self.axes[axis] = (f, x, n, count * 4, crosses, expected, self._hosts_along(mesh, i))
            if metrics:
                metrics.axis(axis)
            if metrics and expected:
                metrics.expected_busbw.labels(**metrics.base, axis=axis).set(expected)
        self.source = f"hardware file {hw.name}" if hw else None
        self.warnings: list[str] = []
        if self.axes and hw is None:
            log.info(f"collective probe: no hardware file matches {device_kind!r}; bandwidth is exported but not "
                     "judged (set observe.hardware)")

    def _hosts_along(self, mesh, axis_index: int) -> list[str]:
        """Hosts of the devices on this process's line along the axis (through its first device)."""
        mine = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        pos = list(np.argwhere(mesh.devices == mine)[0])
        line = np.moveaxis(mesh.devices, axis_index, 0)[(slice(None), *pos[:axis_index], *pos[axis_index + 1:])]
        return sorted({self.hosts[d.process_index] for d in line})

    def maybe_run(self, step: int, in_flight) -> dict[str, float]:
        """Every ``every`` steps: wait for ``in_flight`` (the step just dispatched), then time each axis. Returns
        axis -> bus bandwidth in bytes/s (empty when not due)."""
        if not self.every or step % self.every or not self.axes:
            return {}
        jax.block_until_ready(in_flight)
        out = {}
        for axis, (f, x, n, nbytes, crosses, expected, hosts) in self.axes.items():
            f(x).block_until_ready()  # every process arrives: the timing starts together
            t0 = time.perf_counter()
            for _ in range(PROBE_ITERS):
                y = f(x)
            y.block_until_ready()
            m = Measurement(axis, "all-reduce", nbytes, (time.perf_counter() - t0) / PROBE_ITERS, True, n)
            out[axis] = busbw = m.busbw * 1e9
            if self.metrics:
                self.metrics.busbw.labels(**self.metrics.base, axis=axis).set(busbw)
            if expected and busbw < self.fraction * expected:
                self._warn(axis, n, busbw, expected, step, crosses, hosts)
        return out

    def _warn(self, axis: str, n: int, busbw: float, expected: float, step: int, crosses: bool,
              hosts: list[str]) -> None:
        """Say that ``axis`` ran below the expected fraction of its link, and where to look."""
        where = f"it crosses hosts {', '.join(hosts)}" if crosses else f"inside host {hosts[0]}"
        msg = (f"collective bandwidth: axis {axis} ({n} devices; {where}) all-reduce bus bandwidth "
               f"{busbw / 1e9:.2f} GB/s at step {step} is below observe.min_bandwidth_fraction={self.fraction} "
               f"of the expected {expected / 1e9:.1f} GB/s ({self.source}); run `jaxtrain check` with this "
               "config to find the slow link and exclude its host")
        self.warnings.append(msg)
        log.info(msg)
        if self.metrics:
            self.metrics.bandwidth_warnings.labels(**self.metrics.base, axis=axis).inc()


def _ones(count: int, index) -> np.ndarray:
    """A probe's per-device buffer (``make_array_from_callback`` passes each shard's index)."""
    return np.ones(count, np.float32)
