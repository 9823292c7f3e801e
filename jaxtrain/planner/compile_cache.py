"""The auto search's compile cache on disk: each compile's reading (memory, collectives, loops the planner could
not count) stored as ``<cache_dir>/<hash>.json``, keyed by a hash of the config sections that change the compiled
step, the devices and JAX's version, so that a second plan of the same config compiles nothing. Process 0 writes;
an entry is never half-written, and a damaged one is compiled again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from jaxtrain.config import Config, to_dict
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.planner import search
from jaxtrain.planner.collectives import Collective
from jaxtrain.planner.hlo import UnknownLoop

CACHE_DIR = "plan-cache"  # under run.dir
CACHE_VERSION = 1
# Sections that do not change the compiled step (a cached reading serves any of their values).
_NOT_COMPILED = ("run", "checkpoint", "observe", "check")


def cache_key(cfg: Config, devices: list, gpu: str = "") -> str:
    """The hash naming ``cfg``'s entry on ``devices``: the compiled sections, the devices, JAX and XLA_FLAGS, and
    ``gpu``, what compiled the XLA:GPU figures of the entry if any (``xla_gpu.PlanCompiler.label``)."""
    import jax

    tree = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_COMPILED}
    body = {"version": CACHE_VERSION, "config": tree, "devices": len(devices), "kind": devices[0].device_kind,
            "platform": devices[0].platform, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            **({"xla_gpu": gpu} if gpu else {})}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _to_json(comp: search.Compiled) -> dict:
    sizes = ("params_bytes", "opt_bytes", "temp_bytes", "memory_bytes", "compile_s")
    return {**{k: getattr(comp, k) for k in sizes},
            "collectives": [[c.kind, c.bytes, c.count, c.groups.tolist(), c.op_name] for c in comp.collectives],
            "unknown_loops": [[u.name, u.op_name, u.holds_collectives] for u in comp.unknown_loops],
            "extra": comp.extra}


def _from_json(d: dict) -> search.Compiled:
    colls = [Collective(k, b, n, np.asarray(g, dtype=np.int64).reshape(len(g), -1), op)
             for k, b, n, g, op in d["collectives"]]
    loops = [UnknownLoop(name, op, holds_collectives=h) for name, op, h in d["unknown_loops"]]
    return search.Compiled(d["params_bytes"], d["opt_bytes"], d["temp_bytes"], d["memory_bytes"], colls, loops,
                           d["compile_s"], d.get("extra", {}))


def cache_path(cache_dir: str, cfg: Config, shape: MeshShape, devices: list, gpu: str = "") -> str:
    """The entry of ``cfg`` on ``shape`` (the first ``shape.num_devices`` of ``devices``) in ``cache_dir``."""
    return os.path.join(cache_dir, cache_key(shape.apply(cfg), devices[:shape.num_devices], gpu) + ".json")


def store(path: str, comp: search.Compiled) -> None:
    """Write one reading to the cache (process 0; never a half-written entry)."""
    import jax

    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump(_to_json(comp), f)
        os.replace(f"{path}.tmp", path)


def compile_cached(cfg: Config, shape: MeshShape, devices: list, cache_dir: str | None, keep: dict | None = None,
                   key=None, gpu=None) -> tuple[search.Compiled, bool]:
    """The compiled step's reading for ``cfg`` on ``shape`` and whether it came from the cache; a fresh compile's
    (step, executable) go into ``keep[key]`` when ``keep`` is given (the trial runs them without compiling again).
    ``gpu``: a ``xla_gpu.PlanCompiler`` whose XLA:GPU figures replace the CPU-derived ones (kept beside them)."""
    path = cache_path(cache_dir, cfg, shape, devices, gpu.label if gpu else "") if cache_dir else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                return _from_json(json.load(f)), True
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry is compiled again and rewritten
    step = search._step(cfg, shape, devices)
    train, seconds = search.compile_train_step(step)
    comp = search.reading(step, train, seconds)
    if gpu is not None:
        comp = gpu.read(cfg, shape, comp)
    if keep is not None:
        keep[key] = (step, train)
    if path and "xla_gpu_error" not in comp.extra:  # a failed XLA:GPU compile is tried again next time
        store(path, comp)
    return comp, False
