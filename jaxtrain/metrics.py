"""Training metrics: analytic model FLOPs, MFU, and the sinks (progress line, metrics.jsonl, TensorBoard).

Only process 0 writes. Sinks receive plain Python numbers: the loop converts device values (one step late) first.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

from jaxtrain.config import ModelConfig

# Dense bf16 peak FLOP/s per device (vendor datasheets; sparsity excluded). Matched by substring of device_kind.
PEAK_FLOPS = (
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device, or None when unknown (e.g. CPU)."""
    for key, value in PEAK_FLOPS:
        if key.lower() in device_kind.lower():
            return value
    return None


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward), rematerialisation not counted.

    Forward: 2 FLOPs per weight of every matmul (the embedding lookup is not a matmul; the output projection is),
    plus attention's two [seq x seq] matmuls, 2 * 2 * seq * heads * head_dim per layer, halved for causal masking.
    """
    d, hd, l = cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    matmul_weights = l * (d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff) + d * cfg.vocab_size
    attention = l * 2 * 2 * seq_len * cfg.n_heads * hd / 2
    return 3 * (2 * matmul_weights + attention)


class MetricsWriter:
    """Writes one record per logged step to the progress line, ``metrics.jsonl`` and TensorBoard (process 0 only)."""

    def __init__(self, run_dir: str, *, enabled: bool, total_steps: int, start_step: int = 0):
        """``start_step``: the step a resumed run restored; records after it (from the interrupted run) are dropped."""
        self.enabled, self.total_steps = enabled, total_steps
        self._jsonl = self._tb = None
        if enabled:
            path = os.path.join(run_dir, "metrics.jsonl")
            _truncate_jsonl(path, start_step)
            self._jsonl = open(path, "a", buffering=1)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        print(self._progress(record), flush=True)

    def _progress(self, r: dict) -> str:
        parts = [f"step {r['step']:>{len(str(self.total_steps))}}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        if "eval_loss" in r:
            parts.append(f"eval {r['eval_loss']:.4f}")
        if "grad_norm" in r:
            parts += [f"gnorm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}"]
        if r.get("step_time") is not None:
            parts += [f"{r['step_time'] * 1e3:.1f} ms", f"{r['tokens_per_sec']:,.0f} tok/s"]
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def _truncate_jsonl(path: str, last_step: int) -> None:
    """Keep only the records of steps <= last_step, atomically (a resumed run logs the later steps again)."""
    if not last_step or not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def summary_line(*, compile_s: float, step_times: list[float], tokens_per_step: int, final_loss: float) -> str:
    """One line for the end of a run; the median skips no steps (the first step is not timed: it is the compile)."""
    med = statistics.median(step_times) if step_times else float("nan")
    return (f"done: compile {compile_s:.2f} s | median step {med * 1e3:.2f} ms over {len(step_times)} steps | "
            f"{tokens_per_step / med:,.0f} tokens/s | final loss {final_loss:.4f}")


def log_info(msg: str) -> None:
    """A timestamped line on stderr, every process (tagged with its index in multi-process jobs)."""
    from jaxtrain.runtime import process_tag

    print(f"[{time.strftime('%H:%M:%S')}] {process_tag()}{msg}", file=sys.stderr, flush=True)
