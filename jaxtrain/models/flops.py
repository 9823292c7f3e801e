"""Model FLOPs and parameter counts, from the model config alone: the one formula that MFU, the planner's compute
time and the benchmarks all use."""

from __future__ import annotations

from jaxtrain.config import ModelConfig


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward), rematerialisation not counted.

    Forward: 2 FLOPs per weight of every matmul (the embedding lookup is not a matmul; the output projection is),
    plus attention's two [seq x seq] matmuls, 2 * 2 * seq * heads * head_dim per layer, halved for causal masking.
    The one formula for model FLOPs: MFU, the planner's compute time and the benchmarks all use it.
    An MoE model counts the weights a token multiplies: its top_k routed experts, the shared ones and the router
    (:func:`mlp_weights`), not the experts it skips.
    """
    matmul_weights = cfg.n_layers * attention_weights(cfg)[0] + mlp_weights(cfg)[1] + cfg.d_model * cfg.vocab_size
    return 3 * (2 * matmul_weights + attention_flops_per_token(cfg, seq_len))


def mlp_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(weights of every layer's MLP, the part one token multiplies). Dense: 3 d_model d_ff per layer, all of it.
    MoE (``cfg.moe``): each MoE layer (``cfg.moe_layers`` of them) holds E routed experts of 3 d_model d_ff_expert, the
    shared experts and the router [d_model, E] (and the shared gate); a token multiplies top_k routed experts, the
    shared ones and the router. The other layers are dense."""
    d, moe = cfg.d_model, cfg.moe
    dense = 3 * d * cfg.d_ff
    if not moe.experts:
        return cfg.n_layers * dense, cfg.n_layers * dense
    n_moe = cfg.moe_layers
    expert = 3 * d * cfg.expert_d_ff
    common = d * moe.experts + moe.shared_experts * expert + (d if moe.shared_gate else 0)
    n_dense = cfg.n_layers - n_moe
    return (n_dense * dense + n_moe * (moe.experts * expert + common),
            n_dense * dense + n_moe * (moe.top_k * expert + common))


def attention_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, other parameters) of one layer's attention. Standard: q, k, v, o projections
    d_model x head_dim x (2 heads + 2 kv_heads); biases and q/k norm scales by the config. MLA (``kv_lora_rank``):
    q (d_model x heads x qk_head_dim) or its two low-rank factors (d_model x q_lora_rank + q_lora_rank x heads x
    qk_head_dim, and the latent's norm scale), kv_a d_model x (kv_lora_rank + qk_rope_head_dim), kv_b
    kv_lora_rank x heads x (qk_nope_head_dim + v_head_dim), o heads x v_head_dim x d_model, the kv latent's norm."""
    d, h = cfg.d_model, cfg.n_heads
    if not cfg.mla:
        hd = cfg.resolved_head_dim
        other = hd * (h + 2 * cfg.n_kv_heads) * cfg.qkv_bias + 2 * hd * cfg.qk_norm  # biases, q/k norm scales
        return d * hd * (2 * h + 2 * cfg.n_kv_heads), other
    r, rq, qk = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_head_dim
    assert r is not None
    q = d * h * qk if rq is None else d * rq + rq * h * qk
    kv = d * (r + cfg.qk_rope_head_dim) + r * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d, r + (rq or 0)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of attention's two [seq x seq] matmuls per token, all layers: 2 * seq * heads * (qk head
    dim + v head dim) per layer (2 * 2 * seq * heads * head_dim where they are equal), halved for causal masking
    (part of :func:`train_flops_per_token`; the planner's remat cost too)."""
    v_dim = cfg.v_head_dim if cfg.mla else cfg.resolved_head_dim
    return cfg.n_layers * 2 * seq_len * cfg.n_heads * (cfg.qk_head_dim + v_dim) / 2


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, the embedding table alone, the routed experts' weights (0 for a dense
    model), and the active parameters: those one token's forward uses (an MoE model's top_k experts of each layer
    instead of all of them; the embedding table counted once)."""
    d, l = cfg.d_model, cfg.n_layers
    attn = sum(attention_weights(cfg))
    mlp, active_mlp = mlp_weights(cfg)
    embed = cfg.vocab_size * d
    unembed = 0 if cfg.tie_embeddings else embed
    rest = embed + unembed + l * (attn + 2 * d) + d
    experts = cfg.moe_layers * cfg.moe.experts * 3 * d * cfg.expert_d_ff
    return {"total": rest + mlp, "embedding": embed, "experts": experts, "active": rest + active_mlp}


def fp8_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The part of :func:`train_flops_per_token` that ``model.fp8`` multiplies in float8: the attention and MLP
    projections (q, k, v, o, gate, up, down; MLA's q or q_a and q_b, kv_a, kv_b, o; an MoE model's dense layers and
    shared experts), forward and backward, and the routed experts' active FLOPs (top_k experts' three grouped
    matmuls) where they multiply in float8 too (every recipe with ``model.moe.gemm=xla``; ``auto`` is the pallas
    kernel on GPUs, which stays 16-bit: docs/fp8.md); 0 with ``model.fp8=none``. The output projection, attention's
    [seq x seq] matmuls and the router stay in the compute dtype."""
    if cfg.fp8 == "none":
        return 0.0
    d, moe = cfg.d_model, cfg.moe
    attn = attention_weights(cfg)[0]
    n_moe = cfg.moe_layers
    mlp = (cfg.n_layers - n_moe) * 3 * d * cfg.d_ff + n_moe * moe.shared_experts * 3 * d * cfg.expert_d_ff
    if moe.gemm == "xla":  # every recipe is one of jaxtrain.models.fp8_experts.RECIPES; the kernels stay 16-bit
        mlp += n_moe * moe.top_k * 3 * d * cfg.expert_d_ff
    return 3 * 2 * (cfg.n_layers * attn + mlp)
