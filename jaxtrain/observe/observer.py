"""Watching a running job: a Prometheus ``/metrics`` endpoint, straggler and bandwidth warnings, profiler windows,
the memory profile on an out-of-memory error, and goodput (``jaxtrain.observe.goodput``).

The train loop calls a few hooks of :class:`Observer`; none of them waits for the devices on an ordinary step.
Each step's time splits into this process's own work and its waits for the devices and peers (timed around the
loop's own calls; :class:`StragglerWatch`); the straggler exchange goes through JAX's coordination service (a
key-value store), not the devices, every ``observe.straggler_every`` steps; only the collective probe and the end
of a profile window wait for the step in flight, because they must.

Metric names (``jaxtrain.observe.metrics.PrometheusMetrics``) follow Prometheus' conventions (prefix ``jaxtrain_``, base
units, ``_total``); every metric carries the labels ``run`` (the run directory's name), ``process`` and ``host``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import threading
import time
from collections import deque

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import log, rundir
from jaxtrain.cluster.links import Measurement, node_name
from jaxtrain.config import hardware
from jaxtrain.observe.goodput import Goodput
from jaxtrain.observe.metrics import PrometheusMetrics, Throughput
from jaxtrain.observe.profiler import Profiler
from jaxtrain.parallel.layout import compiled_need

# A straggler must also matter: its own time must exceed the median by this fraction of the median step time
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


class StallClock:
    """A daemon thread that wakes every ``interval`` seconds and records each time it woke more than ``slack``
    late: the process was not running (stopped, CPU-throttled, its cores given to other work). It sleeps in
    ``time.sleep``, which releases the GIL, so a main thread blocked in JAX (GIL released) does not delay it.
    ``gaps``: (start, end) perf_counter times of the stalls, oldest first."""

    def __init__(self, interval: float = 0.01, slack: float = 0.015):
        self.interval, self.slack, self._stopped = interval, slack, False
        self.gaps: deque[tuple[float, float]] = deque()  # appended by the thread, read and trimmed by the loop
        self._thread = threading.Thread(target=self._run, name="jaxtrain-stall-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stopped:
            time.sleep(self.interval)  # cheaper per wake than Event.wait (no lock made per call)
            now = time.perf_counter()
            if now - last > self.interval + self.slack:
                self.gaps.append((last + self.interval, now))
            last = now

    def stalled_in(self, intervals: list[tuple[float, float]], since: float) -> float:
        """Seconds of stalls inside ``intervals`` (disjoint (start, end)); forgets those ended before ``since``."""
        while self.gaps and self.gaps[0][1] < since:
            self.gaps.popleft()
        return sum(max(0.0, min(e, g1) - max(s, g0)) for g0, g1 in list(self.gaps) for s, e in intervals)

    def close(self) -> None:
        self._stopped = True
        self._thread.join(1)  # it ends within one interval


class StragglerWatch:
    """Per-step split of this process's time, and every ``every`` steps an exchange of window means.

    A step's cycle (from its start to the next step's) splits into *own* time, the host work this process does by
    itself (reading and sending the batch, the loop's bookkeeping), and *wait*: the dispatch blocking, the wait for
    results, saves and evaluation (the devices and the other processes' collectives). A process slowed by its host
    shows it as own time, the others as wait: blaming by own time names the slow one, never the ones waiting for it
    (blaming the wall time until the dispatch returned named the waiting one, whose dispatch blocks in the
    collective). A stall of the process while it waits (:class:`StallClock`) delays its peers too: own time.
    Each process posts its window's means under ``KV_PREFIX/straggler/<step>/<process>``; process 0 reads the
    previous window's posts (one window late: it never waits for a process still finishing it) and judges them."""

    def __init__(self, every: int, ratio: float, hosts: list[str], metrics: PrometheusMetrics | None):
        self.every, self.ratio, self.hosts, self.metrics = every, ratio, hosts, metrics
        self.own: dict[int, float] = {}  # step -> seconds
        self.data: dict[int, float] = {}
        self.wait: dict[int, float] = {}
        self.cycle: dict[int, float] = {}
        self.stalled: dict[int, float] = {}
        self._posted: int | None = None
        self.warnings: list[str] = []

    def finished(self, step: int, cycle_s: float, wait_s: float, data_s: float, stalled_s: float = 0.0) -> None:
        """``step``'s cycle took ``cycle_s``, ``wait_s`` of it waiting (stalls excluded), ``data_s`` of it for the
        batch, ``stalled_s`` of its waits stalled."""
        wait_s = min(max(0.0, wait_s), cycle_s)
        self.cycle[step], self.wait[step], self.own[step], self.data[step] = cycle_s, wait_s, cycle_s - wait_s, data_s
        self.stalled[step] = stalled_s

    def split(self, step: int) -> dict[str, float]:
        """This process's figures for a step, for metrics.jsonl: own host work, data wait, wait (when known)."""
        if step not in self.own:
            return {}
        return {"step_host_seconds": self.own[step], "data_wait_seconds": self.data[step],
                "step_device_seconds": self.wait[step]}

    def _forget(self, before: int) -> None:
        for d in (self.own, self.data, self.wait, self.cycle, self.stalled):
            for old in [k for k in d if k < before]:
                del d[old]

    def maybe_exchange(self, step: int) -> None:
        if not (self.every and jax.process_count() > 1 and _kv_client() is not None):
            if len(self.own) > 64:  # nothing to exchange: keep only what report() still needs
                self._forget(step - 1)
            return
        if step % self.every or not self.own:
            return
        window = sorted(self.own)
        mine = {k: statistics.fmean(d.values()) for k, d in
                (("own", self.own), ("data", self.data), ("wait", self.wait), ("cycle", self.cycle),
                 ("stalled", self.stalled))}
        mine.update(first=window[0], last=window[-1])
        self._forget(step - 1)  # the last finished step stays until report() has used it
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
        """Warn about stragglers among ``posts`` (process -> window means); returns their indices."""
        slow, median, step_time = stragglers(posts, self.ratio)
        for proc, p in sorted(posts.items()):
            ratio = p["own"] / median if median > 0 else math.inf
            if self.metrics:
                self.metrics.host_ratio.labels(**self.metrics.base, peer=str(proc)).set(
                    ratio if math.isfinite(ratio) else 0.0)
            if proc not in slow:
                continue
            others = statistics.median(q["wait"] for k, q in posts.items() if k != proc)
            msg = (f"straggler: process {proc} (host {self.hosts[proc]}) spends {p['own'] * 1e3:.1f} ms of its own "
                   f"host work per step, {ratio:.1f}x the median {median * 1e3:.1f} ms (observe.straggler_ratio="
                   f"{self.ratio}), steps {p['first']}-{p['last']}: data wait {p['data'] * 1e3:.1f} ms, stalled "
                   f"{p.get('stalled', 0.0) * 1e3:.1f} ms (its CPU taken away while it waited); it waits "
                   f"{p['wait'] * 1e3:.1f} ms per step for devices and peers, the others {others * 1e3:.1f} ms; the "
                   f"job runs at its pace (mean step {step_time * 1e3:.1f} ms)")
            self.warnings.append(msg)
            log.info(msg)
            if self.metrics:
                self.metrics.straggler_warnings.labels(**self.metrics.base, peer=str(proc)).inc()
        return slow


def stragglers(posts: dict[int, dict], ratio: float) -> tuple[list[int], float, float]:
    """The verdict on one window: ``posts`` maps a process to its means per step of ``own`` (host work by itself),
    ``wait`` (for devices and peers) and ``cycle`` (the whole step), in seconds.

    A process is a straggler when its own time exceeds ``ratio`` x the median of all processes' (the lower
    median: with two processes, the faster one) by more than ``STRAGGLER_MIN_STEP_SHARE`` of the median step,
    and it waits less than the others do (the median of theirs): the one the others wait for. Returns
    (stragglers, the median own time, the median step time).
    """
    if len(posts) < 2:
        return [], 0.0, 0.0
    median = statistics.median_low(p["own"] for p in posts.values())
    step_time = statistics.median(p["cycle"] for p in posts.values())
    slow = [proc for proc, p in sorted(posts.items())
            if p["own"] > ratio * median and p["own"] - median > STRAGGLER_MIN_STEP_SHARE * step_time
            and p["wait"] < statistics.median(q["wait"] for k, q in posts.items() if k != proc)]
    return slow, median, step_time


class CollectiveProbe:
    """A small all-reduce per mesh axis (size > 1), compiled once, timed every ``every`` steps.

    Bus bandwidth as in ``jaxtrain.health.check`` (nccl-tests' definition, :class:`jaxtrain.cluster.links.Measurement`):
    the same figure the pre-flight check reports, so the two compare. The expected rate is the link the axis runs over
    in the hardware file (``observe.hardware``, else the shipped file of these devices): the NIC where the axis crosses
    hosts, NVLink inside a node.
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
    return any(w in str(e) for w in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"))


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
                                             self.hosts[jax.process_index()], jax.process_count())
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
        self._checkpointer, self._last_step = None, 0
        self.linger_s = o.prometheus_linger_s
        # The step whose cycle runs: (step, its start, its data wait); what it waited so far (see StragglerWatch).
        self._cycle: tuple[int, float, float] | None = None
        self._waits: list[tuple[float, float]] = []
        self._phases_at_start = 0.0
        self.clock = StallClock() if o.straggler_every and jax.process_count() > 1 else None  # judged then only

    def _port_offset(self, how: str) -> int:
        if how == "process":
            return jax.process_index()
        if how == "local":  # my index among the processes sharing my host
            me = self.hosts[jax.process_index()]
            return sum(h == me for h in self.hosts[:jax.process_index()])
        return 0

    # -- hooks of the train loop ---------------------------------------------------------------------------------

    def _phases(self) -> float:
        """Seconds so far in goodput's checkpoint, evaluation and compilation (eval step) phases: not own work."""
        seconds = self.goodput.seconds
        return sum(seconds.get(k, 0.0) for k in ("checkpoint", "evaluation", "compilation"))

    def _finish_cycle(self, now: float) -> None:
        if self._cycle is not None:
            step, start, data_s = self._cycle
            stalled = self.clock.stalled_in(self._waits, start) if self.clock else 0.0
            wait = sum(e - s for s, e in self._waits) + self._phases() - self._phases_at_start
            self.stragglers.finished(step, now - start, wait - stalled, data_s, stalled)
            self._cycle = None

    def step_begin(self, step: int) -> float:
        """A step starts (and the previous one's cycle ends): goodput category, profile window. Returns the start
        time (perf_counter)."""
        self.goodput.step(step)
        self.profiler.begin(step)
        now = time.perf_counter()
        self._finish_cycle(now)
        self._waits, self._phases_at_start = [], self._phases()
        self._cycle = (step, now, 0.0)
        return now

    def step_dispatched(self, step: int, t_begin: float, t_batch: float, t_sent: float) -> None:
        """The step was dispatched: its batch arrived at ``t_batch``, was on the devices at ``t_sent``; the
        dispatch, from then until now, may block on the devices and the other processes (a wait, not own work)."""
        self._waits.append((t_sent, time.perf_counter()))
        self._cycle = (step, t_begin, t_batch - t_begin)
        if self.metrics:
            self.metrics.data_wait_seconds.observe(t_batch - t_begin)

    def waited(self, start: float, end: float) -> None:
        """The loop waited from ``start`` to ``end`` (perf_counter) for a step's results (the devices, and the
        collectives with the peers)."""
        self._waits.append((start, end))

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
        t0 = time.perf_counter()
        if self.probe:  # both wait for the step in flight
            self.probe.maybe_run(step, in_flight)
        self.profiler.end(step, in_flight)
        self._waits.append((t0, time.perf_counter()))
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
        """A step's metrics arrived (every step, one step late; ``logged``: a step the writer logs)."""
        m = self.metrics
        if m is None:
            return
        m.set("step", step)
        m.step_time(step_time)
        split = self.step_split(step)
        if split:
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
        process; for one reported inside its own cycle (an evaluated step, the last), its figures so far."""
        split = self.stragglers.split(step)
        if split or self._cycle is None or self._cycle[0] != step:
            return split
        _, start, data_s = self._cycle
        wait = sum(e - s for s, e in self._waits) + self._phases() - self._phases_at_start
        return {"step_host_seconds": time.perf_counter() - start - wait, "data_wait_seconds": data_s,
                "step_device_seconds": wait}

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

    def close(self, stop_serving: bool = True) -> None:
        """End of the run (or of an error): stop a trace in progress, record the last save, publish the last
        values with ``jaxtrain_up`` 0, then stop serving at once (an error: its peers wait for it to exit), or
        leave that to the caller's :meth:`stop_serving` after its summary (the linger must not count as goodput)."""
        self._finish_cycle(time.perf_counter())
        if self.clock:
            self.clock.close()
        self.profiler.close(self._last_step)
        self._poll_save(force=True)
        self.goodput.finish()
        if self.metrics:
            for category, fraction in self.goodput.fractions().items():
                self.metrics.goodput.labels(**self.metrics.base, category=category).set(fraction)
            self.metrics.set("up", 0)
        if stop_serving:
            self.stop_serving(linger=False)

    def stop_serving(self, linger: bool = True) -> None:
        """Serve the last values for ``observe.prometheus_linger_s`` (so that a scrape sees them), then stop."""
        if self.server is not None:
            if linger and self.linger_s:
                log.info(f"metrics: serving the last values {self.linger_s:g} s more (observe.prometheus_linger_s)")
                time.sleep(self.linger_s)
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _ones(count: int, index) -> np.ndarray:
    """A probe's per-device buffer (``make_array_from_callback`` passes each shard's index)."""
    return np.ones(count, np.float32)
