"""Training metrics sinks: the progress line, ``metrics.jsonl`` and TensorBoard.

Only process 0 writes. Sinks receive plain Python numbers: the loop converts device values (one step late) first.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import Any


class MetricsWriter:
    """Writes one record per logged step to the progress line, ``metrics.jsonl`` and TensorBoard (process 0 only)."""

    def __init__(self, run_dir: str, *, enabled: bool, total_steps: int, start_step: int = 0):
        """``start_step``: the step a resumed run restored; records after it (from the interrupted run) are dropped."""
        self.enabled, self.total_steps = enabled, total_steps
        self._jsonl: Any = None
        self._tb: Any = None
        if enabled:
            path = os.path.join(run_dir, "metrics.jsonl")
            _truncate_jsonl(path, start_step)
            self._jsonl = open(path, "a", buffering=1)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1 if start_step else None)

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
            parts += [f"gnorm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}"]
        if r.get("step_time") is not None:
            parts += [f"{r['step_time'] * 1e3:.1f} ms", f"{r['tokens_per_sec']:,.0f} tok/s"]
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


def _truncate_jsonl(path: str, last_step: int) -> None:
    """Keep only the records of steps <= last_step, atomically (a resumed run logs the later steps again)."""
    if not os.path.isfile(path):  # also with last_step 0: a run killed before its first checkpoint starts over
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        kept = [line for line in f if _step_of(line) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _step_of(line: str) -> float:
    """A record's step; a line cut short by a crash mid-write (or otherwise unreadable) is dropped (infinity)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


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


def log_info(msg: str) -> None:
    """A timestamped line on stderr, every process (tagged with its index in multi-process jobs)."""
    from jaxtrain.runtime import process_tag

    print(f"[{time.strftime('%H:%M:%S')}] {process_tag()}{msg}", file=sys.stderr, flush=True)
