"""Hugging Face Mixtral checkpoints (``MixtralForCausalLM``) in and out: ``config.json`` <-> the MoE ModelConfig,
per-expert safetensors tensors <-> the stacked expert parameters of :mod:`jaxtrain.models.moe`.

Mixtral is jaxtrain's MoE model with ``model.moe.every=1`` (every layer routed), softmax routing renormalised over
the top k, no shared experts: its attention, norms, embeddings and rotary are Llama's (:mod:`.mapping`). Tensors,
per layer i and expert j, in the layout Hub checkpoints have and transformers' ``save_pretrained`` writes
(transformers 5 fuses the experts in memory but saves them per expert):

    model.layers.{i}.block_sparse_moe.gate.weight          [E, d]  -> blocks.moe.mlp.router [i]      (transposed)
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight [f, d] -> blocks.moe.mlp.w_gate [i, j]   (transposed)
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight [f, d] -> blocks.moe.mlp.w_up [i, j]     (transposed)
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight [d, f] -> blocks.moe.mlp.w_down [i, j]   (transposed)

Import also reads transformers 5's fused names (``mlp.gate.weight``, ``mlp.experts.gate_up_proj [E, 2f, d]``: w1
then w3 of each expert, ``mlp.experts.down_proj [E, d, f]``), as in a state_dict saved without save_pretrained.

Qwen3-MoE and Qwen2-MoE: :mod:`.qwen_moe`; this module picks the class (:func:`moe_architecture`) and the maps.
"""

from __future__ import annotations

from collections.abc import Collection

from jaxtrain.config import ModelConfig
from jaxtrain.errors import ConfigError
from jaxtrain.hf import deepseek, families, mapping, qwen_moe

ARCHITECTURES = mapping.MOE_ARCHITECTURES
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # transformers 5's in-memory names


def model_fields(hf: dict) -> dict:
    """ModelConfig field values for any ``config.json`` :mod:`jaxtrain.hf` reads: Mixtral's here, Qwen3-MoE's and
    Qwen2-MoE's from :mod:`.qwen_moe`, DeepSeek-V3's from :mod:`.deepseek`, the dense ones' from
    :func:`jaxtrain.hf.mapping.model_fields_from_hf`; ConfigError naming what does not fit."""
    if deepseek.is_deepseek(hf):
        return deepseek.model_fields_from_hf(hf)
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    qwen = next((a for a in archs if a in qwen_moe.MODEL_TYPES), None)
    if qwen is not None:
        return qwen_moe.model_fields_from_hf(hf, qwen)
    if any(a in ARCHITECTURES for a in archs):
        return model_fields_from_hf(hf)
    return mapping.model_fields_from_hf(hf)


def moe_architecture(m: ModelConfig, preferred: str | None = None) -> str:
    """The Hugging Face MoE class that holds the MoE model ``m``: ``preferred`` (the class it was imported from)
    where it can, else the first of Mixtral, Qwen3-MoE, Qwen2-MoE that can; ConfigError naming, for each, the
    first setting it cannot hold."""
    why = {"MixtralForCausalLM": mixtral_problem(m),
           **{arch: qwen_moe.fits(m, arch) for arch in qwen_moe.MODEL_TYPES}}
    if preferred in why and why[preferred] is None:
        return preferred
    for arch, problem in why.items():
        if problem is None:
            return arch
    raise ConfigError("this MoE model has no Hugging Face form: " + "; ".join(f"{a}: {p}" for a, p in why.items()))


def tensor_maps_for(m: ModelConfig, names: Collection[str] = (), interleaved: bool = True) -> list[mapping.TensorMap]:
    """Every parameter of the model ``m``, dense or MoE (in the class :func:`moe_architecture` picks; DeepSeek-V3's,
    the only class with multi-head latent attention, for an MLA model, ``interleaved`` its ``rope_interleave``);
    ``names``: the tensor names of the checkpoint to read (an MoE import reads the fused layout when they have it)."""
    if m.mla:
        return deepseek.tensor_maps(m, names, interleaved)
    if not m.moe.experts:
        return mapping.tensor_maps(m)
    if moe_architecture(m) == "MixtralForCausalLM":
        return tensor_maps(m, fused=is_fused(names))
    return qwen_moe.tensor_maps(m, fused=is_fused(names))


def hf_config(m: ModelConfig, *, architecture: str | None = None, output_router_logits: bool = False, **kw) -> dict:
    """``config.json`` for the model ``m``, dense (the class :func:`jaxtrain.hf.mapping.dense_architecture` picks,
    preferring ``architecture``) or MoE (:func:`moe_architecture`'s, with ``output_router_logits`` as the imported
    config had it), or DeepSeek-V3 for an MLA model; ``kw`` as :func:`hf_config_from_model`."""
    if m.mla:
        return deepseek.hf_config_from_model(m, output_router_logits=output_router_logits, **kw)
    if m.moe.experts:
        arch = moe_architecture(m, architecture)
        config = (hf_config_from_model(m, **kw) if arch == "MixtralForCausalLM"
                  else qwen_moe.hf_config_from_model(m, arch, **kw))
        return {**config, "output_router_logits": output_router_logits}
    return mapping.hf_config_from_model(m, architecture=architecture, **kw)


def model_fields_from_hf(hf: dict) -> dict:
    """ModelConfig field values (dotted ``model.*`` keys) for a Hugging Face Mixtral ``config.json``; ConfigError
    naming the first feature jaxtrain cannot represent (sliding windows, biases, an expert count or top-k out of
    range, activations other than SiLU)."""
    mapping.check_common(hf)
    families.refuse_attention_options(hf)
    experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    if not isinstance(experts, int) or experts < 1:
        raise ConfigError(f"num_local_experts={experts!r} in config.json must be a positive integer")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok={top_k!r} in config.json must be in 1..{experts} "
                          "(num_local_experts)")
    fields = mapping.decoder_fields(hf)
    fields.update({
        "model.moe.experts": experts,
        "model.moe.top_k": top_k,
        "model.moe.d_ff": hf["intermediate_size"],
        "model.moe.every": 1,
        "model.moe.shared_experts": 0,
        "model.moe.shared_gate": False,
        "model.moe.router": "softmax",
        "model.moe.normalize": True,
        "model.moe.capacity_factor": 0.0,  # Mixtral is dropless
        # Mixtral's training weight of the load-balancing loss (transformers adds it with output_router_logits) and
        # the form it weighs: load_balancing_loss_func pools the counts over layers (model.moe.balance_loss=pooled).
        "model.moe.aux_loss": float(hf.get("router_aux_loss_coef", 0.001)),
        "model.moe.balance_loss": "pooled",
        "model.moe.z_loss": 0.0,
    })
    return fields


def is_fused(names: Collection[str]) -> bool:
    """Whether a checkpoint with tensors ``names`` holds Mixtral's experts fused (transformers 5's in-memory
    names, e.g. a state_dict saved directly) rather than per expert (what save_pretrained and the Hub have)."""
    return any(name.endswith(_FUSED) for name in names)


def tensor_maps(m: ModelConfig, fused: bool = False) -> list[mapping.TensorMap]:
    """Every parameter of the Mixtral-shaped model ``m``, in Hugging Face's usual tensor order; ``fused``: the
    experts as transformers 5 holds them in memory (import only)."""
    check_exportable(m)
    layer = "model.layers.{i}."
    path = ("blocks", "moe", "mlp")
    TM = mapping.TensorMap
    if fused:
        experts = mapping.fused_expert_maps(layer)
    else:
        # router [d, E] = gate.weight [E, d] transposed; w_gate, w_up [d, f] = w1, w3 [f, d] transposed; w_down
        # [f, d] = w2 [d, f] transposed.
        moe = layer + "block_sparse_moe."
        experts = [
            TM(moe + "gate.weight", (*path, "router"), True, (1,), (0,)),
            TM(moe + "experts.{j}.w1.weight", (*path, "w_gate"), True, (1,), (0,), experts=True),
            TM(moe + "experts.{j}.w2.weight", (*path, "w_down"), True, (1,), (0,), experts=True),
            TM(moe + "experts.{j}.w3.weight", (*path, "w_up"), True, (1,), (0,), experts=True),
        ]
    before, after = mapping.outer_maps(m)
    return before + mapping.attention_maps(layer, ("blocks", "moe")) + experts + after


def mixtral_problem(m: ModelConfig) -> str | None:
    """The first setting of ``m`` (an MoE model) that a Mixtral checkpoint cannot hold, or None."""
    moe = m.moe
    problems = [
        (moe.every != 1, f"model.moe.every={moe.every} (Mixtral routes every layer: 1)"),
        (moe.first_dense != 0, f"model.moe.first_dense={moe.first_dense} (Mixtral routes every layer: 0)"),
        (moe.shared_experts != 0, f"model.moe.shared_experts={moe.shared_experts} (Mixtral has none: 0)"),
        (moe.router != "softmax", f"model.moe.router={moe.router} (Mixtral's is softmax)"),
        (not moe.normalize, "model.moe.normalize=false (Mixtral renormalises the top-k weights: true)"),
        (m.qkv_bias, "model.qkv_bias=true (Mixtral's attention has no biases)"),
        (m.qk_norm, "model.qk_norm=true (Mixtral's attention has no q/k norms)"),
        (m.sliding_window is not None, f"model.sliding_window={m.sliding_window} (not mapped for Mixtral)"),
    ]
    return next((what for bad, what in problems if bad), None)


def check_exportable(m: ModelConfig) -> None:
    """ConfigError naming the first setting of ``m`` (an MoE model) that a Mixtral checkpoint cannot hold."""
    problem = mixtral_problem(m)
    if problem is not None:
        raise ConfigError(f"this MoE model has no Hugging Face (Mixtral) form: {problem}")


def hf_config_from_model(m: ModelConfig, *, eos_token_id=None, bos_token_id=None,
                         max_position_embeddings: int = 2048) -> dict:
    """The ``config.json`` of a ``MixtralForCausalLM`` with the shapes of the MoE model ``m`` (rotary written both
    ways, as for Llama: :func:`jaxtrain.hf.mapping.hf_config_from_model`)."""
    check_exportable(m)
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            **mapping.decoder_config_entries(m, m.expert_d_ff, max_position_embeddings),
            "sliding_window": None, "num_local_experts": m.moe.experts, "num_experts_per_tok": m.moe.top_k,
            "output_router_logits": False, "router_aux_loss_coef": m.moe.aux_loss, "router_jitter_noise": 0.0,
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
