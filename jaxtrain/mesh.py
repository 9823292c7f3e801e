"""The mesh: its shape (axes data, stage, fsdp, context, tensor, each an intra-node ici part times an inter-node dcn
part) and the device mesh built from it.

:class:`MeshShape` owns every fact about a shape: resolving the config's ``-1`` axis, the axis sizes, its label and
JSON form, the ``key=value`` overrides that reproduce it, the config with it pinned, and
which node each device sits on. :func:`build_mesh` lays devices out by the same node coordinates, so the planner's
view of which collectives cross nodes is the mesh's own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxtrain.config import MESH_AXES, Config, MeshConfig, check_divisibility
from jaxtrain.errors import ConfigError

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


@dataclass(frozen=True)
class MeshShape:
    """Resolved axis sizes in ``MESH_AXES`` order: ``ici`` inside a node, ``dcn`` across nodes."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...]

    def __post_init__(self):
        if len(self.ici) != len(MESH_AXES) or len(self.dcn) != len(MESH_AXES):
            raise ValueError(f"MeshShape takes one size per mesh axis {MESH_AXES}, got ici={self.ici} dcn={self.dcn}")

    @classmethod
    def resolve(cls, mesh_cfg: MeshConfig, num_devices: int) -> MeshShape:
        """The config's shape over ``num_devices``: the one ``-1`` axis filled, the total checked."""
        sizes = mesh_cfg.sizes()
        fixed = math.prod(v for v in sizes.values() if v != -1)
        fill = [k for k, v in sizes.items() if v == -1]
        if fill:
            if num_devices % fixed:
                part, ax = fill[0]
                raise ConfigError(f"mesh.{part}.{ax}=-1 cannot fill {num_devices} devices: the other mesh axes "
                                  f"multiply to {fixed}, which does not divide {num_devices}")
            sizes[fill[0]] = num_devices // fixed
        elif fixed != num_devices:
            listing = " x ".join(f"{p}.{a}={v}" for (p, a), v in sizes.items() if v != 1) or "all axes 1"
            raise ConfigError(f"the mesh ({listing}) has {fixed} devices but {num_devices} are available; make the "
                              f"mesh sizes multiply to {num_devices} (or set one axis to -1), or set "
                              f"runtime.cpu_devices={fixed} on CPU")
        return cls(ici=tuple(sizes[("ici", a)] for a in MESH_AXES), dcn=tuple(sizes[("dcn", a)] for a in MESH_AXES))

    # -- sizes ---------------------------------------------------------------------------------------------------

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Total size of each mesh axis, e.g. ``{"data": 2, "stage": 1, "fsdp": 4, "context": 1, "tensor": 1}``."""
        return {ax: i * d for ax, i, d in zip(MESH_AXES, self.ici, self.dcn)}

    @property
    def num_devices(self) -> int:
        return math.prod(self.ici) * math.prod(self.dcn)

    @property
    def num_nodes(self) -> int:
        """Hosts (processes, one per node) the dcn parts step across."""
        return math.prod(self.dcn)

    @property
    def devices_per_node(self) -> int:
        return math.prod(self.ici)

    # -- renderings ----------------------------------------------------------------------------------------------

    @property
    def label(self) -> str:
        """Short human label: ``fsdp8``, ``data2 fsdp2 tensor2``, ``fsdp4 | dcn data2``."""
        ici = " ".join(f"{a}{s}" for a, s in zip(MESH_AXES, self.ici) if s > 1) or "one-device"
        dcn = " ".join(f"{a}{s}" for a, s in zip(MESH_AXES, self.dcn) if s > 1)
        return f"{ici} | dcn {dcn}" if dcn else ici

    def as_dict(self) -> dict:
        """The JSON form: total axis sizes, and their intra-node (ici) and inter-node (dcn) parts."""
        return {**self.axis_sizes, "ici": dict(zip(MESH_AXES, self.ici)), "dcn": dict(zip(MESH_AXES, self.dcn))}

    def overrides(self) -> list[str]:
        """The command-line overrides that select exactly this shape (all eight sizes)."""
        return [f"mesh.{part}.{ax}={s}" for part, sizes in (("ici", self.ici), ("dcn", self.dcn))
                for ax, s in zip(MESH_AXES, sizes)]

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with its mesh pinned to this shape (no ``-1`` left)."""
        ici = dataclasses.replace(cfg.mesh.ici, **dict(zip(MESH_AXES, self.ici)))
        dcn = dataclasses.replace(cfg.mesh.dcn, **dict(zip(MESH_AXES, self.dcn)))
        return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, ici=ici, dcn=dcn))

    # -- device layout -------------------------------------------------------------------------------------------

    def coordinates(self, ids: np.ndarray) -> np.ndarray:
        """Logical device ids (positions in the row-major (data, stage, fsdp, context, tensor) mesh) -> [..., 2 * axes]
        coordinates ``(dcn_data, ici_data, dcn_stage, ici_stage, ..., dcn_tensor, ici_tensor)``, MESH_AXES order.

        Within each axis the dcn index is the major part (dcn = coord // ici, ici = coord % ici): the layout
        :func:`build_mesh` gives the devices, so the dcn coordinates name the node a device sits on.
        """
        ids = np.asarray(ids)
        coords = np.stack(np.unravel_index(ids, tuple(self.axis_sizes.values())), axis=-1)
        ici = np.array(self.ici)
        return np.stack([coords // ici, coords % ici], axis=-1).reshape(*ids.shape, 2 * len(MESH_AXES))

    def node_of(self, ids: np.ndarray) -> np.ndarray:
        """The node index (0 .. num_nodes - 1) of each logical device id."""
        dcn_coords = self.coordinates(ids)[..., 0::2]
        return np.ravel_multi_index(tuple(np.moveaxis(dcn_coords, -1, 0)), self.dcn)

    def device_grid(self, devices: list) -> np.ndarray:
        """``devices`` (node after node, each node's devices contiguous) arranged as this mesh: an array of shape
        ``axis_sizes`` whose logical id ``i`` holds a device of node ``node_of(i)``."""
        per_node = self.devices_per_node
        groups = [mesh_utils.create_device_mesh(self.ici, devices[g * per_node:(g + 1) * per_node],
                                                allow_split_physical_axes=True) for g in range(self.num_nodes)]
        n = len(MESH_AXES)
        grid = np.stack(groups).reshape(*self.dcn, *self.ici)  # [dcn of each axis..., ici of each axis...]
        grid = grid.transpose([k for ax in range(n) for k in (ax, n + ax)])  # the dcn index is the major part
        return grid.reshape(tuple(self.axis_sizes.values()))


def cpu_devices_per_process(cfg: Config, num_processes: int = 1) -> int:
    """``runtime.cpu_devices``, or (unset) the mesh's fixed axis sizes (``-1`` counted as 1) shared by the processes."""
    if cfg.runtime.cpu_devices is not None:
        return cfg.runtime.cpu_devices
    return max(1, math.prod(cfg.mesh.fixed_axis_sizes().values()) // num_processes)


def build_mesh(cfg: Config, devices: list | None = None) -> tuple[Mesh, MeshShape]:
    """The training mesh over ``devices`` (default: all global devices) and its resolved shape, after checking the
    model and batch against the axis sizes."""
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = MeshShape.resolve(cfg.mesh, len(devices))
    check_divisibility(cfg, shape.axis_sizes)
    n_proc = len({d.process_index for d in devices})
    if n_proc > 1:
        if shape.num_nodes != n_proc:
            raise ConfigError(f"mesh.dcn sizes multiply to {shape.num_nodes} but there are {n_proc} processes; "
                              "with one process per host the dcn axes must multiply to the number of processes")
        arr = mesh_utils.create_hybrid_device_mesh(shape.ici, shape.dcn, devices, process_is_granule=True)
    else:
        # One process emulates the nodes with contiguous groups of its devices.
        arr = shape.device_grid(devices)
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
