"""Hugging Face dense checkpoints in and out: ``config.json`` <-> ModelConfig, safetensors <-> the model's parameters.

The dense families (Llama, Mistral, Qwen2/2.5, Qwen3) are one decoder with options, so each maps onto the same
parameters, plus its biases or q/k norm scales; which options each class's config.json sets: :mod:`.families`.

Both directions stream. Import builds each parameter with ``jax.make_array_from_callback``: every device shard reads
only its own slice of each layer's tensor from the (memory-mapped) safetensors files, so no host ever holds more than
one shard of one parameter beyond what its devices hold. Export restores one parameter at a time from the Orbax
checkpoint into the mesh's shardings and gathers it layer by layer into safetensors files of at most
``max_shard_bytes``; the host holds at most one file's tensors and one layer of one parameter.

Rotary layout: jaxtrain's rotary is half-split (``x[..., :d/2]`` pairs with ``x[..., d/2:]``), and so is the
``rotate_half`` of Hugging Face's Llama code; the q/k permutation in Hugging Face's own conversion script maps
Meta's interleaved checkpoints onto that layout. So Hugging Face q/k weights map onto jaxtrain's without a
permutation; tests/test_hf.py proves it against ``transformers``' logits (and fails if a permutation were applied).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from dataclasses import dataclass

import numpy as np

from jaxtrain.config import ModelConfig
from jaxtrain.errors import ConfigError, one_line
from jaxtrain.hf.families import MODEL_TYPES, attention_fields, class_entries, dense_architecture

ARCHITECTURES = tuple(MODEL_TYPES)  # the dense classes (jaxtrain.hf.families)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")  # jaxtrain.hf.moe_mapping
DEEPSEEK_ARCHITECTURE = "DeepseekV3ForCausalLM"  # jaxtrain.hf.deepseek (MLA, dense or MoE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
# Hugging Face's default max_shard_size for save_pretrained; published checkpoints use 5 GB shards.
MAX_SHARD_BYTES = 5 * 1000**3
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed from the config
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


# ---------------------------------------------------------------------------------------------------------------
# Config mapping


def read_hf_config(src: str) -> dict:
    """``SRC/config.json`` as a dict; ConfigError if SRC is not a Hugging Face model directory."""
    if not os.path.isdir(src):
        raise ConfigError(f"{src!r} is not a directory (expected a Hugging Face model directory)")
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{src!r} has no config.json; it is not a Hugging Face model directory")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {one_line(e)}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return hf


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling parameters or None), from transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters")
    scaling: dict | None
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3" or scaling is None:
        raise ConfigError(f"unsupported rope scaling {kind!r} in config.json (supported: llama3, or none)")
    return float(theta), {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")}


def check_common(hf: dict) -> None:
    """The checks every architecture mapped here shares: ConfigError naming the first feature jaxtrain's decoder
    lacks (MLP biases, partial rotary, split linear layers, activations other than SiLU)."""
    if hf.get("mlp_bias"):
        raise ConfigError(f"unsupported feature: MLP biases (mlp_bias={hf['mlp_bias']!r} in config.json)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported feature: hidden_act={hf['hidden_act']!r} (jaxtrain's MLP is SwiGLU, silu)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"unsupported feature: partial_rotary_factor={hf['partial_rotary_factor']}")
    if hf.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"unsupported feature: pretraining_tp={hf['pretraining_tp']} (split linear layers)")


def decoder_fields(hf: dict) -> dict:
    """The ModelConfig fields (dotted ``model.*`` keys) of the decoder around the MLPs: vocabulary, widths, heads,
    rotary, norms, embeddings and dtype, from a Llama-style ``config.json``."""
    need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in need if k not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    theta, scaling = _rope(hf)
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    fields = {
        "model.vocab_size": hf["vocab_size"],
        "model.d_model": hf["hidden_size"],
        "model.n_layers": hf["num_hidden_layers"],
        "model.n_heads": n_heads,
        "model.n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "model.head_dim": head_dim,
        "model.d_ff": hf["intermediate_size"],
        "model.rope_theta": theta,
        "model.norm_eps": hf.get("rms_norm_eps", 1e-6),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.param_dtype": _DTYPES.get(dtype, "float32"),
    }
    if scaling is not None:
        fields.update({"model.rope_scaling.type": "llama3", "model.rope_scaling.factor": scaling["factor"],
                       "model.rope_scaling.low_freq_factor": scaling["low_freq_factor"],
                       "model.rope_scaling.high_freq_factor": scaling["high_freq_factor"],
                       "model.rope_scaling.original_max_len": scaling["original_max_position_embeddings"]})
    return fields


def model_fields_from_hf(hf: dict) -> dict:
    """ModelConfig field values (dotted ``model.*`` keys) for a Hugging Face Llama, Mistral, Qwen2/2.5 or Qwen3
    ``config.json``; Mixtral's are :func:`jaxtrain.hf.moe_mapping.model_fields_from_hf`.

    Raises ConfigError naming the first unsupported architecture or feature (an output-projection bias, a sliding
    window on some layers only, MoE in a dense config, partial rotary, activations other than SiLU).
    """
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"unsupported architecture {', '.join(map(str, archs))} "
                          f"(supported: {', '.join((*ARCHITECTURES, *MOE_ARCHITECTURES, DEEPSEEK_ARCHITECTURE))})")
    for key in ("num_local_experts", "num_experts"):
        if hf.get(key):
            raise ConfigError(f"unsupported feature: mixture of experts ({key}={hf[key]!r} in config.json)")
    check_common(hf)
    return {**decoder_fields(hf), **attention_fields(hf, arch)}


def rope_entries(m: ModelConfig) -> tuple[dict, dict | None]:
    """(transformers 5's ``rope_parameters``, 4.x's ``rope_scaling`` or None) for ``m``'s rotary settings."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    scaling = None
    if m.rope_scaling.type == "llama3":
        scaling = {"rope_type": "llama3", "factor": m.rope_scaling.factor,
                   "low_freq_factor": m.rope_scaling.low_freq_factor,
                   "high_freq_factor": m.rope_scaling.high_freq_factor,
                   "original_max_position_embeddings": m.rope_scaling.original_max_len}
        rope = {**scaling, "rope_theta": m.rope_theta}
    return rope, scaling


def hf_config_from_model(m: ModelConfig, *, eos_token_id=None, bos_token_id=None,
                         max_position_embeddings: int = 2048, architecture: str | None = None) -> dict:
    """The ``config.json`` of the dense class that holds ``m`` (:func:`dense_architecture`, preferring
    ``architecture``) with the shapes of the dense model ``m``: the keys ``save_pretrained`` writes for that class
    (an MoE model's: :func:`jaxtrain.hf.moe_mapping.hf_config_from_model`).

    Rotary settings are written both ways, as transformers 5's ``rope_parameters`` and as 4.x's ``rope_theta`` /
    ``rope_scaling``, so that older readers (and serving tools that read the 4.x keys) get the same model.
    """
    arch = dense_architecture(m, architecture)
    return {"architectures": [arch], "model_type": MODEL_TYPES[arch],
            **decoder_config_entries(m, m.d_ff, max_position_embeddings), **class_entries(m, arch),
            "pad_token_id": None, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}


def decoder_config_entries(m: ModelConfig, intermediate_size: int, max_position_embeddings: int) -> dict:
    """The ``config.json`` entries Llama and Mixtral share: the decoder's shapes, rotary settings, norm, tying and
    initialisation, and the parameters' dtype."""
    rope, scaling = rope_entries(m)
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope,
        "rope_theta": m.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": m.init_std,
        "use_cache": True,
        "dtype": m.param_dtype,
    }


# ---------------------------------------------------------------------------------------------------------------
# Parameter mapping


@dataclass(frozen=True)
class TensorMap:
    """One Hugging Face tensor family <-> one jaxtrain parameter.

    ``hf``: the tensor name (``{i}``: layer index, ``{j}``: expert index). ``path``: the parameter's path in the
    model state. ``layered``: the parameter stacks the layers on a leading axis; ``experts``: then the experts on the
    next one (one Hugging Face tensor per layer and expert). The per-layer (per-expert) parameter is the Hugging Face
    matrix ``W [rows, cols]`` with its rows split into the parameter axes ``rows`` and its columns into ``cols``
    (row-major), then transposed into the parameter's axis order; a 1-D tensor has ``cols == ()``.

    ``part`` (k, n), for import only: the tensor holds all experts of a layer stacked on its first axis (no ``{j}``
    in the name; transformers 5's fused layout) and the matrix ``W`` is the k-th of n equal blocks of its rows.

    Layers grouped ``stride`` at a time (an MoE model with ``model.moe.every`` = stride): the parameter's layer g is
    Hugging Face layer ``g * stride + offset``; with ``sublayers`` its second stacked axis j is the group's dense
    layer j, Hugging Face layer ``g * stride + j``.
    """

    hf: str
    path: tuple[str, ...]
    layered: bool
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    experts: bool = False
    part: tuple[int, int] | None = None
    sublayers: bool = False
    stride: int = 1
    offset: int = 0

    @property
    def lead(self) -> int:
        """How many leading axes of the parameter index Hugging Face tensors (layers, sublayers or experts)."""
        return int(self.layered) + int(self.experts) + int(self.sublayers)

    def name(self, layer: int | None = None, second: int | None = None) -> str:
        """The tensor name of parameter index (layer, expert) or, with ``sublayers``, (group, dense layer)."""
        if layer is None:
            return self.hf.format(i=None, j=second)
        if self.sublayers:
            return self.hf.format(i=layer * self.stride + (second or 0))
        return self.hf.format(i=layer * self.stride + self.offset, j=second)

    def keys(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The (layer, expert) indices of the Hugging Face tensors of a parameter of shape ``shape``, in order
        (``[()]`` for a parameter without stacked axes)."""
        return list(itertools.product(*(range(n) for n in shape[:self.lead])))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for the per-layer parameter shape ``shape``."""
        rows = math.prod(shape[a] for a in self.rows)
        return (rows, math.prod(shape[a] for a in self.cols)) if self.cols else (rows,)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the stored tensor for the parameter of shape ``shape`` (stacked axes included)."""
        per = self.hf_shape(shape[self.lead:])
        if self.part is None:
            return per
        return (shape[self.lead - 1], per[0] * self.part[1], *per[1:])

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Per-layer parameter -> Hugging Face tensor."""
        order = self.rows + self.cols
        return np.ascontiguousarray(np.transpose(x, order)).reshape(self.hf_shape(x.shape))


def attention_maps(layer: str, block: tuple[str, ...], m: ModelConfig | None = None) -> list[TensorMap]:
    """A layer's attention and norms: Hugging Face names ``layer`` + ..., parameters under the stacked ``block``;
    with ``m``, its q/k/v biases (``qkv_bias``) and q/k norms (``qk_norm``) too."""
    attn = (*block, "attn")
    extra = []
    if m is not None and m.qkv_bias:  # b [heads * head_dim]; bias [heads, head_dim]
        extra += [TensorMap(layer + f"self_attn.{p}_proj.bias", (*attn, p, "bias"), True, (0, 1), ())
                  for p in "qkv"]
    if m is not None and m.qk_norm:  # [head_dim]
        extra += [TensorMap(layer + f"self_attn.{p}_norm.weight", (*attn, f"{p}_norm", "scale"), True, (0,), ())
                  for p in "qk"]
    return extra + [
        # q, k, v: W [heads * head_dim, d_model]; kernel [d_model, heads, head_dim].
        TensorMap(layer + "self_attn.q_proj.weight", (*block, "attn", "q", "kernel"), True, (1, 2), (0,)),
        TensorMap(layer + "self_attn.k_proj.weight", (*block, "attn", "k", "kernel"), True, (1, 2), (0,)),
        TensorMap(layer + "self_attn.v_proj.weight", (*block, "attn", "v", "kernel"), True, (1, 2), (0,)),
        # o: W [d_model, heads * head_dim]; kernel [heads, head_dim, d_model].
        TensorMap(layer + "self_attn.o_proj.weight", (*block, "attn", "o", "kernel"), True, (2,), (0, 1)),
        TensorMap(layer + "input_layernorm.weight", (*block, "attn_norm", "scale"), True, (0,), ()),
        TensorMap(layer + "post_attention_layernorm.weight", (*block, "mlp_norm", "scale"), True, (0,), ()),
    ]


def fused_expert_maps(layer: str) -> list[TensorMap]:
    """An MoE layer's router and routed experts as transformers 5 holds them in memory for every MoE class (Mixtral,
    Qwen-MoE): ``mlp.gate.weight`` [E, d] (the router transposed), ``mlp.experts.gate_up_proj`` [E, 2f, d] (each
    expert's gate then up rows) and ``mlp.experts.down_proj`` [E, d, f]. Import only."""
    path = ("blocks", "moe", "mlp")
    return [
        TensorMap(layer + "mlp.gate.weight", (*path, "router"), True, (1,), (0,)),
        TensorMap(layer + "mlp.experts.gate_up_proj", (*path, "w_gate"), True, (1,), (0,), True, (0, 2)),
        TensorMap(layer + "mlp.experts.down_proj", (*path, "w_down"), True, (1,), (0,), True, (0, 1)),
        TensorMap(layer + "mlp.experts.gate_up_proj", (*path, "w_up"), True, (1,), (0,), True, (1, 2)),
    ]


def expert_maps(layer: str) -> list[TensorMap]:
    """An MoE layer's router and routed experts as checkpoints store them (Qwen-MoE, DeepSeek-V3):
    ``mlp.gate.weight`` [E, d] (the router transposed) and each expert's ``mlp.experts.{j}.{gate,up,down}_proj``
    (transposed)."""
    path = ("blocks", "moe", "mlp")
    return [TensorMap(layer + "mlp.gate.weight", (*path, "router"), True, (1,), (0,))] + [
        TensorMap(layer + f"mlp.experts.{{j}}.{p}_proj.weight", (*path, f"w_{p}"), True, (1,), (0,), experts=True)
        for p in ("gate", "up", "down")]


def outer_maps(m: ModelConfig) -> tuple[list[TensorMap], list[TensorMap]]:
    """(the tensors before the layers, those after): embedding; final norm and, untied, the output projection."""
    after = [TensorMap("model.norm.weight", ("final_norm", "scale"), False, (0,), ())]
    if not m.tie_embeddings:
        after.append(TensorMap("lm_head.weight", ("unembed", "kernel"), False, (1,), (0,)))
    return [TensorMap("model.embed_tokens.weight", ("embed", "embedding"), False, (0,), (1,))], after


def tensor_maps(m: ModelConfig) -> list[TensorMap]:
    """Every parameter of the dense model ``m``, in Hugging Face's usual tensor order (an MoE model's:
    :func:`jaxtrain.hf.moe_mapping.tensor_maps`)."""
    layer = "model.layers.{i}."
    mlp = [TensorMap(layer + "mlp.gate_proj.weight", ("blocks", "mlp", "gate", "kernel"), True, (1,), (0,)),
           TensorMap(layer + "mlp.up_proj.weight", ("blocks", "mlp", "up", "kernel"), True, (1,), (0,)),
           TensorMap(layer + "mlp.down_proj.weight", ("blocks", "mlp", "down", "kernel"), True, (1,), (0,))]
    before, after = outer_maps(m)
    return before + attention_maps(layer, ("blocks",), m) + mlp + after


def _bounds(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"strided shard index {s}")
    return start, stop


def _group(axes: tuple[int, ...], shape: tuple[int, ...], index: tuple[slice, ...]):
    """The contiguous range of one Hugging Face dimension that covers ``index`` on the parameter ``axes`` it splits
    into: (slice on the HF dimension, block shape after reshaping it, selection on that block)."""
    first, inner = axes[0], axes[1:]
    lo, hi = _bounds(index[first], shape[first])
    size = math.prod(shape[a] for a in inner)
    return slice(lo * size, hi * size), [hi - lo] + [shape[a] for a in inner], [slice(None)] + [index[a] for a in inner]


def read_block(tm: TensorMap, tensor, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The part ``index`` of the per-layer parameter of shape ``shape``, read from the Hugging Face tensor
    ``tensor`` (a safetensors slice: only the rows and columns needed are read)."""
    r_sl, r_shape, r_sel = _group(tm.rows, shape, index)
    if tm.cols:
        c_sl, c_shape, c_sel = _group(tm.cols, shape, index)
        block = tensor[r_sl, c_sl].reshape(r_shape + c_shape)[tuple(r_sel + c_sel)]
    else:
        block = tensor[r_sl].reshape(r_shape)[tuple(r_sel)]
    return np.transpose(block, np.argsort(tm.rows + tm.cols))


class SafetensorsDir:
    """The tensors of a Hugging Face model directory: ``model.safetensors.index.json`` + shards, or every
    ``*.safetensors`` file. Headers are read up front; tensor data is read lazily, slice by slice (memory-mapped)."""

    def __init__(self, src: str):
        import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16", which safetensors' numpy API needs)
        from safetensors import safe_open

        self._open = safe_open
        index = os.path.join(src, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.isfile(os.path.join(src, name)):
                    raise ConfigError(f"shard {name!r} listed in {index} is missing")
        else:
            files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if not files:
                raise ConfigError(f"{src!r} has no *.safetensors files (other formats, e.g. pytorch_model.bin, are "
                                  "not read: convert them with transformers' save_pretrained first)")
        self.files = [os.path.join(src, f) for f in files]
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for path in self.files:
            try:
                with safe_open(path, framework="numpy") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        self.where[key], self.shapes[key] = path, tuple(sl.get_shape())
                        self.dtypes[key] = sl.get_dtype()
            except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
                raise ConfigError(f"{path} is not a readable safetensors file: {one_line(e)}") from None

    def read(self, tm: TensorMap, key: tuple[int, ...], shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """:func:`read_block` of ``tm``'s tensor for ``key`` (:meth:`TensorMap.keys`). The file is mapped only while
        it is read, so its pages leave this process's resident memory once the block is copied out."""
        name = tm.name(*key)
        with self._open(self.where[name], framework="numpy") as f:
            tensor = f.get_slice(name)
            if tm.part is not None:
                tensor = _Part(tensor, key[-1], tm.part[0] * tm.hf_shape(shape)[0])
            return read_block(tm, tensor, shape, index)


class _Part:
    """Expert ``expert``'s matrix inside a fused tensor [experts, rows, cols], its rows from ``offset`` on: sliced
    like a 2-D tensor, read lazily from the safetensors slice."""

    def __init__(self, tensor, expert: int, offset: int):
        self.tensor, self.expert, self.offset = tensor, expert, offset

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        rows, *rest = index if isinstance(index, tuple) else (index,)
        return self.tensor[(self.expert, slice(self.offset + rows.start, self.offset + rows.stop), *rest)]


def check_tensors(tensors: SafetensorsDir, maps: list[TensorMap], shapes: dict[tuple[str, ...], tuple[int, ...]],
                  tie_embeddings: bool) -> None:
    """Every tensor the model needs is there with the shape the config implies, and nothing else is."""
    expected = set()
    for tm in maps:
        shape = shapes[tm.path]
        for key in tm.keys(shape):
            name, want = tm.name(*key), tm.stored_shape(shape)
            expected.add(name)
            if name not in tensors.shapes:
                raise ConfigError(f"tensor {name!r} is missing from the safetensors files")
            if tensors.shapes[name] != want:
                raise ConfigError(f"tensor {name} has shape {list(tensors.shapes[name])} but config.json implies "
                                  f"{list(want)}")
    for name in tensors.shapes:
        if name in expected or name.endswith(_IGNORED) or (tie_embeddings and name == "lm_head.weight"):
            continue
        what = "a bias" if name.endswith(".bias") else "a tensor this mapping does not know"
        raise ConfigError(f"unsupported feature: tensor {name!r} ({what})")


# ---------------------------------------------------------------------------------------------------------------
# Files around the weights


def copy_tokenizer(src_dir: str, out: str) -> list[str]:
    """Copy the Hugging Face tokenizer files found in ``src_dir`` into ``out``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out, name))
            copied.append(name)
    return copied


def shard_plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into files of at most ``max_bytes`` (a larger tensor gets a file to itself)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, n in sizes:
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards

