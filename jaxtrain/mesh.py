"""Device mesh with axes (data, fsdp, tensor), each split into an intra-node (ici) and an inter-node (dcn) part.

Device order: every ici group (the devices one host holds) is a contiguous block of the mesh, and the dcn part of each
axis steps across hosts, so collectives over ici-only axes never leave a node. Logical-axis rules from the config map
the model's logical names to these mesh axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtrain.config import MESH_AXES, ConfigError, Config, MeshConfig, check_divisibility

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


@dataclass(frozen=True)
class MeshShape:
    """Resolved axis sizes, in MESH_AXES order."""

    ici: tuple[int, int, int]
    dcn: tuple[int, int, int]

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {ax: i * d for ax, i, d in zip(MESH_AXES, self.ici, self.dcn)}

    def describe(self) -> str:
        parts = []
        for ax, i, d in zip(MESH_AXES, self.ici, self.dcn):
            parts.append(f"{ax}={i * d}" + (f" (ici {i} x dcn {d})" if d > 1 else ""))
        return ", ".join(parts)


def resolve_shape(mesh_cfg: MeshConfig, num_devices: int) -> MeshShape:
    """Fill in the one ``-1`` axis and check the mesh covers exactly ``num_devices`` devices."""
    sizes = {(part, ax): getattr(getattr(mesh_cfg, part), ax) for part in ("ici", "dcn") for ax in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if num_devices % fixed:
            part, ax = fill[0]
            raise ConfigError(f"mesh.{part}.{ax}=-1 cannot fill {num_devices} devices: the other mesh axes multiply "
                              f"to {fixed}, which does not divide {num_devices}")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        listing = " x ".join(f"{p}.{a}={v}" for (p, a), v in sizes.items() if v != 1) or "all axes 1"
        raise ConfigError(f"the mesh ({listing}) has {fixed} devices but {num_devices} are available; make the mesh "
                          f"sizes multiply to {num_devices} (or set one axis to -1), or set runtime.cpu_devices={fixed} on CPU")
    return MeshShape(ici=tuple(sizes[("ici", a)] for a in MESH_AXES), dcn=tuple(sizes[("dcn", a)] for a in MESH_AXES))


def build_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """The training mesh over ``devices`` (default: all global devices), after checking sizes against the model."""
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = resolve_shape(cfg.mesh, len(devices))
    check_divisibility(cfg, shape.axis_sizes)
    n_proc = len({d.process_index for d in devices})
    num_granules = math.prod(shape.dcn)
    if n_proc > 1:
        if num_granules != n_proc:
            raise ConfigError(f"mesh.dcn sizes multiply to {num_granules} but there are {n_proc} processes; "
                              "with one process per host the dcn axes must multiply to the number of processes")
        arr = mesh_utils.create_hybrid_device_mesh(shape.ici, shape.dcn, devices, process_is_granule=True)
    else:
        arr = _single_host_hybrid(shape, devices)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _single_host_hybrid(shape: MeshShape, devices: list) -> np.ndarray:
    """On one process, emulate hosts as contiguous groups of devices, arranged as create_hybrid_device_mesh would."""
    n_groups = math.prod(shape.dcn)
    per_group = len(devices) // n_groups
    groups = [mesh_utils.create_device_mesh(shape.ici, devices[g * per_group:(g + 1) * per_group],
                                            allow_split_physical_axes=True) for g in range(n_groups)]
    grid = np.stack(groups).reshape(*shape.dcn, *shape.ici)  # [dcn_d, dcn_f, dcn_t, ici_d, ici_f, ici_t]
    grid = grid.transpose(0, 3, 1, 4, 2, 5)  # dcn index is the major part of each axis
    return grid.reshape([d * i for d, i in zip(shape.dcn, shape.ici)])


def rules_from_config(rules: dict) -> Rules:
    """Config rules (a mapping of logical name to mesh axis, list of axes, or None) in Flax's tuple form."""
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in rules.items())

