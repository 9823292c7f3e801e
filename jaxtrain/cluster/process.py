"""Process-level JAX settings that must be made before the first JAX computation touches a backend."""

from __future__ import annotations

import contextlib
import os
import sys

import jax

from jaxtrain import rundir
from jaxtrain.cluster import distributed
from jaxtrain.config import Config
from jaxtrain.parallel.dims import cpu_devices_per_process

# XLA:CPU aborts the process in AllReducePromotion ("Invalid binary instruction opcode copy") on a bfloat16 psum
# whose reduction computation ends in a copy: shard_map's transpose writes one for the bfloat16 expert weights'
# gradients of an MoE model under fsdp (`train model.dtype=bfloat16 mesh.ici.fsdp=2` on tiny-deepseek-moe), as the
# pipelines' first version did for their input gradients. Without the pass XLA:CPU's bf16 normalisation widens such
# all-reduces to float32 all the same (the planner's collectives.widened_by_cpu counts them at 16 bits, as the GPU
# moves them). XLA:GPU's promotes only 16-bit integer all-reduces, which no jaxtrain program has; the planner's XLA:GPU
# compiles drop the flag (user_xla_flags).
SKIPPED_PASSES = ("all-reduce-promotion",)
_DISABLE = "--xla_disable_hlo_passes"

# What add_xla_flags put in XLA_FLAGS, for this process's XLA:CPU compiles only: whole flags, and passes merged into
# the one --xla_disable_hlo_passes (user_xla_flags gives XLA_FLAGS without them, for the planner's XLA:GPU compiles).
ADDED_XLA_FLAGS: set[str] = set()
ADDED_PASSES: set[str] = set()


def _passes(flag: str | None) -> list[str]:
    return [p for p in flag.split("=", 1)[1].split(",") if p] if flag else []


def add_xla_flags(*flags: str) -> None:
    """Append ``flags`` to XLA_FLAGS, each once; ``--xla_disable_hlo_passes=...`` lists merge into the one flag
    there (XLA keeps only the last of a repeated flag). Effective before JAX creates its first backend."""
    current = os.environ.get("XLA_FLAGS", "").split()
    for flag in flags:
        if flag.startswith(_DISABLE + "="):
            old = next((f for f in current if f.startswith(_DISABLE + "=")), None)
            new = [p for p in _passes(flag) if p not in _passes(old)]
            ADDED_PASSES.update(new)
            merged = f"{_DISABLE}={','.join([*_passes(old), *new])}"
            current = [merged if f == old else f for f in current] if old else [*current, merged]
        elif flag not in current:
            current.append(flag)
            ADDED_XLA_FLAGS.add(flag)
    os.environ["XLA_FLAGS"] = " ".join(current)


def skip_aborting_passes() -> None:
    """Skip :data:`SKIPPED_PASSES` in this process's compiles (before JAX creates its first backend)."""
    add_xla_flags(f"{_DISABLE}={','.join(SKIPPED_PASSES)}")


def user_xla_flags() -> list[str]:
    """XLA_FLAGS as the user set them: without what :func:`add_xla_flags` added."""
    flags = []
    for f in os.environ.get("XLA_FLAGS", "").split():
        if f.startswith(_DISABLE + "="):
            kept = [p for p in _passes(f) if p not in ADDED_PASSES]
            f = f"{_DISABLE}={','.join(kept)}" if kept else ""
        if f and f not in ADDED_XLA_FLAGS:
            flags.append(f)
    return flags


def configure(cfg: Config) -> distributed.Settings:
    """XLA's passes that abort on jaxtrain's programs skipped (:data:`SKIPPED_PASSES`), emulated CPU devices
    (``runtime.cpu_devices`` per process; no effect on GPU devices), then ``jax.distributed``."""
    skip_aborting_passes()
    settings = distributed.resolve(cfg.dist)
    jax.config.update("jax_num_cpu_devices", cpu_devices_per_process(cfg, settings.expected_processes))
    use_compile_cache(compile_cache_dir(cfg.runtime.compile_cache))
    distributed.initialize(cfg.dist, settings)
    return settings


def compile_cache_dir(setting: str) -> str | None:
    """``runtime.compile_cache`` -> the directory of JAX's persistent compile cache, or None (``none``). ``auto``:
    JAX's own ``JAX_COMPILATION_CACHE_DIR`` where set (the launchers put it in the run directory, so a requeued job
    finds its programs), else ``$XDG_CACHE_HOME/jaxtrain/compile``, else ``~/.cache/jaxtrain/compile``."""
    if setting == "none":
        return None
    if setting == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        return user_cache_dir("compile")
    return os.path.abspath(os.path.expanduser(setting))


def user_cache_dir(name: str) -> str:
    """``$XDG_CACHE_HOME/jaxtrain/NAME``, else ``~/.cache/jaxtrain/NAME``: this user's caches, in no run directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxtrain", name)


def use_compile_cache(directory: str | None) -> None:
    """Keep compiled programs in ``directory`` (JAX's persistent compilation cache, keyed by the program, the
    devices, the compile options and the jax/XLA versions), so that a rerun of the same config loads its train and
    eval steps instead of compiling them. Every program is kept, however fast it compiled: JAX's default (only
    those over 1 s) would leave out the eval step and the initialisation, which a rerun pays too."""
    if directory is None:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def quiet_logs() -> None:
    """Orbax and JAX log routine events as absl warnings; keep the console for jaxtrain's own lines and errors."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


class _Tee:
    def __init__(self, stream, file):
        self.stream, self.file = stream, file

    def write(self, text):
        self.file.write(text)
        return self.stream.write(text)

    def flush(self):
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def process_log(run_dir: str):
    """Copy this process's stdout and stderr (Python-level) into ``<run_dir>/logs/process_<i>.log``."""
    path = rundir.process_log_path(run_dir, jax.process_index())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", buffering=1) as f:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, f), _Tee(err, f)
        try:
            yield path
        finally:
            sys.stdout, sys.stderr = out, err
