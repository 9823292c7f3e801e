"""What listens on the network: nothing for a single process; the coordinator address for several (issue: a
single-process train used to bind JAX's coordination service on every interface)."""

import os
import subprocess
import sys
import time

import pytest

from helpers import REPO
from jaxtrain import distributed
from jaxtrain.config import load_config


def _listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state held by process ``pid`` (from /proc: socket inodes of its fds)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
def test_a_single_process_train_listens_nowhere(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "XLA_FLAGS"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", f"run.dir={tmp_path / 'run'}",
                             "train.steps=400", "data.threads=0", "runtime.cpu_devices=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        seen = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            seen.append(line)
            if line.startswith("step"):  # training: the runtime is fully up
                break
        assert proc.poll() is None, "".join(seen)
        assert _listening_ports(proc.pid) == set()
    finally:
        proc.kill()
        proc.wait()


def test_several_processes_bind_the_coordinator_address_only():
    settings = distributed.resolve(load_config(None, []).dist, environ={
        "JAX_COORDINATOR_ADDRESS": "10.1.2.3:7000", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
    assert settings.bind_address == "10.1.2.3:7000"
    alone = distributed.resolve(load_config(None, []).dist, environ={})
    assert alone.num_processes == 1 and alone.bind_address is None
