"""Several real processes on 127.0.0.1 (launch/local.sh), a real one-node Slurm, and the Kubernetes manifest."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from conftest import REPO, run_cli

F32 = ["model.dtype=float32", "model.param_dtype=float32", "train.eval_every=0", "train.eval_batches=1"]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHON"] = sys.executable
    return env


def local(n, *args, timeout=600):
    return subprocess.run([os.path.join(REPO, "launch/local.sh"), str(n), *args], capture_output=True, text=True,
                          cwd=REPO, env=_env(), timeout=timeout)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoints_cross_process_counts(tmp_path):
    two = tmp_path / "two"
    proc = local(2, "train", f"run.dir={two}", "runtime.cpu_devices=4", "mesh.dcn.data=2", "mesh.ici.fsdp=4", *F32,
                 "train.steps=6", "checkpoint.every=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = tmp_path / "one"
    ref = run_cli("train", f"run.dir={one}", "runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=4", *F32,
                  "train.steps=9", "checkpoint.every=3")
    assert ref.returncode == 0, ref.stderr
    expected = _losses(one)
    got = _losses(two)
    np.testing.assert_allclose([got[s] for s in range(1, 7)], [expected[s] for s in range(1, 7)], rtol=1e-4)

    # Only process 0 writes metrics and progress; each process has its own log; their data rows are disjoint.
    assert "[0] step 6/6" in proc.stdout and "[1] step" not in proc.stdout
    rows = []
    for i in (0, 1):
        log = (two / "logs" / f"process_{i}.log").read_text()
        lo, hi = map(int, re.search(r"reads rows \[(\d+), (\d+)\)", log).groups())
        rows.append(set(range(lo, hi)))
    assert rows[0].isdisjoint(rows[1]) and rows[0] | rows[1] == set(range(16))

    # A checkpoint written by 2 processes resumes in 1 process ...
    resumed = run_cli("train", f"run.dir={two}", "runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=4", *F32,
                      "train.steps=9", "checkpoint.every=3")
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr
    got = _losses(two)
    np.testing.assert_allclose([got[s] for s in range(7, 10)], [expected[s] for s in range(7, 10)], rtol=1e-4)
    # ... and one written by 1 process resumes in 2.
    shutil.rmtree(one / "checkpoints" / "9")
    again = local(2, "train", f"run.dir={one}", "runtime.cpu_devices=4", "mesh.dcn.data=2", "mesh.ici.fsdp=4", *F32,
                  "train.steps=9", "checkpoint.every=3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    final = _losses(one)
    np.testing.assert_allclose([final[s] for s in range(7, 10)], [expected[s] for s in range(7, 10)], rtol=1e-4)


@pytest.mark.slow
def test_launcher_stops_the_job_when_a_process_is_killed(tmp_path):
    proc = subprocess.Popen([os.path.join(REPO, "launch/local.sh"), "2", "train", f"run.dir={tmp_path}",
                             "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", "train.steps=2000",
                             *F32], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env(),
                            start_new_session=True)
    deadline = time.time() + 300
    for line in proc.stdout:  # until process 0 has logged a step (steps are right-aligned: "step    2/2000")
        if re.match(r"\[0\] step +[2-9]/", line) or time.time() > deadline:
            break
    victim = subprocess.run(["pgrep", "-f", f"run.dir={tmp_path}"], capture_output=True, text=True).stdout.split()
    children = [p for p in victim if p != str(proc.pid)]
    os.kill(int(children[-1]), signal.SIGKILL)
    killed_at = time.time()
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - killed_at < 90
    assert "exited with status" in rest and "stopping the others" in rest


def test_distributed_settings_errors():
    from jaxtrain.config import ConfigError, load_config
    from jaxtrain.distributed import resolve

    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES set in the environment but not"):
        resolve(cfg.dist, {"JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID=2 must be below JAX_NUM_PROCESSES=2"):
        resolve(cfg.dist, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    s = resolve(cfg.dist, {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7",
                           "SLURM_PROCID": "1", "SLURM_LOCALID": "0"})
    assert s.source == "slurm" and s.coordinator == "n1:61447" and s.num_processes == 2
    s = resolve(load_config(None, ["dist.coordinator=10.0.0.1:1234", "dist.num_processes=4",
                                   "dist.process_id=3"]).dist, {})
    assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("10.0.0.1:1234", 4, 3, "config")
    assert resolve(cfg.dist, {}).source == "single"


def test_a_missing_coordinator_or_peer_ends_the_process_instead_of_hanging(tmp_path):
    # A worker whose coordinator never comes up: jaxtrain's own one-line error.
    env = _env() | {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "jaxtrain", "train", f"run.dir={tmp_path / 'a'}",
                           "dist.init_timeout_s=3"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert time.time() - start < 60
    last = proc.stderr.strip().splitlines()[-1]
    assert "process 1 of 2 could not reach the coordinator 127.0.0.1:1 within dist.init_timeout_s=3 s" in last
    # A coordinator whose peer never arrives: JAX ends it at the deadline (it aborts; jaxtrain said what it awaited).
    env = _env() | {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:%d" % _free_port(), "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": "0"}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "jaxtrain", "train", f"run.dir={tmp_path / 'b'}",
                           "dist.init_timeout_s=3"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode != 0 and time.time() - start < 60
    assert "all 2 processes must join within dist.init_timeout_s=3 s" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_check_on_8_devices(tmp_path):
    proc = run_cli("check", "runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2",
                   "check.sizes_mb=[0.25,1]", "check.iters=2", "check.matmul_size=256")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for axis in ("data", "fsdp", "tensor"):
        section = proc.stdout.split(f"axis {axis}:")[1].split("axis ")[0]
        for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
            rows = [r for r in section.splitlines() if r.startswith(f"| {op} |")]
            assert len(rows) == 2 and all(r.endswith("| ok |") for r in rows), section
            assert float(rows[-1].split("|")[5]) > 0  # busbw
    assert proc.stdout.count("| cpu:") == 8
    slow = run_cli("check", "runtime.cpu_devices=2", "mesh.ici.fsdp=2", "check.sizes_mb=[0.25]", "check.iters=2",
                   "check.matmul_size=256", "check.min_busbw_gbps=1000000")
    assert slow.returncode == 1
    assert "check failed: axis fsdp: all-reduce bus bandwidth" in slow.stderr


@pytest.mark.slow
def test_health_check_with_two_processes():
    proc = local(2, "check", "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", "check.sizes_mb=[0.25]",
                 "check.iters=2", "check.matmul_size=256")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[0] axis data: 2 devices (crosses hosts)" in proc.stdout
    assert "[0] [process 0/2] check passed" in proc.stdout and "[1] [process 1/2] check passed" in proc.stdout


@pytest.mark.slow
def test_real_slurm_runs_the_sbatch_script(tmp_path):
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs root and Debian's slurmctld/slurmd/slurm-client (.ci/run installs them)")
    cluster = tmp_path / "slurm"
    script = os.path.join(REPO, "tests/slurm/cluster.sh")
    up = subprocess.run([script, "start", str(cluster)], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    env = _env() | {"SLURM_CONF": str(cluster / "slurm.conf")}
    try:
        run_dir, out = tmp_path / "run", tmp_path / "job.out"
        submit = subprocess.run(
            ["sbatch", "--parsable", "--wait", "-N1", "--ntasks-per-node=2", "--overcommit", f"--output={out}",
             "--export=ALL", f"--chdir={REPO}", os.path.join(REPO, "launch/slurm.sbatch"), "train",
             f"run.dir={run_dir}", "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", "train.steps=4",
             *F32], capture_output=True, text=True, env=env, timeout=900)
        log = out.read_text() if out.exists() else ""
        assert submit.returncode == 0, submit.stderr + log[-3000:]
        job = submit.stdout.strip().split(";")[0]
        state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
        assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
        assert sorted(_losses(run_dir)) == [1, 2, 3, 4]
        assert "[process 1/2]" in log and "[process 0/2]" in log  # two processes really ran under srun
        assert sorted(os.listdir(run_dir / "logs")) == ["process_0.log", "process_1.log"]
    finally:
        subprocess.run([script, "stop", str(cluster)], timeout=60)
