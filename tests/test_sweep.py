"""The sweep: experiment files, measurements read back from real runs' summary.json, one failing run recorded,
outputs."""

import csv
import json
import os

import pytest
import yaml

from jaxtrain import rundir
from jaxtrain.config import ConfigError, load_config
from jaxtrain.parallel.dims import MESH_AXES
from jaxtrain.sweep import run as sweep_run
from jaxtrain.sweep import spec
from jaxtrain_testing import REPO, run_cli


def write(tmp_path, body, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return str(path)


@pytest.mark.parametrize("body, expected", [
    ({"runz": []}, "unknown keys: runz"),
    ({"runs": [{"name": "a"}, {"name": "a"}]}, "run names must be unique, repeated: a"),
    ({"runs": [{"name": "a", "overrides": ["run.dir=/x"]}]}, "sets run.dir"),
    ({"runs": [{"name": "a b"}]}, "may only use letters"),
    ({"runs": []}, "runs must be a non-empty list or 'all'"),
    ({"overrides": ["train.steps"]}, "overrides must be a list of key=value strings"),
    ({"config": "nope.yaml"}, "config file 'nope.yaml' does not exist"),
])
def test_bad_experiment_files(tmp_path, body, expected):
    with pytest.raises(ConfigError, match=expected):
        spec.load_experiment(write(tmp_path, body))


def test_shipped_example_is_valid_for_8_devices():
    exp = spec.load_experiment(os.path.join(REPO, "configs/experiments/cpu8-tiny.yaml"))
    runs = spec.expand_runs(exp)
    assert len(runs) >= 4
    for run in runs:
        cfg = load_config(exp.config, run.overrides)
        assert cfg.runtime.cpu_devices == 8 and cfg.train.steps <= 20


def test_all_expands_to_the_planners_meshes(tmp_path):
    exp = spec.load_experiment(write(tmp_path, {"overrides": ["runtime.cpu_devices=2"], "runs": "all"}))
    names = sorted(r.name for r in spec.expand_runs(exp))
    # a pipeline needs 2 microbatches; context waits until each group holds one sequence (16 here)
    assert names == sorted(f"{ax}2" for ax in MESH_AXES if ax not in ("stage", "context", "expert"))  # expert: MoE


def test_measurements_from_summary(tmp_path):
    """A run's summary.json (rundir.Summary, written and read back) gives the record's measurements; no summary,
    none."""
    assert rundir.read_summary(str(tmp_path)) is None
    rundir.Summary(mesh={}, devices=1, processes=1, start_step=0, last_step=4, steps_timed=4, compile_seconds=2.51,
                   step_seconds={"median": 0.2, "p10": 0.1, "p90": 0.3, "max": 0.3}, tokens_per_second=5000.0,
                   mfu=None, final_loss=3.0, final_eval_loss=None, compiled_memory_bytes_per_device=None,
                   device_peak_bytes=None, host_peak_rss_bytes=123456789, preempted_at=None, goodput={},
                   goodput_wall_seconds=1.0, recomputed_steps=0).write(str(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text())["tokens_per_second"] == 5000.0
    s = sweep_run.measurements(rundir.read_summary(str(tmp_path)))
    assert s == {"compile_s": 2.51, "median_step_s": 0.2, "tokens_per_s": 5000.0, "final_loss": 3.0,
                 "steps_measured": 4, "peak_rss_bytes": 123456789}
    assert sweep_run.last_error_line("noise\nerror: model.n_heads=8 is not divisible\n") == \
        "error: model.n_heads=8 is not divisible"
    traceback = "Traceback (most recent call last):\n  x\nValueError: boom\n"
    assert sweep_run.last_error_line(traceback) == "ValueError: boom"


@pytest.mark.slow
def test_sweep_runs_isolated_and_records_a_failure(tmp_path):
    """Two real runs on 2 emulated devices: one trains, one has an impossible mesh; the sweep finishes both."""
    exp = write(tmp_path, {
        "name": "t",
        "overrides": ["runtime.cpu_devices=2", "train.steps=4", "train.eval_every=0", "train.eval_batches=1",
                      "data.threads=0", "checkpoint.every=0", "train.log_every=1"],
        "runs": [{"name": "fsdp2", "overrides": ["mesh.ici.fsdp=2"]},
                 {"name": "tensor3", "overrides": ["mesh.ici.fsdp=1", "mesh.ici.tensor=3"]}],
    })
    out = tmp_path / "sweep"
    proc = run_cli("sweep", "--config", exp, "--dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "1 of 2 run(s) ok, failed: tensor3" in proc.stdout
    with open(out / "sweep.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    ok, bad = rows["fsdp2"], rows["tensor3"]
    assert ok["status"] == "ok" and ok["mesh"] == "fsdp2"
    for key in ("compile_s", "median_step_s", "tokens_per_s", "peak_rss_bytes", "final_loss", "predicted_step_s",
                "predicted_memory_bytes_per_device"):
        assert float(ok[key]) > 0, key
    # The step is compiled ahead of time, so every step is timed; the figures are the run's own summary.json.
    summary = json.loads((out / "runs/fsdp2/summary.json").read_text())
    assert int(ok["steps_measured"]) == summary["steps_timed"] == 4
    assert float(ok["median_step_s"]) == summary["step_seconds"]["median"]
    metrics_loss = [line for line in (out / "runs/fsdp2/metrics.jsonl").read_text().splitlines() if line]
    assert len(metrics_loss) == 4
    assert bad["status"] == "failed" and "the mesh (ici.tensor=3) has 3 devices but 2 are available" in bad["error"]
    assert "exit 2" in bad["error"] and bad["predicted_step_s"] == ""
    md = (out / "sweep.md").read_text()
    assert "| fsdp2 | fsdp2 | ok |" in md and "tensor3" in md
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_cli_bad_input():
    proc = run_cli("sweep", "--config", "configs/experiments/missing.yaml")
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: experiment file 'configs/experiments/missing.yaml' does not exist"


def test_remat_and_microbatch_axes_cross_every_run(tmp_path):
    exp = spec.load_experiment(write(tmp_path, {
        "overrides": ["runtime.cpu_devices=2"], "remat": ["none", "full"], "microbatches": [1, 2],
        "runs": [{"name": "fsdp2", "overrides": ["mesh.ici.fsdp=2"]}]}))
    runs = spec.expand_runs(exp)
    assert [r.name for r in runs] == ["fsdp2-remat_none-mb1", "fsdp2-remat_none-mb2", "fsdp2-remat_full-mb1",
                                      "fsdp2-remat_full-mb2"]
    cfg = load_config(exp.config, runs[3].overrides)
    assert (cfg.model.remat, cfg.train.microbatches, cfg.mesh.ici.fsdp) == ("full", 2, 2)


@pytest.mark.parametrize("body, expected", [
    ({"remat": ["fast"]}, r"remat=\['fast'\] must be a non-empty list of none, save_matmuls, full"),
    ({"microbatches": [0]}, r"microbatches=\[0\] must be a non-empty list of integers >= 1"),
    ({"microbatches": []}, r"microbatches=\[\] must be a non-empty list"),
])
def test_bad_crossed_axes(tmp_path, body, expected):
    with pytest.raises(ConfigError, match=expected):
        spec.load_experiment(write(tmp_path, body))
