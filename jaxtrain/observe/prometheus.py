"""This process's Prometheus ``/metrics`` endpoint (``observe.prometheus_port``): the metrics of
:class:`jaxtrain.observe.metrics.PrometheusMetrics` served over HTTP from a daemon thread, the port offset that
lets several processes of one host serve side by side, each step's values published as they arrive, and the last
values served a while after the run ends (``observe.prometheus_linger_s``) so that a scrape sees them.

An endpoint that cannot bind its port says so and the job trains on without it: an observer must not stop a job
that can train.
"""

from __future__ import annotations

import os
import time

import jax

from jaxtrain import log
from jaxtrain.observe.goodput import Goodput
from jaxtrain.observe.metrics import PrometheusMetrics, Throughput


def port_offset(how: str, hosts: list[str], process: int) -> int:
    """What ``process`` adds to ``observe.prometheus_port`` (``observe.prometheus_port_offset``): its process
    index (``process``), its index among the processes on its host (``local``; ``hosts``: every process's host),
    or nothing (``none``)."""
    if how == "process":
        return process
    if how == "local":  # my index among the processes sharing my host
        me = hosts[process]
        return sum(h == me for h in hosts[:process])
    return 0


class Endpoint:
    """The metrics of this process and the HTTP server that serves them (``server`` None when it could not bind)."""

    def __init__(self, o, run_dir: str, hosts: list[str], start_time: float):
        """``o``: the config's ``observe`` section; ``hosts``: every process's host; ``start_time``: Unix time this
        process started."""
        process = jax.process_index()
        self.metrics = PrometheusMetrics(os.path.basename(run_dir), process, hosts[process], jax.process_count())
        self.metrics.set("start_time_seconds", start_time)
        self.linger_s = o.prometheus_linger_s
        self.server = None
        port = o.prometheus_port + port_offset(o.prometheus_port_offset, hosts, process) if o.prometheus_port else 0
        try:
            self.server = self.metrics.serve(o.prometheus_address, port)
            log.info(f"metrics: http://{o.prometheus_address}:{self.server.server_port}/metrics")
        except OSError as e:  # an observer must not stop a job that can train: say so and train on
            log.info(f"WARNING: no metrics endpoint: cannot serve on {o.prometheus_address}:{port} ({e.strerror}); "
                     "pick a free observe.prometheus_port (0: any)")

    def step(self, step: int, values: dict, step_time: float, split: dict[str, float], throughput: Throughput,
             goodput: Goodput, logged: bool) -> None:
        """A step's metrics arrived: ``values`` (loss, gradient norm, ...), its wall time, this process's ``split``
        of it (``StepCycles.split``), and at the logging pace (``logged``) the devices' memory and ``goodput``'s
        fractions."""
        m = self.metrics
        m.set("step", step)
        m.step_time(step_time)
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
        m.set("tokens_per_second", throughput.tokens_per_second(step_time))
        mfu = throughput.mfu(step_time)
        if mfu is not None:
            m.set("mfu_ratio", mfu)
        if logged:  # the costlier reads, at the logging pace
            self._device_memory()
            self.goodput(goodput.fractions())

    def _device_memory(self) -> None:
        m = self.metrics
        for d in jax.local_devices():
            stats = d.memory_stats() or {}
            if "bytes_in_use" in stats:
                m.memory_in_use.labels(**m.base, device=str(d.id)).set(stats["bytes_in_use"])
            if "peak_bytes_in_use" in stats:
                m.memory_peak.labels(**m.base, device=str(d.id)).set(stats["peak_bytes_in_use"])

    def goodput(self, fractions: dict[str, float]) -> None:
        """Goodput's fractions per category (``Goodput.fractions``)."""
        for category, fraction in fractions.items():
            self.metrics.goodput.labels(**self.metrics.base, category=category).set(fraction)

    def stop(self, linger: bool = True) -> None:
        """Serve the last values for ``observe.prometheus_linger_s`` (when ``linger``), then stop serving."""
        if self.server is None:
            return
        if linger and self.linger_s:
            log.info(f"metrics: serving the last values {self.linger_s:g} s more (observe.prometheus_linger_s)")
            time.sleep(self.linger_s)
        self.server.shutdown()
        self.server.server_close()
        self.server = None
