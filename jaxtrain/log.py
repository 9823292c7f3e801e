"""The run's own log lines: timestamped, on stderr, tagged with the process in multi-process jobs."""

from __future__ import annotations

import sys
import time


def process_tag() -> str:
    """"[process i/n] " in multi-process jobs, else "" (without importing JAX when nothing has yet)."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1:
        return f"[process {jax.process_index()}/{jax.process_count()}] "
    return ""


def info(msg: str) -> None:
    """A timestamped line on stderr, every process."""
    print(f"[{time.strftime('%H:%M:%S')}] {process_tag()}{msg}", file=sys.stderr, flush=True)
