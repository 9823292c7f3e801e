"""Loading the config tree: defaults, then a YAML file, then dotted ``key=value`` overrides; validated once."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import yaml

from jaxtrain.config.schema import build, find_yaml, load_yaml, set_dotted
from jaxtrain.config.tree import Config, unknown_config_key
from jaxtrain.config.validate import validate
from jaxtrain.errors import ConfigError


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (),
                num_devices: Callable[[Config], int | None] | None = None) -> Config:
    """Defaults, then the YAML file at ``path`` (if any; a shipped name such as ``7b`` also works), then
    ``overrides`` (``"a.b=value"``, value in YAML syntax). ``num_devices``: see :func:`validate`."""
    tree = load_yaml(find_yaml(path, "", "config"), "config file") if path is not None else {}
    given: dict = {}  # the overrides alone: which mesh sizes the command line sets (mesh.auto keeps them)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.steps=100)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(tree, key.strip(), value)
        set_dotted(given, key.strip(), value)
    keep = _mesh_sizes_given(given)
    if keep:
        mesh = tree.setdefault("mesh", {})
        listed = mesh.get("auto_keep") if isinstance(mesh, dict) else None
        if isinstance(mesh, dict) and (listed is None or isinstance(listed, list)):
            mesh["auto_keep"] = list(dict.fromkeys([*(listed or []), *keep]))
    cfg = build(Config(), tree, "", unknown_config_key)
    validate(cfg, num_devices)
    return cfg


def _mesh_sizes_given(given: dict) -> list[str]:
    """``["ici.data", ...]``: the mesh sizes the overrides ``given`` (as a tree) set, ``mesh.ici.data=4`` or
    ``mesh.ici={data: 4}`` alike."""
    mesh = given.get("mesh")
    if not isinstance(mesh, dict):
        return []
    return [f"{part}.{ax}" for part in ("ici", "dcn") if isinstance(mesh.get(part), dict) for ax in mesh[part]]


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
