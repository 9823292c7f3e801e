"""Out of device memory: the device memory profile written next to this process's log, and one line saying where
the memory went per device (parameters and optimizer state from the sharded state, temporaries from XLA's
compiled figure), so that the failed run explains itself.
"""

from __future__ import annotations

import os

import jax

from jaxtrain import log, rundir
from jaxtrain.parallel.layout import compiled_need


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is XLA's (or the allocator's) out-of-memory error."""
    return any(w in str(e) for w in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"))


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def report_out_of_memory(e: BaseException, layout, run_dir: str, compiled_step=None) -> str | None:
    """On an out-of-memory error: write the device memory profile (pprof) into ``run_dir``'s logs, say where, with
    the per-device split of parameters / optimizer state (``layout``'s sharded state) and temporaries (XLA's
    compiled figure for ``compiled_step``). Returns the profile's path (None when ``e`` is not an out-of-memory
    error: nothing is written)."""
    if not is_out_of_memory(e):
        return None
    path = rundir.memory_profile(run_dir, jax.process_index())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(jax.profiler.device_memory_profile())
    params, opt = layout.state_bytes
    split = {"parameters": params, "optimizer": opt}
    need = compiled_need(compiled_step) if compiled_step is not None else None
    if need is not None:
        split["temporaries"] = need.temporaries
    log.info(f"out of device memory: memory profile written to {path} (view: pprof -http=: {path}); per device on "
             f"mesh {layout.shape.label}: " + ", ".join(f"{k} {_size(v)}" for k, v in split.items()))
    return path
