"""Closed forms of a step's memory per device, known before compiling: the state (parameters and AdamW's moments
over their shards), the gradients the update takes, the activations one microbatch keeps for the backward and the
peak of one layer's backward (XLA:CPU's or XLA:GPU's temporaries, :data:`COMPILERS`), and an MoE layer's dispatch
buffers. The auto search (``planner/auto/choose.py``) prunes and orders candidates with them; the compiled program
is the judge. :mod:`.model` prices the same quantities in time.

May import what :mod:`jaxtrain.planner.cost` may.
"""

from __future__ import annotations

import math

from jaxtrain.config import Config, kernel_head_dim
from jaxtrain.models.flops import count_params
from jaxtrain.parallel.dims import Axis, MeshShape, ParallelDims
from jaxtrain.parallel.expert import choose_dispatch, chunk_rows, dispatch_bytes

# ---------------------------------------------------------------------------------------------------------------
# Before compiling: closed forms the auto search (planner/auto/choose.py) prunes and orders candidates with. Rough by
# design (the compiled program is the judge); ``state_bytes_lower`` and ``compute_seconds`` are lower bounds.

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(name: str) -> int:
    return _BYTES.get(name, 4)  # "auto" before resolution: count float32, the larger


def params_per_shard(cfg: Config, shape: MeshShape) -> float:
    """Parameters of the largest kind one device holds a share of, over the fsdp x tensor x stage shards: an MoE
    model's routed experts are split over the expert axis too."""
    counts = count_params(cfg.model)
    return counts["total"] - counts["experts"] + counts["experts"] / shape.size(Axis.EXPERT)


def _latent_up_params(cfg: Config) -> int:
    """MLA's up-projections from the latents, q_b [q_lora_rank, heads, qk head dim] and kv_b [kv_lora_rank, heads,
    nope + v head dims], all layers: their latent dimension is unnamed (``models/mla.py``), so fsdp does not split
    them, tensor (heads) and stage do. 0 without MLA."""
    m = cfg.model
    if not m.mla:
        return 0
    assert m.kv_lora_rank is not None
    q_b = (m.q_lora_rank or 0) * m.n_heads * m.qk_head_dim
    return m.n_layers * (q_b + m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim))


def _params_per_device(cfg: Config, shape: MeshShape) -> float:
    """Parameters one device holds (:func:`params_per_shard` over the fsdp x tensor x stage shards), MLA's
    up-projections over tensor x stage only: on DeepSeek-V3 at tensor 8 x fsdp 32 they are 1.6 of the 4.5 GB a
    device holds (the lower bound had them at a 32nd of that)."""
    latent = _latent_up_params(cfg)
    return ((params_per_shard(cfg, shape) - latent) / ParallelDims(cfg, shape).param_shards
            + latent / (shape.size(Axis.TENSOR) * shape.size(Axis.STAGE)))


def state_bytes_lower(cfg: Config, shape: MeshShape) -> float:
    """Parameters and AdamW's two moments (both in param_dtype) per device, every parameter divided by the fsdp x
    tensor x stage shards (routed experts also by the expert axis; MLA's up-projections by tensor x stage only): a
    lower bound (the embedding is not split over stages, norms not at all)."""
    return 3 * _params_per_device(cfg, shape) * dtype_bytes(cfg.model.param_dtype)


def gradient_bytes(cfg: Config, shape: MeshShape) -> float:
    """The gradients one device holds when the optimizer runs: a temporary the state does not count, and the
    largest one the closed forms had missed (at 32 Mixtral layers, a third of the state again).

    One gradient per parameter of the device's shards (``state_bytes_lower``'s third), in param_dtype; with
    microbatches under ``train.accumulate=sharded`` (or no batch axis), the float32 accumulator beside the
    microbatch's gradient (``train.step._accumulated_grads``); under ``unreduced``, each device's accumulator, its
    microbatch's gradient and the parameters gathered once in the compute dtype, all the size of the parameters
    gathered over the batch axes (fsdp's shards undone). A pipeline sums its microbatches' gradients inside its
    loop, in a float32 accumulator beside the result (a compiled Mixtral 1F1B stage: 12.7 GB of gradients twice)."""
    m, dims = cfg.model, ParallelDims(cfg, shape)
    pb, elems = dtype_bytes(m.param_dtype), _params_per_device(cfg, shape)
    if dims.microbatches == 1:
        return elems * pb
    if cfg.train.accumulate == "sharded" or not dims.batch_axes or dims.stages > 1:
        return elems * (4 + pb)
    gathered = elems * math.prod(dims.size(a) for a in dims.batch_axes if a == Axis.FSDP)
    return gathered * (4 + pb + dtype_bytes(m.dtype))


def memory_estimate(cfg: Config, shape: MeshShape, compiler: str = "xla-cpu") -> float:
    """The closed-form estimate of a step's memory per device: the state (:func:`state_bytes_lower`), the gradients
    (:func:`gradient_bytes`) and the activations (:func:`activation_bytes`' estimate). What ``mesh.auto`` orders and
    skips candidates by before compiling (the compiled figure is the judge); ``compiler``: whose temporaries
    (:data:`COMPILERS`: XLA:CPU's, or XLA:GPU's where the search compiles for the GPUs)."""
    return state_bytes_lower(cfg, shape) + gradient_bytes(cfg, shape) + activation_bytes(cfg, shape, compiler)[1]


def rows_and_seq(cfg: Config, shape: MeshShape) -> tuple[float, float]:
    """(sequences of one microbatch per device, tokens of a sequence per device)."""
    dims = ParallelDims(cfg, shape)
    return dims.rows_per_microbatch / dims.data_parallel, cfg.data.seq_len / dims.context


COMPILERS = ("xla-cpu", "xla-gpu")  # whose temporaries the closed forms size (activation_bytes' ``compiler``)


def activation_bytes(cfg: Config, shape: MeshShape, compiler: str = "xla-cpu") -> tuple[float, float]:
    """(lower bound, estimate) of the activations one device keeps for the backward of one microbatch.

    Lower bound: each layer's input (what every remat policy saves). Estimate: what each layer keeps
    (:func:`_kept_per_layer`), plus the peak of one layer's backward (:func:`_layer_peak`: the heaviest layer, dense
    or MoE, recomputed or not) and the float32 logits with their gradient. GPipe keeps every microbatch of its stage.
    ``compiler``: whose temporaries (:data:`COMPILERS`); XLA:CPU keeps some 16-bit buffers in float32 that XLA:GPU
    keeps in 16 bits (the saved attention outputs, the experts' hidden products; docs/planning.md)."""
    m, s = cfg.model, shape.axis_sizes
    rows, seq = rows_and_seq(cfg, shape)
    act, layers = dtype_bytes(m.dtype), m.n_layers / s[Axis.STAGE]
    tokens = rows * seq
    lower = layers * tokens * m.d_model * act
    dense, moe = _layer_peak(cfg, shape, compiler)
    if compiler == "xla-cpu":
        dense_extra, moe_extra = _cpu_transients(cfg, shape)
        dense, moe = dense + dense_extra, moe + moe_extra
    n_moe = m.moe_layers / s[Axis.STAGE]
    kept = _kept_per_layer(cfg, shape, compiler)
    if m.remat == "none":  # every layer keeps what its backward needs: its own peak, unfused (no GEMM epilogue
        # can take elementwise work whose inputs must be kept anyway: XLA:GPU keeps XLA:CPU's float32 products too)
        dense_kept, moe_kept = _layer_peak(cfg, shape, "xla-cpu")
        kept = (layers - n_moe) * dense_kept + n_moe * moe_kept
    else:
        kept *= layers
    # float32 logits and their gradient; XLA:GPU writes the gradient over the logits (one float32 array: compiled
    # Qwen3-30B-A3B, vocabulary 151,936, docs/planning.md)
    logits = tokens * m.vocab_size / s[Axis.TENSOR] * 4 * (2 if compiler == "xla-cpu" else 1)
    if s[Axis.STAGE] > 1 and cfg.train.pipeline_schedule == "gpipe":
        # GPipe keeps what every microbatch's pass through the stage's layers keeps (``kept`` is one microbatch's
        # over the stage's layers): M of them, not M / S (until 2026-12-05, which put Mixtral's GPipe layouts at a
        # third of their compiled memory and sent mesh.auto's compiles there first), and the loop's buffers of
        # every microbatch's input and output activations (a compiled Mixtral stage at 512 microbatches: 34 GB)
        kept = cfg.train.microbatches * (kept + 2 * tokens * m.d_model * act)
    elif s[Axis.STAGE] > 1:  # 1F1B: at most 2 S - 1 stage inputs, each pass's own recomputed from its input
        kept += (2 * s[Axis.STAGE] - 1) * tokens * m.d_model * act
    vocab = _vocab_copies(cfg, shape, compiler)
    if vocab and m.moe.experts:
        # XLA:CPU's peak of an MoE stack with microbatches falls inside an MoE layer's backward, with the vocabulary
        # tables' copies live and the logits' gradient already freed: the larger of the two, not their sum (the
        # peak-usage breakdowns of Mixtral, Qwen3-30B-A3B and DeepSeek-V3 stacks, 2026-12-05)
        return lower, kept + max(max(dense, moe) + vocab, logits)
    return lower, kept + max(dense, moe) + logits + vocab


def _vocab_copies(cfg: Config, shape: MeshShape, compiler: str) -> float:
    """XLA:CPU's float32 copies of the vocabulary tables (embedding and output projection, [vocab, d_model] over
    tensor; one table when tied) live through a microbatch's backward: the output projection widened for its
    float32 dot and the embedding's copy; under fsdp also both tables gathered and their whole-table gradients
    before the reduce-scatter (5 copies); under tensor parallelism also the embedding's gradient and its
    resharding, each of the whole table. Read off XLA:CPU's peak-usage breakdown (``--xla_dump_to``'s live-range
    file) of DeepSeek-V3 (vocabulary 129,280 x 7,168: 3.7 GB a copy), Qwen3-30B-A3B, Mixtral and the 1B and 7B
    with 2 microbatches, 2026-12-05; without microbatches the peak is at the loss head, which the logits term stands
    for. 0 on XLA:GPU, which gathers and multiplies the tables in the compute dtype."""
    dims, t = ParallelDims(cfg, shape), shape.size(Axis.TENSOR)
    if compiler != "xla-cpu" or dims.microbatches == 1:
        return 0.0
    copies = (5 if shape.size(Axis.FSDP) > 1 else 2) / t + (2 if t > 1 else 0)
    if cfg.model.tie_embeddings:  # one table, not two: half the copies (the 1B at fsdp 8: 2.7 GB of 1.05 GB copies)
        copies /= 2
    return copies * cfg.model.vocab_size * cfg.model.d_model * 4


def _cpu_transients(cfg: Config, shape: MeshShape) -> tuple[float, float]:
    """(a dense layer's, an MoE layer's) float32 copies that XLA:CPU adds to one layer's backward and XLA:GPU does
    not make, per device and microbatch: part of the peak, never of what each layer keeps. Read off XLA:CPU's
    peak-usage breakdowns of DeepSeek-V3 stacks (2026-12-05; benchmarks/moe_memory.py --peak)."""
    m, s = cfg.model, shape.axis_sizes
    rows, seq = rows_and_seq(cfg, shape)
    tokens, act, t = rows * seq, dtype_bytes(m.dtype), s[Axis.TENSOR]
    attention = 0.0
    if m.mla and m.attention != "xla":
        # MLA's q, k and v zero-padded to the kernel's head dim, their gradients and the interpreted flash kernel's
        # copies of them: 22-34 arrays of [tokens, heads, padded head dim] (cuDNN takes them as they are)
        width = kernel_head_dim(m.attention, m.qk_head_dim, m.v_head_dim) or 0
        attention = 28 * tokens * m.n_heads / t * width * act
    if not m.moe.experts:
        return attention, 0.0
    # one expert matrix (gate's or up's) of the layer's local experts widened for its dot: 15 GB at fsdp 8
    moe = m.moe.experts // s[Axis.EXPERT] * m.d_model * m.expert_d_ff / t * 4
    if s[Axis.FSDP] > 1:
        # and the model.moe.first_dense layers' MLPs gathered in float32 through the MoE layers' backward, twice
        # (DeepSeek-V3's first layer at fsdp 8: six [7168, 18432] arrays, 3.2 GB)
        moe += 2 * m.moe.first_dense * 3 * m.d_model * m.d_ff / t * 4
    return attention, attention + moe


def _kept_per_layer(cfg: Config, shape: MeshShape, compiler: str) -> float:
    """Bytes a layer keeps for the backward under remat ``full`` or ``save_matmuls``, per device and microbatch:
    its input; save_matmuls also the weight matmuls' outputs (:func:`_matmul_outputs`); and where attention is
    a kernel (cuDNN, flash: not the XLA reference, which names nothing) both policies keep its named output and
    log-sum-exp (``models.attention.REMAT_POLICIES``) -- missed until 2026-12-05. XLA:CPU keeps that stacked output
    in float32 (docs/planning.md: the 7B's +17 GB), XLA:GPU in the compute dtype."""
    m, s = cfg.model, shape.axis_sizes
    rows, seq = rows_and_seq(cfg, shape)
    tokens, act, t = rows * seq, dtype_bytes(m.dtype), s[Axis.TENSOR]
    kept = tokens * m.d_model * act
    if m.remat == "save_matmuls":
        kept += tokens * _matmul_outputs(cfg, t) * act
    if m.attention != "xla":
        # MLA runs the kernels zero-padded to one head dim (config.kernel_head_dim): cuDNN's on XLA:GPU, the flash
        # kernel's (which stands in for cuDNN) on XLA:CPU; the saved output is that wide
        impl = m.attention if compiler == "xla-cpu" else "cudnn"
        v_dim = (kernel_head_dim(impl, m.qk_head_dim, m.v_head_dim) or m.v_head_dim) if m.mla else m.resolved_head_dim
        kept += tokens * m.n_heads / t * (v_dim * (4 if compiler == "xla-cpu" else act) + 4)
    return kept


def _matmul_outputs(cfg: Config, tensor: int) -> float:
    """Values a token's weight matmuls output in one layer (the layers' mean), what remat ``save_matmuls`` keeps
    (``dots_with_no_batch_dims_saveable``): the attention projections (MLA's latents, whole on every tensor device,
    and its up-projections; or q, k, v), the output projection and the MLP's down projection at d_model (whole after
    their all-reduce), gate and up (an MoE layer's shared experts', and its router's logits; the routed experts'
    grouped matmuls are not dots the policy saves). Until 2026-12-05 this was 4 d_model + 2 d_ff over tensor, which
    put DeepSeek-V3's MLA layers at a third of their compiled figure."""
    m = cfg.model
    if m.mla:
        assert m.kv_lora_rank is not None
        attn = ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
                + m.n_heads * (m.qk_head_dim + m.qk_nope_head_dim + m.v_head_dim) / tensor)
    else:
        attn = (m.n_heads + 2 * m.n_kv_heads) * m.resolved_head_dim / tensor
    dense = 2 * m.d_ff / tensor
    moe = 2 * m.moe.shared_experts * m.expert_d_ff / tensor + m.moe.experts
    mlp = (dense * (m.n_layers - m.moe_layers) + moe * m.moe_layers) / m.n_layers
    return attn + 2 * m.d_model + mlp


def _layer_peak(cfg: Config, shape: MeshShape, compiler: str) -> tuple[float, float]:
    """(a dense layer's, an MoE layer's) activations while its backward runs, per device and microbatch: ~8 d_model
    values a token (projections, norms) and, with the XLA reference attention, the heads' score rows; the dense MLP
    3 d_ff (an MoE layer's shared experts instead, not model.d_ff: Qwen3-MoE's d_ff is no layer's); an MoE layer
    adds :func:`_moe_peak`. 0 for an MoE layer of a dense model."""
    m, s = cfg.model, shape.axis_sizes
    rows, seq = rows_and_seq(cfg, shape)
    tokens, act, t = rows * seq, dtype_bytes(m.dtype), s[Axis.TENSOR]
    scores = m.n_heads / t * cfg.data.seq_len * 4 if m.attention == "xla" else 0.0
    dense = tokens * ((8 * m.d_model + 3 * m.d_ff) / t * act + scores)
    if not m.moe.experts:
        return dense, 0.0
    shared = m.moe.shared_experts * m.expert_d_ff
    moe = tokens * ((8 * m.d_model + 3 * shared) / t * act + scores) + _moe_peak(cfg, shape, compiler)
    return dense, moe


def _moe_peak(cfg: Config, shape: MeshShape, compiler: str) -> float:
    """An MoE layer's own buffers in its backward, per device and microbatch: the dispatch buffers
    (:func:`moe_dispatch`), the expert rows' hidden states on every row of the padded buffer, XLA's ragged_dot's
    masked copies (``moe.gemm=xla`` only: the kernels take the groups as they are), and one layer's local experts
    with their float32 gradient (gathered over fsdp)."""
    m, s = cfg.model, shape.axis_sizes
    act, t = dtype_bytes(m.dtype), s[Axis.TENSOR]
    moe = moe_dispatch(cfg, shape, compiler)
    rows = moe["expert_rows"]
    cpu = compiler == "xla-cpu"
    # XLA:CPU: float32 gate and up products, the SwiGLU in the compute dtype, and their gradients (2 x (8 + act) a
    # row and hidden unit); XLA:GPU fuses the backward's elementwise work into its GEMMs' epilogues and keeps three
    # compute-dtype arrays (gate, up, SwiGLU): compiled Mixtral and Qwen3 layouts, docs/planning.md.
    hidden = rows * m.expert_d_ff / t * (2 * (8 + act) if cpu else 3 * act)
    local = m.moe.experts // s[Axis.EXPERT]
    width = max(m.d_model, m.expert_d_ff / t)
    # XLA's ragged_dot masks the rows once per local expert (docs/moe.md): the gate and up products' masked inputs
    # and their gradients, 4 copies (2 until 2026-12-05, when 8 CPU devices' compiled fsdp8 step had twice them).
    masked = 4 * local * rows * width * act if local > 1 and m.moe.gemm == "xla" else 0
    # The layer's weights in the compute dtype with their gradient: float32 on XLA:CPU, the GEMM's own 16-bit
    # output on XLA:GPU (converted as it is reduce-scattered).
    gathered = local * 3 * m.d_model * m.expert_d_ff / t * (act + (4 if cpu else act))
    return moe["buffer_bytes"] + hidden + masked + gathered


def moe_dispatch(cfg: Config, shape: MeshShape, compiler: str = "xla-cpu") -> dict:
    """Closed-form figures of an MoE model's dispatch per device, MoE layer and microbatch (``jaxtrain.parallel.
    expert``): ``kind`` (model.moe.dispatch resolved), ``bytes_per_layer`` (sent in the forward; the backward sends as
    many), ``buffer_bytes`` (the forward's dispatch buffers: all_to_all's chunks out and in, both ways; all_gather's
    gathered tokens, expert rows and float32 results), ``expert_rows`` (the rows the device's experts run on: the
    padded buffer's), ``layers`` (MoE layers in the model); ``compiler``: whose buffers (:data:`COMPILERS`)."""
    m, s = cfg.model, shape.axis_sizes
    moe, ep, act = m.moe, s[Axis.EXPERT], dtype_bytes(m.dtype)
    rows, seq = rows_and_seq(cfg, shape)
    tokens = int(rows * seq)
    slots = math.ceil(moe.capacity_factor * cfg.data.seq_len * moe.top_k / moe.experts) if moe.capacity_factor else 0
    per_expert = min(tokens, int(rows) * slots) if slots else tokens
    kind = choose_dispatch(moe.dispatch, tokens, moe.top_k, moe.experts, ep, m.d_model, act, per_expert)
    chunk = chunk_rows(tokens, moe.top_k, moe.experts, ep, per_expert)
    if ep == 1:
        expert_rows = tokens * moe.top_k
        buffers = expert_rows * m.d_model * act
    elif kind == "all_to_all":
        expert_rows = ep * chunk
        buffers = 4 * expert_rows * m.d_model * act
    else:
        expert_rows = chunk_rows(tokens * ep, moe.top_k, moe.experts, ep, per_expert * ep)
        # The gathered tokens and their float32 results, then per expert row its input (taken from the gathered
        # tokens), its output and, on XLA:CPU, its weighted float32 copy (scatter-added into the results) with the
        # latter's float32 gradient; XLA:GPU fuses the weighting into the scatter and keeps the output's gradient in
        # the compute dtype: missed until 2026-12-05, when the compiled Qwen3-30B-A3B layouts (16 experts a device,
        # eight rows a token) had twice these buffers' memory (docs/planning.md). XLA:CPU also widens the grouped
        # matmul's input and its gradient to float32 (interpreted Pallas: padded by a tile): 4 float32 and 3
        # 16-bit arrays of the rows at DeepSeek-V3's and Qwen3-30B-A3B's peaks, where 8 bytes had been counted.
        per_row = 2 * act + (16 if compiler == "xla-cpu" else act)
        buffers = ep * tokens * m.d_model * (act + 4) + expert_rows * m.d_model * per_row
    return {"kind": kind if ep > 1 else "local", "layers": m.moe_layers, "buffer_bytes": buffers,
            "expert_rows": expert_rows,
            "bytes_per_layer": dispatch_bytes(kind, tokens, moe.top_k, moe.experts, ep, m.d_model, act, per_expert)}
