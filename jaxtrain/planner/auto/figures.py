"""What ``mesh.auto``'s search knows about the devices before it compiles anything: whether any candidate can fit
at all (:func:`affordable`, closed forms, nothing allocated), and the hardware figures it ranks with
(:func:`hardware_for`): the devices' description, a calibration file's measured figures and, on CPU devices, what
``measure`` times at hand (the matmul, copy and all-reduce rates, the matmul rate by rows, a layer's fixed cost and
the model's own step). Those timings are kept in the user's cache (``figures-<hash>.json`` beside the compile
cache's readings, keyed by the host, the devices, the versions and the model's shapes), so that a second search of
the same config on the same machine takes the same figures, hence compiles the same candidates (found in the cache)
and makes the same choice, without timing anything again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable

from jaxtrain.config import Config, to_dict
from jaxtrain.errors import ConfigError
from jaxtrain.planner.auto.report import gb, nothing_fits
from jaxtrain.planner.auto.space import REMATS, Row, candidates
from jaxtrain.planner.cost import memory

FIGURES_VERSION = 1


def affordable(cfg: Config, devices: list, nodes: int = 1, progress: Callable[[str], None] = lambda msg: None) -> None:
    """Before anything is measured or compiled: ConfigError (one line, exit 2) when no candidate's parameters,
    optimizer state and layer inputs (``space.closed_form``'s lower bound, at the dtypes the run will use) fit the
    devices' memory less ``mesh.auto_memory_margin``; else one progress line with the candidates' count."""
    from jaxtrain.planner.cost.measure import usable_at_hand

    usable = usable_at_hand(devices)
    budget = usable * (1 - cfg.mesh.auto_memory_margin)
    cands = candidates(cfg, len(devices), nodes)  # first: sizes given that no layout has are the error to name
    resolved = _resolved(cfg, devices)
    rows = []
    for c in cands:
        applied = c.apply(resolved)
        need = memory.state_bytes_lower(applied, c.shape) + memory.activation_bytes(applied, c.shape)[0]
        rows.append(Row(c, need, need, 0.0, 0.0))
    over = sum(r.state_lower > budget for r in rows)
    if over == len(rows):
        raise ConfigError(nothing_fits(cfg, rows, [], budget, len(devices), usable))
    progress(f"mesh.auto: {len(rows)} candidate layouts over {len(devices)} {devices[0].device_kind} device(s)"
             f"{f' on {nodes} nodes' if nodes > 1 else ''}"
             + (f" with {', '.join(f'mesh.{p}.{a}={v}' for (p, a), v in cfg.mesh.kept().items())} as given"
                if cfg.mesh.kept() else "")
             + f"; {over} cannot fit {gb(budget)} a device by their parameters, optimizer state and layer inputs alone")


def _resolved(cfg: Config, devices: list) -> Config:
    """``cfg`` with its "auto" values resolved for ``devices`` (``layout.resolve_auto``): over their count where the
    configured mesh covers them, else with the count unknown (sizes kept beside mesh.auto, ``mesh.ici.fsdp=2`` on 8
    devices, leave the configured mesh short of the devices: the search fills the rest)."""
    from jaxtrain.parallel.dims import MeshShape
    from jaxtrain.parallel.layout import resolve_auto

    try:
        MeshShape.resolve(cfg.mesh, len(devices))
    except ConfigError:
        return resolve_auto(cfg, devices[0].platform)
    return resolve_auto(cfg, devices[0].platform, len(devices))


def hardware_for(cfg: Config, devices: list, calibration_path: str | None = None, nodes: int = 1,
                 progress: Callable[[str], None] = lambda msg: None, cache_dir: str | None = None):
    """The devices' hardware figures (``measure.hardware_at_hand``) with the calibration in (``calibration_path``,
    else ``run.dir/calibration.json`` if there): a ``calibration.Calibrated``. First :func:`affordable`: a model no
    layout can hold stops here, before anything is measured. ``cache_dir``: where CPU timings are kept (module
    docstring; None: timed afresh, kept nowhere).

    On CPU devices the figures no file carries are timed at hand, and the model's efficiency is worked out after the
    file's figures are in: it is a fraction of ``peak_flops``, so it must be taken against the peak the estimate
    will use (measured against the one at hand, then multiplied by a file's other peak, it had put the tiny model's
    calibrated estimate at 1.8x its measured step)."""
    from jaxtrain.planner.cost import calibration, measure

    affordable(cfg, devices, nodes, progress)
    resolved = _resolved(cfg, devices)
    dtype = resolved.model.dtype
    if devices[0].platform != "cpu":
        return calibration.for_plan(measure.hardware_at_hand(devices, None), calibration_path, cfg.run.dir, dtype,
                                    calibration.Devices.at_hand(devices))
    # The sized and model timings on this process's devices only: they share its cores, and a timing loop of
    # collectives across processes could run a different number of times on each.
    import jax

    local = [d for d in devices if d.process_index == jax.process_index()] or devices
    points = measure.model_points(cfg, len(local), REMATS)
    timed = _timings(resolved, devices, local, points, progress, cache_dir)
    cal = calibration.for_plan(measure.cpu_hardware(devices, **timed["at_hand"]), calibration_path, cfg.run.dir,
                               dtype, calibration.Devices.at_hand(devices))
    hw = cal.hw
    if not hw.matmul_rows and timed["sized"]:  # a file's table, where it has one, is the measurement of record
        hw = calibration.sized(hw, tuple(map(tuple, timed["sized"][0])), timed["sized"][1])
    if timed["model"]:
        hw = dataclasses.replace(hw, model_efficiency=measure.model_efficiency(resolved, len(local), hw, points,
                                                                               timed["model"]))
    return dataclasses.replace(cal, hw=hw)


def _timings(cfg: Config, devices: list, local: list, points, progress: Callable[[str], None],
             cache_dir: str | None) -> dict:
    """What the CPU devices at hand time (``cfg`` resolved): {"at_hand": measure_cpu's rates, "sized": (matmul rate
    by rows, a layer's fixed cost) or None, "model": the model's seconds per point or None}, from ``cache_dir``
    where an entry of the same key is there, else timed (and stored there). The sized and model timings are left
    out (None) where their own allocation would not fit the host's available memory less the margin: a model no
    CPU can time is estimated with ``compute_efficiency``, and a progress line says so."""
    from jaxtrain.planner.cost import measure
    from jaxtrain.train.guards import available_memory

    path = os.path.join(cache_dir, f"figures-{_key(cfg, devices, local, points)}.json") if cache_dir else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                entry = json.load(f)
            if not {"time", "at_hand", "sized", "model"} <= entry.keys():
                raise KeyError("an entry of another version")
            progress(f"mesh.auto: the CPU timings of an earlier search of this model on these devices, "
                     f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(entry['time']))} ({path}; delete it to time "
                     "them again)")
            return entry
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry is timed again and rewritten
    share, where = available_memory()
    room = share * (1 - cfg.mesh.auto_memory_margin) if share else float("inf")
    m, dtype = cfg.model, cfg.model.dtype
    progress(f"mesh.auto: timing the {len(devices)} CPU devices: matmul, copy and all-reduce rates, the matmul rate "
             "by rows, a layer's fixed cost")
    at_hand = measure.measure_cpu(devices)
    body: dict = {"time": time.time(), "at_hand": {k: getattr(at_hand, k) for k in measure.CPU_TIMED}, "sized": None,
                  "model": None}
    need = measure.sized_bytes(m.d_model, m.d_ff, dtype)
    if need <= room:
        body["sized"] = measure.measure_sized(local, m.d_model, m.d_ff, dtype)
    else:
        progress(f"mesh.auto: the matmul rate by rows is not timed: {gb(need)} a device, more than {gb(room)} "
                 f"({where}, less the margin)")
    need = measure.model_bytes(cfg, len(local), points)
    if need > room:
        progress(f"mesh.auto: the model's own step is not timed: it would hold {gb(need)} a device, more than "
                 f"{gb(room)} ({where}, less the margin); the estimate takes compute_efficiency "
                 f"{at_hand.compute_efficiency:g} of the matmul rate")
    else:
        progress(f"mesh.auto: timing the model's step (forward and backward, every device on its own copy) at "
                 f"{len(points)} points ({', '.join(f'remat {r} x{t}' for r, t in points)}), "
                 f"{measure.MODEL_ROUNDS} rounds")
        body["model"] = measure.model_seconds(cfg, local, points, progress)
    if path:
        os.makedirs(cache_dir, exist_ok=True)  # type: ignore[arg-type]  # path is set only with a cache_dir
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:  # every process times and writes its own: never half
            json.dump(body, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    return json.loads(json.dumps(body))  # as an entry reads back: the same figures either way


def _key(cfg: Config, devices: list, local: list, points) -> str:
    """The hash naming the timings of ``cfg``'s model (resolved) at ``points`` on ``devices`` (``local``: this
    process's): the host and its cores, the devices, the versions of JAX and jaxlib, XLA_FLAGS, and the model,
    sequence, batch and logical axes the model's timing runs."""
    import jax
    import jaxlib

    body = {"version": FIGURES_VERSION, "host": platform.node(), "cpus": os.cpu_count(), "devices": len(devices),
            "local": len(local), "kind": devices[0].device_kind, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": to_dict(cfg)["model"], "seq": cfg.data.seq_len,
            "batch": cfg.train.global_batch, "rules": sorted(cfg.mesh.rules), "points": [list(p) for p in points]}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]
