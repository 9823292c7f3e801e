"""The run directory: what a run writes where, the lock that gives one job a directory, and the readers and
writers of the files that other commands read back (``metrics.jsonl``, ``summary.json``).

Layout of ``run.dir`` (every module takes these names from here)::

    config.yaml       the effective config (written by a run that trains)
    summary.json      what the run measured (:class:`Summary`)
    metrics.jsonl     one JSON record per logged step (:func:`read_metrics`)
    tb/               TensorBoard event files
    checkpoints/      Orbax checkpoints (unless checkpoint.dir says otherwise)
    logs/             process_<i>.log, memory_process_<i>.prof
    profile/          jax.profiler traces, process_<i>/
    .jaxtrain.lock    held by process 0 while a job runs

``RunLock``: an advisory ``flock`` on ``<run.dir>/.jaxtrain.lock`` (host, process id and start time inside), held
by process 0 for the whole job. The kernel drops it when its holder exits, however it exits (SIGKILL included), so
a lock file left behind by a dead process is simply taken over, with a warning naming it. On a shared file system
the lock protects across machines only where ``flock`` does: NFS (Linux maps it onto NFS byte-range locks; a
crashed client's lock lapses when the server's lease ends, about 90 s on NFSv4), Lustre mounted with ``-o flock``
(with ``localflock`` or neither it protects one node only, or fails: then jaxtrain warns and runs unlocked), GPFS.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import importlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

from jaxtrain import log
from jaxtrain.errors import ConfigError

CONFIG = "config.yaml"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
PROFILE = "profile"
LOCK = ".jaxtrain.lock"


def path(run_dir: str, *parts: str) -> str:
    """``run_dir/parts...``, e.g. ``path(run_dir, METRICS)``."""
    return os.path.join(run_dir, *parts)


def checkpoints(run_dir: str, checkpoint_dir: str | None = None) -> str:
    """Where a run's checkpoints go: ``checkpoint.dir`` (``checkpoint_dir``) where it is set, else
    ``run_dir/checkpoints``."""
    return checkpoint_dir or path(run_dir, CHECKPOINTS)


def process_log_path(run_dir: str, process: int) -> str:
    """``logs/process_<i>.log``: a process's own output."""
    return os.path.join(run_dir, LOGS, f"process_{process}.log")


def memory_profile(run_dir: str, process: int) -> str:
    """``logs/memory_process_<i>.prof``: the device memory profile written on an out-of-memory error."""
    return os.path.join(run_dir, LOGS, f"memory_process_{process}.prof")


def profile_dir(run_dir: str, process: int) -> str:
    """``profile/process_<i>``: a process's jax.profiler traces."""
    return os.path.join(run_dir, PROFILE, f"process_{process}")


# ---------------------------------------------------------------------------------------------------------------
# Object-store locations (checkpoint.dir, checkpoint.resume / init_from): ``s3://bucket/key``, ``gs://bucket/key``.
# Checked here, without JAX, by config validation; jaxtrain.checkpoint.object_store drives Orbax and TensorStore.

SCHEMES = {"s3": "s3fs", "gs": "gcsfs"}  # scheme -> the fsspec package that epath needs for it
# S3's bucket naming rules (3-63 characters, lower-case letters, digits, dots, hyphens, alphanumeric at both ends);
# GCS allows underscores too and names up to 222 characters with dots.
_BUCKET = {"s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
           "gs": re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")}


def is_remote(path: str | os.PathLike | None) -> bool:
    """True for a ``scheme://`` location (object store or any other URL), False for a local path."""
    return path is not None and "://" in str(path)


def absolute(path: str) -> str:
    """A local path made absolute; an object-store URL unchanged (``os.path.abspath`` would turn ``s3://b/k`` into
    ``<cwd>/s3:/b/k``)."""
    return path if is_remote(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    """``base/parts...`` for local paths and URLs alike."""
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else os.path.join(base, *parts)


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key without leading or trailing slash) of ``scheme://bucket/key``."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def check_location(value: str, name: str) -> None:
    """ConfigError (one line, exit status 2) unless ``value`` is ``s3://bucket[/key]`` or ``gs://bucket[/key]``
    with a valid bucket name, the fsspec client for it is installed, and credentials are there to be found.
    Nothing is contacted: whether the bucket exists is learnt at the first write (the run's write probe)."""
    scheme, bucket, _ = split_url(value)
    valid = "s3://bucket/path or gs://bucket/path (a local path otherwise)"
    if scheme not in SCHEMES:
        raise ConfigError(f"{name}={value!r}: {scheme + '://'!r} is not a supported location; use {valid}")
    if not _BUCKET[scheme].match(bucket):
        raise ConfigError(f"{name}={value!r}: {bucket!r} is not a valid bucket name (3-63 lower-case letters, digits, "
                          f"dots or hyphens, a letter or digit at each end); use {valid}")
    package = SCHEMES[scheme]
    try:
        importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{name}={value!r} needs the {package} package to list and rename {scheme}:// "
                          f"directories: pip install {package}") from None
    if scheme == "s3":
        _check_aws_credentials(value, name)


def _check_aws_credentials(value: str, name: str) -> None:
    """ConfigError when no AWS credentials can be found the way botocore finds them (environment, shared files,
    profile, container or instance role). Half a key pair in the environment is named as such."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if bool(key) != bool(secret):
        have, missing = (("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if key
                         else ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"))
        raise ConfigError(f"{name}={value!r}: {have} is set but {missing} is not; set both, or neither to use a "
                          "profile or an instance role")
    if key:
        return
    import botocore.session  # s3fs's own dependency, present once check_location found s3fs

    if botocore.session.get_session().get_credentials() is None:
        raise ConfigError(f"{name}={value!r}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3 for an S3-compatible server), AWS_PROFILE, "
                          "or run with an instance or pod role")


def endpoint() -> str | None:
    """The S3 endpoint override botocore uses: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (None: AWS)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_kvstore(url: str) -> dict[str, Any]:
    """TensorStore's ``s3`` kvstore spec for ``s3://bucket/key``, with the endpoint and region of the environment
    (TensorStore finds the credentials itself: environment, ``~/.aws/credentials``, instance metadata)."""
    _, bucket, key = split_url(url)
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key + "/" if key else ""}
    if endpoint():
        spec["endpoint"] = endpoint()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


def kvstore_spec(url: str) -> dict[str, Any]:
    """TensorStore's kvstore spec for ``s3://`` (:func:`s3_kvstore`) or ``gs://bucket/key`` (its ``gcs`` driver)."""
    if url.startswith("s3://"):
        return s3_kvstore(url)
    _, bucket, key = split_url(url)
    return {"driver": "gcs", "bucket": bucket, "path": key + "/" if key else ""}

# ---------------------------------------------------------------------------------------------------------------
# metrics.jsonl: one error policy for every reader. A complete line (ending in a newline) that is not a JSON object
# with an integer "step" was cut short by a kill mid-write and is skipped; a last line without its newline is still
# being written (or was cut short) and is not read.


def _record(line: str) -> dict | None:
    if not line.endswith("\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_metrics(run_dir: str) -> list[dict]:
    """The readable records of ``run_dir/metrics.jsonl``, in file order (none when there is no file)."""
    file = path(run_dir, METRICS)
    if not os.path.isfile(file):
        return []
    with open(file, encoding="utf-8", errors="replace") as f:
        return [r for r in map(_record, f) if r is not None]


def last_logged_step(run_dir: str) -> int:
    """The highest step in ``run_dir/metrics.jsonl`` (0 when none)."""
    return max((r["step"] for r in read_metrics(run_dir)), default=0)


def truncate_metrics(run_dir: str, last_step: int) -> None:
    """Keep only the readable records of steps <= ``last_step``, atomically (a resumed run logs later steps again)."""
    file = path(run_dir, METRICS)
    if not os.path.isfile(file):  # also with last_step 0: a run killed before its first checkpoint starts over
        return
    kept = [json.dumps(r) + "\n" for r in read_metrics(run_dir) if r["step"] <= last_step]
    tmp = file + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, file)


# ---------------------------------------------------------------------------------------------------------------
# summary.json


@dataclass
class Summary:
    """``run.dir/summary.json``: what one invocation of ``train`` measured (``sweep`` and benchmarks read it)."""

    mesh: dict  # MeshShape.as_dict()
    devices: int
    processes: int
    start_step: int  # the step restored from a checkpoint (0: fresh)
    last_step: int
    steps_timed: int
    compile_seconds: float
    step_seconds: dict  # median, p10, p90, max
    tokens_per_second: float  # at the median step time
    mfu: float | None  # model FLOPs utilisation at the median step time; None without the device's peak rate
    final_loss: float
    final_eval_loss: float | None
    compiled_memory_bytes_per_device: dict | None  # the compiled step's arguments, temporaries, outputs
    device_peak_bytes: int | None  # the allocator's peak where the backend reports it (GPU)
    host_peak_rss_bytes: int
    preempted_at: int | None
    goodput: dict  # category -> fraction of this invocation's wall time
    goodput_wall_seconds: float
    recomputed_steps: int
    lost_work: dict = dataclasses.field(default_factory=dict)  # goodput's lost_work: steps, seconds, fault_after_step

    def write(self, run_dir: str) -> None:
        with open(path(run_dir, SUMMARY), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)


def read_summary(run_dir: str) -> Summary | None:
    """The run's summary, or None when it wrote none (it failed before its end, or trained nothing)."""
    file = path(run_dir, SUMMARY)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        raw: dict[str, Any] = json.load(f)
    names = {f.name for f in dataclasses.fields(Summary)}
    return Summary(**{k: v for k, v in raw.items() if k in names})


# ---------------------------------------------------------------------------------------------------------------
# The lock


class RunLock:
    """``with RunLock(run_dir):`` the job owns ``run_dir``; a second job on it raises ConfigError naming the holder.

    Only process 0 locks (one lock per job); the others learn its outcome. A directory created only to hold the
    lock is removed again when the lock is released with nothing else in it, so a job that stops on bad input leaves
    no trace.
    """

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK)
        self._fd: int | None = None
        self._created: list[str] = []  # directories made for the lock, innermost first

    def __enter__(self) -> RunLock:
        import jax

        error = None
        if jax.process_index() == 0:
            try:
                error = self._acquire()
            except ConfigError as e:  # reported after the others have heard of it, so that none of them waits
                error = e
        if jax.process_count() > 1:
            import numpy as np
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
                log.info(f"warning: cannot lock {self.path} ({e.strerror}: the file system does not support flock); "
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
            log.info(f"warning: took over the lock of a job that ended without releasing it ({previous})")
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
