"""Qwen2/Qwen2.5, Qwen3 and Mistral checkpoints in and out: the parameter mapping against tensors written here by
hand (default suite, no transformers), then against transformers itself (small random models built from configs and
saved with save_pretrained, nothing downloaded; skipped without the hf-parity extra)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a hub, whatever the machine's settings

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxtrain.checkpoint import format as ckpt  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.hf import convert, families  # noqa: E402
from jaxtrain.hf import mapping as hf_map  # noqa: E402
from jaxtrain_testing import (  # noqa: E402
    HF_BASE,
    export_round_trip,
    hf_logits,
    import_dir,
    jax_logits,
    load_export,
    make_family_model,
)

# ---------------------------------------------------------------------------------------------------------------
# The mapping, without transformers

L, D, H, KV, HD, F, V = 2, 32, 4, 2, 16, 48, 40  # head_dim 16 != D / H on purpose


def _qwen_dir(path, arch, **extra):
    """A Hugging Face directory written by hand: config.json of ``arch`` and random float32 tensors named as
    save_pretrained names them (q/k/v biases for Qwen2, q/k norms for Qwen3). Returns the tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": rng.normal(size=(V, D)), "model.norm.weight": rng.uniform(0.5, 1.5, D),
         "lm_head.weight": rng.normal(size=(V, D))}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rng.normal(size=(H * HD, D)),
                  p + "self_attn.k_proj.weight": rng.normal(size=(KV * HD, D)),
                  p + "self_attn.v_proj.weight": rng.normal(size=(KV * HD, D)),
                  p + "self_attn.o_proj.weight": rng.normal(size=(D, H * HD)),
                  p + "mlp.gate_proj.weight": rng.normal(size=(F, D)),
                  p + "mlp.up_proj.weight": rng.normal(size=(F, D)),
                  p + "mlp.down_proj.weight": rng.normal(size=(D, F)),
                  p + "input_layernorm.weight": rng.uniform(0.5, 1.5, D),
                  p + "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, D)})
        if arch == "Qwen2ForCausalLM":
            t.update({p + "self_attn.q_proj.bias": rng.normal(size=H * HD),
                      p + "self_attn.k_proj.bias": rng.normal(size=KV * HD),
                      p + "self_attn.v_proj.bias": rng.normal(size=KV * HD)})
        if arch == "Qwen3ForCausalLM":
            t.update({p + "self_attn.q_norm.weight": rng.uniform(0.5, 1.5, HD),
                      p + "self_attn.k_norm.weight": rng.uniform(0.5, 1.5, HD)})
    t = {k: v.astype(np.float32) for k, v in t.items()}
    os.makedirs(path)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": [arch], "vocab_size": V, "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
           "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
           "dtype": "float32", "eos_token_id": 2, **extra}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return t


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_parameters_are_the_hugging_face_tensors_reshaped_and_export_writes_them_back(tmp_path, arch):
    """Each imported parameter equals its tensor under the layout the model code defines (q kernel [d, heads,
    head_dim] = W.T split; bias [heads, head_dim] = b split; q/k norm scale [head_dim] = the weight), on a
    fsdp 2 x tensor 2 x data 2 mesh; the export writes the same tensor names and bits back, and the class."""
    extra = {"sliding_window": 8} if arch == "MistralForCausalLM" else {}
    t = _qwen_dir(tmp_path / "hf", arch, **extra)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", "runtime.cpu_devices=8", "mesh.ici.data=2",
                     "mesh.ici.fsdp=2", "mesh.ici.tensor=2")
    m = cfg.model
    assert (m.qkv_bias, m.qk_norm, m.sliding_window, m.head_dim) == (
        arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM", 8 if extra else None, HD)
    from jaxtrain.parallel.layout import Layout

    directory, step = ckpt.resolve(str(tmp_path / "jt"))
    params = ckpt.restore_params(directory, step, Layout.build(cfg).abstract_params)
    attn = params["blocks"]["attn"]
    for i in range(L):
        p = f"model.layers.{i}.self_attn."
        q = np.asarray(attn["q"]["kernel"][...][i])
        np.testing.assert_array_equal(q, t[p + "q_proj.weight"].T.reshape(D, H, HD))
        o = np.asarray(attn["o"]["kernel"][...][i])
        np.testing.assert_array_equal(o, t[p + "o_proj.weight"].T.reshape(H, HD, D))
        if m.qkv_bias:
            for name, heads in (("q", H), ("k", KV), ("v", KV)):
                np.testing.assert_array_equal(np.asarray(attn[name]["bias"][...][i]),
                                              t[p + f"{name}_proj.bias"].reshape(heads, HD))
        if m.qk_norm:
            for name in ("q", "k"):
                np.testing.assert_array_equal(np.asarray(attn[f"{name}_norm"]["scale"][...][i]),
                                              t[p + f"{name}_norm.weight"])
    assert ("bias" in attn["q"]) == m.qkv_bias and ("q_norm" in attn) == m.qk_norm

    from safetensors.numpy import load_file

    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(back) == sorted(t)
    for name in t:
        assert back[name].dtype == t[name].dtype and np.array_equal(back[name].view(np.uint32),
                                                                     t[name].view(np.uint32)), name
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["architectures"] == [arch] and saved["model_type"] == families.MODEL_TYPES[arch]
    assert saved["head_dim"] == HD and saved["rope_parameters"]["rope_theta"] == 1e6


def _fields(arch, **kw):
    return hf_map.model_fields_from_hf({"architectures": [arch], **HF_BASE, **kw})


def test_sliding_windows_are_read_as_transformers_reads_them():
    """Mistral's window covers every layer; Qwen's only with use_sliding_window, on the layers from
    max_window_layers on (or as layer_types says); a window on some layers only is refused with one line."""
    assert _fields("MistralForCausalLM", sliding_window=4096)["model.sliding_window"] == 4096
    assert _fields("MistralForCausalLM", sliding_window=None)["model.sliding_window"] is None
    qwen = "Qwen2ForCausalLM"
    # Qwen2.5-7B's released config: a window size, but use_sliding_window false: full attention
    assert _fields(qwen, use_sliding_window=False, sliding_window=131072, max_window_layers=28)[
        "model.sliding_window"] is None
    assert _fields(qwen, use_sliding_window=True, sliding_window=8, max_window_layers=0)["model.sliding_window"] == 8
    assert _fields(qwen, use_sliding_window=True, sliding_window=8, max_window_layers=2)["model.sliding_window"] is None
    assert _fields(qwen, use_sliding_window=True, sliding_window=8, max_window_layers=28,
                   layer_types=["sliding_attention"] * 2)["model.sliding_window"] == 8
    with pytest.raises(ConfigError, match=r"^unsupported feature: a sliding window on 1 of 2 layers \(use_sliding_"
                                          r"window=true, sliding_window=8, max_window_layers=1 in config.json\)"):
        _fields(qwen, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ConfigError, match="layer_types 'chunked_attention'"):
        _fields("Qwen3ForCausalLM", layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(ConfigError, match=r"attention biases on q, k, v and o_proj \(attention_bias=True"):
        _fields("Qwen3ForCausalLM", attention_bias=True)
    assert _fields("Qwen2ForCausalLM")["model.qkv_bias"] and _fields("Qwen3ForCausalLM")["model.qk_norm"]


def test_the_export_class_holds_the_model():
    """The class imported from where it still holds the model, else the first that can; none for biases + norms."""
    def arch(*overrides, preferred=None):
        return families.dense_architecture(load_config(None, list(overrides)).model, preferred)

    assert arch() == "LlamaForCausalLM" and arch(preferred="MistralForCausalLM") == "MistralForCausalLM"
    assert arch("model.sliding_window=64") == "MistralForCausalLM"
    assert arch("model.sliding_window=64", preferred="LlamaForCausalLM") == "MistralForCausalLM"
    assert arch("model.qkv_bias=true", preferred="Qwen3ForCausalLM") == "Qwen2ForCausalLM"
    assert arch("model.qk_norm=true") == "Qwen3ForCausalLM"
    with pytest.raises(ConfigError, match="model.qkv_bias=true with model.qk_norm=true"):
        arch("model.qkv_bias=true", "model.qk_norm=true")


# ---------------------------------------------------------------------------------------------------------------
# Against transformers (the hf-parity extra)

WINDOW = dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)  # every layer slides (8 < seq)
CASES = {
    "qwen2_biases": ("Qwen2", {}),
    "qwen2.5_tied_window": ("Qwen2", dict(tie_word_embeddings=True, **WINDOW)),
    "qwen3_qk_norm_head_dim": ("Qwen3", dict(head_dim=16)),
    "qwen3_window": ("Qwen3", dict(head_dim=16, **WINDOW)),
    "mistral_window": ("Mistral", dict(sliding_window=8)),
    "mistral_no_window": ("Mistral", dict(sliding_window=None)),
}


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    return torch, transformers


def tokens(shape=(2, 24), seed=1):
    return np.random.default_rng(seed).integers(0, HF_BASE["vocab_size"], size=shape)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_and_the_round_trip_is_bit_exact(hf, tmp_path, case):
    """Import -> logits equal transformers' (1e-4, float32, fsdp over 8 devices); export -> the same class and
    config keys save_pretrained wrote, the same tensor names and bits, loaded cleanly by transformers."""

    torch, transformers = hf
    family, overrides = CASES[case]
    hf_model = make_family_model(tmp_path / "hf", family, **overrides)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    toks = tokens()
    want = hf_logits(hf_model, toks)
    assert want.std() > 0.1
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), want, atol=1e-4, rtol=0)

    src, out = export_round_trip(cfg, tmp_path)
    assert set(src) - {"transformers_version"} <= set(out), set(src) - set(out)
    for key in ("sliding_window", "use_sliding_window", "layer_types", "attention_bias", "tie_word_embeddings"):
        assert out.get(key) == src.get(key), key
    np.testing.assert_allclose(hf_logits(load_export(tmp_path / "out"), toks), want, atol=1e-5, rtol=0)


PROMPTS = [[5, 17, 3, 44, 9, 71, 30, 12, 8, 61, 22], [40, 6], [9, 9, 81, 13, 50, 3]]


MESH = ["runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"]


@pytest.mark.parametrize("case, mesh", [("qwen2.5_tied_window", []), ("qwen3_window", []), ("mistral_window", []),
                                        ("qwen3_window", MESH)],
                         ids=["qwen2.5_tied_window", "qwen3_window", "mistral_window", "qwen3_window_mesh"])
def test_greedy_generation_matches_transformers(hf, tmp_path, case, mesh):
    """20 new tokens on three prompts of different lengths decoded as one batch (past the window of 8, so the KV
    cache's window mask matters) equal transformers' greedy generate on each prompt alone, on one device and on a
    data x fsdp x tensor mesh."""
    from jaxtrain.hf import generate

    torch, _ = hf
    family, overrides = CASES[case]
    hf_model = make_family_model(tmp_path / "hf", family, seed=3, **overrides)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", *mesh)
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=20, eos_ids=(HF_BASE["eos_token_id"],))
    for prompt, got in zip(PROMPTS, res.new_ids):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                    pad_token_id=HF_BASE["eos_token_id"], eos_token_id=HF_BASE["eos_token_id"])
        assert got == out[0, len(prompt):].tolist(), (prompt, got)
    assert any(len(ids) == 20 for ids in res.new_ids)


def test_transformers_disagrees_without_the_window(hf, tmp_path):
    """The window is what makes the match: the same Mistral imported with its window removed differs."""
    hf_model = make_family_model(tmp_path / "hf", "Mistral", sliding_window=8)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", "model.sliding_window=null")
    toks = tokens()
    assert np.abs(jax_logits(cfg, tmp_path / "jt", toks) - hf_logits(hf_model, toks)).max() > 1e-2
