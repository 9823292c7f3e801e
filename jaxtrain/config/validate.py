"""Validation of the config tree: everything that can be checked without devices, once, at load time.

Checks that need the device count (the mesh against the devices) run again when the mesh is built
(:func:`jaxtrain.parallel.mesh.build_mesh`), through the same :meth:`jaxtrain.parallel.dims.ParallelDims.check`.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxtrain.config import locations
from jaxtrain.config.data_checks import check_data_config
from jaxtrain.config.moe_checks import check_moe_config, moe_warnings
from jaxtrain.config.ops import fraction as _fraction
from jaxtrain.config.ops import not_negative as _not_negative
from jaxtrain.config.ops import positive as _positive
from jaxtrain.config.ops import require as _require
from jaxtrain.config.ops import validate_ops
from jaxtrain.config.tree import FLASH_HEAD_DIMS, Config, default_rules, kernel_head_dim, unknown_config_key
from jaxtrain.parallel.dims import MESH_AXES, Axis, MeshShape, ParallelDims


def validate(cfg: Config, num_devices: Callable[[Config], int | None] | None = None) -> None:
    """Check ranges and cross-field constraints; raise :class:`ConfigError` naming the first bad value.

    ``num_devices(cfg)``: the device count the command will run on where it is known before JAX starts (on CPU:
    ``runtime.cpu_devices`` x processes), else None; with it the mesh is checked against the devices before the
    model and batch are checked against the mesh."""

    m, t = cfg.model, cfg.train
    _require(bool(cfg.run.dir), "run.dir must not be empty")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        _positive(f"model.{name}", getattr(m, name))
    _require(m.n_heads % m.n_kv_heads == 0,
             f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
    if m.mla:
        _check_mla(cfg)  # its head dims are its own options
    else:
        _check_head_dim(cfg)
    _require(not (m.attention in ("pallas", "triton") and cfg.mesh.rules.get("act_seq") not in (None, Axis.CONTEXT)),
             f"model.attention={m.attention} runs its kernel on each device's slice of the sequence, so "
             f"mesh.rules.act_seq={cfg.mesh.rules.get('act_seq')!r} would attend only within a slice; set "
             "mesh.rules.act_seq=context (ring attention over the context axis) or null, or model.attention=xla")
    _require(not (m.attention == "cudnn" and cfg.data.document_mask),
             "model.attention=cudnn cannot mask documents (data.document_mask=true); use pallas, triton or xla")
    _check_window(cfg)
    _positive("model.rope_theta", m.rope_theta)
    if m.rope_scaling.type != "none":
        rs = m.rope_scaling
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"):
            _positive(f"model.rope_scaling.{name}", getattr(rs, name))
        _require(rs.high_freq_factor > rs.low_freq_factor, f"model.rope_scaling.high_freq_factor="
                 f"{rs.high_freq_factor} must be > model.rope_scaling.low_freq_factor={rs.low_freq_factor}")
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.fp8_amax_history", m.fp8_amax_history)
    # The weight gradients take the parameters' dtype: float32 ones cannot come out of 16-bit parameters.
    _require(m.reduce_dtype == "compute" or m.param_dtype == "float32",
             f"model.reduce_dtype={m.reduce_dtype} needs model.param_dtype=float32 (the weight gradients have the "
             f"parameters' dtype, here {m.param_dtype}); set model.reduce_dtype=compute or model.param_dtype=float32")
    _positive("model.init_std", m.init_std)
    check_moe_config(cfg)  # model.moe.*: routing, capacity, layer groups (docs/moe.md)

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

    check_data_config(cfg)  # data.*: ranges, mixture, chat (jaxtrain/config/data_checks.py, docs/data.md)

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
        _require(cfg.runtime.cpu_devices <= locations.MAX_CPU_DEVICES,
                 f"runtime.cpu_devices={cfg.runtime.cpu_devices} is more emulated devices than this machine can start "
                 f"in reasonable time; use at most {locations.MAX_CPU_DEVICES}")
    _require(cfg.runtime.compile_cache.strip() != "", "runtime.compile_cache is empty: use auto, a directory or none")
    validate_ops(cfg.dist, cfg.check, cfg.observe)  # dist.*, check.*, observe.* (jaxtrain/config/ops.py)
    _validate_mesh(cfg, num_devices)
    locations.check_paths(cfg)  # files and directories last: value mistakes are reported first


def _check_head_dim(cfg: Config) -> None:
    """Standard attention's head dim: positive (or d_model / n_heads), even for rotary, one the flash kernels take."""
    m = cfg.model
    if m.head_dim is not None:
        _positive("model.head_dim", m.head_dim)
    else:
        _require(m.d_model % m.n_heads == 0,
                 f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; set model.head_dim")
    _require(m.resolved_head_dim % 2 == 0, f"head dim {m.resolved_head_dim} must be even for rotary embeddings")
    if m.attention in ("pallas", "triton") and not m.mla:  # MLA's head dims: _check_mla
        _require(m.resolved_head_dim in FLASH_HEAD_DIMS, f"model.attention={m.attention} needs a head dim in "
                 f"{FLASH_HEAD_DIMS}, got {m.resolved_head_dim}; set model.head_dim")


def _check_mla(cfg: Config) -> None:
    """Multi-head latent attention (``model.kv_lora_rank`` set): positive ranks and head dims, an even rotary part,
    and what it does not combine with: its own head dims replace head_dim, every head has its own k/v (n_kv_heads =
    n_heads), no q/k/v biases or q/k norms (DeepSeek has neither), head dims a kernel attention can pad to one of
    its own (:func:`jaxtrain.config.kernel_head_dim`); no context axis: ``ParallelDims.check``, which
    ``mesh.auto`` asks too."""
    m = cfg.model
    assert m.kv_lora_rank is not None
    _require(m.kv_lora_rank > 0, f"model.kv_lora_rank={m.kv_lora_rank} must be > 0 (or null: standard attention)")
    _require(m.q_lora_rank is None or m.q_lora_rank > 0,
             f"model.q_lora_rank={m.q_lora_rank} must be > 0 (or null: queries projected directly)")
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _positive(f"model.{name}", getattr(m, name))
    _require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs)")
    _require(m.head_dim is None, f"model.head_dim={m.head_dim} does not apply to multi-head latent attention "
             "(model.kv_lora_rank set): its heads are qk_nope_head_dim + qk_rope_head_dim and v_head_dim; set null")
    _require(m.n_kv_heads == m.n_heads, f"model.n_kv_heads={m.n_kv_heads} must equal model.n_heads={m.n_heads} "
             "with multi-head latent attention (model.kv_lora_rank set): every head expands its own k and v")
    for name in ("qkv_bias", "qk_norm"):
        _require(not getattr(m, name), f"model.{name}=true does not combine with multi-head latent attention "
                 "(model.kv_lora_rank set); set it false")
    if m.attention in ("cudnn", "pallas", "triton"):  # they run q/k/v zero-padded to one head dim of theirs
        _require(kernel_head_dim(m.attention, m.qk_head_dim, m.v_head_dim) is not None, f"model.attention="
                 f"{m.attention} takes head dims up to 256, not multi-head latent attention's q/k "
                 f"{m.qk_head_dim} and v {m.v_head_dim}; use xla or auto")


def _check_window(cfg: Config) -> None:
    """``model.sliding_window``: positive, on an attention that has a window mask (XLA, cuDNN, the Pallas flash
    kernel; ``auto`` picks among them; ring attention over a context axis passes it to its blocks)."""
    w, impl = cfg.model.sliding_window, cfg.model.attention
    if w is None:
        return
    _require(w > 0, f"model.sliding_window={w} must be > 0 (or null: full causal attention)")
    _require(impl != "triton", f"model.attention=triton has no sliding-window mask (model.sliding_window={w}); use "
             "model.attention=pallas, cudnn, xla or auto, or model.sliding_window=null")


def config_warnings(cfg: Config) -> list[str]:
    """Lines ``train`` says at start-up (``warning: ...``) about a valid config that is probably not what was meant,
    read from the config as given (``model.dtype=auto`` not yet resolved); [] for none."""
    m = cfg.model
    said = moe_warnings(cfg)
    if m.fp8 != "none" and m.dtype == "float32":
        # Meaningful (models/fp8.py: float8 operands, float32 results; CPUs emulate FP8 so, under dtype=auto too),
        # but where FP8 is for speed the rest of the model then computes in float32.
        said.append(f"model.fp8={m.fp8} with model.dtype=float32: the projections still multiply in float8 (the "
                    "same quantisation, float32 results), but attention, the norms, the embedding and the output "
                    "projection compute in float32, which on GPUs costs much of FP8's speed-up; model.dtype=bfloat16 "
                    "(or auto: bfloat16 on GPUs) is FP8's usual partner")
    return said


def _validate_mesh(cfg: Config, num_devices: Callable[[Config], int | None] | None) -> None:
    sizes = {f"mesh.{part}.{ax}": v for (part, ax), v in cfg.mesh.sizes().items()}
    fills = [k for k, v in sizes.items() if v == -1]
    _require(len(fills) <= 1, f"only one mesh axis may be -1, got {', '.join(fills)}")
    for k, v in sizes.items():
        _require(v == -1 or v >= 1, f"{k}={v} must be >= 1 (or -1 for one axis to fill the rest)")

    names = [f"{part}.{ax}" for part in ("ici", "dcn") for ax in MESH_AXES]
    bad = [n for n in cfg.mesh.auto_keep if n not in names]
    _require(not bad, f"mesh.auto_keep names {', '.join(map(repr, bad))}: each must be one of {', '.join(names)}")
    _require(0 <= cfg.mesh.auto_memory_margin < 1,
             f"mesh.auto_memory_margin={cfg.mesh.auto_memory_margin} must be in [0, 1)")
    _require(cfg.mesh.auto_trial_steps >= 0,
             f"mesh.auto_trial_steps={cfg.mesh.auto_trial_steps} must be >= 0 (0: the estimate alone)")
    known = set(MESH_AXES)
    needed = set(default_rules())
    for logical in cfg.mesh.rules:
        if logical not in needed:
            raise unknown_config_key(f"mesh.rules.{logical}")
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
    # The mesh against the devices first where their count is known (a mesh that does not cover them is the mistake
    # to name, not the batch it then fails to divide); mesh.auto replaces the mesh, so its sizes are not held to it.
    # Otherwise divisibility by the fixed axis sizes now, and again once the -1 axis is resolved (mesh.py).
    n = None if num_devices is None or cfg.mesh.auto else num_devices(cfg)
    ParallelDims(cfg, MeshShape.fixed(cfg.mesh) if n is None else MeshShape.resolve(cfg.mesh, n)).check()
