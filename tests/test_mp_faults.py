"""Faults in multi-process jobs, injected for real at seeded random points (launch/local.sh with 2 and 4 processes,
and a real one-node Slurm): a process killed (SIGKILL) or frozen (SIGSTOP, its sockets left open, as a process stuck
in a collective looks) at a random step, possibly while an asynchronous checkpoint save is in flight, and a
checkpoint directory that turns read-only under one process only (its own mount namespace).

Every test prints its seed; ``JAXTRAIN_FAULT_SEED=<seed> pytest -m slow tests/test_mp_faults.py`` replays it.
The reference for the resumed run's losses is the faulted run itself before the fault (an uninterrupted run up to
that step, same processes, same data order): the recomputed steps must match it bit for bit.
"""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_multihost import job_state, sbatch, slurm  # noqa: F401  (slurm: the real one-node cluster fixture)

from jaxtrain import rundir
from jaxtrain.checkpoint import format as ckpt
from jaxtrain_testing import REPO, launcher_env

SEED = int(os.environ.get("JAXTRAIN_FAULT_SEED") or random.SystemRandom().randrange(2**31))
HEARTBEAT_S = 10  # dist.heartbeat_timeout_s of these jobs (with 5 s, a start-up at a load of 20 on 2 cores missed it)
# The bound stated in docs/failures.md: every surviving process has exited within heartbeat + this (measured here
# ~1-3 s past the heartbeat; the margin covers a machine loaded by other jobs, and the launcher's own stop).
EXIT_BOUND_S = 30
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
        "data.seq_len=32", "train.global_batch=4", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
        "model.dtype=float32", "model.param_dtype=float32", "train.warmup_steps=5", "train.decay_steps=200",
        "runtime.cpu_devices=1", "mesh.ici.fsdp=1", "checkpoint.every=3", "checkpoint.keep=3",
        f"dist.heartbeat_timeout_s={HEARTBEAT_S}"]
LONG = 5000  # train.steps of a faulted run: far more than it runs before the fault


def _rng(name: str) -> random.Random:
    print(f"fault seed {SEED} (replay: JAXTRAIN_FAULT_SEED={SEED})")
    return random.Random(f"{SEED}:{name}")


def _args(run, n, steps):
    return ["train", f"run.dir={run}", f"mesh.dcn.data={n}", *TINY, f"train.steps={steps}"]


def _logged_steps(out_file) -> int:
    found = re.findall(r"^\[0\] step +(\d+)/", open(out_file).read(), re.M)
    return int(found[-1]) if found else 0


def _wait_for(predicate, timeout, what, out_file=None, job=None):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline or (job is not None and job.poll() is not None):
            tail = open(out_file).read()[-3000:] if out_file else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.05)


def _processes(run, id_var) -> dict[int, int]:
    """process id -> pid of the jaxtrain Python processes of ``run`` (found through /proc, under any launcher)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"python" in os.path.basename(argv[0]) and f"run.dir={run}".encode() in argv and id_var.encode() in env:
            found[int(env[id_var.encode()])] = int(pid)
    return found


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    """The launcher's environment with one compilation cache for every job of this module (the faulted run and its
    resumption compile the same steps), and a short grace for the processes the launcher stops."""
    return launcher_env() | {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")), "GRACE_S": "3"}


def _start_local(n, args, out_file, env):
    return subprocess.Popen([os.path.join(REPO, "launch/local.sh"), str(n), *args], stdout=open(out_file, "w"),
                            stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)


def _inject(rng, run, n, out_file, sig, job, id_var="JAX_PROCESS_ID"):
    """Wait for a random step, send ``sig`` to a random process; returns (victim, its pid, survivors' pids, time)."""
    every = 3
    k = rng.randrange(4, 13)
    if rng.random() < 0.5:
        k -= k % every  # right after a save began: the fault lands while it is written in the background
    _wait_for(lambda: _logged_steps(out_file) >= k, 600, f"step {k}", out_file, job)
    time.sleep(rng.uniform(0, 0.05))
    pids = _processes(run, id_var)
    assert sorted(pids) == list(range(n)), pids
    victim = rng.randrange(n)
    os.kill(pids[victim], sig)
    at = time.time()
    print(f"{signal.Signals(sig).name} to process {victim} of {n} at logged step {_logged_steps(out_file)} "
          f"(waited for {k})")
    return victim, pids[victim], [p for i, p in pids.items() if i != victim], at


def _survivors_exit(survivors, at, out_file):
    _wait_for(lambda: not any(map(_alive, survivors)), HEARTBEAT_S + EXIT_BOUND_S + 60, "the survivors", out_file)
    took = time.time() - at
    print(f"every other process exited {took:.1f} s after the fault (heartbeat {HEARTBEAT_S} s)")
    assert took < HEARTBEAT_S + EXIT_BOUND_S, open(out_file).read()[-3000:]


def _check_resume(run, n, fault_log, resumed_log, before):
    """The resumed run restored the newest step every process finished writing, and recomputed the lost steps
    exactly as the uninterrupted run (``before``: its losses) computed them."""
    found = re.search(r"resumed from (\S+)/(\d+)\n", resumed_log)
    restored = int(found.group(2)) if found else 0  # a fault before the first save completed: a fresh start
    # Every process's shards and its array metadata are in the restored step (each process writes its own).
    step_dir = os.path.join(run, "checkpoints", str(restored))
    for i in range(n if restored else 0):
        assert os.path.isfile(os.path.join(step_dir, "state", f"ocdbt.process_{i}", "manifest.ocdbt")), i
    assert restored == fault_log["newest"], (restored, fault_log)
    after = {r["step"]: r["loss"] for r in rundir.read_metrics(run)}
    overlap = [s for s in sorted(before) if restored < s <= max(after)]
    assert overlap or max(before) == restored
    assert [after[s] for s in overlap] == [before[s] for s in overlap]  # bit-exact
    lost = max(before) - restored
    summary = rundir.read_summary(run)
    assert summary is not None and summary.recomputed_steps == lost == summary.lost_work["steps"], summary
    print(f"resumed from step {restored}; work lost: {lost} step(s) recomputed, bit-equal to the first run's")
    return lost


def _fault_then_resume(tmp_path, env, n, sig, name):
    rng = _rng(name)
    run, out = tmp_path / "run", tmp_path / "fault.out"
    job = _start_local(n, _args(run, n, LONG), out, env)
    try:
        _, victim_pid, survivors, at = _inject(rng, run, n, out, sig, job)
        _survivors_exit(survivors, at, out)
        rc = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if sig == signal.SIGSTOP and _alive(victim_pid):
            os.kill(victim_pid, signal.SIGKILL)
    text = out.read_text()
    assert rc != 0, text[-3000:]
    if sig == signal.SIGSTOP:  # a survivor ended itself (the launcher only stops the others once one has ended)
        assert re.search(r"launch/local.sh: process \d+ exited with status [1-9]", text), text[-3000:]
    before = {r["step"]: r["loss"] for r in rundir.read_metrics(run)}
    newest = max(ckpt.existing_steps(str(run / "checkpoints")), default=0)
    partial = [d for d in os.listdir(run / "checkpoints") if "tmp" in d]
    print(f"after the fault: complete steps up to {newest}, unfinished: {partial or 'none'}")
    resumed = subprocess.run([os.path.join(REPO, "launch/local.sh"), str(n),
                              *_args(run, n, max(before) + 1)], capture_output=True, text=True, cwd=REPO,
                             env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return _check_resume(str(run), n, {"newest": newest}, resumed.stdout + resumed.stderr, before)


@pytest.mark.slow
def test_a_killed_process_stops_the_job_and_the_next_start_resumes_exactly(tmp_path, job_env):
    _fault_then_resume(tmp_path, job_env, 2, signal.SIGKILL, "kill-2")


@pytest.mark.slow
def test_a_frozen_process_stops_the_job_within_the_heartbeat_and_the_next_start_resumes_exactly(tmp_path, job_env):
    _fault_then_resume(tmp_path, job_env, 4, signal.SIGSTOP, "stop-4")


@pytest.mark.slow
def test_a_read_only_checkpoint_directory_on_one_process_stops_the_job_naming_it(tmp_path, job_env):
    """The checkpoint directory turns read-only for one process only (a bind mount in that process's own mount
    namespace, remounted read-only mid-run): that process stops at its next step with one line naming itself and
    the path, the job ends, and the steps saved before stay complete."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter") or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root with mount namespaces (unshare, nsenter)")
    rng = _rng("read-only")
    n, run, out = 2, tmp_path / "run", tmp_path / "fault.out"
    ckdir = run / "checkpoints"
    ckdir.mkdir(parents=True)
    faulty = rng.randrange(n)
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/usr/bin/env bash
if [ "$JAX_PROCESS_ID" = {faulty} ]; then
  exec unshare -m --propagation private bash -c 'mount --bind {ckdir} {ckdir} && exec "$0" "$@"' {sys.executable} "$@"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    job = _start_local(n, _args(run, n, LONG), out, env=job_env | {"PYTHON": str(wrapper)})
    try:
        k = rng.randrange(4, 10)
        _wait_for(lambda: _logged_steps(out) >= k, 600, f"step {k}", out, job)

        # Every save so far finished, its step directory renamed into place, before the remount: the directory
        # turning read-only between a save's last write and that rename hangs the job instead (seen once on a
        # loaded machine: step 3 not yet in place at step 5; an open bug, not what this test is about).
        def settled():
            steps = ckpt.existing_steps(str(ckdir))
            return bool(steps) and max(steps) >= 3 * (_logged_steps(out) // 3)

        _wait_for(settled, 120, "every checkpoint save so far complete", out, job)
        pid = _processes(run, "JAX_PROCESS_ID")[faulty]
        # A mount cannot turn read-only while a file on it is open for writing (EBUSY, mount's status 32): an
        # asynchronous save may be writing at this moment, so retry until the writers are gone.
        remount = ["nsenter", "-t", str(pid), "-m", "mount", "-o", "remount,bind,ro", str(ckdir)]
        _wait_for(lambda: subprocess.run(remount, capture_output=True).returncode == 0, 120,
                  "a moment with no checkpoint file open for writing", out, job)
        saved_before = ckpt.existing_steps(str(ckdir))
        print(f"checkpoint directory read-only for process {faulty} at logged step {_logged_steps(out)}; saved: "
              f"{saved_before}")
        rc = job.wait(timeout=HEARTBEAT_S + EXIT_BOUND_S + 120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = out.read_text()
    assert rc != 0
    errors = [line for line in text.splitlines() if line.startswith(f"[{faulty}] error:")]
    assert len(errors) == 1 and f"[process {faulty}/{n}] a checkpoint save in {ckdir} failed" in errors[0] \
        and "Read-only file system" in errors[0] and str(ckdir) in errors[0], text[-3000:]
    print(errors[0])
    # It stopped right after the first save that could not be written (the next multiple of 3 after the steps
    # already saved, or the one in flight), not minutes later.
    assert _logged_steps(out) <= max(saved_before, default=0) + 2 * 3 + 1, (saved_before, _logged_steps(out))
    # Nothing earlier is lost: the newest step saved before is still there, and every listed step is readable
    # (checkpoint.keep=3 may have retired an older one if a save in flight at the fault still completed).
    left = ckpt.existing_steps(str(ckdir))
    assert saved_before and max(saved_before) in left, (saved_before, left)
    assert all(ckpt._metadata_damage(str(ckdir), step) is None for step in left)


@pytest.mark.slow
def test_real_slurm_a_frozen_task_stops_the_job_and_the_next_job_resumes_exactly(slurm, tmp_path):  # noqa: F811
    rng = _rng("slurm-stop")
    n, run, out = 2, tmp_path / "run", tmp_path / "job.out"
    env = slurm | {"JAXTRAIN_CHECK": "0", "JAXTRAIN_METRICS_PORT": "off", "JAXTRAIN_NO_REQUEUE": "1"}
    submit, job = sbatch(env, "-N1", f"--ntasks-per-node={n}", f"--output={out}",
                         os.path.join(REPO, "launch/slurm.sbatch"), *_args(run, n, LONG), wait=False)
    assert submit.returncode == 0, submit.stderr
    _wait_for(lambda: out.exists(), 120, "the job's output")
    # Slurm's output carries no "[i] " prefix: only process 0 logs steps.
    steps = lambda: int((re.findall(r"^step +(\d+)/", out.read_text(), re.M) or ["0"])[-1])  # noqa: E731
    k = rng.randrange(4, 13)
    _wait_for(lambda: steps() >= k, 600, f"step {k}", out)
    pids = _processes(run, "SLURM_PROCID")
    victim = rng.randrange(n)
    os.kill(pids[victim], signal.SIGSTOP)
    at = time.time()
    print(f"SIGSTOP to Slurm task {victim} of {n} at logged step {steps()} (waited for {k})")
    try:
        _survivors_exit([p for i, p in pids.items() if i != victim], at, out)
        _wait_for(lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", job_state(env, job)), 120, "the job")
    finally:
        if _alive(pids[victim]):
            os.kill(pids[victim], signal.SIGKILL)
    assert "JobState=FAILED" in job_state(env, job), out.read_text()[-3000:]
    before = {r["step"]: r["loss"] for r in rundir.read_metrics(run)}
    newest = max(ckpt.existing_steps(str(run / "checkpoints")), default=0)
    again = tmp_path / "again.out"
    submit, job = sbatch(env, "-N1", f"--ntasks-per-node={n}", f"--output={again}",
                         os.path.join(REPO, "launch/slurm.sbatch"), *_args(run, n, max(before) + 1), timeout=600)
    assert submit.returncode == 0, again.read_text()[-3000:]
    _check_resume(str(run), n, {"newest": newest}, again.read_text(), before)
