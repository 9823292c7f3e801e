"""Training metrics sinks: the progress line, ``metrics.jsonl`` and TensorBoard (process 0 only), and the
Prometheus metrics every process serves (:class:`PrometheusMetrics`, served by ``jaxtrain.observe.prometheus``).

Sinks receive plain Python numbers: the loop converts device values (one step late) first.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from jaxtrain import rundir

# Histogram buckets, log-spaced so that histogram_quantile resolves a step time anywhere from sub-millisecond CPU
# steps to multi-second GPU steps: 10 per decade (each bucket 1.26x the previous: a quantile interpolated inside
# one is off by at most 26%, typically a few %) from 0.1 ms to 100 s. Coarser (5 per decade) for the other timings.
STEP_BUCKETS = tuple(round(10 ** (k / 10), 12) for k in range(-40, 21))
TIME_BUCKETS = tuple(round(10 ** (k / 5), 12) for k in range(-20, 11))
QUANTILE_STEPS = 100  # the exact step-time quantiles exported as gauges are over this many recent steps


@dataclass(frozen=True)
class Throughput:
    """Speed figures of a step from its wall time: the one place tokens/s, TFLOP/s and MFU are computed (the
    progress line, metrics.jsonl, TensorBoard, Prometheus and summary.json all take them from here)."""

    tokens_per_step: int
    flops_per_step: float  # model FLOPs (model.train_flops_per_token x tokens)
    num_devices: int
    peak_flops: float | None  # per device (hardware files); None: unknown (CPUs), no MFU

    def tokens_per_second(self, step_seconds: float) -> float:
        return self.tokens_per_step / step_seconds

    def tflops_per_device(self, step_seconds: float) -> float:
        return self.flops_per_step / step_seconds / self.num_devices / 1e12

    def mfu(self, step_seconds: float) -> float | None:
        """Model FLOPs utilisation (0-1) at this step time; None without a peak rate."""
        return self.flops_per_step / step_seconds / self.num_devices / self.peak_flops if self.peak_flops else None

    def step_fields(self, step_seconds: float) -> dict[str, float | None]:
        """A logged step's speed fields (metrics.jsonl, TensorBoard)."""
        return {"step_seconds": step_seconds, "tokens_per_second": self.tokens_per_second(step_seconds),
                "tokens_per_second_per_device": self.tokens_per_second(step_seconds) / self.num_devices,
                "tflops_per_device": self.tflops_per_device(step_seconds), "mfu": self.mfu(step_seconds)}


class MetricsWriter:
    """Writes one record per logged step to the progress line, ``metrics.jsonl`` and TensorBoard (process 0 only)."""

    def __init__(self, run_dir: str, *, enabled: bool, total_steps: int, start_step: int = 0):
        """``start_step``: the step a resumed run restored; records after it (from the interrupted run) are dropped."""
        self.enabled, self.total_steps = enabled, total_steps
        self._jsonl: Any = None
        self._tb: Any = None
        if enabled:
            rundir.truncate_metrics(run_dir, start_step)
            self._jsonl = open(rundir.path(run_dir, rundir.METRICS), "a", buffering=1)
            self._tb = _summary_writer(rundir.path(run_dir, rundir.TENSORBOARD),
                                       purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict, *, elapsed: float | None = None, eta: float | None = None) -> None:
        """Log one step's record; ``elapsed`` (since the loop started) and ``eta`` seconds go to the progress line."""
        if self._jsonl is None or self._tb is None:  # not process 0
            return
        self._jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()  # a logged step at a time: TensorBoard shows it while the run trains
        print(self._progress(record, elapsed, eta), flush=True)

    def _progress(self, r: dict, elapsed: float | None, eta: float | None) -> str:
        width = len(str(self.total_steps))
        parts = [f"step {r['step']:>{width}}/{self.total_steps} {100 * r['step'] / self.total_steps:3.0f}%",
                 f"loss {r['loss']:.4f}"]
        if "eval_loss" in r:
            parts.append(f"eval {r['eval_loss']:.4f}")
        if "grad_norm" in r:
            parts += [f"gnorm {r['grad_norm']:.3f}", f"lr {r['learning_rate']:.2e}"]
        if r.get("step_seconds") is not None:
            parts += [f"{r['step_seconds'] * 1e3:.1f} ms", f"{r['tokens_per_second']:,.0f} tok/s"]
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if elapsed is not None:
            parts.append(f"elapsed {_clock(elapsed)}" + (f" eta {_clock(eta)}" if eta is not None else ""))
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


# Modules tensorboardX imports when installed, for what jaxtrain never asks of it (torch tensors; s3:// and gs://
# log directories): 1.5 s of start-up for torch alone here, 0.6 s for the cloud clients, 4-7 s on a loaded machine.
_NOT_FOR_TENSORBOARDX = ("torch", "boto3", "google.cloud.storage")


def _summary_writer(log_dir: str, purge_step: int | None) -> Any:
    """tensorboardX's ``SummaryWriter``, imported with the modules above marked absent (``sys.modules[name] =
    None`` makes their import raise ImportError, which tensorboardX handles), except those this process has already
    imported; the marks are removed afterwards. The import then takes ~0.1 s."""
    blocked = [name for name in _NOT_FOR_TENSORBOARDX if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            del sys.modules[name]
    return SummaryWriter(log_dir, purge_step=purge_step)


def summary_line(*, compile_s: float, step_times: list[float], tokens_per_step: int, final_loss: float,
                 run_dir: str) -> str:
    """One line for the end of a run: compile time, median step time, throughput, final loss, where it all went."""
    med = statistics.median(step_times) if step_times else float("nan")
    return (f"done: compile {compile_s:.2f} s | median step {med * 1e3:.2f} ms over {len(step_times)} steps | "
            f"{tokens_per_step / med:,.0f} tokens/s | final loss {final_loss:.4f} | results in {run_dir}")


def _clock(seconds: float) -> str:
    """``1:05:09`` / ``5:09``."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PrometheusMetrics:
    """The metrics, in their own registry (not the library's global one: one process may train several times).

    Every metric has the labels run, process, host; a few add one (device, axis, category, peer). Counters exist
    at 0 from the start for every label set they will have (``increase()`` then sees the first increment).
    """

    def __init__(self, run: str, process: int, host: str, processes: int = 1):
        import prometheus_client as prom  # only when the endpoint is on: an image without it still trains

        self.registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes...
        self.base = {"run": run, "process": str(process), "host": host}
        names = tuple(self.base)

        def gauge(name, doc, extra=()):
            return prom.Gauge(name, doc, names + extra, registry=self.registry)

        def hist(name, doc, buckets=TIME_BUCKETS):
            return prom.Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**self.base)

        # Gauges appear on the first value they get (a loss of 0 before the first step would be a false reading).
        self._gauges = {name: gauge(f"jaxtrain_{name}", doc) for name, doc in (
            ("up", "1 while the training process runs; 0 after it ended (served for observe.prometheus_linger_s)"),
            ("start_time_seconds", "Unix time the training process started"),
            ("step", "Last completed training step"), ("loss", "Training loss of the last step"),
            ("eval_loss", "Last evaluation loss"), ("grad_norm", "Global gradient norm (before clipping)"),
            ("learning_rate", "Learning rate of the last step"),
            ("tokens_per_second", "Training tokens per second (all devices), last step"),
            ("mfu_ratio", "Model FLOPs utilisation of the last step (0-1; absent without a peak rate)"),
            ("step_host_seconds", "This process's own work in the last step: the loop's host work (data wait, "
                                  "host-to-device, metrics) outside any wait for the devices or the other processes"),
            ("step_device_seconds", "Time the last step's loop waited for the devices and the other processes "
                                    "(dispatch blocked, results, checkpoint and evaluation)"))}
        self._bound: dict[str, Any] = {}
        self.step_seconds = hist("jaxtrain_step_seconds", "Wall time per training step", STEP_BUCKETS)
        self.recent_step_seconds = gauge("jaxtrain_recent_step_seconds", f"Exact quantile of the last "
                                         f"{QUANTILE_STEPS} steps' wall times", ("quantile",))
        self._recent: list[float] = []
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
        self.host_ratio = gauge("jaxtrain_straggler_host_ratio", "Process 0's view: a process's own time per step "
                                "over the median of all processes, last exchange", ("peer",))
        self.straggler_warnings = prom.Counter("jaxtrain_straggler_warnings", "Straggler warnings naming the peer "
                                               "process (logged by process 0)", names + ("peer",),
                                               registry=self.registry)
        if process == 0:  # the judge: one series per process it may name, at 0 until it names it
            for peer in range(processes):
                self.straggler_warnings.labels(**self.base, peer=str(peer))
        self.goodput = gauge("jaxtrain_goodput_ratio", "Fraction of this invocation's wall time per category",
                             ("category",))
        self.set("up", 1)

    def set(self, name: str, value: float) -> None:
        """Set the gauge ``jaxtrain_<name>`` of this process."""
        child = self._bound.get(name)
        if child is None:
            child = self._bound[name] = self._gauges[name].labels(**self.base)
        child.set(value)

    def step_time(self, seconds: float) -> None:
        """A step's wall time: into the histogram, and the exact p50 / p90 of the recent steps."""
        self.step_seconds.observe(seconds)
        self._recent = self._recent[-(QUANTILE_STEPS - 1):] + [seconds]
        ordered = sorted(self._recent)
        for q in (0.5, 0.9):  # nearest rank, as summary.json's percentiles
            self.recent_step_seconds.labels(**self.base, quantile=str(q)).set(
                ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    def axis(self, axis: str) -> None:
        """A probed mesh axis: its warning counter exists from now on (at 0)."""
        self.bandwidth_warnings.labels(**self.base, axis=axis)

    def serve(self, address: str, port: int):
        """Start the HTTP server (a daemon thread); returns it (``server_port`` is the port it bound)."""
        import prometheus_client as prom

        server, _ = prom.start_http_server(port, addr=address, registry=self.registry)
        return server
