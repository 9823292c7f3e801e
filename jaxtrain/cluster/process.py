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


def configure(cfg: Config) -> distributed.Settings:
    """Emulated CPU devices (``runtime.cpu_devices`` per process; no effect on GPU devices), then
    ``jax.distributed``."""
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
