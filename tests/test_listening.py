"""What listens on the network: nothing for a single process (issue: a single-process train used to bind JAX's
coordination service on every interface); for several, every interface on the coordinator's port where the processes
span hosts (the coordinator's host name may resolve to loopback, issue 21), loopback under launch/local.sh."""

import os
import subprocess
import sys
import time

import pytest

from jaxtrain.cluster import distributed
from jaxtrain.config import load_config
from jaxtrain_testing import REPO


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


BIND_SOURCES = {  # dist overrides, environment -> (where process 0 listens, the source it names)
    "multi-node default": ([], {}, ("[::]:7000", "default")),
    "launch/local.sh": ([], {"JAX_COORDINATOR_BIND_ADDRESS": "127.0.0.1:7000"}, ("127.0.0.1:7000", "environment")),
    "dist.bind_address": (["dist.bind_address=10.9.9.9:7100"], {"JAX_COORDINATOR_BIND_ADDRESS": "127.0.0.1:7000"},
                          ("10.9.9.9:7100", "config")),
}


@pytest.mark.parametrize("case", BIND_SOURCES)
def test_where_process_0_listens_by_source(case):
    overrides, extra, (bind, source) = BIND_SOURCES[case]
    job = {"JAX_COORDINATOR_ADDRESS": "node-a.cluster:7000", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}
    settings = distributed.resolve(load_config(None, overrides).dist, environ=job | extra)
    assert settings.bind_address == bind and settings.sources["coordinator_bind_address"].startswith(source)
    # Slurm: the same default, with JAX's coordinator rule.
    slurm = distributed.resolve(load_config(None, []).dist, environ={
        "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "9", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0"})
    assert (slurm.coordinator, slurm.bind_address) == ("n3:61449", "[::]:61449")


def test_a_single_process_starts_no_service_whatever_is_set():
    alone = distributed.resolve(load_config(None, ["dist.bind_address=10.9.9.9:7100"]).dist,
                                environ={"JAX_COORDINATOR_BIND_ADDRESS": "127.0.0.1:7000"})
    assert alone.num_processes == 1 and alone.coordinator is None and alone.bind_address is None


def _listening(port: int) -> list[str]:
    """Local addresses ("0.0.0.0", "::", "127.0.0.1", ...) with a TCP socket in LISTEN state on ``port``."""
    import ipaddress

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, p = local.partition(":")
                if state == "0A" and int(p, 16) == port:
                    raw = bytes.fromhex(addr)
                    # /proc prints each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append(str(ipaddress.ip_address(raw)))
    return found


@pytest.mark.parametrize("bind_env, expected", [({}, ["::"]), ({"JAX_COORDINATOR_BIND_ADDRESS": "127.0.0.1:{port}"},
                                                                 ["127.0.0.1"])])
def test_the_start_up_roll_call_listens_where_jax_will(bind_env, expected):
    """Process 0 hears its workers on the coordinator's port, on the address JAX's service binds next; a worker
    reaches it through the coordinator address (127.0.0.1 here, through [::]'s IPv4 mapping in the default)."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    env |= {k: v.format(port=port) for k, v in bind_env.items()}
    dist = load_config(None, []).dist
    host = distributed.resolve(dist, environ=env | {"JAX_PROCESS_ID": "0"})
    worker = distributed.resolve(dist, environ=env | {"JAX_PROCESS_ID": "1"})
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_catch(distributed._roll_call_host, host, 20)))
    thread.start()
    deadline = time.monotonic() + 10
    while not _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(port) == expected
    distributed._roll_call_worker(worker, 20)  # returns on "go"
    thread.join(20)
    assert errors == [None] and _listening(port) == []  # the port is free again, for JAX's service


def _catch(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # handed to the test's thread
        return e
    return None
