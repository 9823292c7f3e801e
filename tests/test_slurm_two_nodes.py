"""The whole launch/slurm.sbatch flow on a real two-node Slurm 22.05 (two slurmd daemons on this machine, Slurm's
multiple-slurmd mode: tests/slurm/cluster.sh with NODES=2): health check, exclusion, training with one process per
node (mesh.dcn.data=2), a preemption, the requeue and an exact resume.

The two nodes share this machine's CPUs, address and port space; each process is started by its own node's slurmd,
sees that node's Slurm environment (SLURMD_NODENAME, SLURM_NODEID, SLURM_STEP_NODELIST) and drives its own 2 CPU
devices. Metrics endpoints are off (JAXTRAIN_METRICS_PORT=off): both nodes' task 0 would ask for the same port."""

import os
import re
import shutil
import socket
import subprocess
import time

import pytest
from test_multihost import job_state, sbatch

from jaxtrain_testing import F32, REPO, launcher_env, logged_losses

# The nodes tests/slurm/cluster.sh names (Slurm lists them sorted: localhost is node 0, the coordinator).
NODES = sorted(["localhost", socket.gethostname().split(".")[0]])
SBATCH = os.path.join(REPO, "launch/slurm.sbatch")
CHECK = ["check.sizes_mb=[0.25]", "check.iters=2", "check.matmul_size=256", "check.min_matmul_fraction=0"]
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
         "data.seq_len=32", "train.global_batch=8", "checkpoint.every=100000", "runtime.cpu_devices=2",
         "mesh.dcn.data=2", "mesh.ici.fsdp=2", *F32]


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    """A real two-node Slurm (tests/slurm/cluster.sh DIR 8 2); yields its environment."""
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs root and Debian's slurmctld/slurmd/slurm-client (.ci/run installs them)")
    if NODES[0] == NODES[1]:
        pytest.skip("this machine is called localhost: the two nodes need two names")
    cluster = tmp_path_factory.mktemp("slurm2")
    script = os.path.join(REPO, "tests/slurm/cluster.sh")
    up = subprocess.run([script, "start", str(cluster), "8", "2"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    yield launcher_env() | {"SLURM_CONF": str(cluster / "slurm.conf"), "JAX_PLATFORMS": "cpu",
                            "JAXTRAIN_METRICS_PORT": "off"}
    subprocess.run([script, "stop", str(cluster)], timeout=60)


def wait_for(predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline and not predicate():
        time.sleep(1)
    return predicate()


def logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


@pytest.mark.slow
def test_two_nodes_check_train_preempt_requeue_and_resume_exactly(slurm2, tmp_path):
    """A two-node job in partition `low` passes the health check (both nodes measured by name) and trains; a
    two-node job in `high` (the same training, uninterrupted, in another run directory: the reference) preempts it;
    the first job checkpoints at a step both processes agree on, exits 75, is requeued, checks again, resumes and
    finishes. Every logged loss equals the uninterrupted run's, bit for bit (JSON floats round-trip exactly)."""
    steps = 400  # ~50 ms a step here: the preemption arrives well before the end
    run, ref = tmp_path / "run", tmp_path / "ref"
    out, ref_out = tmp_path / "low.out", tmp_path / "high.out"
    submit, job = sbatch(slurm2, "-p", "low", "-N2", f"--output={out}", SBATCH, "train", f"run.dir={run}",
                         f"train.steps={steps}", *SMALL, *CHECK, wait=False)
    assert submit.returncode == 0, submit.stderr
    assert wait_for(lambda: logged_steps(run) >= 3, 400), (out.read_text() if out.exists() else "")[-3000:]
    high, high_job = sbatch(slurm2 | {"JAXTRAIN_CHECK": "0"}, "-p", "high", "-N2", f"--output={ref_out}", SBATCH,
                            "train", f"run.dir={ref}", f"train.steps={steps}", *SMALL, timeout=900)
    assert high.returncode == 0, high.stderr + ref_out.read_text()[-3000:]
    assert wait_for(lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", job_state(slurm2, job)), 900)
    state, log = job_state(slurm2, job), out.read_text()
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, state + log[-3000:]
    assert f"NodeList={NODES[0]},{NODES[1]}" in state  # both starts ran on the two nodes
    assert f"jaxtrain: job {job} on 2 node(s) ({NODES[0]},{NODES[1]}), restart 0;" in log
    assert f"jaxtrain: job {job} on 2 node(s) ({NODES[0]},{NODES[1]}), restart 1;" in log

    # Health check, at each start: one process per node, each measuring its own 2 devices under its node's name.
    assert log.count("check passed") == 2 and log.count("2 process(es) on 2 host(s), 4 cpu device(s)") == 2
    assert log.count("axis data: 2 devices (crosses hosts)") == 2
    assert log.count("axis fsdp: 2 devices (inside a host)") == 2
    for node in NODES:
        rows = re.findall(rf"^\| cpu:\d+ \| [\d.]+ \| [\d.e+-]+ \| {node} \|$", log, re.M)
        assert len(rows) == 4, (node, log[:4000])  # 2 devices x 2 starts
    # The roll call: both processes join the coordinator on node 0, at each step of each start (check, train).
    for process in (0, 1):
        assert len(re.findall(rf"\[process {process}/2\] joining the job at {NODES[0]}:\d+;", log)) == 4, log[:3000]

    # The preemption, the requeue and the resume.
    assert "stopped for preemption or the time limit (step exit 75); requeueing job" in log
    found = re.search(r"resumed from \S+/(\d+)", log)
    saved = int(found.group(1)) if found else None
    assert saved is not None and 3 <= saved < steps, log[-3000:]
    expected, got = logged_losses(ref), logged_losses(run)
    assert sorted(expected) == list(range(1, steps + 1)) and sorted(got) == sorted(expected)
    assert [got[s] for s in range(saved + 1, steps + 1)] == [expected[s] for s in range(saved + 1, steps + 1)]
    assert [got[s] for s in range(1, saved + 1)] == [expected[s] for s in range(1, saved + 1)]
    assert "Restarts=0" in job_state(slurm2, high_job)  # the reference ran once, uninterrupted
    print(f"preempted after step {saved} of {steps}; compile times (s), per process and start:",
          re.findall(r"compiled in ([\d.]+) s", log), "; summaries:", re.findall(r"^done: .*$", log, re.M))


@pytest.mark.slow
def test_two_nodes_health_check_excludes_the_nodes_it_names(slurm2, tmp_path):
    """The check fails on both nodes (a hardware file whose peak no CPU reaches; every miss counted, all nodes
    excludable): it names each node, and the batch script requeues its job held, excludes both nodes and releases
    it; the job then waits for other nodes (this cluster has none) and no training ran."""
    hw = tmp_path / "fast.yaml"
    hw.write_text("name: fast\ndevice_kind: cpu\npeak_flops: 1.0e+15\nhbm_bytes: 1.0e+9\nhbm_bandwidth: 1.0e+10\n"
                  "devices_per_node: 2\nintra_node_bandwidth: 1.0e+12\ninter_node_bandwidth: 1.0e+12\n"
                  "compute_efficiency: 0.5\n")
    out, both = tmp_path / "job.out", ",".join(NODES)
    submit, job = sbatch(slurm2, "-N2", f"--output={out}", SBATCH, "train", f"run.dir={tmp_path / 'run'}",
                         "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2", f"check.hardware={hw}",
                         *CHECK, "check.bound_misfit_fraction=1", "check.max_exclude_fraction=1", wait=False)
    assert submit.returncode == 0, submit.stderr
    try:
        assert wait_for(lambda: f"ExcNodeList={both}" in job_state(slurm2, job), 400), job_state(slurm2, job)
        time.sleep(5)  # the script releases the job right after updating it
        state, log = job_state(slurm2, job), out.read_text()
        assert "Restarts=1" in state and "JobState=PENDING" in state and "JobHeldUser" not in state, state
        assert f"check: exclude hosts: {both}" in log.splitlines(), log[-3000:]
        assert f"check FAILED on 2 node(s): {', '.join(NODES)} (lines above)" in log
        for i, node in enumerate(NODES):  # each node measured under its own name: alone, with the other, inside
            assert re.search(rf"^check failed: node {node}: device cpu:\d+: matmul [\d.]+ GFLOP/s is below", log, re.M)
            assert re.search(rf"^check: all-reduce between node {i} \({node}\) and its neighbours: with {1 - i}: "
                             r"[\d.e+-]+ GB/s, values ok \(bad\)$", log, re.M), log[-3000:]
            assert re.search(rf"^check: all-reduce inside node {node}: [\d.e+-]+ GB/s, values ok \(bad\)$", log, re.M)
            assert f"check: node {node} is to blame for: matmul peak" in log
        assert f"jaxtrain: health check failed on {both} (sbatch --exclude={both})" in log
        assert f"jaxtrain: job {job} excludes {both} and is released" in log
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no training ran
    finally:
        subprocess.run(["scancel", job], env=slurm2, timeout=60)
