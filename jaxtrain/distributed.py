"""Multi-controller initialisation (``jax.distributed``), before any other JAX use.

Even a single process initialises it: JAX's preemption service, which makes every process stop at the same step
on SIGTERM (see ``checkpoint.PreemptionWatch``), lives in the distributed runtime.
"""

from __future__ import annotations

import socket

import jax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_single_process() -> None:
    """A one-process job with its coordinator on a free local port."""
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{_free_port()}", num_processes=1, process_id=0,
                               initialization_timeout=60)
