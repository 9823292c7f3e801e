"""The auto search's compile cache on disk: each compile's reading (memory, collectives, loops the planner could
not count) stored as ``<cache_dir>/<hash>.json``, keyed by a hash of the config's settings that change the compiled
step, the devices and the versions of JAX and jaxlib, so that a second search of the same config compiles nothing,
in any run directory. The directory is the user's, beside JAX's own compile cache (:func:`plan_cache_dir`). Process
0 writes; an entry is never half-written, and a damaged one is compiled again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from jaxtrain.config import Config, to_dict
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.planner.cost.collectives import Collective
from jaxtrain.planner.cost.hlo import UnknownLoop
from jaxtrain.planner.search import meshes as search

CACHE_VERSION = 2
# Sections, and settings of the others, that do not change the compiled step (a cached reading serves any of their
# values): where the run writes, how it is observed and checked, how long it trains, where its data comes from, and
# mesh.auto's own settings (a new margin re-ranks the same readings).
_NOT_COMPILED = ("run", "runtime", "checkpoint", "observe", "check")
_NOT_COMPILED_KEYS = {"mesh": ("auto", "auto_memory_margin", "auto_trial_steps"),
                      "train": ("steps", "seed", "eval_every", "eval_batches", "log_every", "max_nonfinite_steps"),
                      "data": ("source", "mixture", "tokenizer", "token_dtype", "eval_fraction", "threads",
                               "prefetch")}


def plan_cache_dir(setting: str) -> str | None:
    """``runtime.compile_cache`` -> where the search keeps its readings, beside JAX's compiled programs
    (``cluster.process.compile_cache_dir``): None for ``none``; for ``auto``, ``$XDG_CACHE_HOME/jaxtrain/plan``
    (else ``~/.cache/jaxtrain/plan``), or ``JAX_COMPILATION_CACHE_DIR/jaxtrain-plan`` where that is set (the
    launchers set it in the run directory, on storage every node sees); a directory D: ``D/jaxtrain-plan``."""
    from jaxtrain.cluster.process import compile_cache_dir

    jax_dir = compile_cache_dir(setting)
    if jax_dir is None:
        return None
    if setting == "auto" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.path.join(os.path.dirname(jax_dir), "plan")
    return os.path.join(jax_dir, "jaxtrain-plan")


def fingerprint(cfg: Config, devices: list) -> dict:
    """What a compiled step of ``cfg`` on ``devices`` depends on: the config's compiled settings, the devices
    (count, kind, platform, processes), the versions of JAX and jaxlib, and XLA_FLAGS."""
    import jax
    import jaxlib

    tree = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_COMPILED}
    for section, keys in _NOT_COMPILED_KEYS.items():
        tree[section] = {k: v for k, v in tree[section].items() if k not in keys}
    return {"version": CACHE_VERSION, "config": tree, "devices": len(devices), "kind": devices[0].device_kind,
            "platform": devices[0].platform, "processes": len({d.process_index for d in devices}),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}


def cache_key(cfg: Config, devices: list, gpu: str = "") -> str:
    """The hash naming ``cfg``'s entry on ``devices``: of its :func:`fingerprint` and ``gpu``, what compiled the
    XLA:GPU figures of the entry if any (``xla_gpu.PlanCompiler.label``)."""
    body = {**fingerprint(cfg, devices), **({"xla_gpu": gpu} if gpu else {})}
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
