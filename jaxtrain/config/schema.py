"""Typed YAML files: the one reader for config, hardware and experiment files.

A file is read as UTF-8 YAML whose mappings may not repeat a key (:func:`load_yaml`), and each value is checked
against its dataclass field's type (:func:`coerce`, :func:`load_typed`); every mistake is a :class:`ConfigError`
(one line, exit status 2) naming the file, the key and what would be valid. Shipped files (package data under
``jaxtrain/configs``) are found by name (:func:`find_yaml`). Nothing here imports JAX or another jaxtrain module.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import yaml

from jaxtrain.errors import ConfigError, one_line

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")  # package data


def shipped(kind: str = "") -> dict[str, str]:
    """Shipped YAML files by name: model configs (``kind=""``), ``"hardware"`` or ``"experiments"``."""
    folder = os.path.join(SHIPPED_DIR, kind)
    return {f[:-5]: os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".yaml")}


def find_yaml(name: str, kind: str, what: str) -> str:
    """A path as given, or the shipped file of that name (``7b``, ``h100-8x``); ConfigError listing the names."""
    if os.path.exists(name) or name.endswith((".yaml", ".yml")) or os.sep in name:
        return name
    known = shipped(kind)
    if name in known:
        return known[name]
    raise ConfigError(f"{what} {name!r} is neither a file nor a shipped name; shipped: {', '.join(known)}")


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
        raise ConfigError(f"{what} {path!r} is not valid YAML: {one_line(e)}") from None
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path!r} must hold a mapping at the top level, got a {type(loaded).__name__}")
    return loaded


def load_typed(path: str, cls: type, what: str) -> Any:
    """A dataclass ``cls`` from the YAML mapping at ``path``, each value checked against the field's type: the one
    loader for config-shaped files (hardware descriptions, experiments). Fields without defaults are required."""
    raw = load_yaml(path, what)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{what} {path!r} has unknown keys: {', '.join(map(str, unknown))}; "
                          f"valid: {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{what} {path!r} lacks: {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: coerce(hints[k], v, f"{what} {path!r}: {k}") for k, v in raw.items()})


def coerce(tp: Any, value: Any, name: str) -> Any:
    """``value`` checked against the type ``tp`` (and converted where YAML reads a number as a string); ``name``
    says where it came from in errors."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:  # free-form: the file's owner checks it (an experiment's runs: a list of mappings or "all")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], value, name)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(map(str, args))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be an integer")
    if tp is float:
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):  # .inf/.nan (and 1e999) would poison the run silently
            return float(number)
        raise ConfigError(f"{name}={value!r} must be a finite number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}={value!r} must be a string")
    if origin is list and args == (str,):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}={value!r} must be a list of strings")
        return list(value)
    if origin is list or tp is list:
        numbers = isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        if not value or not numbers:
            raise ConfigError(f"{name}={value!r} must be a non-empty list of numbers, e.g. [1, 4, 16]")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    raise TypeError(f"unsupported config type {tp} for {name}")  # a bug in the schema, not a user error


# ---------------------------------------------------------------------------------------------------------------
# Dataclass trees from nested mappings (the config's loading; generic, so that its rules are the same everywhere)


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """``tree`` with ``a.b.c = value`` set, creating (or replacing non-mapping) intermediate levels."""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    node[parts[-1]] = value


def dotted_keys(cls: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass tree (dict-valued fields end at their name)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys += dotted_keys(tp, prefix + f.name + ".") if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return keys


def unknown_key(name: str, known: list[str], what: str) -> ConfigError:
    """ConfigError for an unknown dotted key, suggesting the closest known key: one of its own section's (the
    names compared, so that a stray name is not matched to an unrelated key), else, for a misspelt section, a key
    of another section that is nearly the same as a whole. Within the section: a near-spelling of the whole name
    (``n_head``: ``n_heads``), else a key the name ends in after a qualifier (``expert_d_ff``: ``d_ff``, the
    experts' width, not ``experts``, which merely shares the prefix), else the closest spelling."""
    return ConfigError(f"unknown {what} {name!r}{_did_you_mean(name, known)}")


def _did_you_mean(name: str, known: list[str]) -> str:
    section, _, leaf = name.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    words = leaf.split("_")
    tails = ["_".join(words[i:]) for i in range(1, len(words))]  # longest first: expert_d_ff -> d_ff, ff
    close = (difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.85)
             or [t for t in tails if t in siblings][:1]
             or difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6))
    suggestion = siblings[close[0]] if close else next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.8)),
                                                        None)
    return f"; did you mean {suggestion!r}?" if suggestion else ""


def _first_leaf(key: str, value: Any) -> str:
    while isinstance(value, dict) and value:
        k, value = next(iter(value.items()))
        key = f"{key}.{k}"
    return key


def build(default: Any, tree: Any, prefix: str, unknown: Callable[[str], ConfigError]):
    """A copy of the dataclass instance ``default`` with the values of the nested mapping ``tree`` applied (each
    checked against its field's type by :func:`coerce`); ``unknown(dotted key)`` makes the error for a key that is
    not a field."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {tree!r}")
    cls = type(default)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in tree.items():
        if k not in names:
            raise unknown(_first_leaf(prefix + str(k), v))
    changes = {}
    for name, value in tree.items():
        tp, current, dotted = hints[name], getattr(default, name), prefix + name
        if dataclasses.is_dataclass(tp):
            changes[name] = build(current, value, dotted + ".", unknown)
        elif typing.get_origin(tp) is dict:
            # Mappings merge into the defaults, so that one rule can be overridden alone.
            changes[name] = {**current, **coerce(tp, value, dotted)}
        else:
            changes[name] = coerce(tp, value, dotted)
    return dataclasses.replace(default, **changes)
