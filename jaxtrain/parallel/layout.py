"""The layout: one config laid out on one set of devices, and every fact derived from that pairing.

A :class:`Layout` is built once per run (``Layout.build``) from the config and the devices. It resolves the
config's ``auto`` choices for the platform, builds the mesh, maps the logical rules, and derives what the rest of
jaxtrain would otherwise work out again: the batch axes and the data-parallel size, the pipeline stages, the rows
per microbatch and per data-parallel group, the rules inside manual (per-device) regions, the abstract train state
with its shardings, the state's bytes per device and the memory a compiled step needs. The step, the loop, the
planner, convert/generate, guards and observe take these facts from here; none derives them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain.config import FLASH_HEAD_DIMS, Config, kernel_head_dim
from jaxtrain.errors import ConfigError
from jaxtrain.models.fp8 import check_devices as check_fp8_devices
from jaxtrain.models.llama import Transformer
from jaxtrain.models.moe import make_model
from jaxtrain.optim.state import TrainState, make_optimizer
from jaxtrain.parallel import context as context_schedule
from jaxtrain.parallel.attention import MeshAttention
from jaxtrain.parallel.dims import Axis, MeshShape, ParallelDims, seq_shards
from jaxtrain.parallel.expert import MeshExperts, resolve_gemm
from jaxtrain.parallel.mesh import Rules, build_mesh, rules_from_config

# Head dims cuDNN's fused attention takes on every GPU jaxtrain targets (jax checks: a multiple of 8, at most 128
# before Hopper, 256 from Hopper on; jax/_src/cudnn/fused_attention_stablehlo.py): "auto" picks it only for these.
CUDNN_HEAD_DIMS = range(8, 129, 8)


def resolve_auto(cfg: Config, platform: str, num_devices: int | None = None) -> Config:
    """``cfg`` with ``model.dtype=auto`` and ``model.attention=auto`` replaced by the concrete choice for
    ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``) on ``num_devices`` devices (None: not known yet, as when
    planning; a ``-1`` mesh axis then counts as possibly sharding): the one place "auto" gets a meaning.

    dtype: float32 on CPU, bfloat16 on accelerators. attention on GPU, for 16-bit compute only: cuDNN's fused kernel
    without document masking (its entry point takes no segment ids), with an unsharded sequence (it refuses a
    sharded sequence dimension at compile time) and a head dim of :data:`CUDNN_HEAD_DIMS`, pipelines included
    (``parallel/attention.py`` calls it per device); else jaxtrain's flash kernel where it takes the head dim and the
    sequence is not sharded or split over the context axis alone (ring attention); the XLA reference everywhere
    else, float32 included (the flash kernels' float32 path is exact-FMA, 32x32 tiles without tensor cores: for
    checking, not speed; cuDNN has no float32 kernel); multi-head latent attention (``model.kv_lora_rank``) by
    the head dim its q/k and v pad to (:func:`jaxtrain.config.kernel_head_dim`). A sliding window
    (``model.sliding_window``) keeps cuDNN (its sliding-window causal mask) or the Pallas flash kernel (the
    Triton-language one has no window mask). Concrete values pass through unchanged, so resolving twice is harmless;
    an explicit ``model.attention=cudnn`` with a sharded sequence raises ConfigError.
    ``model.moe.gemm``: :func:`jaxtrain.parallel.expert.resolve_gemm`.
    """
    m = cfg.model
    dtype = m.dtype if m.dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16")
    shards = seq_shards(cfg, num_devices)
    if m.attention == "cudnn" and shards is not None and shards > 1:
        raise ConfigError(
            f"model.attention=cudnn cannot take a sharded sequence: mesh.rules.act_seq="
            f"{cfg.mesh.rules.get('act_seq')!r} cuts it into {shards} slices and cuDNN refuses that at compile "
            "time; set mesh.rules.act_seq=null or model.attention=xla")
    if m.attention == "triton" and platform == "gpu" and importlib.util.find_spec("jax_triton") is None:
        raise ConfigError("model.attention=triton needs the jax-triton package, which is not installed (python -m "
                          "jaxtrain.cluster.packages --install-kernels, or pip install jax-triton); or set "
                          "model.attention=pallas, cudnn, xla or auto")
    if m.attention == "triton" and platform != "gpu":
        raise ConfigError(f"model.attention=triton runs on a CUDA GPU, not on {platform} devices; use pallas (on CPU "
                          "interpreted, for checking), xla, or auto")
    attention = m.attention
    if attention == "auto":
        attention = "xla"
        seq_rule = cfg.mesh.rules.get("act_seq")
        ring = seq_rule == Axis.CONTEXT and shards is not None and shards > 1  # ring attention (parallel/context.py)
        # Multi-head latent attention (model.kv_lora_rank): the kernels run it zero-padded to one head dim of theirs
        # (models/attention.Local), so the padded width is what must fit.
        cudnn_dim, flash_dim = ((kernel_head_dim(impl, m.qk_head_dim, m.v_head_dim) for impl in ("cudnn", "pallas"))
                                if m.mla else (m.resolved_head_dim,) * 2)
        if platform == "gpu" and dtype != "float32" and (shards == 1 or ring):
            segments = cfg.data.document_mask or (cfg.data.format == "chat" and cfg.data.pack)  # chat packs too
            if shards == 1 and not segments and cudnn_dim in CUDNN_HEAD_DIMS:
                attention = "cudnn"
            elif flash_dim in FLASH_HEAD_DIMS and seq_rule in (None, Axis.CONTEXT):
                # The Triton-language kernel where jax-triton is installed (JAX 0.11 deprecates Pallas' Triton
                # backend and names jax-triton as the way to keep Triton kernels); the two compile to the same
                # tiles and wgmma counts for sm_90a (docs/kernels.md).
                triton = importlib.util.find_spec("jax_triton") and m.sliding_window is None
                attention = "triton" if triton else "pallas"
    moe = dataclasses.replace(m.moe, gemm=resolve_gemm(m.moe.gemm, platform)) if m.moe.experts else m.moe
    return dataclasses.replace(cfg, model=dataclasses.replace(m, dtype=dtype, attention=attention, moe=moe))


@dataclass(frozen=True)
class MemoryNeed:
    """What a compiled step needs per device, in bytes (from XLA's memory analysis)."""

    total: int  # arguments + temporaries + outputs, less the outputs aliased to donated arguments
    arguments: int  # state and batch
    temporaries: int


def compiled_need(compiled) -> MemoryNeed | None:
    """The memory a compiled (ahead-of-time) function needs per device; None where the backend gives no analysis.
    Donated arguments are reused for the outputs aliased to them, so those are not counted twice."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    args, temp = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    return MemoryNeed(args + temp + mem.output_size_in_bytes - mem.alias_size_in_bytes, args, temp)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs (with shardings: the largest shard of each
    leaf; without: the whole leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: jit keys on its bound methods
class Layout:
    """One config on one mesh. Build with :meth:`build`; immutable afterwards."""

    cfg: Config  # resolved for the platform: no "auto" left (layout.resolve_auto)
    mesh: Mesh
    shape: MeshShape
    rules: Rules  # logical axis -> mesh axes, Flax's tuple form
    graphdef: Any  # the train state's graph structure (nnx.split)
    abstract_state: Any  # ShapeDtypeStructs with their target shardings: restore targets, compiling, planning
    state_sharding: Any  # NamedShardings of the train state

    @classmethod
    def build(cls, cfg: Config, devices: list | None = None) -> Layout:
        """Resolve ``cfg`` for the devices' platform, build the mesh and the abstract, sharded train state; raises
        ConfigError for a mesh that does not fit the devices, the model or the batch."""
        devices = list(jax.devices()) if devices is None else list(devices)
        cfg = resolve_auto(cfg, devices[0].platform, num_devices=len(devices))
        check_fp8_devices(cfg.model.fp8, devices)  # never a silent fallback to 16-bit matmuls
        mesh, shape = build_mesh(cfg, devices)
        rules = rules_from_config(cfg.mesh.rules)
        interpret = devices[0].platform == "cpu"
        with _scope(mesh, rules):
            abstract = nnx.eval_shape(lambda: _train_state(cfg, 0, interpret))
            graphdef, abstract_state = nnx.split(abstract)
            state_sharding = nnx.get_named_sharding(abstract_state, mesh)
            abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                          abstract_state, state_sharding)
        return cls(cfg, mesh, shape, rules, graphdef, abstract_state, state_sharding)

    def replace(self, devices: list | None = None, **changes) -> Layout:
        """The layout of this config with sections replaced (``train=...``), on the same devices by default."""
        return Layout.build(dataclasses.replace(self.cfg, **changes),
                            list(self.mesh.devices.flat) if devices is None else devices)

    # -- the devices -----------------------------------------------------------------------------------------------

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    @property
    def num_devices(self) -> int:
        return self.shape.num_devices

    @property
    def interpret_kernels(self) -> bool:
        """Run the flash kernels in Pallas' interpreter: the devices are CPUs."""
        return self.platform == "cpu"

    def scope(self):
        """The mesh and logical-rule context that tracing the model needs."""
        return _scope(self.mesh, self.rules)

    # -- parallel facts (device-free: jaxtrain.parallel.dims; asked as layout.dims.<fact>, never forwarded here) ----

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The config's parallel facts on this mesh shape: batch axes, data-parallel size, stages, rows, ..."""
        return ParallelDims(self.cfg, self.shape)

    @property
    def stage_axis(self) -> str:
        """The mesh axis the layer stack and the pipeline's buffers are split over (``mesh.rules.stage``)."""
        axis = self.cfg.mesh.rules.get("stage")  # the logical name of the pipeline buffers' stage dimension
        assert isinstance(axis, str)  # config validation: mesh.rules.stage is "stage" whenever stages > 1
        return axis

    @functools.cached_property
    def token_order(self) -> np.ndarray | None:
        """int [seq_len]: the original position of each slot of the load-balanced (zigzag) order the step feeds the
        model when context > 1 (device i holds chunks i and 2 context - 1 - i of 2 context); None without context."""
        context = self.dims.context
        return None if context == 1 else context_schedule.token_order(self.cfg.data.seq_len, context)

    @functools.cached_property
    def causal_pairs(self) -> np.ndarray:
        """float [context]: (query, key) pairs each context rank attends to per sequence and layer, in this order
        (the planner's attention compute per device; attention FLOPs = 4 * head_dim * heads per pair)."""
        context = self.dims.context
        return context_schedule.causal_pairs(self.cfg.data.seq_len, context, balanced=context > 1)

    @functools.cached_property
    def local_rules(self) -> Rules:
        """The rules inside a region where each device (group) holds its own rows (a vmap over the batch axes, or
        shard_map's manual batch axes): ``batch`` maps to nothing there, since those axes already split it."""
        return tuple((name, None if name == "batch" else target) for name, target in self.rules)

    # -- the batch -----------------------------------------------------------------------------------------------

    @property
    def batch_shape(self) -> tuple[int, int]:
        """The global batch: int32 [global_batch, seq_len + 1] (logical: batch, act_seq), targets included."""
        return self.cfg.train.global_batch, self.cfg.data.seq_len + 1

    @functools.cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(dict(self.rules)["batch"], None))

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)

    def local_rows(self) -> tuple[int, int]:
        """The rows [lo, hi) of the global batch that this process's devices hold."""
        starts, stops = set(), set()
        for idx in self.batch_sharding.addressable_devices_indices_map(self.batch_shape).values():
            assert idx is not None  # every addressable device holds a block of the batch
            rows = idx[0]
            starts.add(rows.start or 0)
            stops.add(self.batch_shape[0] if rows.stop is None else rows.stop)
        return min(starts), max(stops)

    def to_device(self, local: np.ndarray) -> jax.Array:
        """This process's rows -> the global batch array int32 [global_batch, seq_len + 1]."""
        return jax.make_array_from_process_local_data(self.batch_sharding, local, self.batch_shape)

    # -- the state -------------------------------------------------------------------------------------------------

    def new_state(self, seed: int) -> TrainState:
        """A fresh train state (call inside :meth:`scope`, under jit, to create it in its shards)."""
        return _train_state(self.cfg, seed, self.interpret_kernels)

    def init_state(self):
        """Fresh parameters (from train.seed) and optimizer state, created directly in their shards."""
        with self.scope():
            init = jax.jit(lambda: nnx.state(self.new_state(self.cfg.train.seed)), out_shardings=self.state_sharding)
            # Runs once: LLVM's level 1 compiles it in about a third of the default's time (tiny config on CPU, 1.8 s
            # against 4.8 s) with byte-identical values (level 0 moved some by 1-2 ULP).
            return init.lower().compile(compiler_options={"xla_backend_optimization_level": 1})()

    @property
    def abstract_params(self) -> Any:
        """The model's part of the abstract state (what a parameters-only restore reads)."""
        return self.abstract_state["model"]

    def model_graphdef(self) -> Any:
        """The model's graph structure alone (for ``nnx.merge`` with parameters)."""
        with self.scope():
            return nnx.graphdef(nnx.eval_shape(lambda: _model(self.cfg, 0, self.interpret_kernels)))

    @functools.cached_property
    def state_bytes(self) -> tuple[int, int]:
        """Per-device bytes of (the parameter shards, the optimizer-state shards)."""
        params = bytes_per_device(self.abstract_state["model"])
        return params, bytes_per_device(self.abstract_state) - params

    @functools.cached_property
    def param_axes(self) -> frozenset[str]:
        """The mesh axes that some parameter is sharded over."""
        axes: set[str] = set()
        for leaf in jax.tree.leaves(self.abstract_params):
            for entry in leaf.sharding.spec:
                axes.update(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a)
        return frozenset(axes)

    def effective_config(self) -> Config:
        """The config as this run executes it: "auto" resolved, the mesh pinned (no -1), devices per process on
        CPU."""
        cfg = self.shape.apply(self.cfg)
        cpu = self.platform == "cpu"
        return dataclasses.replace(cfg, runtime=dataclasses.replace(
            cfg.runtime, cpu_devices=self.num_devices // jax.process_count() if cpu else None))


def _model(cfg: Config, seed: int, interpret_kernels: bool) -> Transformer:
    """The model, with its attention (and an MoE model's experts) laid out on the mesh in scope (parallelism applied
    to the model here)."""
    attention = MeshAttention(cfg.model.attention, interpret_kernels, cfg.model.sliding_window)
    return make_model(cfg.model, rngs=nnx.Rngs(seed), attention=attention,
                      experts=MeshExperts(cfg.model.moe.dispatch, cfg.model.moe.gemm, interpret_kernels))


def _train_state(cfg: Config, seed: int, interpret_kernels: bool) -> TrainState:
    tx, _ = make_optimizer(cfg.train)
    return TrainState(_model(cfg, seed, interpret_kernels), tx)


@contextlib.contextmanager
def _scope(mesh: Mesh, rules: Rules):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield
