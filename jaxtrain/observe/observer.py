"""Watching a running job: the train loop's hooks, composed of this package's parts: the Prometheus endpoint
(:mod:`.prometheus`), straggler detection (:mod:`.stragglers`), the collective-bandwidth probe (:mod:`.probe`),
profiler windows (:mod:`.profiler`), the memory profile on an out-of-memory error (:mod:`.oom`) and goodput
(:mod:`.goodput`).

The train loop calls a few hooks of :class:`Observer`; none of them waits for the devices on an ordinary step.
Each step's time splits into this process's own work and its waits for the devices and peers (timed around the
loop's own calls); the straggler exchange goes through JAX's coordination service (a key-value store), not the
devices, every ``observe.straggler_every`` steps; only the collective probe and the end of a profile window wait
for the step in flight, because they must.

Metric names (``jaxtrain.observe.metrics.PrometheusMetrics``) follow Prometheus' conventions (prefix
``jaxtrain_``, base units, ``_total``); every metric carries the labels ``run`` (the run directory's name),
``process`` and ``host``.
"""

from __future__ import annotations

import time

import jax

from jaxtrain import rundir
from jaxtrain.observe.goodput import Goodput
from jaxtrain.observe.hosts import exchange_hosts
from jaxtrain.observe.metrics import Throughput
from jaxtrain.observe.oom import report_out_of_memory
from jaxtrain.observe.probe import CollectiveProbe
from jaxtrain.observe.profiler import Profiler
from jaxtrain.observe.prometheus import Endpoint
from jaxtrain.observe.stragglers import StallClock, StepCycles, StragglerWatch


class Observer:
    """Everything the train loop reports to, for one invocation of ``train``; see the module docstring."""

    def __init__(self, layout, run_dir: str, throughput: Throughput):
        o = layout.cfg.observe
        self.layout = layout
        self.run_dir = run_dir
        self.throughput = throughput
        self.goodput = Goodput(previous_last_step=rundir.last_logged_step(run_dir))
        self.hosts = exchange_hosts()
        self.endpoint = None
        if o.prometheus_port is not None:
            start_time = time.time() - self.goodput.seconds["startup"]
            self.endpoint = Endpoint(o, run_dir, self.hosts, start_time)
        self.metrics = self.endpoint.metrics if self.endpoint else None
        self.stragglers = StragglerWatch(o.straggler_every, o.straggler_ratio, self.hosts, self.metrics)
        self.probe = None
        if o.collective_probe_every:
            self.probe = CollectiveProbe(layout.mesh, layout.shape, layout.cfg, self.hosts, self.metrics)
        self.profiler = Profiler(run_dir, o)
        # The stall clock runs only where stragglers are judged: several processes, exchanges on.
        clock = StallClock() if o.straggler_every and jax.process_count() > 1 else None
        self.cycles = StepCycles(self.stragglers, self._phases, clock)
        self._save_started: float | None = None
        self._checkpointer = None
        self._last_step = 0

    def _phases(self) -> float:
        """Seconds so far in goodput's checkpoint, evaluation and compilation (eval step) phases: not own work."""
        seconds = self.goodput.seconds
        return sum(seconds.get(k, 0.0) for k in ("checkpoint", "evaluation", "compilation"))

    # -- hooks of the train loop ---------------------------------------------------------------------------------

    def step_begin(self, step: int) -> float:
        """A step starts (and the previous one's cycle ends): goodput category, profile window. Returns the start
        time (perf_counter)."""
        self.goodput.step(step)
        self.profiler.begin(step)
        return self.cycles.begin(step)

    def step_dispatched(self, step: int, t_begin: float, t_batch: float, t_sent: float) -> None:
        """The step was dispatched: its batch arrived at ``t_batch``, was on the devices at ``t_sent``; the
        dispatch, from then until now, may block on the devices and the other processes (a wait, not own work)."""
        self.cycles.dispatched(step, t_begin, t_batch, t_sent)
        if self.metrics:
            self.metrics.data_wait_seconds.observe(t_batch - t_begin)

    def waited(self, start: float, end: float) -> None:
        """The loop waited from ``start`` to ``end`` (perf_counter) for a step's results (the devices, and the
        collectives with the peers)."""
        self.cycles.waited(start, end)

    def saved(self, checkpointer, blocking_s: float) -> None:
        """A checkpoint save started and held the loop ``blocking_s`` seconds."""
        self.goodput.charge("checkpoint", blocking_s)
        self._checkpointer = checkpointer
        self._save_started = time.perf_counter() - blocking_s
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
        self.cycles.waited(t0, time.perf_counter())
        self._poll_save()

    def _poll_save(self, force: bool = False) -> None:
        """Record the save in flight's whole time once it is on disk (``force``: the run ends, it is)."""
        if self._save_started is None:
            return
        manager = getattr(self._checkpointer, "_manager", None)
        if force or manager is None or not manager.is_saving_in_progress():
            if self.metrics:
                self.metrics.checkpoint_save_seconds.observe(time.perf_counter() - self._save_started)
            self._save_started = None

    def report(self, step: int, values: dict, step_time: float, logged: bool) -> None:
        """A step's metrics arrived (every step, one step late; ``logged``: a step the writer logs)."""
        if self.endpoint is None:
            return
        self.endpoint.step(step, values, step_time, self.step_split(step), self.throughput, self.goodput, logged)

    def step_split(self, step: int) -> dict[str, float]:
        """``step_host_seconds``, ``data_wait_seconds``, ``step_device_seconds`` of a reported step on this
        process; for one reported inside its own cycle (an evaluated step, the last), its figures so far."""
        return self.cycles.split(step)

    def evaluated(self, eval_loss: float) -> None:
        if self.metrics:
            self.metrics.set("eval_loss", eval_loss)

    def out_of_memory(self, e: BaseException, compiled_step=None) -> str | None:
        """On an out-of-memory error, the memory profile and where the memory went (:mod:`.oom`); returns the
        profile's path (None when ``e`` is not an out-of-memory error)."""
        return report_out_of_memory(e, self.layout, self.run_dir, compiled_step)

    def close(self, stop_serving: bool = True) -> None:
        """End of the run (or of an error): stop a trace in progress, record the last save, publish the last
        values with ``jaxtrain_up`` 0, then stop serving at once (an error: its peers wait for it to exit), or
        leave that to the caller's :meth:`stop_serving` after its summary (the linger must not count as goodput)."""
        self.cycles.close()
        self.profiler.close(self._last_step)
        self._poll_save(force=True)
        self.goodput.finish()
        if self.endpoint:
            self.endpoint.goodput(self.goodput.fractions())
            self.endpoint.metrics.set("up", 0)
        if stop_serving:
            self.stop_serving(linger=False)

    def stop_serving(self, linger: bool = True) -> None:
        """Serve the last values for ``observe.prometheus_linger_s`` (so that a scrape sees them), then stop."""
        if self.endpoint:
            self.endpoint.stop(linger)
