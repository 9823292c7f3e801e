"""Running a sweep: a real short training run per run of the experiment, side by side with the planner's
prediction.

Each run is its own process (``python -m jaxtrain train run.dir=... overrides...``), so a shape that fails (bad
config, out of memory, a crash in XLA) is recorded with its error and the sweep goes on. Each run's
``run.dir/summary.json`` (written by train) gives the measurements, and its ``metrics.jsonl`` the progress while it
runs; the planner (``jaxtrain.planner``) compiles the same step in this process for the prediction, with the CPU's
measured rates as the hardware.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxtrain import rundir
from jaxtrain.config import load_config
from jaxtrain.errors import ConfigError, one_line
from jaxtrain.sweep.report import Record, write_outputs
from jaxtrain.sweep.spec import Experiment, RunSpec, expand_runs


def train_command(exp: Experiment, run: RunSpec, run_dir: str) -> list[str]:
    """The subprocess: the project's own CLI, fresh (no resume) so that a re-run sweep measures again."""
    base = ["--config", exp.config] if exp.config else []
    return [sys.executable, "-m", "jaxtrain", "train", *base, f"run.dir={run_dir}", "checkpoint.resume=never",
            *run.overrides]


def measurements(summary: rundir.Summary) -> dict:
    """Record fields from a run's summary.json: compile time, median step time, tokens/s, final loss, steps
    timed, the process's peak resident memory."""
    return {"compile_s": summary.compile_seconds, "median_step_s": summary.step_seconds["median"],
            "tokens_per_s": summary.tokens_per_second, "final_loss": summary.final_loss,
            "steps_measured": summary.steps_timed, "peak_rss_bytes": summary.host_peak_rss_bytes}


def last_error_line(stderr: str) -> str:
    """The line that says why a run failed: its ``error:`` line, else the last exception line, else the tail."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or re.match(r"^[\w.]+(Error|Exception)\b", ln):
            return ln
    return lines[-1] if lines else ""


def run_training(cmd: list[str], run_dir: str,
                 progress: Callable[[int, float | None], None]) -> tuple[int, str, str, int, float]:
    """Run ``cmd``, calling ``progress(step, loss)`` as metrics.jsonl grows; returns (exit status, stdout, stderr,
    the child's peak resident memory in bytes, wall seconds). Output goes to files in run_dir (no pipe to fill)."""
    os.makedirs(run_dir, exist_ok=True)
    out_path, err_path = os.path.join(run_dir, "stdout.log"), os.path.join(run_dir, "stderr.log")
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        seen = 0
        while True:
            # os.wait4 gives this child's own peak RSS; Popen.wait would not.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            records = rundir.read_metrics(run_dir)
            if len(records) != seen:
                seen = len(records)
                progress(records[-1]["step"], records[-1].get("loss"))
            time.sleep(0.3)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped above: tell Popen, so it does not wait again
    with open(out_path) as f_out, open(err_path) as f_err:
        stdout, stderr = f_out.read(), f_err.read()
    return proc.returncode, stdout, stderr, usage.ru_maxrss * 1024, time.perf_counter() - t0  # ru_maxrss: KiB


class Predictor:
    """The planner in this process: compiles each run's step on emulated CPU devices, with measured CPU rates."""

    def __init__(self, n_devices: int):
        import jax

        from jaxtrain.cluster import process

        process.skip_aborting_passes()  # as the train command does (an MoE model's bf16 psums abort one of them)
        jax.config.update("jax_num_cpu_devices", n_devices)
        self.devices = jax.devices("cpu")
        self._hardware: dict[int, Any] = {}

    def predict(self, cfg) -> dict:
        from jaxtrain.parallel.dims import MeshShape, cpu_devices_per_process
        from jaxtrain.parallel.layout import resolve_auto
        from jaxtrain.planner.cost import measure
        from jaxtrain.planner.search import meshes as search

        n = cpu_devices_per_process(cfg)
        if n > len(self.devices):
            raise ConfigError(f"the run needs {n} devices but the sweep started {len(self.devices)}")
        devices = self.devices[:n]
        if n not in self._hardware:
            self._hardware[n] = measure.measure_cpu(devices)
        cfg = resolve_auto(cfg, "cpu")  # as the run will (Layout.build on CPU devices)
        shape = search.given_shape(cfg, n, nodes=MeshShape.resolve(cfg.mesh, n).num_nodes)
        return search.candidate_result(cfg, shape, self._hardware[n], search.compile_step(cfg, shape, devices))


def sweep(exp: Experiment, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
          predict: bool = True) -> tuple[list[Record], dict[str, str | None]]:
    """Run every run of the experiment, one process each. sweep.csv, sweep.md and sweep.png in exp.dir are rewritten
    after every run (an interrupted sweep keeps what it measured); returns the records and those paths."""
    runs = expand_runs(exp)
    os.makedirs(exp.dir, exist_ok=True)
    configs = {run.name: _load(exp, run) for run in runs}  # a bad config is recorded, not fatal
    from jaxtrain.parallel.dims import cpu_devices_per_process

    n_max = max([cpu_devices_per_process(c) for c in configs.values() if not isinstance(c, ConfigError)] or [1])
    predictor = Predictor(n_max) if predict else None
    records, paths = [], {}
    tty = sys.stderr.isatty()
    for i, run in enumerate(runs, 1):
        head = f"[{i}/{len(runs)}] {run.name}"
        cfg = configs[run.name]
        rec = Record(run.name, overrides=run.overrides, mesh=_mesh_of(cfg))
        if isinstance(cfg, ConfigError):
            rec.prediction_error = str(cfg)
        elif predictor is not None:
            log(f"{head}: planning")
            _predict_into(rec, predictor, cfg)
        records.append(_measure_into(rec, exp, run, cfg, head, log, tty))
        paths = write_outputs(exp, records)
    return records, paths


def _load(exp: Experiment, run: RunSpec):
    try:
        return load_config(exp.config, run.overrides)
    except ConfigError as e:
        return e


def _mesh_of(cfg) -> str:
    """The run's mesh label, or "" when its config or mesh is invalid (the run will say why)."""
    from jaxtrain.parallel.dims import MeshShape, cpu_devices_per_process

    if isinstance(cfg, ConfigError):
        return ""
    try:
        return MeshShape.resolve(cfg.mesh, cpu_devices_per_process(cfg)).label
    except ConfigError:
        return ""


def _predict_into(rec: Record, predictor: Predictor, cfg) -> None:
    try:
        p = predictor.predict(cfg)
    except ConfigError as e:
        rec.prediction_error = str(e)
        return
    except Exception as e:  # the planner failing on one shape must not stop the sweep
        rec.prediction_error = f"{type(e).__name__}: {one_line(e, 300)}"
        return
    rec.predicted_step_s = p["est_step_seconds"]
    rec.predicted_step_overlap_s = p["est_step_seconds_overlap"]
    rec.predicted_memory_bytes_per_device = p["memory_bytes_per_device"]
    rec.predicted_fits = p["fits"]


def _measure_into(rec: Record, exp: Experiment, run: RunSpec, cfg, head: str, log, tty: bool) -> Record:
    run_dir = os.path.join(exp.dir, "runs", run.name)
    rec.run_dir = run_dir
    if os.path.isdir(run_dir):  # a previous sweep's run of the same name: measure afresh
        shutil.rmtree(run_dir)
    total = cfg.train.steps if not isinstance(cfg, ConfigError) else 0

    def progress(step: int, loss: float | None) -> None:
        if tty:
            loss_text = f" loss {loss:.4f}" if loss is not None else ""
            print(f"\r{head}: step {step}/{total}{loss_text}   ", end="", file=sys.stderr, flush=True)

    log(f"{head}: training ({rec.mesh or 'invalid config'})")
    rec.load_avg = os.getloadavg()[0]
    status, stdout, stderr, rss, wall = run_training(train_command(exp, run, run_dir), run_dir, progress)
    if tty:
        print(file=sys.stderr)
    rec.wall_s, rec.peak_rss_bytes = wall, rss  # the child's peak RSS, also when it wrote no summary
    if status != 0:
        rec.status, rec.error = "failed", f"exit {status}: {last_error_line(stderr)}"
    summary = rundir.read_summary(run_dir)
    if summary is not None:
        for k, v in measurements(summary).items():
            setattr(rec, k, v)
    done = (f"median step {rec.median_step_s * 1e3:.1f} ms" if rec.median_step_s else "no step timed")
    pred = f", predicted {rec.predicted_step_s * 1e3:.1f} ms" if rec.predicted_step_s else ""
    log(f"{head}: {rec.status} in {wall:.1f} s; {done}{pred}" + (f"; {rec.error}" if rec.error else ""))
    return rec
