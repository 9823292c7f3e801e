"""Checks of the files, directories and addresses the command line is given, before anything is written.

Each failure is a :class:`~jaxtrain.config.ConfigError` (one line, exit status 2) that names the value and what would
be valid. Kept apart from ``config`` (the typed tree and its value checks); like it, nothing here imports JAX.
"""

from __future__ import annotations

import ipaddress
import os

import yaml

from jaxtrain.config import ConfigError

MAX_CPU_DEVICES = 512  # emulated devices are host threads; beyond this JAX start-up alone takes minutes


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key repeated in one mapping is an error, not a silent overwrite."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: PyYAML's own error message follows
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def existing_file(path: str, what: str) -> None:
    """ConfigError unless ``path`` is a regular file (a directory is named as one, not as missing)."""
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory, not a file")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} does not exist")


def load_yaml(path: str, what: str) -> dict:
    """The mapping at the top of a UTF-8 YAML file whose keys are unique in every mapping."""
    existing_file(path, what)
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path!r} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path!r} must hold a mapping at the top level, got a {type(loaded).__name__}")
    return loaded


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
    if d.source not in ("embedded", "synthetic"):
        if not d.source.endswith((".bin", ".npy")):
            raise ConfigError(f"data.source={d.source!r} must be 'embedded', 'synthetic' or a .bin/.npy token file")
        existing_file(d.source, "data.source file")
    if c.resume not in ("auto", "never") and not c.resume.isdigit():
        if not os.path.isdir(c.resume):
            kind = "is a file" if os.path.exists(c.resume) else "does not exist"
            raise ConfigError(f"checkpoint.resume={c.resume!r} {kind}; use auto, never, a step number, or a "
                              "checkpoint directory")
    if c.init_from is not None and not os.path.isdir(c.init_from):
        kind = "a file, not a directory" if os.path.exists(c.init_from) else "a directory that does not exist"
        raise ConfigError(f"checkpoint.init_from={c.init_from!r} is {kind}; give a checkpoint directory or one step "
                          "in it")
    _writable_dir(cfg.run.dir, "run.dir")
    if c.dir is not None:
        _writable_dir(c.dir, "checkpoint.dir")
    else:
        _writable_dir(os.path.join(cfg.run.dir, "checkpoints"), "run.dir")
    if cfg.runtime.cpu_devices is not None and cfg.runtime.cpu_devices > MAX_CPU_DEVICES:
        raise ConfigError(f"runtime.cpu_devices={cfg.runtime.cpu_devices} is more emulated devices than this machine "
                          f"can start in reasonable time; use at most {MAX_CPU_DEVICES}")
