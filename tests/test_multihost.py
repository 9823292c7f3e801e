"""Several real processes on 127.0.0.1 (launch/local.sh), a real one-node Slurm, and the Kubernetes manifest."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from test_launchers import HGX, fake_sysfs

from jaxtrain_testing import F32, REPO, launch_local, launcher_env, logged_losses, run_cli


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoints_cross_process_counts(tmp_path):
    two = tmp_path / "two"
    proc = launch_local(2, "train", f"run.dir={two}", "runtime.cpu_devices=4", "mesh.dcn.data=2", "mesh.ici.fsdp=4",
                        *F32, "train.steps=6", "checkpoint.every=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = tmp_path / "one"
    ref = run_cli("train", f"run.dir={one}", "runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=4", *F32,
                  "train.steps=9", "checkpoint.every=3")
    assert ref.returncode == 0, ref.stderr
    expected = logged_losses(one)
    got = logged_losses(two)
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
    got = logged_losses(two)
    np.testing.assert_allclose([got[s] for s in range(7, 10)], [expected[s] for s in range(7, 10)], rtol=1e-4)
    # ... and one written by 1 process resumes in 2.
    shutil.rmtree(one / "checkpoints" / "9")
    again = launch_local(2, "train", f"run.dir={one}", "runtime.cpu_devices=4", "mesh.dcn.data=2", "mesh.ici.fsdp=4",
                         *F32, "train.steps=9", "checkpoint.every=3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr
    final = logged_losses(one)
    np.testing.assert_allclose([final[s] for s in range(7, 10)], [expected[s] for s in range(7, 10)], rtol=1e-4)


@pytest.mark.slow
def test_launcher_stops_the_job_when_a_process_is_killed(tmp_path):
    proc = subprocess.Popen([os.path.join(REPO, "launch/local.sh"), "2", "train", f"run.dir={tmp_path}",
                             "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", "train.steps=2000",
                             *F32], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=launcher_env(), start_new_session=True)
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
    from jaxtrain.cluster.distributed import resolve
    from jaxtrain.config import ConfigError, load_config

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


# Slow pass: real processes waiting out a start-up deadline (13 s); the roll call's decisions are tested by default.
@pytest.mark.slow
def test_a_missing_coordinator_or_peer_ends_the_process_instead_of_hanging(tmp_path):
    # A worker whose coordinator never comes up: jaxtrain's own one-line error.
    env = launcher_env() | {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "jaxtrain", "train", f"run.dir={tmp_path / 'a'}",
                           "dist.init_timeout_s=3"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert time.time() - start < 60
    last = proc.stderr.strip().splitlines()[-1]
    assert "process 1 of 2 could not reach the coordinator 127.0.0.1:1 within dist.init_timeout_s=3 s" in last
    # A 3-process job whose process 2 is never started: at the deadline the coordinator and the worker that did
    # join both end with one line naming process 2 (JAX alone aborts every process, exit 134, naming no one).
    # A batch that 3 processes can split: the config is checked before anyone waits for the job to form.
    # 6 s: both start together, and process 1 must find process 0 listening within its own timeout.
    job = launcher_env() | {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": "3"}
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", f"run.dir={tmp_path / 'b'}",
                               "train.global_batch=12", "dist.init_timeout_s=6"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=job | {"JAX_PROCESS_ID": str(i)}) for i in (0, 1)]
    outs = [p.communicate(timeout=120)[1] for p in procs]
    assert time.time() - start < 60
    for p, err in zip(procs, outs):
        assert p.returncode == 1 and "Traceback" not in err, err[-2000:]
        assert "all 3 processes must join within dist.init_timeout_s=6 s" in err
        assert err.strip().splitlines()[-1].startswith(
            f"error: process(es) 2 of 3 never joined the job at {job['JAX_COORDINATOR_ADDRESS']} within "
            "dist.init_timeout_s=6 s (joined: 0-1)"), err[-2000:]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("claims, expected", [
    ([("3", "1"), ("4", "2")], "process 2 on {host} says the job has 4 processes, process 0 on {host} says 3"),
    ([("3", "1"), ("3", "1")], "process id 1 was claimed twice, by {host} and by {host}: ids must be distinct"),
])
def test_the_roll_call_stops_a_job_whose_processes_disagree(claims, expected):
    """Every process that reported gets process 0's verdict, and process 0 raises it too: one line each."""
    import threading

    from jaxtrain.cluster import distributed
    from jaxtrain.config import load_config
    from jaxtrain.errors import DistributedError

    port = _free_port()
    dist = load_config(None, []).dist
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}
    host = distributed.resolve(dist, environ=env | {"JAX_NUM_PROCESSES": claims[0][0], "JAX_PROCESS_ID": "0"})
    workers = [distributed.resolve(dist, environ=env | {"JAX_NUM_PROCESSES": n, "JAX_PROCESS_ID": i})
               for n, i in claims]
    got: dict = {}

    def run(key, fn, settings):
        try:
            fn(settings, 20)
        except DistributedError as e:
            got[key] = str(e)

    threads = [threading.Thread(target=run, args=("host", distributed._roll_call_host, host))]
    threads += [threading.Thread(target=run, args=(k, distributed._roll_call_worker, w)) for k, w in enumerate(workers)]
    for t, pause in zip(threads, (0.3, 1.0, 0)):  # in order: the second claim is the one process 0 refuses
        t.start()
        time.sleep(pause)
    for t in threads:
        t.join(30)
    raised = got.pop("host")
    assert expected.format(host=socket.gethostname()) in raised
    assert len(got) == 2 and set(got.values()) == {raised}, got  # every worker heard the same verdict


def test_start_up_timeouts_default_to_jaxs_own():
    """120 / 30 s were below JAX's 300 / 100 s; a container start on many nodes can skew by minutes."""
    import inspect

    import jax

    from jaxtrain.cluster import distributed
    from jaxtrain.config import load_config

    params = inspect.signature(jax.distributed.initialize).parameters
    assert (params["initialization_timeout"].default, params["heartbeat_timeout_seconds"].default) == (300, 100)
    assert distributed.jax_timeouts(load_config(None, []).dist) == (300, 100)
    set_by_user = load_config(None, ["dist.init_timeout_s=900", "dist.heartbeat_timeout_s=60"]).dist
    assert distributed.jax_timeouts(set_by_user) == (900, 60)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Slow pass (keeps the default suite under 10 minutes); the verdict and grouping are tested by default in
# tests/test_health.py, a whole check by test_health_check_bounds_from_a_hardware_file.
@pytest.mark.slow
def test_health_check_on_8_devices(tmp_path):
    proc = run_cli("check", f"run.dir={tmp_path}/a", "runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=2",
                   "mesh.ici.tensor=2",
                   "check.sizes_mb=[0.25,1]", "check.iters=2", "check.matmul_size=256", "check.min_matmul_fraction=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for axis in ("data", "fsdp", "tensor"):
        section = proc.stdout.split(f"axis {axis}:")[1].split("axis ")[0]
        for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
            rows = [r for r in section.splitlines() if r.startswith(f"| {op} |")]
            assert len(rows) == 2 and all(r.endswith("| ok |") for r in rows), section
            assert float(rows[-1].split("|")[5]) > 0  # busbw
    assert proc.stdout.count("| cpu:") == 8
    # A bound the only node misses, counted as a failure (bound_misfit_fraction=1): the check fails, but the CPU's
    # kind is in no hardware file, so nobody is excluded.
    slow = run_cli("check", f"run.dir={tmp_path}/b", "runtime.cpu_devices=2", "mesh.ici.fsdp=2",
                   "check.sizes_mb=[0.25]", "check.iters=2",
                   "check.matmul_size=256", "check.min_busbw_gbps=1000000", "check.bound_misfit_fraction=1")
    assert slow.returncode == 1
    assert re.search(r"check failed: node \S+: axis fsdp: all-reduce bus bandwidth", slow.stderr)
    assert "nobody is excluded" in slow.stdout and "exclude hosts" not in slow.stdout


@pytest.mark.slow
def test_health_check_with_two_processes(tmp_path):
    proc = launch_local(2, "check", f"run.dir={tmp_path}", "runtime.cpu_devices=2", "mesh.dcn.data=2",
                        "mesh.ici.fsdp=2",
                        "check.sizes_mb=[0.25]", "check.iters=2", "check.matmul_size=256",
                        "check.min_matmul_fraction=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[0] axis data: 2 devices (inside a host)" in proc.stdout  # two processes, one host name
    # One verdict for the job: process 0 says it, process 1 agrees silently (same exit status).
    assert "[0] check passed" in proc.stdout and proc.stdout.count("check passed") == 1


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real one-node Slurm 22.05 (tests/slurm/cluster.sh) with 8 stand-in GPUs as GRES; yields its environment."""
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs root and Debian's slurmctld/slurmd/slurm-client (.ci/run installs them)")
    cluster = tmp_path_factory.mktemp("slurm")
    script = os.path.join(REPO, "tests/slurm/cluster.sh")
    up = subprocess.run([script, "start", str(cluster), "8"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    # CPU JAX here: the launcher's environment file says JAX_PLATFORMS=cuda, and the user's value wins.
    yield launcher_env() | {"SLURM_CONF": str(cluster / "slurm.conf"), "JAX_PLATFORMS": "cpu"}
    subprocess.run([script, "stop", str(cluster)], timeout=60)


def sbatch(env, *args, wait=True, timeout=900):
    """sbatch from the repository root (the launcher finds launch/jaxtrain.env through SLURM_SUBMIT_DIR)."""
    proc = subprocess.run(["sbatch", "--parsable", *(["--wait"] if wait else []), "--export=ALL", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    return proc, proc.stdout.strip().split(";")[0]


def job_state(env, job):
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout


@pytest.mark.slow
def test_real_slurm_runs_the_sbatch_script(slurm, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    # The check step reads them too. Two processes time their matmuls at once on shared cores, so their rates are
    # not comparable here: the median test is off, as in the other multi-process checks.
    check = ["check.sizes_mb=[0.25]", "check.iters=2", "check.matmul_size=256", "check.min_matmul_fraction=0"]
    submit, job = sbatch(slurm, "-N1", "--ntasks-per-node=2", f"--output={out}",
                         os.path.join(REPO, "launch/slurm.sbatch"), "train", f"run.dir={run_dir}",
                         "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", "train.steps=4", *check, *F32,
                         "observe.prometheus_linger_s=0")  # the sbatch serves metrics: no linger at the end
    log = out.read_text() if out.exists() else ""
    assert submit.returncode == 0, submit.stderr + log[-3000:]
    state = job_state(slurm, job)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
    assert log.count("check passed") == 1  # the health check step: one verdict for the job, from process 0
    assert sorted(logged_losses(run_dir)) == [1, 2, 3, 4]
    assert "[process 1/2]" in log and "[process 0/2]" in log  # two processes really ran under srun
    assert sorted(os.listdir(run_dir / "logs")) == ["process_0.log", "process_1.log"]
    assert "jax-cache" in log and (run_dir / "jax-cache").is_dir()  # the compilation cache lives in the run
    # The node's 16 CPUs (tests/slurm/cluster.sh) split over its 2 tasks, given to both steps.
    assert "jaxtrain: 2 task(s) per node, 8 CPU(s) each, --cpu-bind=" in log


LAYOUTS = {  # sbatch options -> per task (CUDA_VISIBLE_DEVICES, local_device_ids) as a function of the local id
    "one task per node": (["--ntasks-per-node=1"], lambda i: ("0,1,2,3,4,5,6,7", list(range(8)))),
    "one task per GPU": (["--ntasks-per-node=8"], lambda i: ("0,1,2,3,4,5,6,7", [i])),
    "one task per GPU, bound": (["--ntasks-per-node=8", "--gpus-per-task=1"], lambda i: (str(i), [0])),
}
# The CPUs and binding each layout's steps get on this node (16 CPUs) if it were an HGX node (tests/test_launchers.py's
# made-up sysfs: GPUs 0-3 on NUMA node 0, 4-7 on node 1): worked by hand.
LAYOUT_CPUS = {  # one process driving all 8 GPUs spans both NUMA nodes: it keeps every core
    "one task per node": "1 task(s) per node, 16 CPU(s) each, --cpu-bind=cores (a task's GPUs span NUMA nodes: "
                         "0 0 0 0 1 1 1 1)",
    "one task per GPU": "8 task(s) per node, 2 CPU(s) each, --cpu-bind=map_ldom:0,0,0,0,1,1,1,1 (NUMA nodes of the 8 "
                        "GPUs: 0 0 0 0 1 1 1 1)",
    "one task per GPU, bound": "8 task(s) per node, 2 CPU(s) each, --cpu-bind=map_ldom:0,0,0,0,1,1,1,1 (NUMA nodes of "
                               "the 8 GPUs: 0 0 0 0 1 1 1 1)"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_slurm_gpu_layouts_as_each_task_sees_them(slurm, tmp_path, layout):
    options, expected = LAYOUTS[layout]
    out = tmp_path / "env.out"
    sysfs = fake_sysfs(tmp_path / "sys", HGX)
    # Each task's output in a file of its own (srun reads SLURM_STDOUTMODE as -o): srun splits lines over 1 KiB
    # into messages, and 8 tasks' env --json lines (about 1.2 KB each) would interleave in one stream.
    tasks = tmp_path / "task-%t.out"
    submit, job = sbatch(slurm | {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=", "JAXTRAIN_SYSFS": sysfs,
                                  "SLURM_STDOUTMODE": str(tasks)}, "-N1", *options,
                         f"--output={out}", os.path.join(REPO, "launch/slurm.sbatch"), "env", "--json", timeout=300)
    log = out.read_text()
    assert submit.returncode == 0, submit.stderr + log[-3000:]
    lines = [line for f in sorted(tmp_path.glob("task-*.out")) for line in f.read_text().splitlines()]
    rows = sorted((json.loads(line) for line in lines if line.startswith("{")), key=lambda r: r["process_id"])
    n = len(rows)
    assert n == (1 if "--ntasks-per-node=1" in options else 8)
    assert [r["process_id"] for r in rows] == list(range(n)) and {r["num_processes"] for r in rows} == {n}
    assert len({r["coordinator"] for r in rows}) == 1
    if n > 1:  # JAX's own rule: first node of the step, port 61440 + job id % 4096
        assert rows[0]["coordinator"] == f"{socket.gethostname().split('.')[0]}:{61440 + int(job) % 4096}"
    for i, r in enumerate(rows):  # on one node the local id is the process id
        assert (r["cuda_visible_devices"], r["local_device_ids"]) == expected(i), r
        assert r["sources"]["local_device_ids"].startswith("slurm:") or n == 1
        assert r["platform"] == "cpu"  # the user's JAX_PLATFORMS beat the file's cuda
    # The launcher put the file's XLA flags first and the user's last (XLA applies the last).
    assert "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=" in log
    # srun took the binding (this cluster's task/none cannot apply it and says so) and every task ran.
    assert f"jaxtrain: {LAYOUT_CPUS[layout]}" in log


@pytest.mark.slow
def test_real_slurm_steps_get_the_container_and_the_batch_script_does_not(slurm, tmp_path):
    """pyxis is not installable here: tests/slurm/pyxis_srun.sh, first on PATH as `srun`, records each step's
    options, applies pyxis' environment rule for an image that sets XLA_FLAGS and NCCL_DEBUG (the image's value wins
    unless named in --container-env) and runs the step through the real srun without the container options. The
    step carries the image, the container's name, mounts, workdir and --container-env; the batch script runs on the
    host (it calls the host's srun, and sbatch got no container option); each task sees the environment file's
    NCCL_DEBUG, not the image's, and XLA_FLAGS layered: the image's, then the file's."""
    real = shutil.which("srun", path=slurm["PATH"])
    bin_dir, calls = tmp_path / "bin", tmp_path / "srun-calls"
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to(os.path.join(REPO, "tests/slurm/pyxis_srun.sh"))
    image_env = tmp_path / "image.env"
    image_env.write_text("XLA_FLAGS=--xla_gpu_enable_triton_gemm=false\nNCCL_DEBUG=INFO\n")
    python = tmp_path / "python"  # each task's environment, then the real command
    python.write_text(f'#!/usr/bin/env bash\nenv -0 > {tmp_path}/env-$SLURM_PROCID\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    image = "registry.example.com#acme/jaxtrain@sha256:" + "0123456789abcdef" * 4
    env = slurm | {"PATH": f"{bin_dir}:{slurm['PATH']}", "PYTHON": str(python), "JAXTRAIN_IMAGE": image,
                   "JAXTRAIN_CONTAINER_MOUNTS": f"{REPO}:{REPO},{tmp_path}:{tmp_path}", "PYXIS_STUB_LOG": str(calls),
                   "PYXIS_STUB_SRUN": real, "PYXIS_STUB_IMAGE_ENV": str(image_env)}
    out = tmp_path / "job.out"
    submit, job = sbatch(env, "-N1", "--ntasks-per-node=2", f"--output={out}",
                         os.path.join(REPO, "launch/slurm.sbatch"), "env", "--json", timeout=300)
    log = out.read_text()
    assert submit.returncode == 0, submit.stderr + log[-3000:]
    assert "--container" not in " ".join(submit.args)  # the batch script was not started in a container
    (step,) = [shlex.split(line) for line in calls.read_text().splitlines()]
    opts = dict(a[2:].split("=", 1) for a in step if a.startswith("--container"))
    assert opts["container-image"] == image and opts["container-name"].startswith("jaxtrain-")
    assert opts["container-mounts"] == f"{REPO}:{REPO},{tmp_path}:{tmp_path}" and opts["container-workdir"] == REPO
    assert {"NCCL_DEBUG", "JAX_PLATFORMS", "JAXTRAIN_XLA_FLAGS"} <= set(opts["container-env"].split(","))
    rows = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert sorted(r["process_id"] for r in rows) == [0, 1]  # the step ran its 2 tasks through the real srun
    for task in (0, 1):
        seen = dict(item.split("=", 1) for item in (tmp_path / f"env-{task}").read_text().split("\0") if "=" in item)
        assert seen["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
        assert seen["NCCL_DEBUG"] == "WARN" and seen["JAX_PLATFORMS"] == "cpu"  # the file's; the user's
    assert "jaxtrain: each step runs in the container" in log


@pytest.mark.slow
def test_real_slurm_sees_exit_75_when_srun_kills_the_later_tasks(slurm, tmp_path):
    """Two tasks stop early (exit 75) 3 s apart: --kill-on-bad-exit terminates the second on the first's 75 and srun
    returns 143; the script still knows the run stopped early (requeue path, job exit 75)."""
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\nsleep $((SLURM_PROCID * 3 + 1)); exit 75\n")
    stub.chmod(0o755)
    out = tmp_path / "job.out"
    submit, job = sbatch(slurm | {"PYTHON": str(stub), "JAXTRAIN_CHECK": "0", "JAXTRAIN_METRICS_PORT": "off",
                                  "JAXTRAIN_NO_REQUEUE": "1"}, "-N1", "--ntasks-per-node=2", f"--output={out}",
                         os.path.join(REPO, "launch/slurm.sbatch"), "train", timeout=300)
    log = out.read_text()
    assert submit.returncode == 75, submit.stderr + log[-3000:]
    assert "task 1: Terminated" in log  # srun did kill the later task (otherwise this test shows nothing)
    assert "stopped for preemption or the time limit (step exit 143); not requeueing (JAXTRAIN_NO_REQUEUE=1)" in log
    assert "ExitCode=75:0" in job_state(slurm, job)


@pytest.mark.slow
def test_real_slurm_requeues_after_a_preemption_signal(slurm, tmp_path):
    """A job in partition `low` is preempted by one in `high`: Slurm signals the batch shell
    (preempt_send_user_signal), jaxtrain checkpoints at an agreed step and exits 75, the job is requeued, and the
    second run resumes from that checkpoint, loading its compiled step from the cache in the run directory."""
    run_dir, out = tmp_path / "run", tmp_path / "low.out"
    small = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
             "data.seq_len=32", "train.global_batch=4", "train.eval_every=0", "checkpoint.every=100000"]
    steps = 30000  # far more than run before the preemption arrives (~2 ms per step here)
    submit, job = sbatch(slurm | {"JAXTRAIN_CHECK": "0"}, "-p", "low", "-N1", f"--output={out}",
                         os.path.join(REPO, "launch/slurm.sbatch"), "train", f"run.dir={run_dir}",
                         f"train.steps={steps}", "runtime.cpu_devices=1", *small, "observe.prometheus_linger_s=0",
                         wait=False)
    assert submit.returncode == 0, submit.stderr
    deadline = time.time() + 300
    while time.time() < deadline and not re.search(r"step +\d+/", out.read_text() if out.exists() else ""):
        time.sleep(1)
    assert "RUNNING" in job_state(slurm, job), out.read_text()[-2000:]
    high, _ = sbatch(slurm, "-p", "high", "-N1", "--gpus-per-node=8", f"--output={tmp_path / 'high.out'}",
                     "--wrap", "sleep 1", timeout=600)
    assert high.returncode == 0, high.stderr
    deadline = time.time() + 900
    while time.time() < deadline and not re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", job_state(slurm, job)):
        time.sleep(2)
    state, log = job_state(slurm, job), out.read_text()
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, state + log[-3000:]
    found = re.search(r"resumed from \S+/(\d+)", log)
    saved = int(found.group(1)) if found else None
    assert saved is not None and 0 < saved < steps, log[-3000:]
    assert "restart 1;" in log and "stopped for preemption or the time limit (step exit 75)" in log
    assert max(logged_losses(run_dir)) == steps
    # Both starts compiled through the persistent cache in the run directory (the second one loads from it; the
    # times are printed, not asserted: docs/results.md has the measured figures).
    assert any((run_dir / "jax-cache").iterdir())
    print("compile times, first and requeued start:", re.findall(r"compiled train and eval steps in ([\d.]+) s", log))


def test_health_check_bounds_from_a_hardware_file(tmp_path):
    """A hardware file's peak and link rates are absolute bounds: a node whose devices all miss them is named."""
    hw = tmp_path / "slow-cpu.yaml"
    hw.write_text("name: slow-cpu\ndevice_kind: cpu\npeak_flops: 1.0e+15\nhbm_bytes: 1.0e+9\n"
                  "hbm_bandwidth: 1.0e+10\ndevices_per_node: 2\nintra_node_bandwidth: 1.0e+12\n"
                  "inter_node_bandwidth: 1.0e+12\ncompute_efficiency: 0.5\n")
    # No relative matmul bound: on a loaded machine one emulated device can fall under half the median (docs).
    args = [f"run.dir={tmp_path}/run", "runtime.cpu_devices=2", "mesh.ici.fsdp=2", "check.sizes_mb=[0.25]",
            "check.iters=2", "check.matmul_size=256", "check.min_matmul_fraction=0"]
    # The job's only node misses them all: the bounds do not fit this hardware, nobody is excluded, the check passes.
    fits = run_cli("check", *args, f"check.hardware={hw}")
    assert fits.returncode == 0, fits.stdout[-2000:] + fits.stderr[-2000:]
    assert "check: matmul peak (check.min_peak_fraction=0.5 of slow-cpu's peak): missed on 1 of 1 node(s), more " \
           "than check.bound_misfit_fraction=0.5: the bound does not fit this hardware" in fits.stdout
    assert "check: all-reduce over axis fsdp (check.min_link_fraction=0.5 of slow-cpu's intra-node link): missed " \
           "on 1 of 1 node(s)" in fits.stdout
    assert "exclude hosts" not in fits.stdout
    # Every miss counted and a cap that allows the one node: it is named and excluded.
    proc = run_cli("check", *args, f"check.hardware={hw}", "check.bound_misfit_fraction=1",
                   "check.max_exclude_fraction=1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "below 500000.0" in proc.stderr  # 0.5 x 1e15 FLOP/s in GFLOP/s
    node = socket.gethostname().split(".")[0]
    assert f"check: exclude hosts: {node}" in proc.stdout.splitlines()
    assert re.search(r"check: all-reduce inside node \S+: [\d.e+-]+ GB/s, values ok \(bad\)", proc.stdout)


@pytest.mark.slow
def test_health_check_names_nodes_with_pairwise_sub_checks(tmp_path):
    """4 processes as 4 nodes (named through SLURMD_NODENAME, as Slurm names them): an axis across nodes that misses
    its bound is re-measured pair by pair between ring neighbours, really (sub-meshes of two nodes' devices). Every
    node's pairs all miss (a bound no link here reaches): the bound does not fit, nobody is excluded, the check
    passes."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", "check", f"run.dir={tmp_path}", "runtime.cpu_devices=2", "mesh.dcn.data=4",
         "mesh.ici.fsdp=2",
         "check.sizes_mb=[0.25]", "check.iters=2", "check.matmul_size=256", "check.min_busbw_gbps=1000000",
         "check.min_matmul_fraction=0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env=launcher_env() | {"SLURMD_NODENAME": f"gpu{i:03d}", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                      "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": str(i)}) for i in range(4)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-3000:]
        left, right = (i - 1) % 4, (i + 1) % 4
        line = next(x for x in out.splitlines() if x.startswith(f"check: all-reduce between node {i} (gpu{i:03d})"))
        assert f"with {min(left, right)}:" in line and f"with {max(left, right)}:" in line and line.count("(bad)") == 2
        assert "exclude hosts" not in out
    assert "check: all-reduce over axis data (check.min_busbw_gbps): missed on 4 of 4 node(s)" in outs[0]
    assert "check passed (bounds that do not fit this hardware: see above)" in outs[0]


@pytest.mark.slow
def test_health_check_groups_processes_by_host_name(tmp_path):
    """One process per device, 4 processes on 2 hosts (host names injected through SLURMD_NODENAME, which the check
    reads as Slurm sets it): the axis whose processes share a host is judged against the intra-node link, the other
    against the NIC, and the host whose intra-node link misses (here: both, by a bound only the intra-node link
    carries; misfits off) is named once, with both of its processes' measurements."""
    hw = tmp_path / "two-links.yaml"
    hw.write_text("name: two-links\ndevice_kind: cpu\npeak_flops: 1.0e+6\nhbm_bytes: 1.0e+9\nhbm_bandwidth: 1.0e+10\n"
                  "devices_per_node: 2\nintra_node_bandwidth: 1.0e+15\ninter_node_bandwidth: 1.0\n"
                  "compute_efficiency: 0.5\n")
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", "check", f"run.dir={tmp_path}/run", "runtime.cpu_devices=1",
         "mesh.dcn.data=2", "mesh.dcn.fsdp=2",
         "check.sizes_mb=[0.25]", "check.iters=2", "check.matmul_size=64", f"check.hardware={hw}",
         "check.bound_misfit_fraction=1", "check.max_exclude_fraction=1", "check.min_matmul_fraction=0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env=launcher_env() | {"SLURMD_NODENAME": f"host{i // 2}", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                              "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": str(i)}) for i in range(4)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [1] * 4, outs[0][-3000:]
    out = outs[0]
    assert "4 process(es) on 2 host(s)" in out
    # Processes 0,1 (host0) and 2,3 (host1) are neighbours along fsdp: NVLink's bound; data pairs 0-2 and 1-3.
    assert "axis fsdp: 2 devices (inside a host); bound 500000.00 GB/s (check.min_link_fraction=0.5 of " \
           "two-links's intra-node link)" in out
    assert "axis data: 2 devices (crosses hosts); bound 0.00 GB/s (check.min_link_fraction=0.5 of two-links's " \
           "inter-node link)" in out
    assert out.splitlines().count("check: exclude hosts: host0,host1") == 1
    blame = [x for x in out.splitlines() if x.startswith("check: node host")]
    assert len(blame) == 2 and all("over axis fsdp" in x and "axis data" not in x for x in blame), blame


@pytest.mark.slow
def test_real_slurm_excludes_the_node_the_health_check_names(slurm, tmp_path):
    """The check step fails on a node (here: a hardware file whose peak this CPU cannot reach); the batch script
    requeues its job held, adds the node to its ExcNodeList (Slurm refuses that while the job runs, accepts it once
    the job is requeued) and releases it, with no helper job; it then waits for other nodes (this cluster has
    none)."""
    hw = tmp_path / "fast.yaml"
    hw.write_text("name: fast\ndevice_kind: cpu\npeak_flops: 1.0e+15\nhbm_bytes: 1.0e+9\nhbm_bandwidth: 1.0e+10\n"
                  "devices_per_node: 1\nintra_node_bandwidth: 1.0e+9\ninter_node_bandwidth: 1.0e+9\n"
                  "compute_efficiency: 0.5\n")
    out = tmp_path / "job.out"
    submit, job = sbatch(slurm, "-N1", f"--output={out}", os.path.join(REPO, "launch/slurm.sbatch"), "train",
                         f"run.dir={tmp_path / 'run'}", "runtime.cpu_devices=1", f"check.hardware={hw}",
                         "check.sizes_mb=[0.25]", "check.iters=2", "check.matmul_size=256",
                         # one node missing a bound: counted (not a misfit) and excludable (cap: all of 1 node)
                         "check.bound_misfit_fraction=1", "check.max_exclude_fraction=1", wait=False)
    assert submit.returncode == 0, submit.stderr
    node = socket.gethostname().split(".")[0]
    deadline = time.time() + 300
    while time.time() < deadline and not re.search(rf"ExcNodeList={node}\b.*", job_state(slurm, job)):
        time.sleep(2)
    time.sleep(5)  # the script releases the job right after updating it
    state, log = job_state(slurm, job), out.read_text()
    try:
        assert f"ExcNodeList={node}" in state and "Restarts=1" in state, state + log[-3000:]
        assert "JobState=PENDING" in state and "JobHeldUser" not in state, state  # released, waiting for nodes
        assert f"jaxtrain: health check failed on {node} (sbatch --exclude={node})" in log
        assert "requeueing job" in log and not (tmp_path / "run" / "metrics.jsonl").exists()  # no training ran
        # The job itself did it, before Slurm's SIGKILL (KillWait=5 here): no other job was ever submitted.
        assert f"jaxtrain: job {job} excludes {node} and is released" in log, log[-3000:]
        jobs = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, env=slurm).stdout
        assert jobs.split() == [job, "jaxtrain"], jobs
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, env=slurm).stdout
        next_id = re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", config)
        assert next_id and next_id.group(1) == str(int(job) + 1), config
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=60)
