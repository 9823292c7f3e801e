"""Typed configuration: a tree of dataclasses, loaded from YAML, overridden by dotted ``key=value`` pairs.

The dataclass defaults *are* the tiny CPU config (``configs/tiny.yaml`` spells the same values out), so
``python -m jaxtrain train`` with no arguments needs no file. Everything that can be checked without devices is
checked once, in :func:`validate`; device-dependent checks (mesh size versus device count) live in ``mesh``.
Nothing in this module imports JAX: it must be usable before the runtime is configured.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from jaxtrain import locations
from jaxtrain.config_ops import CheckConfig, DistConfig, ObserveConfig, validate_ops
from jaxtrain.config_ops import fraction as _fraction
from jaxtrain.config_ops import not_negative as _not_negative
from jaxtrain.config_ops import positive as _positive
from jaxtrain.config_ops import require as _require
from jaxtrain.data.checks import check_data_config
from jaxtrain.errors import ConfigError
from jaxtrain.schema import build, dotted_keys, find_yaml, load_yaml, set_dotted, unknown_key

FLASH_HEAD_DIMS = (32, 64, 128, 256)  # head dims jaxtrain's flash kernels take (kernels.flash_pallas checks the same)
# Mesh axes, outermost first: devices adjacent in a node differ in tensor first, then context, fsdp, stage, data.
MESH_AXES = ("data", "stage", "fsdp", "context", "tensor")


@dataclass
class RunConfig:
    dir: str = "runs/tiny"  # where the run writes (relative to the working directory); its files: docs/training.md


@dataclass
class RuntimeConfig:
    # Emulated CPU devices per process; None: as many as the mesh's fixed axes need (mesh.cpu_devices_per_process).
    cpu_devices: int | None = None
    ignore_memory_check: bool = False  # train even when the compiled step needs more memory than the devices have
    compile_cache: str = "auto"  # compile cache: auto ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxtrain), dir, none


@dataclass
class AxisSizes:
    data: int = 1  # data parallelism: replicas of the parameters, each with its rows of the batch
    stage: int = 1  # pipeline stages: the layer stack is split into this many consecutive groups of devices
    fsdp: int = 1  # fully sharded data parallelism: parameters, gradients and optimizer state sharded (ZeRO-3)
    context: int = 1  # context parallelism: the sequence split, ring attention over it (docs/long-context.md)
    tensor: int = 1  # tensor parallelism: heads and MLP columns split (Megatron); inside a node only


def _default_rules() -> dict[str, Any]:
    # Parameters are sharded over fsdp (ZeRO-3 style) and tensor (Megatron style); activations' batch dimension
    # over data and fsdp. Activation names start with "act_" so that an activation's embed dimension stays
    # replicated while the parameter's embed dimension is fsdp-sharded.
    return {
        "batch": ["data", "fsdp"],
        "vocab": "tensor",
        "embed": "fsdp",
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        # The stacked layers' leading axis: split over pipeline stages (nothing to split with one stage).
        "layers": "stage",
        # The pipeline's per-stage activation buffers [stage, microbatch, seq, embed] (jaxtrain/pipeline.py).
        "stage": "stage",
        "norm": None,
        "act_seq": "context",  # the activations' sequence dimension; ring attention when the context axis > 1
        "act_embed": None,
        "act_mlp": "tensor",
        "act_heads": "tensor",
        "act_kv_heads": "tensor",
        "act_vocab": "tensor",
    }


@dataclass
class MeshConfig:
    # Intra-node (NVLink) and inter-node (InfiniBand) parts of each axis; the axis size is ici * dcn.
    # One of the eight may be -1: it takes whatever the device count leaves.
    ici: AxisSizes = field(default_factory=lambda: AxisSizes(data=1, stage=1, fsdp=-1, tensor=1))
    dcn: AxisSizes = field(default_factory=AxisSizes)
    rules: dict[str, Any] = field(default_factory=_default_rules)  # logical axis -> mesh axis, list of axes, or null
    # true: at start-up the planner picks the mesh sizes, model.remat, train.microbatches and train.pipeline_schedule
    # (of those that fit, the fastest estimate, or measured: auto_trial_steps; docs/auto-layout.md) and
    # run.dir/config.yaml records them, with auto false.
    auto: bool = False  # let the planner choose the layout (mesh, remat, microbatches, pipeline schedule)
    auto_memory_margin: float = 0.1  # mesh.auto: fraction of the usable device memory a choice must leave free
    # mesh.auto: each finalist (fits, estimated near the best) runs this many timed steps, in two passes with a
    # warm-up step each, and the fastest measured is chosen; 0: the estimate alone (docs/auto-layout.md says what
    # a trial costs on GPUs)
    auto_trial_steps: int = 6  # mesh.auto: timed steps per finalist (the fastest measured wins); 0 = estimate only

    def sizes(self) -> dict[tuple[str, str], int]:
        """``{("ici", "data"): 1, ...}``: the eight configured sizes, ``-1`` included."""
        return {(part, ax): getattr(getattr(self, part), ax) for part in ("ici", "dcn") for ax in MESH_AXES}

    def fixed_axis_sizes(self) -> dict[str, int]:
        """Each axis's ici x dcn size with ``-1`` counted as 1: what is known before the device count is."""
        return {ax: max(getattr(self.ici, ax), 1) * max(getattr(self.dcn, ax), 1) for ax in MESH_AXES}


@dataclass
class RopeScalingConfig:
    # Llama 3.1's rotary frequency scaling ("llama3"): wavelengths longer than original_max_len / low_freq_factor
    # are stretched by `factor`, those shorter than original_max_len / high_freq_factor kept, smoothly in between.
    type: Literal["none", "llama3"] = "none"  # none: plain RoPE; llama3: Llama 3.1's scaling (above)
    factor: float = 8.0  # how much the longest wavelengths are stretched
    low_freq_factor: float = 1.0  # wavelengths above original_max_len / low_freq_factor are stretched fully
    high_freq_factor: float = 4.0  # wavelengths below original_max_len / high_freq_factor are kept
    original_max_len: int = 8192  # the context length the model was pre-trained with


@dataclass
class ModelConfig:
    vocab_size: int = 256  # token ids 0 .. vocab_size - 1 (256: the byte-level embedded corpus)
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # decoder blocks (attention + SwiGLU MLP, pre-RMSNorm)
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention); divides n_heads
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int = 384  # hidden width of the SwiGLU MLP
    rope_theta: float = 10000.0  # rotary embeddings' base wavelength
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = True  # the output projection reuses the embedding table
    init_std: float = 0.02  # standard deviation of the normal initialisation (output projections scaled by depth)
    # Compute dtype. "auto": resolved once at start-up (layout.resolve_auto): bfloat16 on accelerators, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameters and AdamW moments
    # xla: reference einsum; cudnn: jax.nn.dot_product_attention's cuDNN kernel (GPU, 16-bit); pallas / triton:
    # jaxtrain's flash kernels (pallas runs interpreted, slowly, on CPU); auto: resolved once at start-up for the
    # platform (layout.resolve_auto), and recorded as the concrete choice in run.dir/config.yaml.
    attention: Literal["xla", "cudnn", "pallas", "triton", "auto"] = "xla"
    remat: Literal["none", "full", "save_matmuls"] = "none"  # recompute: full, or all but matmuls

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | synthetic | .bin/.npy file | shard dir | glob | chat .jsonl (docs/data.md)
    mixture: Any = field(default_factory=list)  # instead of source: [{source: PATH, weight: W}, ...] drawn by weight
    format: Literal["tokens", "chat"] = "tokens"  # chat: supervised fine-tuning on `messages` .jsonl, loss-masked
    tokenizer: str | None = None  # the model's tokenizer.json (or its dir): renders chat, checks shards' index
    pack: bool = True  # chat: examples packed into seq_len rows (document-masked), else one per row, padded
    seq_len: int = 128  # tokens per training sequence (each window reads seq_len + 1 for the targets)
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # for .bin files only
    # Packed documents: with document_mask a token attends only to tokens of its own document, the segments being
    # cut after each eos_id token (0 separates documents of the byte-level sources).
    document_mask: bool = False
    eos_id: int = 0  # the token that ends a document (document_mask)
    eval_fraction: float = 0.05  # tail of the token stream held out for evaluation
    threads: int = 2  # Grain reader threads
    prefetch: int = 4  # batches read ahead


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps of the whole run (a resumed run continues up to it)
    seed: int = 0  # parameter initialisation and the data order
    global_batch: int = 16  # sequences per optimizer step, over all devices and processes
    microbatches: int = 1  # gradient accumulation: global_batch is split into this many sequential chunks
    # With microbatches > 1: "unreduced" reduces gradients across the batch axes once per step (one all-gather and
    # one reduce-scatter per step, as without accumulation; each device holds the gathered parameters and a gradient
    # accumulator of their size); "sharded" keeps them reduced and sharded inside the loop (the memory of a step
    # without accumulation; the collectives once per microbatch). With pipeline stages the pipeline's microbatches
    # are the accumulation and this does not apply.
    accumulate: Literal["unreduced", "sharded"] = "unreduced"
    # Pipeline (mesh stage axis > 1): chunks of the layer stack each stage holds, visited round-robin (the
    # interleaved schedule: a microbatch passes every stage this many times). More chunks shrink the pipeline bubble,
    # (stages - 1) / (microbatches * virtual_stages + stages - 1), at the price of moving the stage's layer weights
    # between stages once per step (docs/parallelism.md). Does nothing with one stage.
    virtual_stages: int = 1
    pipeline_schedule: Literal["gpipe", "1f1b"] = "gpipe"  # 1f1b: memory bounded by stages (docs/parallelism.md)
    lr: float = 3e-3  # peak learning rate (AdamW)
    warmup_steps: int = 30  # linear warmup from 0 to lr
    # The cosine's horizon is its own option, not train.steps, so that extending or resuming a run with more steps
    # does not rewrite the learning rates already used; past it the rate stays at lr * min_lr_ratio.
    decay_steps: int = 300
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW's decoupled weight decay (not on norm scales)
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    eval_every: int = 100  # 0 disables periodic evaluation (it still runs at the end)
    eval_batches: int = 4  # held-out batches per evaluation
    log_every: int = 10  # progress line and metrics.jsonl every N steps (and the first and last step)
    max_nonfinite_steps: int = 10  # stop after this many steps in a row with non-finite loss or gradients (skipped)


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <run.dir>/checkpoints
    every: int = 100  # save every N steps (and at the last step); 0: only at the last step
    keep: int = 3  # the newest N checkpoints are kept
    resume: str = "auto"  # auto (latest, if any) | never | a step number | a path to a checkpoint directory or step
    init_from: str | None = None  # parameters only, fresh optimizer (fine-tuning); used when nothing is resumed
    async_save: bool = True  # write in the background while training continues
    # Local (emergency) checkpoints: a host-local directory (e.g. /dev/shm/jaxtrain, local NVMe); each process
    # writes its own shards under <local_dir>/process_<i>/, and a copy of them under its peer's (docs/checkpoints.md)
    local_dir: str | None = None
    local_every: int = 0  # save there every N steps, in addition to checkpoint.dir (0: off; < checkpoint.every)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (if any; a shipped name such as ``7b`` also works), then
    ``overrides`` (``"a.b=value"``, value in YAML syntax)."""
    tree = load_yaml(find_yaml(path, "", "config"), "config file") if path is not None else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.steps=100)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(tree, key.strip(), value)
    cfg = build(Config(), tree, "", _unknown_key)
    validate(cfg)
    return cfg


def all_keys() -> list[str]:
    """Every dotted key of the config tree, e.g. ``["run.dir", ...]`` (dict-valued options end at their name)."""
    return dotted_keys(Config)


def _unknown_key(name: str) -> ConfigError:
    return unknown_key(name, all_keys() + [f"mesh.rules.{k}" for k in _default_rules()], "config key")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ---------------------------------------------------------------------------------------------------------------
# Validation (everything that needs no devices)


def validate(cfg: Config) -> None:
    """Check ranges and cross-field constraints; raise :class:`ConfigError` naming the first bad value."""

    m, t = cfg.model, cfg.train
    _require(bool(cfg.run.dir), "run.dir must not be empty")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        _positive(f"model.{name}", getattr(m, name))
    if m.head_dim is not None:
        _positive("model.head_dim", m.head_dim)
    else:
        _require(m.d_model % m.n_heads == 0,
                 f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; set model.head_dim")
    _require(m.n_heads % m.n_kv_heads == 0,
             f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
    _require(m.resolved_head_dim % 2 == 0, f"head dim {m.resolved_head_dim} must be even for rotary embeddings")
    if m.attention in ("pallas", "triton"):
        _require(m.resolved_head_dim in FLASH_HEAD_DIMS, f"model.attention={m.attention} needs a head dim in "
                 f"{FLASH_HEAD_DIMS}, got {m.resolved_head_dim}; set model.head_dim")
    _require(not (m.attention in ("pallas", "triton") and cfg.mesh.rules.get("act_seq") not in (None, "context")),
             f"model.attention={m.attention} runs its kernel on each device's slice of the sequence, so "
             f"mesh.rules.act_seq={cfg.mesh.rules.get('act_seq')!r} would attend only within a slice; set "
             "mesh.rules.act_seq=context (ring attention over the context axis) or null, or model.attention=xla")
    _require(not (m.attention == "cudnn" and cfg.data.document_mask),
             "model.attention=cudnn cannot mask documents (data.document_mask=true); use pallas, triton or xla")
    _positive("model.rope_theta", m.rope_theta)
    if m.rope_scaling.type != "none":
        rs = m.rope_scaling
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"):
            _positive(f"model.rope_scaling.{name}", getattr(rs, name))
        _require(rs.high_freq_factor > rs.low_freq_factor, f"model.rope_scaling.high_freq_factor="
                 f"{rs.high_freq_factor} must be > model.rope_scaling.low_freq_factor={rs.low_freq_factor}")
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)

    for name in ("steps", "global_batch", "microbatches", "virtual_stages", "eval_batches", "log_every",
                 "max_nonfinite_steps"):
        _positive(f"train.{name}", getattr(t, name))
    _require(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    _positive("train.lr", t.lr)
    _require(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _require(t.decay_steps > t.warmup_steps,
             f"train.decay_steps={t.decay_steps} must be > train.warmup_steps={t.warmup_steps} "
             "(it includes the warmup)")
    _fraction("train.min_lr_ratio", t.min_lr_ratio)
    _not_negative("train.weight_decay", t.weight_decay)
    _require(0 <= t.b1 < 1, f"train.b1={t.b1} must be in [0, 1)")
    _require(0 <= t.b2 < 1, f"train.b2={t.b2} must be in [0, 1)")
    _not_negative("train.grad_clip", t.grad_clip, " (0 disables clipping)")
    _not_negative("train.eval_every", t.eval_every, " (0: only at the end)")
    _require(t.global_batch % t.microbatches == 0,
             f"train.global_batch={t.global_batch} is not divisible by train.microbatches={t.microbatches}")

    check_data_config(cfg)  # data.*: ranges, mixture, chat (jaxtrain/data/checks.py, docs/data.md)

    c = cfg.checkpoint
    _not_negative("checkpoint.every", c.every, " (0: only at the last step)")
    _require(c.keep >= 1, f"checkpoint.keep={c.keep} must be >= 1")
    _not_negative("checkpoint.local_every", c.local_every, " (0: no local checkpoints)")
    _require(not c.local_every or bool(c.local_dir), f"checkpoint.local_every={c.local_every} needs "
             "checkpoint.local_dir (a host-local directory, e.g. /dev/shm/jaxtrain)")
    _require(not c.local_every or not c.every or c.local_every < c.every, f"checkpoint.local_every={c.local_every} "
             f"must be < checkpoint.every={c.every} (local saves are the frequent ones), or 0 (off)")

    if cfg.runtime.cpu_devices is not None:
        _positive("runtime.cpu_devices", cfg.runtime.cpu_devices)
    _require(cfg.runtime.compile_cache.strip() != "", "runtime.compile_cache is empty: use auto, a directory or none")
    validate_ops(cfg.dist, cfg.check, cfg.observe)  # dist.*, check.*, observe.* (jaxtrain/config_ops.py)
    _validate_mesh(cfg)
    locations.check_paths(cfg)  # files and directories last: value mistakes are reported first


def _validate_mesh(cfg: Config) -> None:
    sizes = {f"mesh.{part}.{ax}": v for (part, ax), v in cfg.mesh.sizes().items()}
    fills = [k for k, v in sizes.items() if v == -1]
    _require(len(fills) <= 1, f"only one mesh axis may be -1, got {', '.join(fills)}")
    for k, v in sizes.items():
        _require(v == -1 or v >= 1, f"{k}={v} must be >= 1 (or -1 for one axis to fill the rest)")

    _require(0 <= cfg.mesh.auto_memory_margin < 1,
             f"mesh.auto_memory_margin={cfg.mesh.auto_memory_margin} must be in [0, 1)")
    _require(cfg.mesh.auto_trial_steps >= 0,
             f"mesh.auto_trial_steps={cfg.mesh.auto_trial_steps} must be >= 0 (0: the estimate alone)")
    known = set(MESH_AXES)
    needed = set(_default_rules())
    for logical in cfg.mesh.rules:
        if logical not in needed:
            raise _unknown_key(f"mesh.rules.{logical}")
    missing = sorted(needed - set(cfg.mesh.rules))
    _require(not missing, f"mesh.rules is missing logical axes: {', '.join(missing)}")
    for logical, target in cfg.mesh.rules.items():
        targets = target if isinstance(target, list) else [target]
        for ax in targets:
            _require(ax is None or (isinstance(ax, str) and ax in known),
                     f"mesh.rules.{logical}={target!r} names an unknown mesh axis; valid: "
                     f"{', '.join(MESH_AXES)} or null")

    # Tensor parallelism exchanges activations inside every layer: across nodes it would ride InfiniBand.
    _require(cfg.mesh.dcn.tensor == 1, f"mesh.dcn.tensor={cfg.mesh.dcn.tensor} would split tensor parallelism "
             "across nodes; keep it inside a node (mesh.dcn.tensor=1, mesh.ici.tensor up to the GPUs per node) and "
             "use mesh.dcn.stage, mesh.dcn.fsdp or mesh.dcn.data across nodes")
    # Divisibility by the fixed axis sizes now; the -1 axis is checked again once it is resolved (mesh.py).
    check_divisibility(cfg, cfg.mesh.fixed_axis_sizes())


def batch_mesh_axes(rules: dict[str, Any]) -> tuple[str, ...]:
    """The mesh axes the batch is split over, from ``mesh.rules.batch`` (a name, a list of names, or null): the one
    reading of that rule (``layout.Layout.batch_axes`` exposes it)."""
    target = rules.get("batch")
    return tuple(a for a in (target if isinstance(target, (list, tuple)) else [target]) if a is not None)


def check_divisibility(cfg: Config, axis_sizes: dict[str, int]) -> None:
    """Shapes that must split evenly over the mesh axes their logical axes map to."""
    m, t = cfg.model, cfg.train
    tensor = axis_sizes["tensor"]
    _require(m.n_heads % tensor == 0, f"model.n_heads={m.n_heads} is not divisible by the tensor axis size {tensor}")
    _require(m.n_kv_heads % tensor == 0,
             f"model.n_kv_heads={m.n_kv_heads} is not divisible by the tensor axis size {tensor}")
    batch_axes = batch_mesh_axes(cfg.mesh.rules)
    dp = math.prod(axis_sizes[ax] for ax in batch_axes)
    micro = t.global_batch // t.microbatches
    _require(micro % dp == 0,
             f"train.global_batch={t.global_batch} (/{t.microbatches} microbatches = {micro}) is not divisible by the "
             f"data-parallel size {dp} ({' x '.join(batch_axes)})")
    context = axis_sizes.get("context", 1)
    if context > 1:  # the zigzag order gives each device two chunks of seq_len / (2 * context) (docs/long-context.md)
        _require(cfg.mesh.rules.get("act_seq") == "context", f"mesh.rules.act_seq={cfg.mesh.rules.get('act_seq')!r} "
                 f"must be 'context' with a context axis of size {context} (it splits the activations' sequence)")
        _require(cfg.data.seq_len % (2 * context) == 0, f"data.seq_len={cfg.data.seq_len} is not divisible by 2 x "
                 f"the context axis size {context} (each device holds two chunks of the sequence)")
    stages = axis_sizes["stage"]
    if stages > 1:
        chunks = stages * t.virtual_stages
        _require(m.n_layers % chunks == 0,
                 f"model.n_layers={m.n_layers} does not split into {stages} stages x train.virtual_stages="
                 f"{t.virtual_stages}; make n_layers a multiple of {chunks}")
        _require(t.microbatches >= stages and t.microbatches % stages == 0,
                 f"train.microbatches={t.microbatches} must be a multiple of the {stages} pipeline stages (each stage "
                 "needs a microbatch in flight; the loss is split over stages by microbatch)")
        for logical in ("layers", "stage"):
            _require(cfg.mesh.rules.get(logical) == "stage",
                     f"mesh.rules.{logical}={cfg.mesh.rules.get(logical)!r} must be 'stage' with {stages} pipeline "
                     "stages (the layer stack and the pipeline's buffers are split over the stage axis)")
