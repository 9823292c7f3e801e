"""Memory guards that stop a run before it can waste a job: the state must fit a device (:func:`check_state_fits`,
milliseconds), and so must the compiled step (:func:`check_memory_fit`: XLA's own figures against what the devices,
on CPU the host, have), before any array of the state exists. (The other guard, one job per run directory, is
``rundir.RunLock``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from jaxtrain.errors import ConfigError
from jaxtrain.parallel.layout import Layout, compiled_need


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


def check_state_fits(layout: Layout) -> None:
    """ConfigError when the parameters and optimizer state alone (their shards, from the abstract state's shardings)
    exceed a device's memory: found in milliseconds, before the data is read or the step compiled."""
    budget, where = available_memory()
    if layout.cfg.runtime.ignore_memory_check or budget is None:
        return
    state = sum(layout.state_bytes)
    if state > budget:
        raise ConfigError(
            f"the parameters and optimizer state alone need {state / 2**30:.2f} GiB per device on mesh "
            f"{layout.shape.label}, but {budget / 2**30:.2f} GiB are available per device ({where}); shard them over "
            "more devices (mesh.ici.fsdp), use a smaller model, or runtime.ignore_memory_check=true to start anyway")


def check_memory_fit(layout: Layout, compiled_step, recompile: Callable[[int], Any], max_trials: int = 2) -> None:
    """ConfigError (exit 2) with the figures and what would fit when the compiled step needs more memory per device
    than there is; skipped with ``runtime.ignore_memory_check=true``. ``recompile(microbatches)``: the train step
    compiled for the same layout with another ``train.microbatches``.

    The suggestion is checked, not guessed: temporaries do not shrink in proportion to the microbatch (gathered
    parameters and gradient accumulators stay), so up to ``max_trials`` microbatch counts, from the proportional
    estimate upwards, are compiled (from abstract shapes: seconds to a minute each) and the first that fits is named.
    """
    budget, where = available_memory()
    need = compiled_need(compiled_step)
    if layout.cfg.runtime.ignore_memory_check or need is None or budget is None or need.total <= budget:
        return
    total, state, temp = need.total, need.arguments, need.temporaries
    gib, cfg = 2**30, layout.cfg
    hints = []
    rows = layout.dims.rows_per_group
    k = math.ceil(temp / max(1, budget - (total - temp))) if state < budget else rows + 1
    tried = []
    for m in [m for m in range(max(k, 2), rows + 1) if rows % m == 0][:max_trials]:
        micro = cfg.train.microbatches * m
        trial = compiled_need(recompile(micro))
        assert trial is not None  # the same backend analysed the first compile
        tried.append((micro, trial.total))
        if trial.total <= budget:
            break
    if tried:
        figures = ", ".join(f"{n / gib:.2f} GiB with {micro}" for micro, n in tried)
        fits = tried[-1][1] <= budget
        hints.append(f"train.microbatches={tried[-1][0]} (compiled per device: {figures})" if fits else
                     f"more train.microbatches than {tried[-1][0]} (compiled per device: {figures}: not enough)")
    if cfg.model.remat == "none":
        hints.append("model.remat=full (keeps about one layer's activations)")
    if layout.num_devices > 1 and layout.platform == "cpu":
        hints.append("fewer runtime.cpu_devices (emulated devices share the host's memory)")
    if state >= budget:
        hints.append("more devices to shard the state over (mesh.ici.fsdp), or a smaller model")
    raise ConfigError(
        f"the compiled train step needs {total / gib:.2f} GiB per device (state and batch {state / gib:.2f} GiB, "
        f"temporaries {temp / gib:.2f} GiB) on mesh {layout.shape.label}, but {budget / gib:.2f} GiB are available "
        f"per device ({where}); try {'; '.join(hints) or 'a smaller model or batch'}; or "
        "runtime.ignore_memory_check=true to start anyway")
