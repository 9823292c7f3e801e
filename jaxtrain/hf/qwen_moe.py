"""Hugging Face Qwen3-MoE and Qwen2-MoE checkpoints (``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM``) in and out:
``config.json`` <-> the MoE ModelConfig, safetensors <-> the parameters of :mod:`jaxtrain.models.moe`.

Both are jaxtrain's MoE decoder with fine-grained experts: ``num_experts`` (Qwen3-MoE saves it as
``num_local_experts``) experts of width ``moe_intermediate_size`` (``model.moe.d_ff``), the top ``num_experts_per_tok``
of a softmax router, renormalised when ``norm_topk_prob`` (``model.moe.normalize``); every ``decoder_sparse_step``-th
layer routed (``model.moe.every``), the others dense SwiGLU MLPs of ``intermediate_size`` (``model.d_ff``); dropless.
Qwen3-MoE adds q/k norms (``model.qk_norm``); Qwen2-MoE q/k/v biases (``qkv_bias``, ``model.qkv_bias``) and in each MoE
layer one shared expert of ``shared_expert_intermediate_size`` (``model.moe.shared_experts`` x ``model.moe.d_ff``)
scaled by a sigmoid gate (``model.moe.shared_gate``). ``router_aux_loss_coef`` is ``model.moe.aux_loss`` with
``model.moe.balance_loss=pooled`` (transformers' load_balancing_loss_func). Tensors of MoE layer i, expert j, as
``save_pretrained`` writes them (transformers 5 fuses the experts in memory, saves them per expert):

    model.layers.{i}.mlp.gate.weight                     [E, d] -> blocks.moe.mlp.router [g]          (transposed)
    model.layers.{i}.mlp.experts.{j}.gate_proj.weight    [f, d] -> blocks.moe.mlp.w_gate [g, j]       (transposed)
    model.layers.{i}.mlp.experts.{j}.up_proj.weight      [f, d] -> blocks.moe.mlp.w_up [g, j]         (transposed)
    model.layers.{i}.mlp.experts.{j}.down_proj.weight    [d, f] -> blocks.moe.mlp.w_down [g, j]       (transposed)
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight -> blocks.moe.mlp.shared.{gate,up,down}.kernel
    model.layers.{i}.mlp.shared_expert_gate.weight       [1, d] -> blocks.moe.mlp.shared_gate [g]     (transposed)

with i = g x every + every - 1; a dense layer i = g x every + j (j < every - 1) is ``blocks.dense`` [g, j], named as
a dense Qwen layer's. Import also reads the fused names (``mlp.experts.gate_up_proj`` [E, 2f, d], ``down_proj``
[E, d, f]). Anything else (``mlp_only_layers``, a window on some layers only, ...) is refused naming the field.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.config import ModelConfig
from jaxtrain.errors import ConfigError
from jaxtrain.hf import families, mapping

MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}


def _positive(hf: dict, key: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value!r} in config.json must be a positive integer")
    return value


def model_fields_from_hf(hf: dict, arch: str) -> dict:
    """ModelConfig field values (dotted ``model.*`` keys) for a Qwen3-MoE or Qwen2-MoE ``config.json``; ConfigError
    naming the first field whose value jaxtrain cannot represent."""
    mapping.check_common(hf)
    qwen3 = arch == "Qwen3MoeForCausalLM"
    experts_key = "num_local_experts" if qwen3 and "num_local_experts" in hf else "num_experts"
    experts = _positive(hf, experts_key, hf.get(experts_key, 128 if qwen3 else 60))
    top_k = hf.get("num_experts_per_tok", 8 if qwen3 else 4)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok={top_k!r} in config.json must be in 1..{experts} ({experts_key})")
    d_ff = _positive(hf, "moe_intermediate_size", hf.get("moe_intermediate_size", 768 if qwen3 else 1408))
    step = _positive(hf, "decoder_sparse_step", hf.get("decoder_sparse_step", 1))
    n = hf.get("num_hidden_layers")
    if isinstance(n, int) and n % step:
        raise ConfigError(f"unsupported feature: decoder_sparse_step={step} with num_hidden_layers={n} in "
                          "config.json (jaxtrain's model.moe.every divides the layers)")
    if hf.get("mlp_only_layers"):
        raise ConfigError(f"unsupported feature: mlp_only_layers={hf['mlp_only_layers']!r} in config.json (jaxtrain "
                          "places dense layers by decoder_sparse_step only)")
    norm = hf.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"norm_topk_prob={norm!r} in config.json must be true or false")
    fields = mapping.decoder_fields(hf)
    if qwen3:
        if hf.get("attention_bias"):
            raise ConfigError(f"unsupported feature: attention biases (attention_bias={hf['attention_bias']!r} in "
                              "config.json)")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        if window is not None:  # Qwen3-MoE's window, where set, covers every layer
            window = families.sliding_window({"sliding_window": window}, "MistralForCausalLM")
        fields.update({"model.qkv_bias": False, "model.qk_norm": True, "model.sliding_window": window})
        shared = 0
    else:
        if hf.get("use_sliding_window", False):
            raise ConfigError(f"unsupported feature: use_sliding_window={hf['use_sliding_window']!r} in a "
                              "Qwen2MoeForCausalLM config.json (its window covers some layers only)")
        qkv_bias = hf.get("qkv_bias", True)
        if not isinstance(qkv_bias, bool):
            raise ConfigError(f"qkv_bias={qkv_bias!r} in config.json must be true or false")
        size = hf.get("shared_expert_intermediate_size", 5632)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or size % d_ff:
            raise ConfigError(f"unsupported feature: shared_expert_intermediate_size={size!r} in config.json "
                              f"(jaxtrain's shared experts are a positive multiple of moe_intermediate_size={d_ff})")
        shared = size // d_ff
        fields.update({"model.qkv_bias": qkv_bias, "model.qk_norm": False, "model.sliding_window": None})
    fields.update({
        "model.moe.experts": experts,
        "model.moe.top_k": top_k,
        "model.moe.d_ff": d_ff,
        "model.moe.every": step,
        "model.moe.shared_experts": shared,
        "model.moe.shared_gate": shared > 0,
        "model.moe.router": "softmax",
        "model.moe.normalize": norm,
        "model.moe.capacity_factor": 0.0,  # dropless, as transformers runs them
        # transformers adds router_aux_loss_coef x load_balancing_loss_func (counts pooled over layers) with
        # output_router_logits; model.moe.balance_loss=pooled is that function.
        "model.moe.aux_loss": float(hf.get("router_aux_loss_coef", 0.001)),
        "model.moe.balance_loss": "pooled",
        "model.moe.z_loss": 0.0,
    })
    return fields


def fits(m: ModelConfig, arch: str) -> str | None:
    """None if class ``arch`` holds the MoE model ``m``, else the first setting it cannot hold (a phrase)."""
    moe = m.moe
    common = [(moe.router != "softmax", f"model.moe.router={moe.router} (its router is softmax)"),
              (moe.first_dense != 0, f"model.moe.first_dense={moe.first_dense} (not mapped to mlp_only_layers: 0)")]
    if arch == "Qwen3MoeForCausalLM":
        problems = common + [
            (moe.shared_experts != 0, f"model.moe.shared_experts={moe.shared_experts} (Qwen3-MoE has none: 0)"),
            (m.qkv_bias, "model.qkv_bias=true (Qwen3-MoE's attention has no biases)"),
            (not m.qk_norm, "model.qk_norm=false (Qwen3-MoE normalises q and k: true)"),
        ]
    else:
        problems = common + [
            (moe.shared_experts == 0, "model.moe.shared_experts=0 (Qwen2-MoE has a shared expert)"),
            (not moe.shared_gate, "model.moe.shared_gate=false (Qwen2-MoE gates its shared expert: true)"),
            (m.qk_norm, "model.qk_norm=true (Qwen2-MoE's attention has no q/k norms)"),
            (m.sliding_window is not None, f"model.sliding_window={m.sliding_window} (not mapped for Qwen2-MoE)"),
        ]
    return next((what for bad, what in problems if bad), None)


def tensor_maps(m: ModelConfig, fused: bool = False) -> list[mapping.TensorMap]:
    """Every parameter of the Qwen-MoE-shaped model ``m``; ``fused``: the experts as transformers 5 holds them in
    memory (import only)."""
    TM, every = mapping.TensorMap, m.moe.every
    layer, path = "model.layers.{i}.", ("blocks", "moe", "mlp")
    if fused:
        experts = mapping.fused_expert_maps(layer)
    else:
        experts = mapping.expert_maps(layer)
    if m.moe.shared_experts:
        experts += [TM(layer + f"mlp.shared_expert.{p}_proj.weight", (*path, "shared", p, "kernel"), True, (1,),
                       (0,)) for p in ("gate", "up", "down")]
    if m.moe.shared_gate:  # [1, d] = shared_gate [d, 1] transposed
        experts.append(TM(layer + "mlp.shared_expert_gate.weight", (*path, "shared_gate"), True, (1,), (0,)))
    moe_layer = [dataclasses.replace(tm, stride=every, offset=every - 1)
                 for tm in mapping.attention_maps(layer, ("blocks", "moe"), m) + experts]
    dense: list[mapping.TensorMap] = []
    if every > 1:
        block = ("blocks", "dense")
        mlp = [TM(layer + f"mlp.{p}_proj.weight", (*block, "mlp", p, "kernel"), True, (1,), (0,))
               for p in ("gate", "up", "down")]
        dense = [dataclasses.replace(tm, sublayers=True, stride=every)
                 for tm in mapping.attention_maps(layer, block, m) + mlp]
    before, after = mapping.outer_maps(m)
    return before + dense + moe_layer + after


def hf_config_from_model(m: ModelConfig, arch: str, *, eos_token_id=None, bos_token_id=None,
                         max_position_embeddings: int = 2048) -> dict:
    """The ``config.json`` of class ``arch`` (Qwen3-MoE or Qwen2-MoE) for the MoE model ``m``: the keys
    ``save_pretrained`` writes (rotary written both ways, as for Llama)."""
    moe = m.moe
    entries = {"architectures": [arch], "model_type": MODEL_TYPES[arch],
               **mapping.decoder_config_entries(m, m.d_ff, max_position_embeddings),
               "moe_intermediate_size": m.expert_d_ff, "decoder_sparse_step": moe.every, "mlp_only_layers": [],
               "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.normalize, "output_router_logits": False,
               "router_aux_loss_coef": moe.aux_loss}
    if arch == "Qwen3MoeForCausalLM":
        entries.update({"num_local_experts": moe.experts, "attention_bias": False,
                        "use_sliding_window": m.sliding_window is not None, "sliding_window": m.sliding_window})
    else:
        entries.update({"num_experts": moe.experts, "qkv_bias": m.qkv_bias,
                        "shared_expert_intermediate_size": moe.shared_experts * m.expert_d_ff,
                        "use_sliding_window": False, "sliding_window": 0, "max_window_layers": m.n_layers,
                        "layer_types": ["full_attention"] * m.n_layers})
    return {**entries, "pad_token_id": None, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
