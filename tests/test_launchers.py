"""The launchers' shared environment file and scripts, checked without a cluster. The Kubernetes JobSet is checked
against JobSet's CRD and webhook rules in tests/test_jobset.py."""

import os
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from jaxtrain_testing import REPO

LAUNCH = os.path.join(REPO, "launch")


def env_file() -> dict:
    """launch/jaxtrain.env read the way kustomize's `envs:` reads it: KEY=VALUE lines, # comments, split at the
    first '='."""
    out = {}
    for line in open(os.path.join(LAUNCH, "jaxtrain.env")):
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), line
            out[key] = value
    return out


def jobset():
    (doc,) = yaml.safe_load_all(open(os.path.join(LAUNCH, "k8s", "jaxtrain.yaml")))
    return doc


def test_environment_file_keeps_only_production_settings():
    env = env_file()
    assert env["JAX_PLATFORMS"] == "cuda"
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"].split()
    # Below 0.9: NVLink SHARP, on by default on NVSwitch nodes in NVIDIA's JAX images since 25.10, needs GPU memory
    # outside XLA's pool (JAX-Toolbox's GPU performance guide: reduce the fraction; "0.9 or 0.8").
    assert 0.75 < float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) < 0.9
    # NCCL's "Debugging" variables and cluster-specific device/interface choices are not defaults.
    for name in ("NCCL_NET_GDR_LEVEL", "NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME",
                 "NCCL_IB_TIMEOUT"):
        assert name not in env


def _sbatch_environment(extra):
    """Run the sbatch script's environment block (everything before the first srun) and print the result."""
    script = open(os.path.join(LAUNCH, "slurm.sbatch")).read()
    block = script.split("PYTHON=")[0]
    env = {"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": REPO} | extra
    proc = subprocess.run(["bash", "-c", block + '\nenv', "sbatch", "train", "run.dir=/shared/r1"],
                          capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def test_sbatch_exports_the_file_and_lets_the_user_win():
    file = env_file()
    got = _sbatch_environment({"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false",
                               "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"})
    for key, value in file.items():
        if key not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
            assert got[key] == value
    assert got["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.7" != file["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    # The user's flag comes last, so XLA applies it last.
    assert got["XLA_FLAGS"] == file["XLA_FLAGS"] + " --xla_gpu_enable_latency_hiding_scheduler=false"
    assert got["JAX_COMPILATION_CACHE_DIR"] == "/shared/r1/jax-cache"
    missing = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "train"], capture_output=True,
                             text=True, env={"PATH": os.environ["PATH"], "JAXTRAIN_ENV_FILE": "/nonexistent"})
    assert missing.returncode == 2 and "environment file /nonexistent not found" in missing.stderr


def test_kustomization_makes_the_configmap_the_pods_load():
    kust = yaml.safe_load(open(os.path.join(LAUNCH, "kustomization.yaml")))
    assert kust["resources"] == ["k8s/jaxtrain.yaml"]
    (gen,) = kust["configMapGenerator"]
    assert gen["envs"] == ["jaxtrain.env"] and kust["generatorOptions"]["disableNameSuffixHash"] is True
    pod = jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["envFrom"] == [{"configMapRef": {"name": gen["name"]}}]
    # The ConfigMap kustomize would build validates as a ConfigMap.
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": env_file()}
    kubernetes_validate.validate(configmap, "1.31", strict=True)


@pytest.mark.parametrize("script, env", [
    ("local.sh", {"GRACE_S": "a[$(touch {marker})]"}),
    ("slurm.sbatch", {"JAXTRAIN_METRICS_PORT": "a[$(touch {marker})]", "JAXTRAIN_CHECK": "0"}),
])
def test_launchers_treat_environment_values_as_data(tmp_path, script, env):
    """A value that bash would evaluate in $(( )) is refused (exit 2, one line), never run."""
    marker = tmp_path / "evaluated"
    full = {**os.environ, **{k: v.format(marker=marker) for k, v in env.items()},
            "JAXTRAIN_ENV_FILE": os.path.join(LAUNCH, "jaxtrain.env"), "PYTHON": "false"}
    args = ["1", "train"] if script == "local.sh" else ["train"]
    proc = subprocess.run(["bash", os.path.join(LAUNCH, script), *args], env=full, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and not marker.exists(), proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "must be" in proc.stderr


def _stub(directory, name, body):
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


def _run_sbatch_with_stubs(tmp_path, extra_env, *args, srun_rc=0, srun_says="", check_says="", refused=""):
    """launch/slurm.sbatch run by bash on this host, with srun/scontrol/scancel/sbatch replaced by stubs that record
    their command lines (one per line) and exit: srun's `check` step prints `check_says` and exits 1 if it is set
    (else 0), its other steps print `srun_says` on stderr and exit `srun_rc`; `scontrol <refused>` exits 1."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    _stub(bin_dir, "srun", f'printf "srun %s\\n" "$*" >> {calls}\n'
          f'[[ " $* " == *" check "* ]] && {{ printf "{check_says}"; exit {1 if check_says else 0}; }}\n'
          f'printf "{srun_says}" >&2\nexit {srun_rc}')
    for name in ("scontrol", "scancel", "sbatch"):
        _stub(bin_dir, name, f'printf "{name} %s\\n" "$*" >> {calls}\n'
              f'[ "{name} $1" = "scontrol {refused}" ] && {{ echo "Job is no longer pending execution" >&2; exit 1; }}'
              '\nexit 0')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": REPO, "SLURM_JOB_ID": "7",
           "JAXTRAIN_METRICS_PORT": "off", "HOME": str(tmp_path)} | extra_env
    proc = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, lines


def test_sbatch_gives_the_container_to_every_srun_step_and_runs_on_the_host(tmp_path):
    (tmp_path / "a").mkdir()
    proc, calls = _run_sbatch_with_stubs(tmp_path / "a", {"JAXTRAIN_IMAGE": "reg/jaxtrain@sha256:abc"}, "train",
                                         "run.dir=/shared/r")
    assert proc.returncode == 0, proc.stderr
    steps = [c for c in calls if c.startswith("srun ")]
    assert len(steps) == 2 and " -m jaxtrain check " in steps[0] and " -m jaxtrain train " in steps[1], calls
    for step in steps:  # the options come before the program: srun's own, not the program's
        options = step.split(" python")[0].split()
        assert {"--container-image=reg/jaxtrain@sha256:abc", f"--container-mounts={REPO}:{REPO}",
                f"--container-workdir={REPO}"} <= set(options), step
    # The user's mounts and workdir replace the defaults.
    (tmp_path / "b").mkdir()
    proc, calls = _run_sbatch_with_stubs(tmp_path / "b", {
        "JAXTRAIN_IMAGE": "img", "JAXTRAIN_CONTAINER_MOUNTS": "/a:/a,/runs:/runs", "JAXTRAIN_CONTAINER_WORKDIR": "/a",
        "JAXTRAIN_CHECK": "0"}, "train")
    (step,) = [c for c in calls if c.startswith("srun ")]
    assert "--container-mounts=/a:/a,/runs:/runs --container-workdir=/a" in step and proc.returncode == 0
    # Without an image: no container option anywhere, as before.
    (tmp_path / "c").mkdir()
    proc, calls = _run_sbatch_with_stubs(tmp_path / "c", {}, "train")
    assert proc.returncode == 0 and len(calls) == 2 and not any("--container" in c for c in calls), calls


def _pci(root, address, vendor, klass, numa):
    dev = root / "bus" / "pci" / "devices" / address
    dev.mkdir(parents=True)
    for name, value in (("vendor", vendor), ("class", klass), ("numa_node", str(numa))):
        (dev / name).write_text(value + "\n")


def fake_sysfs(root, numa):
    """A sysfs tree with NVIDIA GPUs on NUMA nodes `numa` (in PCI bus order), plus what must not count as a GPU: an
    NVSwitch (NVIDIA, class 0x0680) and a ConnectX HCA (Mellanox)."""
    for i, node in enumerate(numa):
        _pci(root, f"0000:{0x18 + 0x10 * i:02x}:00.0", "0x10de", "0x030200", node)
    _pci(root, "0000:05:00.0", "0x10de", "0x068000", 0)
    _pci(root, "0000:0c:00.0", "0x15b3", "0x020700", 1)
    return str(root)


HGX = [0, 0, 0, 0, 1, 1, 1, 1]  # an HGX H100 node: GPUs 0-3 on NUMA node 0, 4-7 on node 1


@pytest.mark.parametrize("numa, slurm, want", [
    (HGX, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "224"}, (8, 28, "map_ldom:0,0,0,0,1,1,1,1")),
    (HGX, {"SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "224"}, (2, 112, "map_ldom:0,1")),
    # one process driving all 8 GPUs spans both sockets: no single NUMA node, so every core it was given
    (HGX, {"SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_ON_NODE": "224"}, (1, 224, "cores")),
    # the job's GPUs only (SLURM_JOB_GPUS): 4 tasks on GPUs 4-7 (NUMA node 1); on GPUs 2-5, a task per pair
    (HGX, {"SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_ON_NODE": "112", "SLURM_JOB_GPUS": "4,5,6,7"},
     (4, 28, "map_ldom:1,1,1,1")),
    (HGX, {"SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "112", "SLURM_JOB_GPUS": "2,3,4,5"},
     (2, 56, "map_ldom:0,1")),
    (HGX, {"SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_ON_NODE": "112", "SLURM_JOB_GPUS": "2,3,4,5"},
     (1, 112, "cores")),
    (HGX, {"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_CPUS_ON_NODE": "64"}, (4, 16, "map_ldom:0,0,1,1")),
    # sbatch --cpus-per-task wins over the even split
    (HGX, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "224", "SLURM_CPUS_PER_TASK": "16"},
     (8, 16, "map_ldom:0,0,0,0,1,1,1,1")),
    # 8 GPUs do not split over 3 tasks; a GPU without a NUMA node (-1); no GPU at all: bind to cores
    (HGX, {"SLURM_NTASKS_PER_NODE": "3", "SLURM_CPUS_ON_NODE": "224"}, (3, 74, "cores")),
    ([0, 0, 0, 0, -1, 1, 1, 1], {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "224"}, (8, 28, "cores")),
    ([], {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "16"}, (8, 2, "cores")),
    (HGX, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "224", "JAXTRAIN_CPU_BIND": "none"},
     (8, 28, "none")),
])
def test_every_step_gives_each_task_its_cpus_bound_near_its_gpu(tmp_path, numa, slurm, want):
    """Expected values worked by hand: CPUs on the node / tasks per node, and task t bound to the NUMA node its
    GPUs (the job's, t * gpus / tasks onwards) share; cores where they do not share one."""
    (tmp_path / "run").mkdir()
    sysfs = fake_sysfs(tmp_path / "sys", numa)
    proc, calls = _run_sbatch_with_stubs(tmp_path / "run", slurm | {"JAXTRAIN_SYSFS": sysfs}, "train")
    assert proc.returncode == 0, proc.stderr
    tasks, cpus, bind = want
    steps = [c for c in calls if c.startswith("srun ")]
    assert len(steps) == 2  # the health check and training
    for step in steps:
        options = step.split(" python")[0].split()
        assert {f"--ntasks-per-node={tasks}", f"--cpus-per-task={cpus}", f"--cpu-bind={bind}"} <= set(options), step
    assert f"jaxtrain: {tasks} task(s) per node, {cpus} CPU(s) each, --cpu-bind={bind} (" in proc.stdout


def test_a_cpu_binding_with_slurms_option_words_is_taken(tmp_path):
    proc, calls = _run_sbatch_with_stubs(tmp_path, {"JAXTRAIN_CPU_BIND": "verbose,cores"}, "train")
    assert proc.returncode == 0, proc.stderr
    assert all("--cpu-bind=verbose,cores" in c for c in calls if c.startswith("srun "))


def test_a_cpu_binding_that_is_not_slurms_is_refused_in_one_line(tmp_path):
    proc, calls = _run_sbatch_with_stubs(tmp_path, {"JAXTRAIN_CPU_BIND": "cores; rm -rf /"}, "train")
    assert proc.returncode == 2 and not any(c.startswith("srun ") for c in calls)
    assert proc.stderr.strip().splitlines() == [
        "jaxtrain: JAXTRAIN_CPU_BIND=cores; rm -rf / is not a --cpu-bind value (e.g. none, cores, map_ldom:0,0,1,1)"]


@pytest.mark.parametrize("refused, want", [
    ("", ["scontrol requeuehold 7", "scontrol update JobId=7 ExcNodeList=n3,n5", "scontrol release 7"]),
    # Slurm refuses the update (another version than 22.05, say): the job is cancelled, never left held
    ("update", ["scontrol requeuehold 7"] + ["scontrol update JobId=7 ExcNodeList=n3,n5"] * 4 + ["scancel 7"]),
    ("release", ["scontrol requeuehold 7", "scontrol update JobId=7 ExcNodeList=n3,n5"] + ["scontrol release 7"] * 2
     + ["scancel 7"]),
])
def test_the_job_excludes_the_bad_nodes_itself_and_is_never_left_held(tmp_path, refused, want):
    """The check names n3 and n5: the script requeues its job held, sets ExcNodeList and releases it, with no helper
    job; if Slurm refuses either, it cancels the job, saying how to resubmit."""
    proc, calls = _run_sbatch_with_stubs(tmp_path, {}, "train", check_says="check: exclude hosts: n5,n3\\n",
                                         refused=refused)
    assert proc.returncode == 1
    assert [c for c in calls if c.startswith(("scontrol", "scancel", "sbatch"))][-len(want):] == want, calls
    assert not any(c.startswith("sbatch") for c in calls) and sum(c.startswith("srun") for c in calls) == 1
    assert "jaxtrain: health check failed on n3,n5 (sbatch --exclude=n3,n5)" in proc.stdout
    if refused:
        assert "cancelled instead: resubmit with sbatch --exclude=n3,n5" in proc.stdout
    else:
        assert "jaxtrain: job 7 excludes n3,n5 and is released" in proc.stdout


KILLED_AFTER_75 = ("srun: error: n1: task 0: Exited with exit code 75\\n"
                   "srun: launch/slurm: _step_signal: Terminating StepId=7.0\\nsrun: error: n1: task 1: Terminated\\n")


@pytest.mark.parametrize("srun_rc, says, status, requeued", [
    (0, "", 0, False), (75, "", 75, True), (1, "", 1, False),
    # Task 0 exited 75 first and --kill-on-bad-exit terminated task 1: srun returns 143 (as Slurm 22.05 does).
    (143, KILLED_AFTER_75, 75, True)])
def test_sbatch_requeues_a_run_that_stopped_early(tmp_path, srun_rc, says, status, requeued):
    """Exit 75 (stopped by a signal before train.steps, checkpoint saved) requeues the job even when the signal
    went to the tasks only (Slurm's preemption without send_user_signal); 0 (finished) and failures do not."""
    proc, calls = _run_sbatch_with_stubs(tmp_path, {"JAXTRAIN_CHECK": "0"}, "train", srun_rc=srun_rc,
                                         srun_says=says)
    assert proc.returncode == status, proc.stderr
    assert ("scontrol requeue 7" in calls) == requeued, calls


def _run_local_sh(tmp_path, n, rcs):
    """launch/local.sh with a stub interpreter: process i prints its coordinator settings and exits rcs[i]."""
    _stub(tmp_path, "python", '[ "$1" = -c ] && exec python3 "$@"\n'
          'echo "addr=$JAX_COORDINATOR_ADDRESS bind=$JAX_COORDINATOR_BIND_ADDRESS id=$JAX_PROCESS_ID"\n'
          'rcs=($STUB_RCS); exit ${rcs[$JAX_PROCESS_ID]}')
    env = {**os.environ, "PYTHON": str(tmp_path / "python"), "STUB_RCS": " ".join(map(str, rcs)),
           "JAXTRAIN_LOCAL_GPUS": "0"}
    return subprocess.run([os.path.join(LAUNCH, "local.sh"), str(n), "train"], env=env, capture_output=True,
                          text=True, timeout=60)


def test_local_launcher_binds_loopback_and_passes_on_exit_75(tmp_path):
    proc = _run_local_sh(tmp_path, 2, [0, 0])
    assert proc.returncode == 0, proc.stderr
    rows = sorted(re.findall(r"^\[(\d)\] addr=(\S+) bind=(\S+) id=(\d)$", proc.stdout, re.M))
    assert len(rows) == 2 and rows[0][1].startswith("127.0.0.1:"), proc.stdout
    assert all(addr == bind == rows[0][1] for _, addr, bind, _ in rows)  # loopback: all processes share the host
    # Every process stopped early (75): the launcher says so with 75, and stops no one (75 is not a failure).
    early = _run_local_sh(tmp_path, 2, [75, 75])
    assert early.returncode == 75 and "stopping the others" not in early.stderr, early.stderr
    # A real failure wins over 75.
    failed = _run_local_sh(tmp_path, 2, [75, 3])
    assert failed.returncode == 3 and "process 1 exited with status 3" in failed.stderr, failed.stderr


def test_local_launcher_drops_gloo_lines_split_by_its_threads(tmp_path):
    """Gloo writes its connection line piece by piece from one thread per device, so the pieces of several threads
    interleave at each flush (seen: '<line>[Gloo] Rank ' then '2 is connected to 7 ...'); none of it gets through,
    nor JAX's "SIGTERM caught" (a Ctrl-C reaches JAX as SIGTERM: each process says what it got), and the program's
    own lines (a blank one included) do, whole."""
    msg = "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : {}"
    out = [msg.format(1, 7, 7) + "[Gloo] Rank ", "2 is connected to 7 peer ranks. Expected number of connected peer "
           "ranks is : 7", "step 1/2 | loss 5.3541 | 86,687 tok/s" + msg.format(0, 1, 1), "[Gloo] Rank " +
           msg.format(3, 3, 3), "0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
           "", "reads rows [0, 8) of each global batch of 16", msg.format(4, 7, 7),
           "W1204 15:15:05.551945    6584 preemption_notifier.cc:90] SIGTERM caught at 2026-12-04T15:15:05.5519+00:00",
           "done: 20 steps"]
    (tmp_path / "lines").write_text("\n".join(out) + "\n")
    _stub(tmp_path, "python", f'[ "$1" = -c ] && exec python3 "$@"\ncat {tmp_path / "lines"}')
    env = {**os.environ, "PYTHON": str(tmp_path / "python"), "JAXTRAIN_LOCAL_GPUS": "0"}
    proc = subprocess.run([os.path.join(LAUNCH, "local.sh"), "1", "train"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [line.rstrip() for line in proc.stdout.splitlines()] == [
        "[0] step 1/2 | loss 5.3541 | 86,687 tok/s", "[0]", "[0] reads rows [0, 8) of each global batch of 16",
        "[0] done: 20 steps"], proc.stdout
