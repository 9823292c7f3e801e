"""The experiment's spec: an experiment file read and checked, and its runs expanded (``runs: all``: one per mesh
the planner finds valid; ``remat`` and ``microbatches`` crossed with every run).

An experiment file (YAML, read by ``schema.load_typed`` into :class:`ExperimentFile`)::

    name: cpu8-tiny
    config: null                  # base config file for every run (default: the built-in tiny config)
    dir: runs/sweep-cpu8-tiny     # sweep.csv, sweep.md, sweep.png, and runs/<name>/ for each run
    overrides: [runtime.cpu_devices=8, train.steps=12]   # every run
    runs:                         # a list, or "all": every mesh the planner finds valid
      - {name: data8, overrides: [mesh.ici.data=8, mesh.ici.fsdp=1]}
    remat: [none, full]           # optional: every run once per remat policy (model.remat)
    microbatches: [1, 4]          # optional: ... and per microbatch count (train.microbatches)

``remat`` and ``microbatches`` cross every run with each value (the planner's ``mesh.auto`` searches the same
axes), so a user can check the planner's choice on their own cluster.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxtrain.config import load_config
from jaxtrain.config.schema import find_yaml, load_typed
from jaxtrain.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass
class ExperimentFile:
    """The keys of an experiment file, as written."""

    name: str | None = None  # default: the file's stem
    config: str | None = None  # base config file or shipped name (default: the built-in tiny config)
    dir: str | None = None  # default: runs/sweep-<name>
    overrides: list[str] | None = None  # every run
    runs: Any = "all"  # a list of {name, overrides}, or "all"
    remat: list[str] | None = None  # every run once per model.remat policy
    microbatches: list[int] | None = None  # every run once per train.microbatches count


@dataclass
class RunSpec:
    name: str
    overrides: list[str]  # the experiment's, then the run's own


@dataclass
class Experiment:
    name: str
    config: str | None
    dir: str
    overrides: list[str]
    runs: list[RunSpec] | str  # or "all"
    axes: list[list[tuple[str, str]]] = field(default_factory=list)  # [(name suffix, override)] per crossed axis


def _string_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise ConfigError(f"{where} must be a list of key=value strings")
    return list(value)


def load_experiment(path: str, extra_overrides: Sequence[str] = (), directory: str | None = None) -> Experiment:
    """Read and check an experiment file (a path, or a shipped name such as ``cpu8-tiny``); ``extra_overrides``
    (command line) apply to every run, last."""
    path = find_yaml(path, "experiments", "experiment file")
    raw = load_typed(path, ExperimentFile, "experiment file")
    if any(o.partition("=")[0].strip() == "run.dir" for o in extra_overrides):
        raise ConfigError("run.dir is set per run by the sweep; use --dir for the sweep's directory")
    name = raw.name or Path(path).stem
    common = _string_list(raw.overrides, "overrides") + list(extra_overrides)
    runs_raw = raw.runs
    if runs_raw == "all":
        runs: list[RunSpec] | str = "all"
    elif isinstance(runs_raw, list) and runs_raw:
        runs = [_run_spec(i, r, common) for i, r in enumerate(runs_raw)]
        names = [r.name for r in runs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"experiment file {path!r}: run names must be unique, repeated: {', '.join(dupes)}")
    else:
        raise ConfigError(f"experiment file {path!r}: runs must be a non-empty list or 'all'")
    config = raw.config
    if config is not None:
        try:
            config = find_yaml(config, "", "config")
        except ConfigError:
            pass  # not a shipped name either: reported as a missing file below
        if not os.path.isfile(config):
            raise ConfigError(f"experiment file {path!r}: config file {raw.config!r} does not exist")
    return Experiment(name, config, directory or raw.dir or f"runs/sweep-{name}", common, runs,
                      _crossed_axes(path, raw))


def _crossed_axes(path: str, raw: ExperimentFile) -> list[list[tuple[str, str]]]:
    """The ``remat`` and ``microbatches`` lists as [(run name suffix, override)] per axis."""
    from jaxtrain.planner.auto.space import REMATS

    axes = []
    if raw.remat is not None:
        bad = [r for r in raw.remat if r not in REMATS]
        if not raw.remat or bad:
            raise ConfigError(f"experiment file {path!r}: remat={raw.remat!r} must be a non-empty list of "
                              f"{', '.join(REMATS)}")
        axes.append([(f"remat_{r}", f"model.remat={r}") for r in raw.remat])
    if raw.microbatches is not None:
        if not raw.microbatches or not all(isinstance(k, int) and k >= 1 for k in raw.microbatches):
            raise ConfigError(f"experiment file {path!r}: microbatches={raw.microbatches!r} must be a non-empty "
                              "list of integers >= 1")
        axes.append([(f"mb{k}", f"train.microbatches={k}") for k in raw.microbatches])
    return axes


def cross(runs: list[RunSpec], axes: list[list[tuple[str, str]]]) -> list[RunSpec]:
    """Every run once per combination of the crossed axes' values, named ``<run>-<suffix>...``."""
    for axis in axes:
        runs = [RunSpec(f"{r.name}-{suffix}", r.overrides + [override]) for r in runs for suffix, override in axis]
    return runs


def _run_spec(index: int, raw: Any, common: list[str]) -> RunSpec:
    if not isinstance(raw, dict) or set(raw) - {"name", "overrides"}:
        raise ConfigError(f"runs[{index}] must be a mapping with 'name' and 'overrides'")
    own = _string_list(raw.get("overrides"), f"runs[{index}].overrides")
    name = str(raw.get("name") or f"run{index}")
    if not _NAME_RE.match(name):
        raise ConfigError(f"runs[{index}].name={name!r} may only use letters, digits and _ . + -")
    if any(o.partition("=")[0].strip() == "run.dir" for o in own):
        raise ConfigError(f"runs[{index}] sets run.dir; the sweep places each run under its own directory")
    return RunSpec(name, common + own)


def expand_runs(exp: Experiment) -> list[RunSpec]:
    """The experiment's runs; for ``all``, one per mesh the planner finds valid on the configured devices."""
    if not isinstance(exp.runs, str):
        return cross(list(exp.runs), exp.axes)
    from jaxtrain.parallel.dims import cpu_devices_per_process
    from jaxtrain.planner.search.meshes import enumerate_shapes

    cfg = load_config(exp.config, exp.overrides)
    return cross([RunSpec(re.sub(r"[^A-Za-z0-9_.+-]+", "_", shape.label), exp.overrides + shape.overrides())
                  for shape in enumerate_shapes(cfg, cpu_devices_per_process(cfg), nodes=1)], exp.axes)
