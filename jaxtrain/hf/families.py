"""The dense Hugging Face classes as options of jaxtrain's one decoder (:mod:`jaxtrain.models.llama`): which
``model.*`` options each class's ``config.json`` sets, and which class holds a given model on export.

    LlamaForCausalLM    (llama)    the plain decoder
    MistralForCausalLM  (mistral)  + model.sliding_window = sliding_window (every layer)
    Qwen2ForCausalLM    (qwen2)    + model.qkv_bias: self_attn.{q,k,v}_proj.bias [heads * head_dim] (o_proj has none);
                                     Qwen2.5 is the same class
    Qwen3ForCausalLM    (qwen3)    + model.qk_norm: self_attn.{q,k}_norm.weight [head_dim], before rotary

Qwen's sliding window (``use_sliding_window``) is taken where it covers every layer (``layer_types`` all
``sliding_attention``, i.e. ``max_window_layers=0``) and refused where it covers some layers only. The tensors
themselves: :mod:`.mapping`.
"""

from __future__ import annotations

from jaxtrain.config import ModelConfig
from jaxtrain.errors import ConfigError

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def refuse_attention_options(hf: dict) -> None:
    """ConfigError for attention biases or a sliding window in a config.json whose mapping has neither (Mixtral)."""
    if hf.get("attention_bias"):
        raise ConfigError(f"unsupported feature: attention biases (attention_bias={hf['attention_bias']!r} in "
                          "config.json)")
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):
        raise ConfigError(f"unsupported feature: sliding-window attention (sliding_window={hf['sliding_window']})")


def attention_fields(hf: dict, arch: str) -> dict:
    """``model.qkv_bias``, ``model.qk_norm`` and ``model.sliding_window`` of the dense architecture ``arch``."""
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):  # Qwen2 has no such field: its q/k/v biases are fixed
        raise ConfigError(f"unsupported feature: attention biases on q, k, v and o_proj (attention_bias="
                          f"{hf['attention_bias']!r} in config.json); jaxtrain's are on q, k and v only, as Qwen2's "
                          "(model.qkv_bias)")
    return {"model.qkv_bias": arch == "Qwen2ForCausalLM", "model.qk_norm": arch == "Qwen3ForCausalLM",
            "model.sliding_window": sliding_window(hf, arch)}


def sliding_window(hf: dict, arch: str) -> int | None:
    """The window every layer attends in (None: full causal attention), as transformers reads ``config.json``:
    Mistral's ``sliding_window`` on all layers; Qwen's only with ``use_sliding_window``, on the layers ``layer_types``
    names ``sliding_attention`` (by default those from ``max_window_layers`` on). A window on some layers only is
    refused: jaxtrain's applies to every layer."""
    window = hf.get("sliding_window")
    if arch == "LlamaForCausalLM":
        return None  # Llama's attention has no window, whatever the file says
    if arch in _QWEN:
        window = window if hf.get("use_sliding_window", False) else None
        n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
        types = hf.get("layer_types") or ["sliding_attention" if window is not None and i >= first
                                          else "full_attention" for i in range(n)]
        odd = sorted(set(types) - {"sliding_attention", "full_attention"})
        if odd:
            raise ConfigError(f"unsupported feature: layer_types {odd[0]!r} in config.json (supported: "
                              "full_attention, sliding_attention)")
        sliding = sum(t == "sliding_attention" for t in types)
        if window is None or not sliding:
            return None
        if sliding != len(types):
            raise ConfigError(f"unsupported feature: a sliding window on {sliding} of {len(types)} layers "
                              f"(use_sliding_window=true, sliding_window={window}, max_window_layers="
                              f"{hf.get('max_window_layers')} in config.json); jaxtrain's model.sliding_window "
                              "covers every layer (max_window_layers=0)")
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"sliding_window={window!r} in config.json must be a positive integer or null")
    return window


def dense_architecture(m: ModelConfig, preferred: str | None = None) -> str:
    """The dense Hugging Face class that holds ``m``'s attention options: ``preferred`` (e.g. the class the model
    was imported from) where it can, else the first of Llama, Mistral, Qwen2, Qwen3 that can. ConfigError if none
    can (q/k/v biases with q/k norms)."""
    fits = {
        "LlamaForCausalLM": not (m.qkv_bias or m.qk_norm or m.sliding_window is not None),
        "MistralForCausalLM": not (m.qkv_bias or m.qk_norm),
        "Qwen2ForCausalLM": m.qkv_bias and not m.qk_norm,
        "Qwen3ForCausalLM": m.qk_norm and not m.qkv_bias,
    }
    if preferred is not None and fits.get(preferred):
        return preferred
    for arch, ok in fits.items():
        if ok:
            return arch
    raise ConfigError("this model has no Hugging Face form: model.qkv_bias=true with model.qk_norm=true (Qwen2 "
                      "has q/k/v biases without q/k norms, Qwen3 q/k norms without biases)")


def class_entries(m: ModelConfig, arch: str) -> dict:
    """The ``config.json`` entries of class ``arch`` beyond the decoder's shapes, as ``save_pretrained`` writes them:
    Llama's bias and tensor-parallel fields, Mistral's window, Qwen's window fields (every layer sliding, or none)
    and Qwen3's ``attention_bias``."""
    if arch == "LlamaForCausalLM":
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if arch == "MistralForCausalLM":
        return {"sliding_window": m.sliding_window}
    window = m.sliding_window is not None
    entries: dict = {"use_sliding_window": window, "sliding_window": m.sliding_window,
                     "max_window_layers": 0 if window else m.n_layers,
                     "layer_types": [("sliding_attention" if window else "full_attention")] * m.n_layers}
    return {**entries, "attention_bias": False} if arch == "Qwen3ForCausalLM" else entries
