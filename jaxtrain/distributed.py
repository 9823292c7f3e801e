"""Multi-controller initialisation (``jax.distributed``): one process per host, before any other JAX use.

Where the settings come from, first match wins:
  1. the config: ``dist.coordinator``, ``dist.num_processes``, ``dist.process_id``;
  2. the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (what
     ``launch/local.sh`` and the Kubernetes manifest set);
  3. Slurm, inside an ``srun`` step with more than one task (JAX's own Slurm detection: coordinator on the first
     node, port 61440 + job id % 4096 unless ``JAX_COORDINATOR_PORT`` is set);
  4. a single process, with its coordinator on a free local port.
Even a single process initialises the runtime: JAX's preemption service, which makes every process stop at the
same step on SIGTERM (``checkpoint.PreemptionWatch``), lives in it. CPU processes exchange data with gloo.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass

import jax

from jaxtrain.config import ConfigError, DistConfig


class DistributedError(RuntimeError):
    """The job's processes could not form or keep a group (a peer never arrived, or died)."""


@dataclass(frozen=True)
class Settings:
    coordinator: str | None  # None: let JAX detect (Slurm)
    num_processes: int | None
    process_id: int | None
    source: str  # "config" | "environment" | "slurm" | "single"

    @property
    def expected_processes(self) -> int:
        return self.num_processes or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(environ, name: str) -> int:
    value = environ[name]
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}={value!r} must be a non-negative integer")
    return int(value)


def _wait_for_coordinator(settings: Settings, timeout_s: int) -> None:
    host, _, port = settings.coordinator.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {settings.process_id} of {settings.num_processes} could not reach the coordinator "
                    f"{settings.coordinator} within dist.init_timeout_s={timeout_s} s ({e.strerror or e}); "
                    "is process 0 running, and is the address right?") from None
            time.sleep(0.5)


def resolve(dist: DistConfig, environ=os.environ) -> Settings:
    """Where this process's multi-process settings come from (see the module docstring)."""
    if dist.coordinator is not None:
        return Settings(dist.coordinator, dist.num_processes, dist.process_id, "config")
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    present = [n for n in names if n in environ]
    if present:
        if len(present) != 3:
            missing = ", ".join(n for n in names if n not in environ)
            raise ConfigError(f"{', '.join(present)} set in the environment but not {missing}: set all three or none")
        n, i = _env_int(environ, "JAX_NUM_PROCESSES"), _env_int(environ, "JAX_PROCESS_ID")
        if i >= n:
            raise ConfigError(f"JAX_PROCESS_ID={i} must be below JAX_NUM_PROCESSES={n}")
        return Settings(environ["JAX_COORDINATOR_ADDRESS"], n, i, "environment")
    if "SLURM_STEP_NODELIST" in environ and int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1"))) > 1:
        return Settings(None, int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))), None, "slurm")
    return Settings(f"127.0.0.1:{_free_port()}", 1, 0, "single")


def initialize(dist: DistConfig, settings: Settings) -> None:
    """Join (or form) the job's process group. Raises DistributedError if peers do not arrive in time."""
    if jax.distributed.is_initialized():
        return
    multi = settings.expected_processes > 1
    if multi and settings.process_id:  # a worker: fail clearly if the coordinator never comes up
        _wait_for_coordinator(settings, dist.init_timeout_s)
    if multi:
        # JAX itself aborts the process (exit 134, "RegisterTask ... DEADLINE_EXCEEDED") when peers are missing
        # at the deadline; say first what is being waited for.
        print(f"[process {settings.process_id if settings.process_id is not None else '?'}/"
              f"{settings.expected_processes}] joining the job at {settings.coordinator or 'the Slurm coordinator'}; "
              f"all {settings.expected_processes} processes must join within dist.init_timeout_s="
              f"{dist.init_timeout_s} s", file=sys.stderr, flush=True)
        # CPU devices of different processes talk through gloo (no effect on GPU backends, which use NCCL).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator,
            num_processes=None if settings.source == "slurm" else settings.num_processes,  # Slurm: JAX detects
            process_id=settings.process_id, initialization_timeout=dist.init_timeout_s,
            heartbeat_timeout_seconds=dist.heartbeat_timeout_s)
    except Exception as e:  # JAX raises various errors here; all mean the group did not form
        where = settings.coordinator or "the Slurm-derived coordinator"
        who = f"process {settings.process_id} of {settings.num_processes}" if settings.process_id is not None else "this process"
        raise DistributedError(f"{who} could not join the job at {where} within dist.init_timeout_s="
                               f"{dist.init_timeout_s} s (are all processes started, with the same coordinator?): "
                               f"{' '.join(str(e).split())[:200]}") from None
