"""Hugging Face DeepSeek-V3 checkpoints (``DeepseekV3ForCausalLM``) in and out: ``config.json`` <-> the ModelConfig
of jaxtrain's decoder with multi-head latent attention (:mod:`jaxtrain.models.mla`) and DeepSeek routing
(:mod:`jaxtrain.models.routing`), safetensors <-> its parameters.

``config.json`` -> ``model.*``: ``kv_lora_rank``, ``q_lora_rank`` (null: queries projected directly),
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` as named; every head has its own k and v
(``n_kv_heads`` = ``n_heads``; transformers' MLA ignores ``num_key_value_heads``). MoE layers: ``n_routed_experts``
experts of ``moe_intermediate_size`` (``moe.experts``, ``moe.d_ff``), the top ``num_experts_per_tok`` of sigmoid
scores (``moe.router=sigmoid``) chosen with ``e_score_correction_bias`` (``moe.expert_bias``) within the
``topk_group`` best of ``n_group`` groups, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
``n_shared_experts`` always-on experts of the same width (``moe.shared_experts``, ungated); dropless. The first
``first_k_dense_replace`` layers (``moe.first_dense``) are dense MLPs of ``intermediate_size`` (``model.d_ff``),
parameters ``first_dense`` [i]; MoE layer k + g is ``blocks.moe`` [g]; with ``first_k_dense_replace`` at least
``num_hidden_layers`` the model is dense (``blocks`` [i]). Tensors of layer i (expert j), as ``save_pretrained``
writes them (dense layers: ``mlp.{gate,up,down}_proj.weight``):

    self_attn.q_proj.weight [h (nope + rope), d]     -> attn.latent.q.kernel [d, h, nope + rope]  (rope rows *)
    self_attn.q_a_proj.weight [q_lora, d]             -> attn.latent.q_a.kernel                     (transposed)
    self_attn.q_a_layernorm.weight [q_lora]           -> attn.latent.q_a_norm.scale
    self_attn.q_b_proj.weight [h (nope + rope), q_lora] -> attn.latent.q_b.kernel [q_lora, h, nope + rope] (*)
    self_attn.kv_a_proj_with_mqa.weight [r + rope, d]  -> attn.latent.kv_a.kernel [d, r + rope]     (rope rows *)
    self_attn.kv_a_layernorm.weight [r]               -> attn.latent.kv_a_norm.scale
    self_attn.kv_b_proj.weight [h (nope + v), r]      -> attn.latent.kv_b.kernel [r, h, nope + v]
    self_attn.o_proj.weight [d, h v]                  -> attn.latent.o.kernel [h, v, d]
    mlp.gate.weight [E, d], mlp.gate.e_score_correction_bias [E] -> mlp.router [d, E], mlp.expert_bias [E]
    mlp.experts.{j}.{gate,up,down}_proj.weight        -> mlp.w_gate, w_up, w_down [j]              (transposed)
    mlp.shared_experts.{gate,up,down}_proj.weight     -> mlp.shared.{gate,up,down}.kernel          (transposed)

(*) DeepSeek's checkpoints (``rope_interleave: true``) rotate interleaved pairs; jaxtrain's rotary is half-split, so
the rotary rows are de-interleaved on import (:func:`jaxtrain.models.mla.deinterleave_rope`) and interleaved back
on export, which always writes ``rope_interleave: true``. Import also reads ``rope_interleave: false`` (no permutation)
and transformers 5's fused expert names. Multi-token-prediction layers (``num_nextn_predict_layers``, stored as
``model.layers.{num_hidden_layers + k}``) are skipped on import with one log line; the export writes none.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection

import numpy as np

from jaxtrain import log
from jaxtrain.config import ModelConfig
from jaxtrain.errors import ConfigError
from jaxtrain.hf import mapping
from jaxtrain.models.mla import deinterleave_rope

ARCHITECTURE = mapping.DEEPSEEK_ARCHITECTURE
MODEL_TYPE = "deepseek_v3"
# transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm use it whatever rms_norm_eps says, while
# jaxtrain's latent norms use model.norm_eps like every other norm; the two agree only at this value.
LATENT_EPS = 1e-6
# Fields of DeepSeek's own (trust_remote_code) config.json with the one value transformers' class implements.
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_deepseek(hf: dict) -> bool:
    """Whether a ``config.json`` is DeepSeek-V3's (its ``architectures``, else its ``model_type``)."""
    archs = hf.get("architectures") or []
    return ARCHITECTURE in archs or (not archs and hf.get("model_type") == MODEL_TYPE)


def _int(hf: dict, key: str, default, low: int = 1) -> int:
    """``hf[key]`` (``default`` if absent): an integer >= ``low``, else a ConfigError naming it."""
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key}={value!r} in config.json must be an integer >= {low}")
    return value


def mtp_layers(hf: dict) -> int:
    """How many multi-token-prediction layers the checkpoint stores after the decoder's: ``num_nextn_predict_layers``
    (``num_mtp_layers``, its alias in transformers), 1 when absent as transformers reads it."""
    key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf or "num_mtp_layers" not in hf else (
        "num_mtp_layers")
    return _int(hf, key, 1, low=0)


def _refuse(hf: dict) -> None:
    """ConfigError naming the first ``config.json`` value jaxtrain's DeepSeek-V3 cannot represent exactly."""
    mapping.check_common(hf)
    if hf.get("quantization_config"):
        method = (hf["quantization_config"] or {}).get("quant_method", "?")
        raise ConfigError(f"unsupported feature: quantization_config (quant_method={method!r}) in config.json; "
                          "jaxtrain reads unquantized weights (dequantize the checkpoint to bfloat16 first)")
    if hf.get("attention_bias"):
        raise ConfigError(f"unsupported feature: attention biases (attention_bias={hf['attention_bias']!r} in "
                          "config.json)")
    for key, value in _FIXED.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"unsupported feature: {key}={hf[key]!r} in config.json (supported: {value!r})")
    eps = hf.get("rms_norm_eps", LATENT_EPS)
    if eps != LATENT_EPS:
        raise ConfigError(f"unsupported feature: rms_norm_eps={eps!r} in config.json: transformers' DeepSeek-V3 "
                          f"latent norms use {LATENT_EPS:g} whatever it says, jaxtrain's model.norm_eps is one "
                          f"epsilon for every norm; only rms_norm_eps={LATENT_EPS:g} maps exactly")
    if not isinstance(hf.get("rope_interleave", True), bool):
        raise ConfigError(f"rope_interleave={hf['rope_interleave']!r} in config.json must be true or false")


def model_fields_from_hf(hf: dict) -> dict:
    """ModelConfig field values (dotted ``model.*`` keys) for a DeepSeek-V3 ``config.json``; ConfigError naming the
    first field whose value jaxtrain cannot represent (quantized weights, attention biases, rms_norm_eps other than
    1e-6, yarn rope scaling, ...)."""
    _refuse(hf)
    fields = mapping.decoder_fields(hf)
    q_lora = hf.get("q_lora_rank", 1536)
    fields.update({
        "model.head_dim": None,  # config.json's head_dim is the rotary width (qk_rope_head_dim)
        "model.n_kv_heads": fields["model.n_heads"],
        "model.kv_lora_rank": _int(hf, "kv_lora_rank", 512),
        "model.q_lora_rank": None if q_lora is None else _int(hf, "q_lora_rank", 1536),
        "model.qk_nope_head_dim": _int(hf, "qk_nope_head_dim", 128),
        "model.qk_rope_head_dim": _int(hf, "qk_rope_head_dim", 64),
        "model.v_head_dim": _int(hf, "v_head_dim", 128),
        "model.qkv_bias": False, "model.qk_norm": False, "model.sliding_window": None,
    })
    mtp_layers(hf)
    dense = _int(hf, "first_k_dense_replace", 3, low=0)
    if dense >= fields["model.n_layers"]:
        return {**fields, "model.moe.experts": 0}  # every layer a dense MLP: no MoE layer to describe
    return {**fields, **_moe_fields(hf), "model.moe.first_dense": dense}


def _moe_fields(hf: dict) -> dict:
    """The ``model.moe.*`` fields of a DeepSeek-V3 ``config.json`` with MoE layers."""
    experts = _int(hf, "n_routed_experts", 256)
    top_k = _int(hf, "num_experts_per_tok", 8)
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} in config.json must be in 1..{experts} (n_routed_experts)")
    norm = hf.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"norm_topk_prob={norm!r} in config.json must be true or false")
    scale = hf.get("routed_scaling_factor", 2.5)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ConfigError(f"routed_scaling_factor={scale!r} in config.json must be a positive number")
    return {
        "model.moe.experts": experts,
        "model.moe.top_k": top_k,
        "model.moe.d_ff": _int(hf, "moe_intermediate_size", 2048),
        "model.moe.shared_experts": _int(hf, "n_shared_experts", 1),
        "model.moe.shared_gate": False,
        "model.moe.every": 1,
        "model.moe.router": "sigmoid",
        "model.moe.normalize": norm,
        "model.moe.routed_scaling_factor": float(scale),
        "model.moe.n_group": _int(hf, "n_group", 8) if hf.get("n_group", 8) is not None else 1,
        "model.moe.topk_group": _int(hf, "topk_group", 4) if hf.get("topk_group", 4) is not None else 1,
        "model.moe.expert_bias": True,
        # For fine-tuning, DeepSeek-V3's training recipe (arXiv 2412.19437, section 4.2): the bias moves by 0.001 a
        # step, the sequence-wise balance loss weighs 1e-4, no other balance loss; transformers trains neither.
        "model.moe.bias_update_rate": 0.001,
        "model.moe.seq_aux_loss": 0.0001,
        "model.moe.aux_loss": 0.0,
        "model.moe.z_loss": 0.0,
        "model.moe.capacity_factor": 0.0,  # dropless, as transformers runs it
    }


def problem(m: ModelConfig) -> str | None:
    """None if ``DeepseekV3ForCausalLM`` holds the MLA model ``m`` exactly, else the first setting it cannot hold."""
    moe = m.moe
    problems = [
        (not m.mla, "model.kv_lora_rank=null (DeepSeek-V3's attention is multi-head latent attention)"),
        (m.norm_eps != LATENT_EPS, f"model.norm_eps={m.norm_eps:g} (transformers' latent norms use {LATENT_EPS:g})"),
        (m.sliding_window is not None, f"model.sliding_window={m.sliding_window} (DeepSeek-V3 has no window)"),
    ]
    if moe.experts:
        problems += [
            (moe.router != "sigmoid", f"model.moe.router={moe.router} (DeepSeek-V3's is sigmoid)"),
            (not moe.expert_bias, "model.moe.expert_bias=false (DeepSeek-V3 chooses with e_score_correction_bias)"),
            (moe.every != 1, f"model.moe.every={moe.every} (DeepSeek-V3 routes every layer after the dense ones: 1)"),
            (moe.shared_experts < 1, "model.moe.shared_experts=0 (DeepSeek-V3 has n_shared_experts >= 1)"),
            (moe.shared_gate, "model.moe.shared_gate=true (DeepSeek-V3's shared experts are ungated)"),
        ]
    return next((what for bad, what in problems if bad), None)


def check_exportable(m: ModelConfig) -> None:
    """ConfigError naming the first setting of the MLA model ``m`` that a DeepSeek-V3 checkpoint cannot hold."""
    what = problem(m)
    if what is not None:
        raise ConfigError(f"this model has no Hugging Face (DeepseekV3ForCausalLM) form: {what}")


# ---------------------------------------------------------------------------------------------------------------
# Tensors


@dataclasses.dataclass(frozen=True)
class RopeRows(mapping.TensorMap):
    """A :class:`jaxtrain.hf.mapping.TensorMap` whose Hugging Face matrix has its rows in blocks of ``nope + rope``
    (one per head; one block for kv_a) with the last ``rope`` of each block in DeepSeek's interleaved rotary order:
    the parameter holds them de-interleaved (half-split)."""

    nope: int = 0
    rope: int = 0

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Per-layer parameter -> Hugging Face tensor, its rotary rows interleaved again."""
        w = super().to_hf(x)
        order = deinterleave_rope(np.arange(self.nope + self.rope), self.nope, self.rope)
        blocks = w.reshape(-1, self.nope + self.rope, *w.shape[1:])
        return np.ascontiguousarray(blocks[:, np.argsort(order)].reshape(w.shape))


class _Deinterleaved:
    """A safetensors slice of a :class:`RopeRows` tensor, read as if its rotary rows were half-split: a row range
    is read widened to whole blocks, de-interleaved, and cut back."""

    def __init__(self, tensor, nope: int, rope: int):
        self.tensor, self.nope, self.rope = tensor, nope, rope

    def __getitem__(self, index) -> np.ndarray:
        rows, *rest = index if isinstance(index, tuple) else (index,)
        block = self.nope + self.rope
        lo, hi = rows.start // block * block, -(-rows.stop // block) * block
        raw = self.tensor[(slice(lo, hi), *rest)]
        return deinterleave_rope(raw, self.nope, self.rope, axis=0)[rows.start - lo:rows.stop - lo]


class Tensors(mapping.SafetensorsDir):
    """A DeepSeek-V3 directory's tensors (:class:`jaxtrain.hf.mapping.SafetensorsDir`) less its multi-token-prediction
    layers, which are skipped with one log line; :class:`RopeRows` tensors read de-interleaved."""

    def __init__(self, src: str, hf: dict):
        super().__init__(src)
        n, extra = hf["num_hidden_layers"], mtp_layers(hf)
        mtp = sorted(name for name in self.shapes if (m := _LAYER.match(name)) and n <= int(m[1]) < n + extra)
        for name in mtp:
            del self.where[name], self.shapes[name], self.dtypes[name]
        if mtp:
            layers = sorted({int(_LAYER.match(name)[1]) for name in mtp})  # type: ignore[index]
            log.info(f"skipped {len(mtp)} tensors of {len(layers)} multi-token-prediction layer(s) (model.layers."
                     f"{','.join(map(str, layers))}, num_nextn_predict_layers={extra}): jaxtrain has no MTP module")

    def read(self, tm: mapping.TensorMap, key: tuple[int, ...], shape: tuple[int, ...],
             index: tuple[slice, ...]) -> np.ndarray:
        if not isinstance(tm, RopeRows):
            return super().read(tm, key, shape, index)
        name = tm.name(*key)
        with self._open(self.where[name], framework="numpy") as f:
            return mapping.read_block(tm, _Deinterleaved(f.get_slice(name), tm.nope, tm.rope), shape, index)


def attention_maps(layer: str, block: tuple[str, ...], m: ModelConfig, interleaved: bool) -> list[mapping.TensorMap]:
    """A layer's MLA weights and norms: Hugging Face names ``layer`` + ..., parameters under the stacked ``block``;
    ``interleaved``: the checkpoint's rotary rows are DeepSeek's interleaved pairs (``rope_interleave``)."""
    TM, attn = mapping.TensorMap, (*block, "attn", "latent")
    assert m.kv_lora_rank is not None

    def rope(hf: str, path: tuple[str, ...], rows: tuple[int, ...], nope: int) -> mapping.TensorMap:
        if not interleaved:
            return TM(layer + hf, path, True, rows, (0,))
        return RopeRows(layer + hf, path, True, rows, (0,), nope=nope, rope=m.qk_rope_head_dim)

    if m.q_lora_rank is None:  # q: W [h (nope + rope), d]; kernel [d, h, nope + rope]
        queries = [rope("self_attn.q_proj.weight", (*attn, "q", "kernel"), (1, 2), m.qk_nope_head_dim)]
    else:
        queries = [TM(layer + "self_attn.q_a_proj.weight", (*attn, "q_a", "kernel"), True, (1,), (0,)),
                   TM(layer + "self_attn.q_a_layernorm.weight", (*attn, "q_a_norm", "scale"), True, (0,), ()),
                   rope("self_attn.q_b_proj.weight", (*attn, "q_b", "kernel"), (1, 2), m.qk_nope_head_dim)]
    return queries + [
        rope("self_attn.kv_a_proj_with_mqa.weight", (*attn, "kv_a", "kernel"), (1,), m.kv_lora_rank),
        TM(layer + "self_attn.kv_a_layernorm.weight", (*attn, "kv_a_norm", "scale"), True, (0,), ()),
        TM(layer + "self_attn.kv_b_proj.weight", (*attn, "kv_b", "kernel"), True, (1, 2), (0,)),
        TM(layer + "self_attn.o_proj.weight", (*attn, "o", "kernel"), True, (2,), (0, 1)),
        TM(layer + "input_layernorm.weight", (*block, "attn_norm", "scale"), True, (0,), ()),
        TM(layer + "post_attention_layernorm.weight", (*block, "mlp_norm", "scale"), True, (0,), ()),
    ]


def _mlp_maps(prefix: str, path: tuple[str, ...]) -> list[mapping.TensorMap]:
    """A SwiGLU MLP's ``{gate,up,down}_proj.weight`` [out, in] -> ``path.{gate,up,down}.kernel`` [in, out]."""
    return [mapping.TensorMap(prefix + f"{p}_proj.weight", (*path, p, "kernel"), True, (1,), (0,))
            for p in ("gate", "up", "down")]


def tensor_maps(m: ModelConfig, names: Collection[str] = (), interleaved: bool = True) -> list[mapping.TensorMap]:
    """Every parameter (and the expert bias) of the MLA model ``m`` as a DeepSeek-V3 checkpoint holds it, in Hugging
    Face's usual order; ``names``: the checkpoint's tensor names (import reads the fused expert layout when they have
    it); ``interleaved``: as :func:`attention_maps`."""
    check_exportable(m)
    layer = "model.layers.{i}."
    before, after = mapping.outer_maps(m)
    if not m.moe.experts:
        return before + attention_maps(layer, ("blocks",), m, interleaved) + _mlp_maps(
            layer + "mlp.", ("blocks", "mlp")) + after
    TM, path = mapping.TensorMap, ("blocks", "moe", "mlp")
    fused = any(name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for name in names)
    if fused:
        experts = mapping.fused_expert_maps(layer)
    else:
        experts = mapping.expert_maps(layer)
    experts += [TM(layer + "mlp.gate.e_score_correction_bias", (*path, "expert_bias"), True, (0,), ()),
                *_mlp_maps(layer + "mlp.shared_experts.", (*path, "shared"))]
    k = m.moe.first_dense  # Hugging Face layers 0..k-1 are first_dense [i], layer k + g is blocks.moe [g]
    moe_layers = [dataclasses.replace(tm, offset=k) for tm in attention_maps(layer, ("blocks", "moe"), m, interleaved)
                  + experts]
    dense = attention_maps(layer, ("first_dense",), m, interleaved) + _mlp_maps(layer + "mlp.", ("first_dense", "mlp"))
    return before + (dense if k else []) + moe_layers + after


# ---------------------------------------------------------------------------------------------------------------
# config.json


def hf_config_from_model(m: ModelConfig, *, eos_token_id=None, bos_token_id=None, max_position_embeddings: int = 2048,
                         output_router_logits: bool = False) -> dict:
    """The ``config.json`` of a ``DeepseekV3ForCausalLM`` holding the MLA model ``m``: the keys ``save_pretrained``
    writes (rotary written both ways, as for Llama), ``rope_interleave: true`` (the tensors are written interleaved)
    and ``num_nextn_predict_layers: 0`` (no MTP layers are written). A dense ``m`` is every layer dense
    (``first_k_dense_replace`` = the layer count, the MoE fields then unused)."""
    check_exportable(m)
    moe = m.moe
    routed = {"n_routed_experts": moe.experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size":
              m.expert_d_ff, "n_shared_experts": moe.shared_experts, "n_group": moe.n_group,
              "topk_group": moe.topk_group, "norm_topk_prob": moe.normalize,
              "routed_scaling_factor": moe.routed_scaling_factor, "first_k_dense_replace": moe.first_dense}
    if not moe.experts:  # transformers builds no MoE layer; these only need to be valid
        routed = {"n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": m.d_ff,
                  "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                  "routed_scaling_factor": 1.0, "first_k_dense_replace": m.n_layers}
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            **mapping.decoder_config_entries(m, m.d_ff, max_position_embeddings),
            "head_dim": m.qk_rope_head_dim,  # transformers sets it so: the width its rotary frequencies are for
            "num_key_value_heads": m.n_heads, "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "qk_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": True,
            "attention_bias": False, "pretraining_tp": 1, "num_nextn_predict_layers": 0,
            "output_router_logits": output_router_logits, **routed,
            "pad_token_id": None, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
