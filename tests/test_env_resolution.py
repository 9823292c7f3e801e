"""What jaxtrain gives ``jax.distributed.initialize``: Slurm variables, JAX_* variables and the config.

The Slurm environments below are the ones Slurm 22.05 really set in tests/slurm/cluster.sh's cluster (GRES gpu:8):
`srun --ntasks-per-node=1 --gpus-per-node=8` gives the task CUDA_VISIBLE_DEVICES=0,...,7 and SLURM_GPUS_ON_NODE=8;
`--ntasks-per-node=8 --gpus-per-node=8` gives every task all eight; `--ntasks-per-node=8 --gpus-per-task=1` gives
task i CUDA_VISIBLE_DEVICES=i with SLURM_GPUS_ON_NODE=8. test_multihost.py checks them inside real Slurm jobs.
"""

import json
import os
import subprocess
import sys

import pytest

from jaxtrain.cluster.distributed import first_slurm_host, resolve
from jaxtrain.config import ConfigError, load_config
from jaxtrain_testing import REPO

DIST = load_config(None, []).dist


def slurm(tasks_per_node, nodes, procid, cvd=None, gpus_on_node=None, nodelist="gpu[003-010]", job=1234, **extra):
    env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": nodelist, "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(procid % tasks_per_node), "SLURM_NODEID": str(procid // tasks_per_node),
           "SLURM_STEP_NUM_TASKS": str(tasks_per_node * nodes), "SLURM_NTASKS": str(tasks_per_node * nodes),
           "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node)}
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    if gpus_on_node is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus_on_node)
    return env | extra


ALL8 = "0,1,2,3,4,5,6,7"


def test_one_task_per_node_drives_every_gpu_of_its_node():
    s = resolve(DIST, slurm(1, 8, procid=5, cvd=ALL8, gpus_on_node=8))
    assert s.local_device_ids == tuple(range(8))
    assert (s.num_processes, s.process_id, s.source) == (8, 5, "slurm")
    assert s.coordinator == f"gpu003:{61440 + 1234 % 4096}"


def test_one_task_per_gpu_sharing_the_node_gpus_takes_its_local_id():
    for procid in (0, 13, 63):
        s = resolve(DIST, slurm(8, 8, procid=procid, cvd=ALL8, gpus_on_node=8))
        assert s.local_device_ids == (procid % 8,) and (s.num_processes, s.process_id) == (64, procid)


def test_tasks_bound_to_their_own_gpu_use_ordinal_zero():
    # --gpus-per-task=1: Slurm sets CUDA_VISIBLE_DEVICES=<the task's GPU>; CUDA renumbers it to ordinal 0, so
    # JAX's own choice (ordinal SLURM_LOCALID) does not exist for every task but the first (jax-ml/jax#28194).
    s = resolve(DIST, slurm(8, 2, procid=11, cvd="3", gpus_on_node=8))
    assert s.local_device_ids == (0,)
    s = resolve(DIST, slurm(4, 1, procid=1, cvd="2,3", gpus_on_node=8))  # --gpus-per-task=2
    assert s.local_device_ids == (0, 1)


def test_two_tasks_split_eight_gpus_four_each():
    assert resolve(DIST, slurm(2, 1, procid=1, cvd=ALL8, gpus_on_node=8)).local_device_ids == (4, 5, 6, 7)


def test_layouts_that_cannot_work_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="3 Slurm tasks on this node cannot share 8 visible GPUs evenly"):
        resolve(DIST, slurm(3, 1, procid=0, cvd=ALL8, gpus_on_node=8))
    with pytest.raises(ConfigError, match="8 Slurm tasks on this node share 4 GPU"):
        resolve(DIST, slurm(8, 1, procid=0, cvd="0,1,2,3", gpus_on_node=4))


def test_without_gpu_gres_one_task_sees_everything_and_many_tasks_follow_jax():
    assert resolve(DIST, slurm(1, 2, procid=1)).local_device_ids is None
    assert resolve(DIST, slurm(4, 2, procid=6)).local_device_ids == (2,)


def test_uneven_tasks_per_node_are_read_for_this_node():
    env = slurm(8, 3, procid=16, cvd="0,1,2,3", gpus_on_node=4) | {"SLURM_STEP_TASKS_PER_NODE": "8(x2),4",
                                                                     "SLURM_LOCALID": "0", "SLURM_NODEID": "2"}
    assert resolve(DIST, env).local_device_ids == (0,)


def test_environment_and_config_take_precedence():
    env = slurm(8, 1, procid=3, cvd=ALL8, gpus_on_node=8) | {"JAX_LOCAL_DEVICE_IDS": "6,7",
                                                             "JAX_COORDINATOR_PORT": "5000"}
    s = resolve(DIST, env)
    assert s.local_device_ids == (6, 7) and s.sources["local_device_ids"] == "environment: JAX_LOCAL_DEVICE_IDS"
    assert s.coordinator == "gpu003:5000"
    env |= {"JAX_COORDINATOR_ADDRESS": "10.1.1.1:7000", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    s = resolve(DIST, env)
    assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("10.1.1.1:7000", 2, 1, "environment")
    cfg = load_config(None, ["dist.coordinator=h0:1", "dist.num_processes=4", "dist.process_id=3"]).dist
    s = resolve(cfg, env)
    assert (s.coordinator, s.num_processes, s.process_id, s.source) == ("h0:1", 4, 3, "config")
    assert s.sources["process_id"] == "config: dist.process_id"


def test_bad_environment_values_name_the_variable():
    with pytest.raises(ConfigError, match="JAX_LOCAL_DEVICE_IDS='0,x'"):
        resolve(DIST, {"JAX_LOCAL_DEVICE_IDS": "0,x"})
    with pytest.raises(ConfigError, match="JAX_LOCAL_DEVICE_IDS='1,1'"):
        resolve(DIST, {"JAX_LOCAL_DEVICE_IDS": "1,1"})
    with pytest.raises(ConfigError, match="SLURM_PROCID='a'"):
        resolve(DIST, slurm(2, 1, procid=0) | {"SLURM_PROCID": "a"})
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS='host' must be host:port"):
        resolve(DIST, {"JAX_COORDINATOR_ADDRESS": "host", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})


@pytest.mark.parametrize("nodelist", ["node001", "node001,host2", "node[001-0015],host2", "node[001,007-015],host2",
                                      "a-b[7-9]", "gpu-h100-[12,14]"])
def test_coordinator_host_matches_jax_own_slurm_parser(nodelist, monkeypatch):
    from jax._src.clusters.slurm_cluster import SlurmCluster

    monkeypatch.setenv("SLURM_STEP_NODELIST", nodelist)
    monkeypatch.setenv("SLURM_JOB_ID", "99999")
    expected = SlurmCluster.get_coordinator_address(timeout_secs=None, override_coordinator_port=None)
    assert f"{first_slurm_host(nodelist)}:{61440 + 99999 % 4096}" == expected
    assert resolve(DIST, slurm(2, 1, procid=0, nodelist=nodelist, job=99999)).coordinator == expected


def test_jax_own_detection_would_pin_one_gpu_per_process(monkeypatch):
    # Why jaxtrain resolves local_device_ids itself: JAX's detection, run whenever any argument is unset, picks
    # [SLURM_LOCALID] even for one task per node (jax/_src/clusters/cluster.py).
    from jax._src.clusters import ClusterEnv

    for k, v in slurm(1, 8, procid=5, cvd=ALL8, gpus_on_node=8).items():
        monkeypatch.setenv(k, v)
    _, n, i, ids = ClusterEnv.auto_detect_unset_distributed_params("h:1", None, None, None, None, None)
    assert (n, i, ids) == (8, 5, [0])
    assert resolve(DIST, dict(os.environ)).local_device_ids == tuple(range(8))


def _env_cli(extra, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "CUDA_"))} | extra
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "jaxtrain", "env", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60)


def test_env_command_prints_json_and_text_without_starting_jax():
    proc = _env_cli(slurm(8, 2, procid=9, cvd=ALL8, gpus_on_node=8) | {"JAX_PLATFORMS": "cuda"}, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"coordinator", "num_processes", "process_id", "local_device_ids", "platform", "sources"} <= out.keys()
    assert (out["num_processes"], out["process_id"], out["local_device_ids"], out["platform"]) == (16, 9, [1], "cuda")
    assert out["coordinator"] == f"gpu003:{61440 + 1234 % 4096}"
    assert out["sources"]["platform"] == "environment: JAX_PLATFORMS"
    assert out["sources"]["local_device_ids"].startswith("slurm: 8 task(s) on this node")
    text = _env_cli({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert text.returncode == 0
    assert any(line.split()[:2] == ["coordinator", "10.0.0.1:9"] and "JAX_COORDINATOR_ADDRESS" in line
               for line in text.stdout.splitlines())
    bad = _env_cli({"JAX_NUM_PROCESSES": "2"})
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "JAX_NUM_PROCESSES set in the environment but not" in bad.stderr
