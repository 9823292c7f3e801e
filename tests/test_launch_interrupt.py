"""Ctrl-C on launch/local.sh from a terminal: the terminal signals the whole foreground process group (launcher,
processes and their output filters); the job must stop as a single process does: every process's "checkpoint
saved" line at the same step, and exit status 75 (EXIT_PREEMPTED: stopped before train.steps), from every process
and from the launcher."""

import os
import re
import signal
import subprocess

import pytest

from jaxtrain_testing import F32, REPO, launcher_env


@pytest.mark.slow
def test_ctrl_c_on_the_process_group_checkpoints_and_exits_75(tmp_path):
    proc = subprocess.Popen([os.path.join(REPO, "launch/local.sh"), "2", "train", f"run.dir={tmp_path}",
                             "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", "train.steps=2000",
                             "train.log_every=1", *F32], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=launcher_env(), start_new_session=True)
    seen = []
    for line in proc.stdout:  # until process 0 has logged step 3
        seen.append(line)
        if re.match(r"\[0\] step +3/", line):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the foreground group
    rest, _ = proc.communicate(timeout=300)
    out = "".join(seen) + rest
    assert proc.returncode == 75, out[-3000:]
    saved = {int(i): int(step) for i, step in
             re.findall(r"^\[(\d)\] .*stopped by a signal after step (\d+); checkpoint saved", out, re.M)}
    assert set(saved) == {0, 1} and len(set(saved.values())) == 1, out[-3000:]
    assert "exited with status" not in out and "Broken pipe" not in out
    # What happened, in words: not JAX's "SIGTERM caught" (SIGINT is passed on to its preemption service as SIGTERM).
    said = set(re.findall(r"^\[(\d)\] .*interrupted \(SIGINT\): saving step (\d+), then stopping$", out, re.M))
    assert said == {("0", str(saved[0])), ("1", str(saved[0]))}, out[-3000:]
    assert "SIGTERM caught" not in out, out[-3000:]
    assert os.path.isdir(tmp_path / "checkpoints" / str(saved[0]))

