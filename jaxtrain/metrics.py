"""Training metrics sinks: the progress line, ``metrics.jsonl`` and TensorBoard.

Only process 0 writes. Sinks receive plain Python numbers: the loop converts device values (one step late) first.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Any

from jaxtrain import rundir


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
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(rundir.path(run_dir, rundir.TENSORBOARD),
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
