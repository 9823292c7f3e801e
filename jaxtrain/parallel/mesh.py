"""The device mesh of a :class:`~jaxtrain.parallel.dims.MeshShape`, and the logical rules in Flax's form.

:func:`build_mesh` lays devices out by the shape's node coordinates (``MeshShape.coordinates``), so the planner's
view of which collectives cross nodes is the mesh's own.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxtrain.config import Config
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MESH_AXES, MeshShape, ParallelDims

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def device_grid(shape: MeshShape, devices: list) -> np.ndarray:
    """``devices`` (node after node, each node's devices contiguous) arranged as this mesh: an array of shape
    ``axis_sizes`` whose logical id ``i`` holds a device of node ``node_of(i)``."""
    per_node = shape.devices_per_node
    groups = [mesh_utils.create_device_mesh(shape.ici, devices[g * per_node:(g + 1) * per_node],
                                            allow_split_physical_axes=True) for g in range(shape.num_nodes)]
    n = len(MESH_AXES)
    grid = np.stack(groups).reshape(*shape.dcn, *shape.ici)  # [dcn of each axis..., ici of each axis...]
    grid = grid.transpose([k for ax in range(n) for k in (ax, n + ax)])  # the dcn index is the major part
    return grid.reshape(tuple(shape.axis_sizes.values()))


def build_mesh(cfg: Config, devices: list | None = None) -> tuple[Mesh, MeshShape]:
    """The training mesh over ``devices`` (default: all global devices) and its resolved shape, after checking the
    model and batch against the axis sizes."""
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = MeshShape.resolve(cfg.mesh, len(devices))
    ParallelDims(cfg, shape).check()
    n_proc = len({d.process_index for d in devices})
    if n_proc > 1:
        if shape.num_nodes != n_proc:
            raise ConfigError(f"mesh.dcn sizes multiply to {shape.num_nodes} but there are {n_proc} processes; "
                              "with one process per host the dcn axes must multiply to the number of processes")
        arr = mesh_utils.create_hybrid_device_mesh(shape.ici, shape.dcn, devices, process_is_granule=True)
    else:
        # One process emulates the nodes with contiguous groups of its devices.
        arr = device_grid(shape, devices)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES)), shape


def without_axes(spec: PartitionSpec, axes) -> PartitionSpec:
    """``spec`` with the mesh ``axes`` removed from every dimension (those dimensions gathered over them)."""
    out = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n not in axes)
        out.append(kept if len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*out)


def rules_from_config(rules: dict) -> Rules:
    """Config rules (a mapping of logical name to mesh axis, list of axes, or None) in Flax's tuple form."""
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in rules.items())
