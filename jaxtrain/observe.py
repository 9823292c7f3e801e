"""Watching a running job: a Prometheus ``/metrics`` endpoint, straggler and bandwidth warnings, profiler windows,
the memory profile on an out-of-memory error, and goodput (``jaxtrain.goodput``).

The train loop calls a few hooks of :class:`Observer`; none of them waits for the devices on an ordinary step.
Host timings are taken around the loop's own work (reading the batch, sending it, dispatching the step); the
straggler exchange goes through JAX's coordination service (a key-value store), not through the devices, every
``observe.straggler_every`` steps; only the collective probe (every ``observe.collective_probe_every`` steps) and
the end of a profile window wait for the step in flight, because they must.

Metric names follow Prometheus' conventions (prefix ``jaxtrain_``, base units, ``_seconds``, ``_bytes``,
``_total``); every metric carries the labels ``run`` (the run directory's name), ``process`` and ``host``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import hardware, log, rundir
from jaxtrain.goodput import Goodput
from jaxtrain.health import Measurement, node_name
from jaxtrain.layout import compiled_need
from jaxtrain.metrics import Throughput
from jaxtrain.profiler import Profiler

# Step times from 1 ms to 100 s.
TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
# A straggler must also matter: its host time must exceed the median by this fraction of the median step time
# (below that, host work hides behind the devices' and costs the job nothing).
STRAGGLER_MIN_STEP_SHARE = 0.05
KV_PREFIX = "jaxtrain/observe"
PROBE_ITERS = 3


def _kv_client():
    """JAX's coordination-service client (set by jax.distributed.initialize), or None."""
    from jax._src import distributed

    return getattr(distributed.global_state, "client", None)


def exchange_hosts(timeout_s: int = 120) -> list[str]:
    """Every process's node name (index = process index), through the coordination service."""
    if jax.process_count() == 1:
        return [node_name()]
    client = _kv_client()
    if client is None:  # JAX moved its client: fall back to a (one-off) device all-gather
        from jax.experimental import multihost_utils

        name = np.frombuffer(node_name().encode()[:64].ljust(64, b"\0"), np.uint8)
        names = np.asarray(multihost_utils.process_allgather(name)).reshape(jax.process_count(), 64)
        return [bytes(n).rstrip(b"\0").decode() for n in names]
    client.key_value_set(f"{KV_PREFIX}/host/{jax.process_index()}", node_name())
    return [client.blocking_key_value_get(f"{KV_PREFIX}/host/{p}", timeout_s * 1000)
            for p in range(jax.process_count())]


class PrometheusMetrics:
    """The metrics, in their own registry (not the library's global one: one process may train several times).

    Every metric has the labels run, process, host; a few add one (device, axis, category, peer).
    """

    def __init__(self, run: str, process: int, host: str):
        import prometheus_client as prom  # only when the endpoint is on: an image without it still trains

        self.registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes...
        self.base = {"run": run, "process": str(process), "host": host}
        names = tuple(self.base)

        def gauge(name, doc, extra=()):
            return prom.Gauge(name, doc, names + extra, registry=self.registry)

        def hist(name, doc):
            return prom.Histogram(name, doc, names, buckets=TIME_BUCKETS, registry=self.registry).labels(**self.base)

        # Gauges appear on the first value they get (a loss of 0 before the first step would be a false reading).
        self._gauges = {name: gauge(f"jaxtrain_{name}", doc) for name, doc in (
            ("up", "1 while the training process runs"),
            ("start_time_seconds", "Unix time the training process started"),
            ("step", "Last completed training step"), ("loss", "Training loss of the last step"),
            ("eval_loss", "Last evaluation loss"), ("grad_norm", "Global gradient norm (before clipping)"),
            ("learning_rate", "Learning rate of the last step"),
            ("tokens_per_second", "Training tokens per second (all devices), last step"),
            ("mfu_ratio", "Model FLOPs utilisation of the last step (0-1; absent without a peak rate)"),
            ("step_host_seconds", "Host work of the last step: data wait, host-to-device, dispatch"),
            ("step_device_seconds", "Time the host waited for the last step's results after its own work"))}
        self._bound: dict[str, Any] = {}
        self.step_seconds = hist("jaxtrain_step_seconds", "Wall time per training step")
        self.data_wait_seconds = hist("jaxtrain_data_wait_seconds", "Time each step waited for its batch")
        self.checkpoint_blocking_seconds = hist("jaxtrain_checkpoint_blocking_seconds",
                                                "Time each checkpoint save held the training loop")
        self.checkpoint_save_seconds = hist("jaxtrain_checkpoint_save_seconds",
                                            "Time from a save's start until it is on disk (async saves included)")
        self.nonfinite_steps = prom.Counter("jaxtrain_nonfinite_steps", "Steps whose loss or gradient norm was not "
                                            "finite", names, registry=self.registry).labels(**self.base)
        self.memory_in_use = gauge("jaxtrain_device_memory_in_use_bytes", "Device memory in use", ("device",))
        self.memory_peak = gauge("jaxtrain_device_memory_peak_bytes", "Peak device memory in use", ("device",))
        self.busbw = gauge("jaxtrain_collective_bus_bandwidth_bytes_per_second",
                           "Collective probe: all-reduce bus bandwidth per mesh axis", ("axis",))
        self.expected_busbw = gauge("jaxtrain_collective_expected_bytes_per_second",
                                    "The link rate the probe's axis is compared with", ("axis",))
        self.bandwidth_warnings = prom.Counter("jaxtrain_bandwidth_warnings", "Probes below the expected rate",
                                               names + ("axis",), registry=self.registry)
        self.host_ratio = gauge("jaxtrain_straggler_host_ratio", "Process 0's view: a process's host time over "
                                "the median of all processes, last exchange", ("peer",))
        self.straggler_warnings = prom.Counter("jaxtrain_straggler_warnings", "Straggler warnings (process 0)",
                                               names, registry=self.registry).labels(**self.base)
        self.goodput = gauge("jaxtrain_goodput_ratio", "Fraction of this invocation's wall time per category",
                             ("category",))
        self.set("up", 1)

    def set(self, name: str, value: float) -> None:
        """Set the gauge ``jaxtrain_<name>`` of this process."""
        child = self._bound.get(name)
        if child is None:
            child = self._bound[name] = self._gauges[name].labels(**self.base)
        child.set(value)

    def serve(self, address: str, port: int):
        """Start the HTTP server (a daemon thread); returns it (``server_port`` is the port it bound)."""
        import prometheus_client as prom

        server, _ = prom.start_http_server(port, addr=address, registry=self.registry)
        return server


class StragglerWatch:
    """Per-step host/device split, and every ``every`` steps an exchange of medians between processes.

    Each process posts the medians of its last window under ``KV_PREFIX/straggler/<step>/<process>``; process 0
    reads the previous window's posts (one window late, so it never waits for a process still finishing it) and
    warns about any process whose host time is above ``ratio`` x the median of all processes (the lower median:
    with two processes, the faster one) by more than ``STRAGGLER_MIN_STEP_SHARE`` of the median step time.
    """

    def __init__(self, every: int, ratio: float, hosts: list[str], metrics: PrometheusMetrics | None):
        self.every, self.ratio, self.hosts, self.metrics = every, ratio, hosts, metrics
        self.host: dict[int, float] = {}  # step -> host seconds
        self.data: dict[int, float] = {}
        self.device: dict[int, float] = {}
        self._posted: int | None = None
        self.warnings: list[str] = []

    def dispatched(self, step: int, host_s: float, data_s: float) -> None:
        self.host[step], self.data[step] = host_s, data_s

    def waited(self, step: int, seconds: float) -> None:
        """The host waited ``seconds`` for ``step``'s results once its own work (the next dispatch) was done."""
        self.device[step] = max(0.0, seconds)

    def split(self, step: int) -> dict[str, float]:
        """This process's figures for a step, for metrics.jsonl: host work, data wait, device (when known)."""
        if step not in self.host:
            return {}
        out = {"step_host_seconds": self.host[step], "data_wait_seconds": self.data[step]}
        if step in self.device:
            out["step_device_seconds"] = self.device[step]
        return out

    def maybe_exchange(self, step: int) -> None:
        if not (self.every and jax.process_count() > 1 and _kv_client() is not None):
            if len(self.host) > 64:  # nothing to exchange: keep only what report() still needs
                for d in (self.host, self.data, self.device):
                    for old in [k for k in d if k < step - 1]:
                        del d[old]
            return
        if step % self.every:
            return
        window = sorted(self.host)
        mine = {"host": statistics.median(self.host.values()), "data": statistics.median(self.data.values()),
                "device": statistics.median(self.device.values()) if self.device else 0.0,
                "first": window[0], "last": window[-1]}
        for d in (self.host, self.data, self.device):  # this step's figures stay until report() has used them
            for old in [k for k in d if k < step]:
                del d[old]
        client = _kv_client()
        client.key_value_set(f"{KV_PREFIX}/straggler/{step}/{jax.process_index()}", json.dumps(mine))
        previous, self._posted = self._posted, step
        if jax.process_index() != 0 or previous is None:
            return
        posts = {int(k.rsplit("/", 1)[1]): json.loads(v)
                 for k, v in client.key_value_dir_get(f"{KV_PREFIX}/straggler/{previous}/")}
        client.key_value_delete(f"{KV_PREFIX}/straggler/{previous}")
        self.judge(posts)

    def judge(self, posts: dict[int, dict]) -> list[int]:
        """Warn about stragglers among ``posts`` (process -> medians); returns their indices."""
        if len(posts) < 2:
            return []
        median = statistics.median_low([p["host"] for p in posts.values()])
        step_time = statistics.median(p["host"] + p["device"] for p in posts.values())
        slow = []
        for proc, p in sorted(posts.items()):
            ratio = p["host"] / median if median > 0 else math.inf
            if self.metrics:
                self.metrics.host_ratio.labels(**self.metrics.base, peer=str(proc)).set(
                    ratio if math.isfinite(ratio) else 0.0)
            if ratio > self.ratio and p["host"] - median > STRAGGLER_MIN_STEP_SHARE * step_time:
                slow.append(proc)
                msg = (f"straggler: process {proc} (host {self.hosts[proc]}) spends {p['host'] * 1e3:.1f} ms of host "
                       f"work per step, {ratio:.1f}x the median {median * 1e3:.1f} ms (observe.straggler_ratio="
                       f"{self.ratio}), steps {p['first']}-{p['last']}: data wait {p['data'] * 1e3:.1f} ms, device "
                       f"{p['device'] * 1e3:.1f} ms; the job runs at its pace (median step {step_time * 1e3:.1f} ms)")
                self.warnings.append(msg)
                log.info(msg)
                if self.metrics:
                    self.metrics.straggler_warnings.inc()
        return slow


class CollectiveProbe:
    """A small all-reduce per mesh axis (size > 1), compiled once, timed every ``every`` steps.

    Bus bandwidth as in ``jaxtrain.health`` (nccl-tests' definition, :class:`jaxtrain.health.Measurement`): the same
    figure the pre-flight check reports, so the two compare. The expected rate is the link the axis runs over in
    the hardware file (``observe.hardware``, else the shipped file of these devices): the NIC where the axis
    crosses hosts, NVLink inside a node.
    """

    def __init__(self, mesh, shape, cfg, hosts: list[str], metrics: PrometheusMetrics | None):
        o = cfg.observe
        self.every, self.fraction, self.metrics, self.hosts = o.collective_probe_every, o.min_bandwidth_fraction, \
            metrics, hosts
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
                where = f"it crosses hosts {', '.join(hosts)}" if crosses else f"inside host {hosts[0]}"
                msg = (f"collective bandwidth: axis {axis} ({n} devices; {where}) all-reduce bus bandwidth "
                       f"{busbw / 1e9:.2f} GB/s at step {step} is below observe.min_bandwidth_fraction={self.fraction}"
                       f" of the expected {expected / 1e9:.1f} GB/s ({self.source}); run `jaxtrain check` with this "
                       "config to find the slow link and exclude its host")
                self.warnings.append(msg)
                log.info(msg)
                if self.metrics:
                    self.metrics.bandwidth_warnings.labels(**self.metrics.base, axis=axis).inc()
        return out


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


class Observer:
    """Everything the train loop reports to, for one invocation of ``train``; see the module docstring."""

    def __init__(self, layout, run_dir: str, throughput: Throughput):
        cfg, o = layout.cfg, layout.cfg.observe
        self.layout, self.run_dir, self.cfg, self.throughput = layout, run_dir, cfg, throughput
        self.goodput = Goodput(previous_last_step=rundir.last_logged_step(run_dir))
        self.hosts = exchange_hosts()
        self.metrics = self.server = None
        if o.prometheus_port is not None:
            self.metrics = PrometheusMetrics(os.path.basename(run_dir), jax.process_index(),
                                             self.hosts[jax.process_index()])
            self.metrics.set("start_time_seconds", time.time() - self.goodput.seconds["startup"])
            port = o.prometheus_port + self._port_offset(o.prometheus_port_offset) if o.prometheus_port else 0
            try:
                self.server = self.metrics.serve(o.prometheus_address, port)
                log.info(f"metrics: http://{o.prometheus_address}:{self.server.server_port}/metrics")
            except OSError as e:  # an observer must not stop a job that can train: say so and train on
                log.info(f"WARNING: no metrics endpoint: cannot serve on {o.prometheus_address}:{port} ({e.strerror});"
                         " pick a free observe.prometheus_port (0: any)")
        self.stragglers = StragglerWatch(o.straggler_every, o.straggler_ratio, self.hosts, self.metrics)
        self.probe = None
        if o.collective_probe_every:
            self.probe = CollectiveProbe(layout.mesh, layout.shape, cfg, self.hosts, self.metrics)
        self.profiler = Profiler(run_dir, o)
        self._save_started: float | None = None
        self._checkpointer = None
        self._last_step = 0
        self._last_dispatch: float | None = None
        self._last_report = 0.0

    def _port_offset(self, how: str) -> int:
        if how == "process":
            return jax.process_index()
        if how == "local":  # my index among the processes sharing my host
            me = self.hosts[jax.process_index()]
            return sum(h == me for h in self.hosts[:jax.process_index()])
        return 0

    # -- hooks of the train loop ---------------------------------------------------------------------------------

    def step_begin(self, step: int) -> float:
        """A step starts: goodput category, profile window. Returns the start time (perf_counter)."""
        self.goodput.step(step)
        self.profiler.begin(step)
        return time.perf_counter()

    def step_dispatched(self, step: int, t_begin: float, t_batch: float) -> None:
        """The step was dispatched: its host work took from ``t_begin`` to now, ``t_batch - t_begin`` of it
        waiting for the batch."""
        self._last_dispatch = time.perf_counter()
        self.stragglers.dispatched(step, self._last_dispatch - t_begin, t_batch - t_begin)
        if self.metrics:
            self.metrics.data_wait_seconds.observe(t_batch - t_begin)

    def saved(self, checkpointer, blocking_s: float) -> None:
        """A checkpoint save started and held the loop ``blocking_s`` seconds."""
        self.goodput.charge("checkpoint", blocking_s)
        self._checkpointer, self._save_started = checkpointer, time.perf_counter() - blocking_s
        if self.metrics:
            self.metrics.checkpoint_blocking_seconds.observe(blocking_s)

    def step_end(self, step: int, in_flight) -> None:
        """After the step's dispatch and save: stragglers, probe, profile window end, save completion."""
        self._last_step = step
        self.stragglers.maybe_exchange(step)
        if self.probe:
            self.probe.maybe_run(step, in_flight)
        self.profiler.end(step, in_flight)
        self._poll_save()

    def _poll_save(self, force: bool = False) -> None:
        if self._save_started is None:
            return
        manager = getattr(self._checkpointer, "_manager", None)
        if force or manager is None or not manager.is_saving_in_progress():
            if self.metrics:
                self.metrics.checkpoint_save_seconds.observe(time.perf_counter() - self._save_started)
            self._save_started = None

    def report(self, step: int, values: dict, step_time: float, logged: bool) -> None:
        """A step's metrics arrived (every step; ``logged``: a step the writer logs). Its device share is the time
        the host then had waited for them since its last dispatch (the next step's, usually): what the devices, and
        the collectives with the other processes, took beyond this host's own work."""
        now = time.perf_counter()
        if self._last_dispatch is not None:  # since its own work, or the previous report when several come at once
            self.stragglers.waited(step, now - max(self._last_dispatch, self._last_report))
        self._last_report = now
        m = self.metrics
        if m is None:
            return
        m.set("step", step)
        m.step_seconds.observe(step_time)
        split = self.stragglers.split(step)
        if "step_device_seconds" in split:
            m.set("step_host_seconds", split["step_host_seconds"])
            m.set("step_device_seconds", split["step_device_seconds"])
        m.set("loss", values["loss"])
        if values.get("nonfinite_steps"):  # the step was skipped (train_step's count of consecutive ones)
            m.nonfinite_steps.inc()
        if "grad_norm" in values:
            m.set("grad_norm", values["grad_norm"])
        if "learning_rate" in values:
            m.set("learning_rate", values["learning_rate"])
        m.set("tokens_per_second", self.throughput.tokens_per_second(step_time))
        mfu = self.throughput.mfu(step_time)
        if mfu is not None:
            m.set("mfu_ratio", mfu)
        if logged:  # the costlier reads, at the logging pace
            for d in jax.local_devices():
                stats = d.memory_stats() or {}
                if "bytes_in_use" in stats:
                    m.memory_in_use.labels(**m.base, device=str(d.id)).set(stats["bytes_in_use"])
                if "peak_bytes_in_use" in stats:
                    m.memory_peak.labels(**m.base, device=str(d.id)).set(stats["peak_bytes_in_use"])
            for category, fraction in self.goodput.fractions().items():
                m.goodput.labels(**m.base, category=category).set(fraction)

    def step_split(self, step: int) -> dict[str, float]:
        """``step_host_seconds``, ``data_wait_seconds``, ``step_device_seconds`` of a reported step on this
        process."""
        return self.stragglers.split(step)

    def evaluated(self, eval_loss: float) -> None:
        if self.metrics:
            self.metrics.set("eval_loss", eval_loss)

    def out_of_memory(self, e: BaseException, compiled_step=None) -> str | None:
        """On an out-of-memory error: write the device memory profile next to this process's log, say where, with
        the per-device split of parameters / optimizer state (from the sharded state) and temporaries (XLA's
        compiled figure). Returns the profile's path (None when ``e`` is not an out-of-memory error)."""
        if not is_out_of_memory(e):
            return None
        path = rundir.memory_profile(self.run_dir, jax.process_index())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(jax.profiler.device_memory_profile())
        params, opt = self.layout.state_bytes
        split = {"parameters": params, "optimizer": opt}
        need = compiled_need(compiled_step) if compiled_step is not None else None
        if need is not None:
            split["temporaries"] = need.temporaries
        log.info(f"out of device memory: memory profile written to {path} (view: pprof -http=: {path}); per "
                 f"device on mesh {self.layout.shape.label}: " + ", ".join(f"{k} {_size(v)}" for k, v in split.items()))
        return path

    def close(self) -> None:
        """End of the run (or of an error): stop a trace in progress, record the last save, stop serving."""
        self.profiler.close(self._last_step)
        self._poll_save(force=True)
        self.goodput.finish()
        if self.metrics:
            for category, fraction in self.goodput.fractions().items():
                self.metrics.goodput.labels(**self.metrics.base, category=category).set(fraction)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _ones(count: int, index) -> np.ndarray:
    """A probe's per-device buffer (``make_array_from_callback`` passes each shard's index)."""
    return np.ones(count, np.float32)
