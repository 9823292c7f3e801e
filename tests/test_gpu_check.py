"""benchmarks/gpu_check.sh's arguments and its budget bookkeeping (results.jsonl), on CPU. The whole --smoke run is
tests/test_flash_attention.py::test_gpu_check_script_smoke_runs_every_section (slow pass)."""

import json
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.sh")


@pytest.mark.parametrize("args, message", [
    (["--budget", "ten"], "--budget 'ten' must be whole seconds"),
    (["--wheels", "/nonexistent/wheels"], "--wheels '/nonexistent/wheels' is not a directory"),
    (["--fast"], "unknown argument '--fast'"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    proc = subprocess.run(["bash", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_spent_budget_skips_every_section_and_records_it(tmp_path):
    """With a 1 s budget the set-up runs (imports, versions, the env verdict) and every section after it is
    recorded as skipped, one JSON line each, in the order of their value; nothing fails."""
    proc = subprocess.run(["bash", SCRIPT, "--smoke", "--budget", "1", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["section"] for r in lines] == ["setup", "step-auto", "step-triton", "step-pallas", "kernel-tests",
                                             "bench", "step-xla", "train-xla", "train-pallas"]
    assert lines[0]["status"] == "ok" and lines[0]["gpu_verdict"]  # the env report rides on the set-up line
    smoke_only = {"step-triton", "step-pallas", "step-xla"}  # not run in --smoke at all
    assert all(r["status"] == ("skipped: --smoke" if r["section"] in smoke_only else "skipped") for r in lines[1:])
    assert "0 section(s) failed" in proc.stdout
