"""Environment resolution (jaxtrain.cluster.distributed.resolve) with asymmetric values, so that a swapped field shows.

Every value below differs from every other (3 processes, process 2, distinct ports and hosts, 6 Slurm tasks on 3
nodes, local id 1), and each expected value is written out by hand from the documented rule (docs/multihost.md).
"""

import pytest

from jaxtrain.cluster.distributed import resolve
from jaxtrain.config import ConfigError, load_config

DIST = load_config(None, []).dist


def test_jax_variables_give_each_field_its_own_value():
    env = {"JAX_COORDINATOR_ADDRESS": "10.2.3.4:7123", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2",
           "JAX_LOCAL_DEVICE_IDS": "5,1", "JAX_COORDINATOR_BIND_ADDRESS": "0.0.0.0:7124", "JAX_PLATFORMS": "cpu"}
    s = resolve(DIST, env)
    assert (s.coordinator, s.num_processes, s.process_id) == ("10.2.3.4:7123", 3, 2)
    assert s.local_device_ids == (5, 1)  # as given, order kept
    assert s.bind_address == "0.0.0.0:7124" and s.platform == "cpu"
    assert s.sources["num_processes"] == "environment: JAX_NUM_PROCESSES"
    assert s.sources["process_id"] == "environment: JAX_PROCESS_ID"
    assert s.as_dict()["coordinator_bind_address"] == "0.0.0.0:7124"


def test_slurm_fields_come_from_their_own_variables():
    # 3 nodes x 2 tasks, this is global task 5 (node 2, local task 1), each node has 4 GPUs visible to both tasks.
    env = {"SLURM_JOB_ID": "5000", "SLURM_STEP_NODELIST": "b[07-09]", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4", "JAX_PLATFORMS": "cuda"}
    s = resolve(DIST, env)
    assert s.coordinator == f"b07:{61440 + 5000 % 4096}"  # first host, JAX's port rule
    assert (s.num_processes, s.process_id) == (6, 5)  # the step's task count, not the job's (7)
    assert s.local_device_ids == (2, 3)  # local task 1 of 2 sharing 4 GPUs
    s = resolve(DIST, env | {"JAX_COORDINATOR_PORT": "4321"})
    assert s.coordinator == "b07:4321"


def test_config_values_win_field_by_field():
    env = {"JAX_COORDINATOR_ADDRESS": "10.2.3.4:7123", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2",
           "JAX_LOCAL_DEVICE_IDS": "5,1", "JAX_COORDINATOR_BIND_ADDRESS": "0.0.0.0:7124"}
    cfg = load_config(None, ["dist.coordinator=h9:6001", "dist.num_processes=5", "dist.process_id=4",
                             "dist.local_device_ids=[3]", "dist.bind_address=h9:6002"]).dist
    s = resolve(cfg, env)
    assert (s.coordinator, s.num_processes, s.process_id, s.local_device_ids, s.bind_address) == \
        ("h9:6001", 5, 4, (3,), "h9:6002")


def test_process_id_must_be_below_the_process_count():
    env = {"JAX_COORDINATOR_ADDRESS": "10.2.3.4:7123", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "3"}
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID=3 must be below JAX_NUM_PROCESSES=3"):
        resolve(DIST, env)
    assert resolve(DIST, env | {"JAX_PROCESS_ID": "0"}).process_id == 0
