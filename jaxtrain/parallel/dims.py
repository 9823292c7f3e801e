"""The parallel facts of a config, before any device exists: the mesh axes, their sizes, and what follows from them.

:class:`Axis` is the one definition of the mesh axes; every module names an axis through it, never by a string of
its own. :class:`MeshShape` holds the sizes (each axis an intra-node ``ici`` part times an inter-node ``dcn`` part) and
which node a device sits on. :class:`ParallelDims` pairs a config with a shape and derives the rest (batch axes and
data-parallel size, stages, context, rows per microbatch and per data-parallel group, the checks that shapes split
evenly): config validation, the planner's closed forms, the compile check and :class:`jaxtrain.parallel.layout.Layout`
all read these, none derives them again (torchtitan's ``ParallelDims`` plays the same part).

A leaf: no JAX and nothing of jaxtrain but errors, so that config validation can use it before JAX starts. The
config is read by its fields (``cfg.mesh``, ``cfg.train``, ...); ``jaxtrain.config`` imports this module, not the
other way round.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxtrain.errors import ConfigError


class Axis(enum.StrEnum):
    """The mesh axes, outermost first: devices adjacent in a node differ in tensor first, then context, expert, fsdp,
    stage, data. A ``str``: ``Axis.FSDP == "fsdp"``, usable wherever JAX takes a mesh axis name."""

    DATA = "data"  # data parallelism: replicas of the parameters, each with its rows of the batch
    STAGE = "stage"  # pipeline stages: consecutive groups of layers
    FSDP = "fsdp"  # fully sharded data parallelism: parameters, gradients and optimizer state sharded (ZeRO-3)
    # Expert parallelism: the MoE layers' experts split over it, tokens sent to their experts' devices (all-to-all);
    # outside the MoE layers one more axis the batch is split over (docs/moe.md).
    EXPERT = "expert"
    CONTEXT = "context"  # context parallelism: the sequence split, ring attention over it
    TENSOR = "tensor"  # tensor parallelism: heads and MLP columns split (Megatron); inside a node only


MESH_AXES: tuple[str, ...] = tuple(a.value for a in Axis)  # plain strings: what JAX's meshes are named by


def rule_axes(target: Any) -> tuple[str, ...]:
    """The mesh axes a logical rule's target names: a name, a list of names, or None -> a tuple (maybe empty)."""
    names = target if isinstance(target, (list, tuple)) else [target]
    return tuple(a for a in names if a is not None)


def batch_mesh_axes(rules: dict[str, Any]) -> tuple[str, ...]:
    """The mesh axes the batch is split over, from ``mesh.rules.batch``, e.g. ``("data", "fsdp")``."""
    return rule_axes(rules.get("batch"))


@dataclass(frozen=True)
class MeshShape:
    """Resolved axis sizes in ``MESH_AXES`` order: ``ici`` inside a node, ``dcn`` across nodes."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...]

    def __post_init__(self):
        if len(self.ici) != len(MESH_AXES) or len(self.dcn) != len(MESH_AXES):
            raise ValueError(f"MeshShape takes one size per mesh axis {MESH_AXES}, got ici={self.ici} dcn={self.dcn}")

    @classmethod
    def of(cls, ici: dict[str, int] | None = None, dcn: dict[str, int] | None = None) -> MeshShape:
        """A shape from sizes by axis name, the rest 1: ``MeshShape.of({"fsdp": 4, "tensor": 2})``."""
        ici, dcn = ici or {}, dcn or {}
        return cls(ici=tuple(ici.get(a, 1) for a in MESH_AXES), dcn=tuple(dcn.get(a, 1) for a in MESH_AXES))

    @classmethod
    def resolve(cls, mesh_cfg: Any, num_devices: int) -> MeshShape:
        """The config's shape (``cfg.mesh``) over ``num_devices``: the one ``-1`` axis filled, the total checked."""
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

    @classmethod
    def fixed(cls, mesh_cfg: Any) -> MeshShape:
        """The config's shape with a ``-1`` axis counted as 1: what is known before the device count is."""
        sizes = {k: max(v, 1) for k, v in mesh_cfg.sizes().items()}
        return cls(ici=tuple(sizes[("ici", a)] for a in MESH_AXES), dcn=tuple(sizes[("dcn", a)] for a in MESH_AXES))

    # -- sizes ---------------------------------------------------------------------------------------------------

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Total size of each mesh axis, e.g. ``{"data": 2, "stage": 1, "fsdp": 4, "expert": 1, "context": 1,
        "tensor": 1}``."""
        return {ax: i * d for ax, i, d in zip(MESH_AXES, self.ici, self.dcn)}

    def size(self, axis: str) -> int:
        """The total size of one axis (ici x dcn)."""
        k = MESH_AXES.index(Axis(axis))
        return self.ici[k] * self.dcn[k]

    def crosses_nodes(self, axis: str) -> bool:
        """Whether ``axis`` has a dcn part: its collectives ride the network between nodes."""
        return self.dcn[MESH_AXES.index(Axis(axis))] > 1

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
        """The command-line overrides that select exactly this shape (every ici and dcn size)."""
        return [f"mesh.{part}.{ax}={s}" for part, sizes in (("ici", self.ici), ("dcn", self.dcn))
                for ax, s in zip(MESH_AXES, sizes)]

    def apply(self, cfg: Any) -> Any:
        """``cfg`` with its mesh pinned to this shape (no ``-1`` left)."""
        ici = dataclasses.replace(cfg.mesh.ici, **dict(zip(MESH_AXES, self.ici)))
        dcn = dataclasses.replace(cfg.mesh.dcn, **dict(zip(MESH_AXES, self.dcn)))
        return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, ici=ici, dcn=dcn))

    # -- which node each device sits on --------------------------------------------------------------------------

    def coordinates(self, ids: np.ndarray) -> np.ndarray:
        """Logical device ids (positions in the row-major mesh, MESH_AXES order) -> [..., 2 * axes] coordinates
        ``(dcn_data, ici_data, dcn_stage, ici_stage, ...)``.

        Within each axis the dcn index is the major part (dcn = coord // ici, ici = coord % ici): the layout
        :func:`jaxtrain.parallel.mesh.build_mesh` gives the devices, so the dcn coordinates name a device's node.
        """
        ids = np.asarray(ids)
        coords = np.stack(np.unravel_index(ids, tuple(self.axis_sizes.values())), axis=-1)
        ici = np.array(self.ici)
        return np.stack([coords // ici, coords % ici], axis=-1).reshape(*ids.shape, 2 * len(MESH_AXES))

    def node_of(self, ids: np.ndarray) -> np.ndarray:
        """The node index (0 .. num_nodes - 1) of each logical device id."""
        dcn_coords = self.coordinates(ids)[..., 0::2]
        return np.ravel_multi_index(tuple(np.moveaxis(dcn_coords, -1, 0)), self.dcn)


@dataclass(frozen=True)
class ParallelDims:
    """One config's parallel facts on one mesh shape (no devices). Build with :meth:`of`."""

    cfg: Any  # jaxtrain.config.Config: its mesh rules, train and data sections are read
    shape: MeshShape

    @classmethod
    def of(cls, cfg: Any, shape: MeshShape | None = None, num_devices: int | None = None) -> ParallelDims:
        """The facts of ``cfg`` on ``shape``; without one, the config's mesh over ``num_devices`` (-1 filled), or
        without that either, its fixed sizes (a -1 axis counted as 1)."""
        if shape is None:
            shape = MeshShape.resolve(cfg.mesh, num_devices) if num_devices else MeshShape.fixed(cfg.mesh)
        return cls(cfg, shape)

    def size(self, axis: str) -> int:
        return self.shape.size(axis)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (``mesh.rules.batch``), e.g. ``("data", "fsdp")``."""
        return batch_mesh_axes(self.cfg.mesh.rules)

    @property
    def data_parallel(self) -> int:
        """The product of the batch axes' sizes: groups of devices holding distinct rows."""
        return math.prod(self.size(a) for a in self.batch_axes)

    @property
    def stages(self) -> int:
        """Pipeline stages: the stage axis (1: no pipeline)."""
        return self.size(Axis.STAGE)

    @property
    def context(self) -> int:
        """Context-parallel size: the context axis (1: the sequence is not split)."""
        return self.size(Axis.CONTEXT)

    @property
    def tensor(self) -> int:
        return self.size(Axis.TENSOR)

    @property
    def expert(self) -> int:
        """Expert-parallel size: the expert axis (1: every device holds all experts' weights, or its fsdp shards)."""
        return self.size(Axis.EXPERT)

    @property
    def param_shards(self) -> int:
        """Pieces the largest parameters are cut into: fsdp x tensor x stage (the embedding is not split over
        stages and norms over nothing, so dividing all parameters by this gives a lower bound)."""
        return self.size(Axis.FSDP) * self.tensor * self.stages

    @property
    def microbatches(self) -> int:
        return self.cfg.train.microbatches

    @property
    def rows_per_microbatch(self) -> int:
        """Sequences in one microbatch of the global batch."""
        return self.cfg.train.global_batch // self.microbatches

    @property
    def rows_per_group(self) -> int:
        """Sequences of one microbatch that one data-parallel group holds."""
        return self.rows_per_microbatch // self.data_parallel

    @property
    def local_seq(self) -> int:
        """Tokens of each sequence one device holds: data.seq_len / context."""
        return self.cfg.data.seq_len // self.context

    def seq_shards(self) -> int:
        """How many slices ``mesh.rules.act_seq`` cuts the activations' sequence dimension into (1: none)."""
        return math.prod(self.size(a) for a in rule_axes(self.cfg.mesh.rules.get("act_seq")))

    def check(self) -> None:
        """Raise ConfigError where a shape does not split evenly over the axes its logical axes map to (heads over
        tensor, a microbatch over the data-parallel groups, the sequence over context, layers over stages), or where
        the data cannot take the layout (chat data with pipeline stages). Config validation, the mesh, ``plan`` and
        ``mesh.auto``'s search all ask here, so none of them picks a layout that training then refuses."""
        m, t = self.cfg.model, self.cfg.train
        for name in ("n_heads", "n_kv_heads"):
            _require(getattr(m, name) % self.tensor == 0,
                     f"model.{name}={getattr(m, name)} is not divisible by the tensor axis size {self.tensor}")
        micro, dp = self.rows_per_microbatch, self.data_parallel
        _require(micro % dp == 0,
                 f"train.global_batch={t.global_batch} (/{t.microbatches} microbatches = {micro}) is not divisible by "
                 f"the data-parallel size {dp} ({' x '.join(self.batch_axes)})")
        if self.context > 1:
            self._check_context()
        if self.stages > 1:
            self._check_stages()
        if m.moe.experts or self.expert > 1:
            self._check_experts()

    def _check_context(self) -> None:
        rule, c = self.cfg.mesh.rules.get("act_seq"), self.context
        # Here, not only in config validation: mesh.auto's search asks here too, so it never picks a context axis
        # for an MLA model.
        axes = [f"mesh.{part}.context={v}" for (part, ax), v in self.cfg.mesh.sizes().items()
                if ax == Axis.CONTEXT and v not in (1, -1)] or [f"the context axis of size {c}"]
        _require(not self.cfg.model.mla, f"{', '.join(axes)}: ring attention takes one head dim, so multi-head latent "
                 "attention (model.kv_lora_rank set) needs mesh.ici.context=1 and mesh.dcn.context=1")
        _require(rule == Axis.CONTEXT, f"mesh.rules.act_seq={rule!r} must be 'context' with a context axis of size "
                 f"{c} (it splits the activations' sequence)")
        # The zigzag order gives each device two chunks of seq_len / (2 * context) (docs/long-context.md).
        _require(self.cfg.data.seq_len % (2 * c) == 0, f"data.seq_len={self.cfg.data.seq_len} is not divisible by "
                 f"2 x the context axis size {c} (each device holds two chunks of the sequence)")

    def _check_stages(self) -> None:
        m, t, stages = self.cfg.model, self.cfg.train, self.stages
        # First: no microbatch count or layer split helps (the plan's note names this reason, not the microbatches).
        _require(self.cfg.data.format != "chat", f"data.format=chat (a per-token loss mask) is not yet supported with "
                 f"pipeline stages (mesh stage={stages}); fine-tune with stage=1 (data, fsdp and tensor parallelism), "
                 "or train data.format=tokens with stages")
        chunks = stages * t.virtual_stages
        _require(m.n_layers % chunks == 0, f"model.n_layers={m.n_layers} does not split into {stages} stages x "
                 f"train.virtual_stages={t.virtual_stages}; make n_layers a multiple of {chunks}")
        # Pipelines split the one scanned stack; the dense layers before it would be a second stack on stage 0.
        _require(not (m.moe.experts and m.moe.first_dense), f"model.moe.first_dense={m.moe.first_dense} is not "
                 f"supported yet with pipeline stages (mesh stage={stages}); use stage=1 (fsdp, expert and tensor "
                 "parallelism) or model.moe.first_dense=0")
        groups = m.moe_layers if m.moe.experts else m.n_layers  # the stack's scanned unit
        _require(groups % chunks == 0, f"model.n_layers / model.moe.every = {groups} layer groups do not split into "
                 f"{stages} stages x train.virtual_stages={t.virtual_stages}; make it a multiple of {chunks}")
        _require(t.microbatches >= stages and t.microbatches % stages == 0,
                 f"train.microbatches={t.microbatches} must be a multiple of the {stages} pipeline stages (each stage "
                 "needs a microbatch in flight; the loss is split over stages by microbatch)")
        for logical in ("layers", "stage"):
            rule = self.cfg.mesh.rules.get(logical)
            _require(rule == Axis.STAGE, f"mesh.rules.{logical}={rule!r} must be 'stage' with {stages} pipeline "
                     "stages (the layer stack and the pipeline's buffers are split over the stage axis)")


    def _check_experts(self) -> None:
        """The expert axis and an MoE model (``model.moe``) against each other (docs/moe.md)."""
        moe, ep, t = self.cfg.model.moe, self.expert, self.cfg.train
        _require(moe.experts > 0, f"the expert axis has size {ep} but the model is dense (model.moe.experts=0); "
                 "set model.moe.experts, or use the data axis for a dense model")
        if moe.experts % ep:
            fits = ", ".join(str(d) for d in range(1, moe.experts + 1) if moe.experts % d == 0)
            raise ConfigError(f"model.moe.experts={moe.experts} is not divisible by the expert axis size {ep}: make "
                              f"the expert axis (mesh.ici.expert x mesh.dcn.expert) one of {fits}, or "
                              f"model.moe.experts a multiple of {ep} (e.g. {-(-moe.experts // ep) * ep})")
        rule = rule_axes(self.cfg.mesh.rules.get("experts"))
        _require(rule in ((), (Axis.EXPERT,)), f"mesh.rules.experts={self.cfg.mesh.rules.get('experts')!r} must "
                 "be 'expert' (experts split over the expert axis) or null (every device holds all experts)")
        if ep > 1:
            _require(rule == (Axis.EXPERT,), f"mesh.rules.experts must be 'expert' with an expert axis of size {ep}")
            _require(Axis.EXPERT in self.batch_axes, f"mesh.rules.batch={self.cfg.mesh.rules.get('batch')!r} must "
                     f"include 'expert' with an expert axis of size {ep} (tokens are split over it)")
        pipelined = self.stages > 1  # the pipeline runs its own microbatches, whatever train.accumulate says
        # The experts' FP8 amaxes reduce over the axes of their own shard_map, which inside the pipeline's loop is
        # not the expert dispatch's; unchecked there, so refused.
        _require(not (pipelined and ep > 1 and self.cfg.model.fp8 != "none"), f"model.fp8={self.cfg.model.fp8} "
                 f"with the expert axis (size {ep}) and {self.stages} pipeline stages is not supported yet; use "
                 "model.fp8=none, expert=1 or stage=1")
        _require(t.microbatches == 1 or t.accumulate == "sharded" or pipelined, f"model.moe with train.microbatches="
                 f"{t.microbatches} needs train.accumulate=sharded (the unreduced mode runs each data-parallel "
                 "group's rows apart, but the experts' dispatch runs across the groups)")


def seq_shards(cfg: Any, num_devices: int | None = None) -> int | None:
    """How many slices ``mesh.rules.act_seq`` cuts the activations' sequence into on ``num_devices`` devices (1: it
    names no axis); None when that depends on a ``-1`` axis and ``num_devices`` is not given (planning)."""
    if num_devices is not None:
        return ParallelDims.of(cfg, num_devices=num_devices).seq_shards()
    named = rule_axes(cfg.mesh.rules.get("act_seq"))
    if any(v == -1 and ax in named for (_, ax), v in cfg.mesh.sizes().items()):
        return None
    return ParallelDims.of(cfg).seq_shards()


def cpu_devices_per_process(cfg: Any, num_processes: int = 1) -> int:
    """``runtime.cpu_devices``, or (unset) the mesh's fixed axis sizes (``-1`` counted as 1) shared by the processes."""
    if cfg.runtime.cpu_devices is not None:
        return cfg.runtime.cpu_devices
    return max(1, MeshShape.fixed(cfg.mesh).num_devices // num_processes)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
