"""Model FLOPs and parameter counts, from the model config alone: the one formula that MFU, the planner's compute
time and the benchmarks all use."""

from __future__ import annotations

from jaxtrain.config import ModelConfig


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward), rematerialisation not counted.

    Forward: 2 FLOPs per weight of every matmul (the embedding lookup is not a matmul; the output projection is),
    plus attention's two [seq x seq] matmuls, 2 * 2 * seq * heads * head_dim per layer, halved for causal masking.
    The one formula for model FLOPs: MFU, the planner's compute time and the benchmarks all use it.
    """
    d, hd, l = cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    matmul_weights = l * (d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff) + d * cfg.vocab_size
    return 3 * (2 * matmul_weights + attention_flops_per_token(cfg, seq_len))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of attention's two [seq x seq] matmuls per token, all layers: 2 * 2 * seq * heads * head_dim
    per layer, halved for causal masking (part of :func:`train_flops_per_token`; the planner's remat cost too)."""
    return cfg.n_layers * 2 * 2 * seq_len * cfg.n_heads * cfg.resolved_head_dim / 2


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, and the embedding table alone."""
    d, hd, l = cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    attn = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * d * cfg.d_ff
    per_layer = attn + mlp + 2 * d
    embed = cfg.vocab_size * d
    unembed = 0 if cfg.tie_embeddings else embed
    return {"total": embed + unembed + l * per_layer + d, "embedding": embed}


def fp8_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The part of :func:`train_flops_per_token` that ``model.fp8`` multiplies in float8: the attention and MLP
    projections (q, k, v, o, gate, up, down), forward and backward; 0 with ``model.fp8=none``. The output projection
    and attention's [seq x seq] matmuls stay in the compute dtype."""
    if cfg.fp8 == "none":
        return 0.0
    d, hd = cfg.d_model, cfg.resolved_head_dim
    return 3 * 2 * cfg.n_layers * (d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff)
