"""Guards that stop a run before it can waste a job: one job per run directory, and a step that must fit in memory.

``RunLock``: an advisory ``flock`` on ``<run.dir>/.jaxtrain.lock`` (host, process id and start time inside), held
by process 0 for the whole job. The kernel drops it when its holder exits, however it exits (SIGKILL included), so
a lock file left behind by a dead process is simply taken over, with a warning naming it. On a shared file system
the lock protects across machines only where ``flock`` does: NFS (Linux maps it onto NFS byte-range locks; a
crashed client's lock lapses when the server's lease ends, about 90 s on NFSv4), Lustre mounted with ``-o flock``
(with ``localflock`` or neither it protects one node only, or fails: then jaxtrain warns and runs unlocked), GPFS.

``check_memory_fit``: the compiled step's own memory figures against what the devices (on CPU: the host) have,
before any array of the state exists.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import math
import os
import socket
import time

import jax
import numpy as np

from jaxtrain.config import ConfigError

LOCK_NAME = ".jaxtrain.lock"


class RunLock:
    """``with RunLock(run_dir):`` the job owns ``run_dir``; a second job on it raises ConfigError naming the holder.

    Only process 0 locks (one lock per job); the others learn its outcome. A directory created only to hold the
    lock is removed again when the lock is released with nothing else in it, so a job that stops on bad input leaves
    no trace.
    """

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self._fd: int | None = None
        self._created: list[str] = []  # directories made for the lock, innermost first

    def __enter__(self) -> RunLock:
        error = None
        if jax.process_index() == 0:
            try:
                error = self._acquire()
            except ConfigError as e:  # reported after the others have heard of it, so that none of them waits
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
            if not ok and error is None:
                error = ConfigError(f"process 0 could not lock run.dir {self.run_dir} (its error says why)")
        if error is not None:
            raise error
        return self

    def _acquire(self) -> ConfigError | None:
        self._make_dirs()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd) or "a process that is starting (no details written yet)"
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    self._remove_dirs()
                    return ConfigError(f"run.dir {self.run_dir} is in use by another job ({holder.strip()}); wait "
                                       "for it to end, or use another run.dir")
                from jaxtrain.metrics import log_info

                log_info(f"warning: cannot lock {self.path} ({e.strerror}: the file system does not support flock); "
                         "running without protection against a second job on this run.dir")
                return None
            # The previous holder may have unlinked the file between our open and our lock: lock the current file.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is not None and (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
                break
            os.close(fd)
        previous = _read(fd).strip()
        if previous:
            from jaxtrain.metrics import log_info

            log_info(f"warning: took over the lock of a job that ended without releasing it ({previous})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return None

    def _make_dirs(self) -> None:
        missing, d = [], self.run_dir
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"run.dir {self.run_dir!r} cannot be created: {e.strerror}") from None
        self._created = missing

    def _remove_dirs(self) -> None:
        for d in self._created:  # innermost first; only if nothing else was put there
            try:
                os.rmdir(d)
            except OSError:
                break
        self._created = []

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        # Unlink before unlocking: a waiting job then locks a fresh file (the inode check in _acquire).
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        self._remove_dirs()


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------------
# Memory


def available_memory() -> tuple[int | None, str]:
    """(bytes one local device may use, where the figure comes from). GPU/TPU: the allocator's limit of the
    smallest device; CPU: the host's available memory divided among this process's emulated devices."""
    devices = jax.local_devices()
    if devices[0].platform != "cpu":
        limits = [int(x) for d in devices if (x := (d.memory_stats() or {}).get("bytes_limit"))]
        return (min(limits), f"{devices[0].device_kind} memory limit") if limits else (None, "")
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        host = info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None, ""
    return host // len(devices), f"the host's available {host / 2**30:.1f} GiB shared by {len(devices)} CPU devices"


def check_state_fits(ts) -> None:
    """ConfigError when the parameters and optimizer state alone (their shards, from the abstract state's shardings)
    exceed a device's memory: found in milliseconds, before the data is read or the step compiled."""
    budget, where = available_memory()
    if ts.cfg.runtime.ignore_memory_check or budget is None:
        return
    state = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves(ts.abstract_state))
    if state > budget:
        raise ConfigError(
            f"the parameters and optimizer state alone need {state / 2**30:.2f} GiB per device on mesh "
            f"{ts.shape.label}, but {budget / 2**30:.2f} GiB are available per device ({where}); shard them over more "
            "devices (mesh.ici.fsdp), use a smaller model, or runtime.ignore_memory_check=true to start anyway")


def _need(compiled_step) -> tuple[int, int, int]:
    """(bytes per device, of which state and batch, of which temporaries) of a compiled step."""
    mem = compiled_step.memory_analysis()
    state, temp = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    return state + temp + mem.output_size_in_bytes - mem.alias_size_in_bytes, state, temp  # donated outputs reuse


def check_memory_fit(ts, compiled_step, max_trials: int = 2) -> None:
    """ConfigError (exit 2) with the figures and what would fit when the compiled step needs more memory per device
    than there is; skipped with ``runtime.ignore_memory_check=true``.

    The suggestion is checked, not guessed: temporaries do not shrink in proportion to the microbatch (gathered
    parameters and gradient accumulators stay), so up to ``max_trials`` microbatch counts, from the proportional
    estimate upwards, are compiled (from abstract shapes: seconds to a minute each) and the first that fits is named.
    """
    budget, where = available_memory()
    if ts.cfg.runtime.ignore_memory_check or compiled_step.memory_analysis() is None or budget is None:
        return
    need, state, temp = _need(compiled_step)
    if need <= budget:
        return
    gib, cfg = 2**30, ts.cfg
    hints = []
    rows = cfg.train.global_batch // cfg.train.microbatches // max(1, _data_parallel(ts))
    k = math.ceil(temp / max(1, budget - (need - temp))) if state < budget else rows + 1
    tried = []
    for m in [m for m in range(max(k, 2), rows + 1) if rows % m == 0][:max_trials]:
        micro = cfg.train.microbatches * m
        tried.append((micro, _need(_compiled_with(ts, train=dataclasses.replace(cfg.train, microbatches=micro)))[0]))
        if tried[-1][1] <= budget:
            break
    if tried:
        figures = ", ".join(f"{n / gib:.2f} GiB with {micro}" for micro, n in tried)
        fits = tried[-1][1] <= budget
        hints.append(f"train.microbatches={tried[-1][0]} (compiled per device: {figures})" if fits else
                     f"more train.microbatches than {tried[-1][0]} (compiled per device: {figures}: not enough)")
    if cfg.model.remat == "none":
        hints.append("model.remat=full (keeps about one layer's activations)")
    if ts.shape.num_devices > 1 and jax.local_devices()[0].platform == "cpu":
        hints.append("fewer runtime.cpu_devices (emulated devices share the host's memory)")
    if state >= budget:
        hints.append("more devices to shard the state over (mesh.ici.fsdp), or a smaller model")
    raise ConfigError(
        f"the compiled train step needs {need / gib:.2f} GiB per device (state and batch {state / gib:.2f} GiB, "
        f"temporaries {temp / gib:.2f} GiB) on mesh {ts.shape.label}, but {budget / gib:.2f} GiB are available per "
        f"device ({where}); try {'; '.join(hints) or 'a smaller model or batch'}; or "
        "runtime.ignore_memory_check=true to start anyway")


def _compiled_with(ts, **changes):
    from jaxtrain import train as train_lib

    trial = train_lib.setup(dataclasses.replace(ts.cfg, **changes), list(ts.mesh.devices.flat))
    return trial.compile(trial.abstract_state)[0]


def _data_parallel(ts) -> int:
    return int(np.prod([ts.mesh.shape[a] for a in ts._batch_axes()]))
