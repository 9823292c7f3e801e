"""What a checkpoint of a layout writes, per host, and how long a save takes at a stated write bandwidth.

A checkpoint (``jaxtrain.checkpoint.format``) is the train state, every leaf in its own dtype (parameters, AdamW's
moments and counters, the step, FP8 amax histories, expert biases), plus a few kB of JSON (config, data iterator
position, checksums). Its bytes are read off the layout's abstract, sharded state (``Layout.abstract_state``: the
same ``jax.eval_shape`` the planner compiles from), not modelled again.

Which host writes which bytes follows Orbax 0.12's ``ArrayHandler`` (``serialization/replica_slices.py``): every
distinct shard of an array is written once. Without *replica-parallel* writing the device holding replica 0 of the
shard (the first, in the mesh's device order, that holds it) writes all of it; with it, the shard is split along its
first dimension divisible by the replica count and each replica writes its slice. Orbax turns replica-parallel on
unless ``JAX_PLATFORMS`` names ``gpu`` or ``cuda`` -- which ``launch/jaxtrain.env`` sets, so a GPU job started by
jaxtrain's launchers writes replicated shards from the hosts of replica 0 (the larger per-host figure).

A save's time per host = the bytes that host writes / the write bandwidth one host gets (``plan
--write-bandwidth``). The device-to-host copy blocks the step; the write itself runs in the background, but a save
still running when the next is due blocks training. So the plan warns where a save takes longer than ``save_share``
of the interval between saves (``checkpoint.every`` x the estimated step time).

May import: config, parallel (the layout), and the planner's ``search`` results as dicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxtrain.config import Config
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.planner.search.report import decimal_bytes

GB = 1e9  # write bandwidths are given in decimal GB/s, as storage vendors state them
DEFAULT_SAVE_SHARE = 0.1


@dataclass(frozen=True)
class Storage:
    """The plan's checkpoint storage: ``write_bandwidth`` bytes/s one host writes at (None: sizes only, no save
    time), ``save_share`` the share of the checkpoint interval a save may take before the plan warns."""

    write_bandwidth: float | None = None
    save_share: float = DEFAULT_SAVE_SHARE


def orbax_replica_parallel(jax_platforms: str) -> bool:
    """Orbax 0.12's default for replica-parallel writing, from ``JAX_PLATFORMS`` (``_get_default_use_replica_parallel``
    in ``serialization/jax_array_handlers.py``): off where it names gpu or cuda."""
    platforms = jax_platforms.lower()
    return not ("gpu" in platforms or "cuda" in platforms)


def _writers(n_replicas: int, shard_shape: tuple[int, ...], replica_parallel: bool) -> int:
    """How many of a shard's ``n_replicas`` copies write a part of it (Orbax's rule: split along the first
    dimension divisible by the replica count, else replica 0 writes it whole)."""
    if not replica_parallel or n_replicas <= 1 or math.prod(shard_shape) == 0:
        return 1
    return n_replicas if any(d % n_replicas == 0 for d in shard_shape) else 1


def leaf_bytes_per_node(leaf: Any, node_of_device: dict[Any, int], n_nodes: int,
                        replica_parallel: bool) -> np.ndarray:
    """[n_nodes] bytes each node writes of one array. ``leaf``: a ShapeDtypeStruct (or array) with a sharding;
    ``node_of_device``: device -> node. Replicas are numbered in the sharding's device order, as JAX numbers
    ``Shard.replica_id``."""
    out = np.zeros(n_nodes, dtype=np.int64)
    itemsize = np.dtype(leaf.dtype).itemsize
    shape = tuple(leaf.shape)
    holders: dict[tuple, list[Any]] = {}  # distinct shard index -> the devices holding it, in device order
    for device, index in leaf.sharding.devices_indices_map(shape).items():
        key = tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))
        holders.setdefault(key, []).append(device)
    for key, devices in holders.items():
        shard_shape = tuple(b - a for a, b in key)
        nbytes = math.prod(shard_shape) * itemsize
        writers = _writers(len(devices), shard_shape, replica_parallel)
        for device in devices[:writers]:
            out[node_of_device[device]] += nbytes // writers
    return out


def bytes_per_node(abstract_state: Any, mesh: jax.sharding.Mesh, shape: MeshShape,
                   replica_parallel: bool) -> np.ndarray:
    """[nodes] bytes each host writes of ``abstract_state`` (sharded over ``mesh``, of ``shape``): a device's node
    is that of its position in the mesh (``MeshShape.node_of``: the layout ``build_mesh`` gives, one process per
    node). Their sum is the state's bytes, each element once."""
    ids = np.arange(mesh.devices.size)
    node_of_device = dict(zip(mesh.devices.flat, shape.node_of(ids).tolist(), strict=True))
    total = np.zeros(shape.num_nodes, dtype=np.int64)
    for leaf in jax.tree.leaves(abstract_state):
        total += leaf_bytes_per_node(leaf, node_of_device, shape.num_nodes, replica_parallel)
    return total


def save_figures(node_bytes: Sequence[int], every: int, step_seconds: float, storage: Storage,
                 replica_parallel: bool) -> dict:
    """The plan's ``checkpoint`` entry for one layout: bytes in total and per host, the slowest host's save time at
    ``storage.write_bandwidth`` (None without one), the interval between saves (``every`` steps of
    ``step_seconds``; None where ``every`` is 0: a save at the last step only) and whether the save exceeds
    ``storage.save_share`` of it."""
    most = int(max(node_bytes))
    save_s = None if storage.write_bandwidth is None else most / storage.write_bandwidth
    interval = every * step_seconds if every > 0 else None
    return {"bytes": int(sum(node_bytes)), "bytes_per_host": [int(b) for b in node_bytes],
            "max_bytes_per_host": most, "replica_parallel": replica_parallel,
            "write_bandwidth": storage.write_bandwidth, "save_seconds": save_s, "interval_seconds": interval,
            "save_share": storage.save_share,
            "too_slow": save_s is not None and interval is not None and save_s > storage.save_share * interval}


def warning(label: str, fig: dict, every: int) -> str | None:
    """A ``warning:`` line where ``fig`` (:func:`save_figures`) says a save takes too long, else None."""
    if not fig["too_slow"]:
        return None
    return (f"warning: {label}: a checkpoint save writes {decimal_bytes(fig['max_bytes_per_host'])} from the busiest "
            f"host, {fig['save_seconds']:.3g} s at {fig['write_bandwidth'] / GB:g} GB/s, more than "
            f"{fig['save_share']:g} of the {fig['interval_seconds']:.3g} s between saves (checkpoint.every={every} "
            f"steps): raise checkpoint.every to at least "
            f"{math.ceil(fig['save_seconds'] / fig['save_share'] / (fig['interval_seconds'] / every))}, or write "
            "to faster storage (docs/checkpoints.md)")


def for_plan(cfg: Config, candidates: list[dict], devices: list, storage: Storage, replica_parallel: bool) -> None:
    """Add a ``checkpoint`` entry (:func:`save_figures`, with its :func:`warning` or None) to each of the plan's
    ``candidates`` (their ``mesh`` dicts), from the abstract state of ``cfg`` laid out on that mesh over ``devices``;
    one layout per mesh."""
    from jaxtrain.parallel.layout import Layout

    seen: dict[tuple, np.ndarray] = {}
    for r in candidates:
        mesh = r["mesh"]
        shape = MeshShape.of(mesh["ici"], mesh["dcn"])
        key = (shape.ici, shape.dcn)
        if key not in seen:
            layout = Layout.build(shape.apply(cfg), devices[:shape.num_devices])
            seen[key] = bytes_per_node(layout.abstract_state, layout.mesh, shape, replica_parallel)
        fig = save_figures(seen[key].tolist(), cfg.checkpoint.every, r["est_step_seconds"], storage, replica_parallel)
        r["checkpoint"] = {**fig, "warning": warning(r["label"], fig, cfg.checkpoint.every)}
