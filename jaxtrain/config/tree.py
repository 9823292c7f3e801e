"""The config tree: typed dataclasses, one per section, whose defaults *are* the tiny CPU config.

``configs/tiny.yaml`` spells the same values out, so ``python -m jaxtrain train`` with no arguments needs no file.
Each field's comment is its documentation (tools/config_reference.py builds docs/configuration-reference.md from
them). No JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from jaxtrain.config.ops import CheckConfig, DistConfig, ObserveConfig
from jaxtrain.config.schema import dotted_keys, unknown_key
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MESH_AXES

FLASH_HEAD_DIMS = (32, 64, 128, 256)  # the flash kernels' head dims (kernels/flash/tiling.py's, tested)


def kernel_head_dim(impl: str, qk: int, v: int) -> int | None:
    """The one head dim attention ``impl`` (cudnn, pallas, triton) runs q/k of ``qk`` and v of ``v`` at: cuDNN's
    next multiple of 8, the flash kernels' next of :data:`FLASH_HEAD_DIMS`; None above their
    largest (256). Multi-head latent attention pads to it (DeepSeek-V3's 192 / 128: 192 on cuDNN, 256 on the flash
    kernels)."""
    need = max(qk, v)
    if impl == "cudnn":
        width = -(-need // 8) * 8
        return width if width <= 256 else None
    return next((d for d in FLASH_HEAD_DIMS if d >= need), None)


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
    expert: int = 1  # expert parallelism: MoE experts split, tokens sent to them by all-to-all (docs/moe.md)
    context: int = 1  # context parallelism: the sequence split, ring attention over it (docs/long-context.md)
    tensor: int = 1  # tensor parallelism: heads and MLP columns split (Megatron); inside a node only


def default_rules() -> dict[str, Any]:
    # Parameters are sharded over fsdp (ZeRO-3 style) and tensor (Megatron style); activations' batch dimension
    # over data, fsdp and expert (outside the MoE layers the expert axis is one more data axis). Activation names
    # start with "act_" so that an activation's embed dimension stays replicated while the parameter's embed
    # dimension is fsdp-sharded.
    return {
        "batch": ["data", "fsdp", "expert"],
        "vocab": "tensor",
        "embed": "fsdp",
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        # The stacked layers' leading axis: split over pipeline stages (nothing to split with one stage).
        "layers": "stage",
        # The pipeline's per-stage activation buffers [stage, microbatch, seq, embed] (jaxtrain/parallel/pipeline.py).
        "stage": "stage",
        "norm": None,
        # MoE layers (docs/moe.md): the routed experts' leading dimension, each expert's hidden width, and the dense
        # layers inside a group of model.moe.every layers (never split: the group is what the scan and stages see).
        "experts": "expert",
        "expert_mlp": "tensor",
        "sublayers": None,
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
    # One of the twelve may be -1: it takes whatever the device count leaves.
    ici: AxisSizes = field(default_factory=lambda: AxisSizes(data=1, stage=1, fsdp=-1, tensor=1))
    dcn: AxisSizes = field(default_factory=AxisSizes)
    rules: dict[str, Any] = field(default_factory=default_rules)  # logical axis -> mesh axis, list of axes, or null
    # true: at start-up the planner picks the mesh sizes, model.remat, train.microbatches and train.pipeline_schedule
    # (of those that fit, the fastest estimate, or measured: auto_trial_steps; docs/auto-layout.md) and
    # run.dir/config.yaml records them, with auto false.
    auto: bool = False
    auto_memory_margin: float = 0.1  # mesh.auto: fraction of the usable device memory a choice must leave free
    # mesh.auto: each finalist (fits, estimated near the best) runs this many timed steps, in two passes with a
    # warm-up step each, and the fastest measured is chosen; 0: the estimate alone (docs/auto-layout.md says what
    # a trial costs on GPUs)
    auto_trial_steps: int = 6
    # mesh.auto: the sizes the search keeps as configured, as "ici.data", "dcn.fsdp", ... (a size of -1 keeps
    # nothing); the loader lists every mesh.ici.* / mesh.dcn.* size a key=value override sets, so that
    # `mesh.auto=true mesh.ici.data=4` searches only the layouts with ici data 4 (a config file's sizes are its own
    # layout, which mesh.auto replaces)
    auto_keep: list[str] = field(default_factory=list)

    def sizes(self) -> dict[tuple[str, str], int]:
        """``{("ici", "data"): 1, ...}``: the configured sizes (ici and dcn of each axis), ``-1`` included."""
        return {(part, ax): getattr(getattr(self, part), ax) for part in ("ici", "dcn") for ax in MESH_AXES}

    def kept(self) -> dict[tuple[str, str], int]:
        """The sizes ``auto_keep`` holds mesh.auto's search to: ``{("ici", "data"): 4}`` (those of -1 left out)."""
        sizes = self.sizes()
        kept = {}
        for name in self.auto_keep:
            part, _, ax = name.partition(".")
            if sizes[(part, ax)] > 0:
                kept[(part, ax)] = sizes[(part, ax)]
        return kept


@dataclass
class RopeScalingConfig:
    # Llama 3.1's rotary frequency scaling ("llama3"): wavelengths longer than original_max_len / low_freq_factor
    # are stretched by `factor`, those shorter than original_max_len / high_freq_factor kept, smoothly in between.
    # none: plain RoPE; llama3: that scaling.
    type: Literal["none", "llama3"] = "none"
    factor: float = 8.0  # how much the longest wavelengths are stretched
    low_freq_factor: float = 1.0  # wavelengths above original_max_len / low_freq_factor are stretched fully
    high_freq_factor: float = 4.0  # wavelengths below original_max_len / high_freq_factor are kept
    original_max_len: int = 8192  # the context length the model was pre-trained with


@dataclass
class MoEConfig:
    """Mixture of experts (docs/moe.md): in every ``every``-th layer the SwiGLU MLP becomes ``experts`` routed SwiGLU
    experts (each token goes to its top_k, weighted by the router) plus ``shared_experts`` always-on ones."""

    experts: int = 0  # routed experts per MoE layer; 0: a dense model
    top_k: int = 2  # experts each token is sent to (token choice)
    d_ff: int = 0  # hidden width of each routed expert; 0: model.d_ff
    shared_experts: int = 0  # always-on experts: one SwiGLU of width shared_experts x d_ff in each MoE layer
    shared_gate: bool = False  # scale the shared experts' output by sigmoid(x . w) per token (Qwen2-MoE)
    # the first first_dense layers are dense SwiGLU MLPs of model.d_ff (DeepSeek-V3's first_k_dense_replace), before
    # the groups of `every`; not split over pipeline stages (stage > 1 refuses it)
    first_dense: int = 0
    # layer first_dense + i is an MoE layer when (i + 1) % every == 0, the others dense; divides model.n_layers -
    # first_dense
    every: int = 1
    # softmax: top_k of softmax(logits) (Mixtral, Qwen2-MoE); sigmoid: top_k of sigmoid(logits) (DeepSeek-V3)
    router: Literal["softmax", "sigmoid"] = "softmax"
    normalize: bool = True  # the top_k weights renormalised to sum 1 (Mixtral; Qwen2-MoE's norm_topk_prob)
    # 0: dropless (every token reaches its experts); > 0: each expert takes at most ceil(capacity_factor x seq_len
    # x top_k / experts) tokens of a sequence, the rest of its assignments are dropped (counted as moe_dropped)
    capacity_factor: float = 0.0
    aux_loss: float = 0.01  # weight of the load-balancing loss (Switch Transformer) in the training loss
    # per_layer: each MoE layer's balance loss from its own counts, their mean over layers (Megatron-Core sums them);
    # pooled: counts and probabilities summed over layers first (transformers' load_balancing_loss_func)
    balance_loss: Literal["per_layer", "pooled"] = "per_layer"
    z_loss: float = 0.0  # weight of the router z-loss (ST-MoE: mean of logsumexp(logits)^2)
    # DeepSeek-V3's complementary sequence-wise balance loss's weight (alpha): per sequence, E / (top_k T^2) x
    # sum_e (its tokens choosing e) x (its summed normalised scores of e), the mean over sequences and layers
    seq_aux_loss: float = 0.0
    # A per-expert correction bias (float32 [experts] per MoE layer, model state, not trained by the optimizer) added
    # to the scores for choosing experts only, never to the combine weights (DeepSeek-V3's auxiliary-loss-free
    # balancing); after each applied step, bias_e += bias_update_rate x sign(mean load - load_e), load_e the step's
    # top-k choices of expert e over all microbatches and data-parallel groups (Megatron-Core)
    expert_bias: bool = False
    # the expert bias's step per applied train step (Megatron-Core's moe_router_bias_update_rate); 0: kept as loaded
    bias_update_rate: float = 0.001
    # group-limited routing (DeepSeek-V3): the experts split into n_group consecutive groups, each scored by the sum
    # of its two best (biased) scores; 1: no groups
    n_group: int = 1
    topk_group: int = 1  # each token chooses its top_k experts within its topk_group best groups (of n_group)
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' combine weights (after normalize)
    # How tokens reach experts on other devices of the expert axis: all_to_all (padded to the worst case),
    # all_gather (every device gathers the axis's tokens, results reduce-scattered back); auto: fewer bytes
    dispatch: Literal["auto", "all_to_all", "all_gather"] = "auto"
    # routed experts' grouped matmuls: xla (ragged_dot), pallas / triton (kernels, per device); auto: pallas on GPU
    gemm: Literal["auto", "xla", "pallas", "triton"] = "auto"


@dataclass
class ModelConfig:
    vocab_size: int = 256  # token ids 0 .. vocab_size - 1 (256: the byte-level embedded corpus)
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # decoder blocks (attention + SwiGLU MLP, pre-RMSNorm)
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (grouped-query attention); divides n_heads
    head_dim: int | None = None  # None: d_model // n_heads
    qkv_bias: bool = False  # biases on the q, k and v projections, none on the output one (Qwen2, Qwen2.5)
    qk_norm: bool = False  # RMSNorm over head_dim of each query and key head, before rotary (Qwen3)
    # Multi-head latent attention (MLA, DeepSeek-V2/V3), on when kv_lora_rank is set: keys and values come out of one
    # compressed latent of kv_lora_rank (RMSNorm-ed) per token, plus one rotary key of qk_rope_head_dim shared by
    # all heads; q/k heads are qk_nope_head_dim + qk_rope_head_dim wide, v heads v_head_dim; generate caches the
    # latent and the rotary key only. null: standard attention (the four options below are then unused).
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # MLA: queries through a low-rank latent of this width (RMSNorm-ed); null: direct
    qk_nope_head_dim: int = 128  # MLA: the part of each q/k head without rotary positions
    qk_rope_head_dim: int = 64  # MLA: the rotary part of each q/k head (half-split rotary layout; even)
    v_head_dim: int = 128  # MLA: width of each value head (and of the attention output per head)
    # Sliding-window attention in every layer (Mistral; Qwen's use_sliding_window): a query attends to itself and
    # the sliding_window - 1 tokens before it; None: full causal attention. On xla, cudnn and pallas attention (not
    # triton); over a context axis with xla or pallas (ring attention skips the chunks outside it).
    sliding_window: int | None = None
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
    # FP8 matmuls in the attention (q, k, v, o) and MLP (gate, up, down) projections: e4m3 weights and activations,
    # e5m2 gradients; embeddings, norms and the output projection stay in the compute dtype (docs/fp8.md). Needs a
    # GPU of compute capability 8.9+ (Ada, Hopper, Blackwell); XLA:CPU emulates it (for tests, not speed).
    # tensorwise: one current scale per tensor; rowwise: a scale per row and column; delayed: scales from an amax
    # history kept in the train state (Transformer Engine's DelayedScaling).
    fp8: Literal["none", "tensorwise", "rowwise", "delayed"] = "none"
    fp8_amax_history: int = 1024  # model.fp8=delayed: steps of amax history per tensor (TE's amax_history_len)
    # The dtype of the projections' weight gradients, hence of their reduction over the batch axes (FSDP's
    # reduce-scatter, data parallelism's all-reduce): "compute" (Flax's cast of the kernel before its dot: a
    # compute-dtype gradient, half the bytes in bfloat16, as MaxText) or "float32" (torchtitan FSDP2's reduce_dtype
    # default: the weight gradient is a compute-dtype dot accumulated and returned in float32; the forward and the
    # input gradients are unchanged). Applies to the projections (attention, MLA, MLP, shared experts, the output
    # projection, tied or not) but the FP8 ones, whose float8 dot computes their weight gradients (in the compute
    # dtype); the routed experts' grouped matmuls keep compute-dtype weight gradients. Needs
    # model.param_dtype=float32; with model.dtype=float32 it changes nothing (docs/parallelism.md).
    reduce_dtype: Literal["compute", "float32"] = "compute"
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts; experts=0: dense (docs/moe.md)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Width of each query and key head: qk_nope_head_dim + qk_rope_head_dim with MLA, else the head dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.resolved_head_dim

    @property
    def moe_layers(self) -> int:
        """How many layers have routed experts: (n_layers - moe.first_dense) / moe.every, 0 for a dense model."""
        return (self.n_layers - self.moe.first_dense) // self.moe.every if self.moe.experts else 0

    @property
    def expert_d_ff(self) -> int:
        """Hidden width of one routed expert: ``moe.d_ff``, or ``d_ff`` when that is 0."""
        return self.moe.d_ff or self.d_ff


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
    # The dtype train.accumulate=unreduced gathers the parameters in before its microbatch loop: "compute" (half the
    # bytes in bfloat16: every parameter the model casts at its use is cast first, so no value changes; the router
    # and the embedding table stay float32; FP8 runs and model.reduce_dtype=float32 gather float32) or "float32"
    # (the master weights as stored). Gradients are accumulated and reduced in float32 either way.
    # Elsewhere XLA already gathers the compute dtype (docs/parallelism.md).
    gather_dtype: Literal["compute", "float32"] = "compute"
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


def all_keys() -> list[str]:
    """Every dotted key of the config tree, e.g. ``["run.dir", ...]`` (dict-valued options end at their name)."""
    return dotted_keys(Config)


def unknown_config_key(name: str) -> ConfigError:
    """The error for a key the tree does not have, naming the closest ones."""
    return unknown_key(name, all_keys() + [f"mesh.rules.{k}" for k in default_rules()], "config key")
