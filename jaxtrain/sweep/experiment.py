"""Sweep: a real short training run per mesh (or other overrides), side by side with the planner's prediction.

Each run is its own process (``python -m jaxtrain train run.dir=... overrides...``), so a shape that fails (bad
config, out of memory, a crash in XLA) is recorded with its error and the sweep goes on. Each run's
``run.dir/summary.json`` (written by train) gives the measurements, and its ``metrics.jsonl`` the progress while it
runs; the planner (``jaxtrain.planner``) compiles the same step in this process for the prediction, with the CPU's
measured rates as the hardware.

An experiment file (YAML, read by ``schema.load_typed`` into :class:`ExperimentFile`)::

    name: cpu8-tiny
    config: null                  # base config file for every run (default: the built-in tiny config)
    dir: runs/sweep-cpu8-tiny     # sweep.csv, sweep.md, sweep.png, and runs/<name>/ for each run
    overrides: [runtime.cpu_devices=8, train.steps=12]   # every run
    runs:                         # a list, or "all": every mesh the planner finds valid
      - {name: data8, overrides: [mesh.ici.data=8, mesh.ici.fsdp=1]}
    remat: [none, full]           # optional: every run once per remat policy (model.remat)
    microbatches: [1, 4]          # optional: ... and per microbatch count (train.microbatches)

``remat`` and ``microbatches`` cross every run with each value (the planner's ``mesh.auto`` searches the same
axes), so a user can check the planner's choice on their own cluster.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxtrain import rundir
from jaxtrain.config import load_config
from jaxtrain.config.schema import find_yaml, load_typed
from jaxtrain.errors import ConfigError, one_line

_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass
class ExperimentFile:
    """The keys of an experiment file, as written."""

    name: str | None = None  # default: the file's stem
    config: str | None = None  # base config file or shipped name (default: the built-in tiny config)
    dir: str | None = None  # default: runs/sweep-<name>
    overrides: list[str] | None = None  # every run
    runs: Any = "all"  # a list of {name, overrides}, or "all"
    remat: list[str] | None = None  # every run once per model.remat policy
    microbatches: list[int] | None = None  # every run once per train.microbatches count


@dataclass
class RunSpec:
    name: str
    overrides: list[str]  # the experiment's, then the run's own


@dataclass
class Experiment:
    name: str
    config: str | None
    dir: str
    overrides: list[str]
    runs: list[RunSpec] | str  # or "all"
    axes: list[list[tuple[str, str]]] = field(default_factory=list)  # [(name suffix, override)] per crossed axis


@dataclass
class Record:
    """One row of the sweep: what was run, what was measured, what the planner predicted."""

    name: str
    mesh: str = ""
    status: str = "ok"  # ok | failed
    error: str = ""
    compile_s: float | None = None
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    peak_rss_bytes: int | None = None
    final_loss: float | None = None
    steps_measured: int = 0
    predicted_step_s: float | None = None
    predicted_step_overlap_s: float | None = None
    predicted_memory_bytes_per_device: int | None = None
    predicted_fits: bool | None = None
    prediction_error: str = ""
    wall_s: float | None = None
    load_avg: float | None = None  # the host's 1-minute load average when the run started (a shared machine's noise)
    run_dir: str = ""
    overrides: list[str] = field(default_factory=list)

    @property
    def measured_over_predicted(self) -> float | None:
        if self.median_step_s and self.predicted_step_s:
            return self.median_step_s / self.predicted_step_s
        return None


# ---------------------------------------------------------------------------------------------------------------
# The experiment file


def _string_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise ConfigError(f"{where} must be a list of key=value strings")
    return list(value)


def load_experiment(path: str, extra_overrides: Sequence[str] = (), directory: str | None = None) -> Experiment:
    """Read and check an experiment file (a path, or a shipped name such as ``cpu8-tiny``); ``extra_overrides``
    (command line) apply to every run, last."""
    path = find_yaml(path, "experiments", "experiment file")
    raw = load_typed(path, ExperimentFile, "experiment file")
    if any(o.partition("=")[0].strip() == "run.dir" for o in extra_overrides):
        raise ConfigError("run.dir is set per run by the sweep; use --dir for the sweep's directory")
    name = raw.name or Path(path).stem
    common = _string_list(raw.overrides, "overrides") + list(extra_overrides)
    runs_raw = raw.runs
    if runs_raw == "all":
        runs: list[RunSpec] | str = "all"
    elif isinstance(runs_raw, list) and runs_raw:
        runs = [_run_spec(i, r, common) for i, r in enumerate(runs_raw)]
        names = [r.name for r in runs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"experiment file {path!r}: run names must be unique, repeated: {', '.join(dupes)}")
    else:
        raise ConfigError(f"experiment file {path!r}: runs must be a non-empty list or 'all'")
    config = raw.config
    if config is not None:
        try:
            config = find_yaml(config, "", "config")
        except ConfigError:
            pass  # not a shipped name either: reported as a missing file below
        if not os.path.isfile(config):
            raise ConfigError(f"experiment file {path!r}: config file {raw.config!r} does not exist")
    return Experiment(name, config, directory or raw.dir or f"runs/sweep-{name}", common, runs,
                      _crossed_axes(path, raw))


def _crossed_axes(path: str, raw: ExperimentFile) -> list[list[tuple[str, str]]]:
    """The ``remat`` and ``microbatches`` lists as [(run name suffix, override)] per axis."""
    from jaxtrain.planner.space import REMATS

    axes = []
    if raw.remat is not None:
        bad = [r for r in raw.remat if r not in REMATS]
        if not raw.remat or bad:
            raise ConfigError(f"experiment file {path!r}: remat={raw.remat!r} must be a non-empty list of "
                              f"{', '.join(REMATS)}")
        axes.append([(f"remat_{r}", f"model.remat={r}") for r in raw.remat])
    if raw.microbatches is not None:
        if not raw.microbatches or not all(isinstance(k, int) and k >= 1 for k in raw.microbatches):
            raise ConfigError(f"experiment file {path!r}: microbatches={raw.microbatches!r} must be a non-empty "
                              "list of integers >= 1")
        axes.append([(f"mb{k}", f"train.microbatches={k}") for k in raw.microbatches])
    return axes


def cross(runs: list[RunSpec], axes: list[list[tuple[str, str]]]) -> list[RunSpec]:
    """Every run once per combination of the crossed axes' values, named ``<run>-<suffix>...``."""
    for axis in axes:
        runs = [RunSpec(f"{r.name}-{suffix}", r.overrides + [override]) for r in runs for suffix, override in axis]
    return runs


def _run_spec(index: int, raw: Any, common: list[str]) -> RunSpec:
    if not isinstance(raw, dict) or set(raw) - {"name", "overrides"}:
        raise ConfigError(f"runs[{index}] must be a mapping with 'name' and 'overrides'")
    own = _string_list(raw.get("overrides"), f"runs[{index}].overrides")
    name = str(raw.get("name") or f"run{index}")
    if not _NAME_RE.match(name):
        raise ConfigError(f"runs[{index}].name={name!r} may only use letters, digits and _ . + -")
    if any(o.partition("=")[0].strip() == "run.dir" for o in own):
        raise ConfigError(f"runs[{index}] sets run.dir; the sweep places each run under its own directory")
    return RunSpec(name, common + own)


def expand_runs(exp: Experiment) -> list[RunSpec]:
    """The experiment's runs; for ``all``, one per mesh the planner finds valid on the configured devices."""
    if not isinstance(exp.runs, str):
        return cross(list(exp.runs), exp.axes)
    from jaxtrain.parallel.dims import cpu_devices_per_process
    from jaxtrain.planner.search import enumerate_shapes

    cfg = load_config(exp.config, exp.overrides)
    return cross([RunSpec(re.sub(r"[^A-Za-z0-9_.+-]+", "_", shape.label), exp.overrides + shape.overrides())
                  for shape in enumerate_shapes(cfg, cpu_devices_per_process(cfg), nodes=1)], exp.axes)


# ---------------------------------------------------------------------------------------------------------------
# Running one training process


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


# ---------------------------------------------------------------------------------------------------------------
# The planner's prediction


class Predictor:
    """The planner in this process: compiles each run's step on emulated CPU devices, with measured CPU rates."""

    def __init__(self, n_devices: int):
        import jax

        jax.config.update("jax_num_cpu_devices", n_devices)
        self.devices = jax.devices("cpu")
        self._hardware: dict[int, Any] = {}

    def predict(self, cfg) -> dict:
        from jaxtrain.parallel.dims import MeshShape, cpu_devices_per_process
        from jaxtrain.parallel.layout import resolve_auto
        from jaxtrain.planner import measure, search

        n = cpu_devices_per_process(cfg)
        if n > len(self.devices):
            raise ConfigError(f"the run needs {n} devices but the sweep started {len(self.devices)}")
        devices = self.devices[:n]
        if n not in self._hardware:
            self._hardware[n] = measure.measure_cpu(devices)
        cfg = resolve_auto(cfg, "cpu")  # as the run will (Layout.build on CPU devices)
        shape = search.given_shape(cfg, n, nodes=MeshShape.resolve(cfg.mesh, n).num_nodes)
        return search.candidate_result(cfg, shape, self._hardware[n], search.compile_step(cfg, shape, devices))


# ---------------------------------------------------------------------------------------------------------------
# The sweep


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


# ---------------------------------------------------------------------------------------------------------------
# Outputs

CSV_FIELDS = ["name", "mesh", "status", "error", "compile_s", "median_step_s", "predicted_step_s",
              "predicted_step_overlap_s", "measured_over_predicted", "tokens_per_s", "peak_rss_bytes",
              "predicted_memory_bytes_per_device", "predicted_fits", "final_loss", "steps_measured",
              "prediction_error", "wall_s", "load_avg", "run_dir", "overrides"]


def write_outputs(exp: Experiment, records: list[Record]) -> dict[str, str | None]:
    """sweep.csv, sweep.md and sweep.png (None when matplotlib is missing) in exp.dir."""
    paths: dict[str, str | None] = {"csv": os.path.join(exp.dir, "sweep.csv"), "md": os.path.join(exp.dir, "sweep.md")}
    write_csv(os.path.join(exp.dir, "sweep.csv"), records)
    with open(os.path.join(exp.dir, "sweep.md"), "w") as f:
        f.write(markdown(exp, records))
    paths["png"] = write_chart(os.path.join(exp.dir, "sweep.png"), exp.name, records)
    return paths


def _row(rec: Record) -> dict:
    row = {k: getattr(rec, k) for k in CSV_FIELDS}
    row["overrides"] = " ".join(rec.overrides)
    return row


def write_csv(path: str, records: list[Record]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for rec in records:
            writer.writerow({k: "" if v is None else v for k, v in _row(rec).items()})


def _num(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "" if x is None else spec.format(x * scale)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(exp: Experiment, records: list[Record]) -> str:
    """The sweep as a Markdown table, with a note of how each column was obtained."""
    lines = [f"# Sweep `{exp.name}`", "",
             "| run | mesh | status | compile s | median step ms | predicted ms | measured / predicted | tokens/s | "
             "peak RSS MB | predicted MB/device | final loss | load avg |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        cells = [r.name, _md_cell(r.mesh), r.status, _num(r.compile_s, "{:.2f}"), _num(r.median_step_s, "{:.1f}", 1e3),
                 _num(r.predicted_step_s, "{:.1f}", 1e3), _num(r.measured_over_predicted, "{:.2f}"),
                 _num(r.tokens_per_s, "{:,.0f}"), _num(r.peak_rss_bytes, "{:,.0f}", 1e-6),
                 _num(r.predicted_memory_bytes_per_device, "{:,.1f}", 1e-6), _num(r.final_loss, "{:.4f}"),
                 _num(r.load_avg, "{:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    problems = [(r.name, r.error or r.prediction_error) for r in records if r.error or r.prediction_error]
    if problems:
        lines += ["", "Errors:", ""] + [f"- `{n}`: {_md_cell(e)}" for n, e in problems]
    lines += ["",
              "Measured: one `python -m jaxtrain train` process per run; compile time, median step time and "
              "tokens/s from its `summary.json` (the step is compiled ahead of time, so every step is timed); peak "
              "RSS of the whole process (all emulated devices plus the runtime). Predicted: `jaxtrain plan` for the "
              "same config with the CPU's measured matmul rate, memory bandwidth and collective latency shared by the "
              "devices, no overlap. Load avg: the host's 1-minute load when the run started (on a shared machine, "
              "steps slow down with it).",
              ""]
    return "\n".join(lines)


def write_chart(path: str, title: str, records: list[Record]) -> str | None:
    """Measured and predicted step time per run, as grouped bars (failed runs labelled). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: sweep.png not written: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    names = [r.name for r in records]
    measured = [(r.median_step_s or 0) * 1e3 for r in records]
    predicted = [(r.predicted_step_s or 0) * 1e3 for r in records]
    x = range(len(records))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(records) + 2), 4.5))
    width = 0.38
    ax.bar([i - width / 2 for i in x], measured, width, label="measured (median step)")
    ax.bar([i + width / 2 for i in x], predicted, width, label="predicted (plan, no overlap)")
    top = max(measured + predicted + [1.0])
    for i, r in enumerate(records):
        if r.status != "ok":
            ax.text(i, top * 0.05, "failed", ha="center", rotation=90, color="red")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"sweep {title}: measured vs predicted step time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
