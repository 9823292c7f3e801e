"""Locations in the config (files, directories, host:port addresses), checked before anything is written.

Each failure is a :class:`~jaxtrain.errors.ConfigError` (one line, exit status 2) that names the value and what would
be valid. Kept apart from ``config`` (the typed tree and its value checks); like it, nothing here imports JAX.
"""

from __future__ import annotations

import ipaddress
import os

from jaxtrain import rundir
from jaxtrain.config.schema import existing_file
from jaxtrain.errors import ConfigError

MAX_CPU_DEVICES = 512  # emulated devices are host threads; beyond this JAX start-up alone takes minutes


def host_port(value: str, name: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) with a host and a port in 1..65535."""
    text = str(value)
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            host = ""
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or " " in host:
        raise ConfigError(f"{name}={value!r} must be host:port with a host name or address and a port in 1..65535, "
                          "e.g. 10.0.0.1:8476")
    return host, int(port)


def _writable_dir(path: str, name: str) -> None:
    """ConfigError unless ``path`` is, or could be created as, a directory this process can write to: the nearest
    existing ancestor must be a writable directory (nothing is created here)."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(f"{name}={path!r} is a file, not a directory")
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{name}={path!r} cannot be created: {probe!r} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == p else f"cannot be created: {probe!r} is not writable"
        raise ConfigError(f"{name}={path!r} {what}")


def check_paths(cfg) -> None:
    """The paths of ``cfg`` (a :class:`~jaxtrain.config.Config`): token file, checkpoint sources, run and checkpoint
    directories. Read-only checks; the run itself creates the directories."""
    d, c = cfg.data, cfg.checkpoint
    from jaxtrain.config.data_checks import check_data_paths  # sources: files, shard directories, globs, mixtures, chat

    check_data_paths(d, existing_file)
    if rundir.is_remote(cfg.run.dir):
        raise ConfigError(f"run.dir={cfg.run.dir!r} must be a directory on a file system (it holds the run lock, logs "
                          "and metrics); put the checkpoints on an object store with checkpoint.dir=s3://bucket/path "
                          "or gs://bucket/path")
    for name, value in (("checkpoint.dir", c.dir), ("checkpoint.resume", c.resume), ("checkpoint.init_from",
                                                                                      c.init_from)):
        if rundir.is_remote(value):  # its existence is learnt when it is read (checkpoint.resolve) or written
            rundir.check_location(str(value), name)
    if c.resume not in ("auto", "never") and not c.resume.isdigit() and not rundir.is_remote(c.resume):
        if not os.path.isdir(c.resume):
            kind = "is a file" if os.path.exists(c.resume) else "does not exist"
            raise ConfigError(f"checkpoint.resume={c.resume!r} {kind}; use auto, never, a step number, or a "
                              "checkpoint directory")
    if c.init_from is not None and not rundir.is_remote(c.init_from) and not os.path.isdir(c.init_from):
        kind = "a file, not a directory" if os.path.exists(c.init_from) else "a directory that does not exist"
        raise ConfigError(f"checkpoint.init_from={c.init_from!r} is {kind}; give a checkpoint directory or one step "
                          "in it")
    _writable_dir(cfg.run.dir, "run.dir")
    # Where the checkpoints will go (rundir's one definition), named by the setting that puts them there.
    if not rundir.is_remote(c.dir):  # an object store's is probed by the first write (checkpoint.Checkpointer)
        _writable_dir(rundir.checkpoints(cfg.run.dir, c.dir), "checkpoint.dir" if c.dir else "run.dir")
