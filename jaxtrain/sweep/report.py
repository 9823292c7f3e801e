"""The sweep's report: one :class:`Record` per run (what was run, what it measured, what the planner predicted),
written after every run as ``sweep.csv``, ``sweep.md`` (a Markdown table with a note on how each column was
obtained) and ``sweep.png`` (measured against predicted step time, when matplotlib is installed).
"""

from __future__ import annotations

import csv
import os
import sys
from dataclasses import dataclass, field

from jaxtrain.sweep.spec import Experiment


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
