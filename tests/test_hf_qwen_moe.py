"""Qwen3-MoE and Qwen2-MoE checkpoints in and out: the parameter mapping against tensors written here by hand
(default suite, no transformers), then against transformers itself (small random models built from configs and saved
with save_pretrained, nothing downloaded; skipped without the hf-parity extra)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a hub, whatever the machine's settings

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxtrain.checkpoint import format as ckpt  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.hf import convert, moe_mapping  # noqa: E402
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

D, H, KV, HD, F, FE, E, V = 32, 4, 2, 8, 48, 16, 6, 40


def _moe_dir(path, arch, n_layers, step, **extra):
    """A Hugging Face directory written by hand: config.json of ``arch`` and random float32 tensors named as
    save_pretrained names them (every ``step``-th layer routed, the others dense). Returns the tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": rng.normal(size=(V, D)), "model.norm.weight": rng.uniform(0.5, 1.5, D),
         "lm_head.weight": rng.normal(size=(V, D))}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rng.normal(size=(H * HD, D)),
                  p + "self_attn.k_proj.weight": rng.normal(size=(KV * HD, D)),
                  p + "self_attn.v_proj.weight": rng.normal(size=(KV * HD, D)),
                  p + "self_attn.o_proj.weight": rng.normal(size=(D, H * HD)),
                  p + "input_layernorm.weight": rng.uniform(0.5, 1.5, D),
                  p + "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, D)})
        if arch == "Qwen2MoeForCausalLM":
            t.update({p + f"self_attn.{n}_proj.bias": rng.normal(size=h * HD) for n, h in (("q", H), ("k", KV),
                                                                                          ("v", KV))})
        else:
            t.update({p + f"self_attn.{n}_norm.weight": rng.uniform(0.5, 1.5, HD) for n in "qk"})
        if (i + 1) % step:  # dense
            t.update({p + "mlp.gate_proj.weight": rng.normal(size=(F, D)), p + "mlp.up_proj.weight":
                      rng.normal(size=(F, D)), p + "mlp.down_proj.weight": rng.normal(size=(D, F))})
            continue
        t[p + "mlp.gate.weight"] = rng.normal(size=(E, D))
        for j in range(E):
            q = p + f"mlp.experts.{j}."
            t.update({q + "gate_proj.weight": rng.normal(size=(FE, D)), q + "up_proj.weight": rng.normal(size=(FE, D)),
                      q + "down_proj.weight": rng.normal(size=(D, FE))})
        if arch == "Qwen2MoeForCausalLM":
            q = p + "mlp.shared_expert."
            t.update({q + "gate_proj.weight": rng.normal(size=(2 * FE, D)), q + "up_proj.weight":
                      rng.normal(size=(2 * FE, D)), q + "down_proj.weight": rng.normal(size=(D, 2 * FE)),
                      p + "mlp.shared_expert_gate.weight": rng.normal(size=(1, D))})
    t = {k: v.astype(np.float32) for k, v in t.items()}
    os.makedirs(path)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": [arch], "vocab_size": V, "hidden_size": D, "intermediate_size": F,
           "num_hidden_layers": n_layers, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
           "tie_word_embeddings": False, "dtype": "float32", "eos_token_id": 2, "moe_intermediate_size": FE,
           "num_experts_per_tok": 4, "decoder_sparse_step": step, "norm_topk_prob": False, "mlp_only_layers": [],
           "router_aux_loss_coef": 0.01, **extra}
    if arch == "Qwen2MoeForCausalLM":
        cfg.update(num_experts=E, shared_expert_intermediate_size=2 * FE)
    else:
        cfg.update(num_local_experts=E)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return t


@pytest.mark.parametrize("arch, n_layers, step", [("Qwen3MoeForCausalLM", 2, 1), ("Qwen2MoeForCausalLM", 4, 2)])
def test_parameters_are_the_hugging_face_tensors_reshaped_and_export_writes_them_back(tmp_path, arch, n_layers, step):
    """Each imported expert, router, shared-expert and dense-layer parameter equals its tensor under the layout
    models/moe.py defines (Hugging Face layer g x every + every - 1 is blocks.moe [g], g x every + j blocks.dense
    [g, j]), on an expert 2 x fsdp 2 x tensor 2 mesh; the export writes the same names and bits back, and the class."""
    t = _moe_dir(tmp_path / "hf", arch, n_layers, step, output_router_logits=step == 1)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", "runtime.cpu_devices=8", "mesh.ici.expert=2",
                     "mesh.ici.fsdp=2", "mesh.ici.tensor=2")
    m, moe = cfg.model, cfg.model.moe
    qwen2 = arch == "Qwen2MoeForCausalLM"
    assert (moe.experts, moe.top_k, moe.d_ff, moe.every, moe.normalize, moe.shared_experts, moe.shared_gate) == (
        E, 4, FE, step, False, 2 if qwen2 else 0, qwen2)
    assert (moe.aux_loss, moe.balance_loss, moe.capacity_factor, m.d_ff) == (0.01, "pooled", 0.0, F)
    assert (m.qkv_bias, m.qk_norm) == (qwen2, not qwen2)
    from jaxtrain.parallel.layout import Layout

    directory, step_ = ckpt.resolve(str(tmp_path / "jt"))
    params = ckpt.restore_params(directory, step_, Layout.build(cfg).abstract_params)
    mlp = params["blocks"]["moe"]["mlp"]
    for g in range(n_layers // step):
        p = f"model.layers.{g * step + step - 1}.mlp."
        np.testing.assert_array_equal(np.asarray(mlp["router"][...][g]), t[p + "gate.weight"].T)
        for j in range(E):
            for name in ("gate", "up", "down"):
                np.testing.assert_array_equal(np.asarray(mlp[f"w_{name}"][...][g, j]),
                                              t[p + f"experts.{j}.{name}_proj.weight"].T)
        if qwen2:
            for name in ("gate", "up", "down"):
                np.testing.assert_array_equal(np.asarray(mlp["shared"][name]["kernel"][...][g]),
                                              t[p + f"shared_expert.{name}_proj.weight"].T)
            np.testing.assert_array_equal(np.asarray(mlp["shared_gate"][...][g]), t[p + "shared_expert_gate.weight"].T)
        for j in range(step - 1):
            dense = params["blocks"]["dense"]
            q = f"model.layers.{g * step + j}."
            np.testing.assert_array_equal(np.asarray(dense["mlp"]["up"]["kernel"][...][g, j]),
                                          t[q + "mlp.up_proj.weight"].T)
            np.testing.assert_array_equal(np.asarray(dense["attn"]["q"]["kernel"][...][g, j]),
                                          t[q + "self_attn.q_proj.weight"].T.reshape(D, H, HD))

    from safetensors.numpy import load_file

    convert.export_hf(cfg, directory, step_, ckpt.read_meta(directory, step_), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(back) == sorted(t)
    for name in t:
        assert np.array_equal(back[name].view(np.uint32), t[name].view(np.uint32)), name
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["architectures"] == [arch] and saved["decoder_sparse_step"] == step
    assert saved["moe_intermediate_size"] == FE and saved["intermediate_size"] == F
    assert saved.get("shared_expert_intermediate_size") == (2 * FE if qwen2 else None)
    assert saved["output_router_logits"] == (step == 1)  # as the source had it


def _fields(arch, **kw):
    base = {**HF_BASE, "moe_intermediate_size": 16, "num_experts": 64, "num_experts_per_tok": 8}
    return moe_mapping.model_fields({"architectures": [arch], **base, **kw})


def test_fine_grained_configs_map_onto_the_moe_options():
    """Qwen3-30B-A3B's routing (128 experts, top 8, normalised), Qwen2-MoE's shared expert as a multiple of the
    expert width, the aux-loss coefficient with transformers' pooled balance loss; Qwen3-MoE's num_local_experts."""
    f = _fields("Qwen3MoeForCausalLM", num_experts=128, norm_topk_prob=True, router_aux_loss_coef=0.001)
    assert (f["model.moe.experts"], f["model.moe.top_k"], f["model.moe.normalize"], f["model.moe.d_ff"]) == (
        128, 8, True, 16)
    assert (f["model.moe.aux_loss"], f["model.moe.balance_loss"], f["model.qk_norm"]) == (0.001, "pooled", True)
    assert _fields("Qwen3MoeForCausalLM", num_local_experts=32)["model.moe.experts"] == 32
    f = _fields("Qwen2MoeForCausalLM", shared_expert_intermediate_size=64, decoder_sparse_step=2)
    assert (f["model.moe.shared_experts"], f["model.moe.shared_gate"], f["model.moe.every"]) == (4, True, 2)
    assert f["model.qkv_bias"] and not f["model.moe.normalize"]
    assert not _fields("Qwen2MoeForCausalLM", shared_expert_intermediate_size=16, qkv_bias=False)["model.qkv_bias"]
    assert _fields("Qwen3MoeForCausalLM", use_sliding_window=True, sliding_window=8)["model.sliding_window"] == 8
    assert _fields("Qwen3MoeForCausalLM", use_sliding_window=False, sliding_window=8)["model.sliding_window"] is None


# The released configs' shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen1.5-MoE-A2.7B).
RELEASED = {
    "Qwen3-30B-A3B": ({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                       "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
                       "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "max_window_layers": 48, "use_sliding_window": False,
                       "sliding_window": None, "tie_word_embeddings": False, "rope_theta": 1e6,
                       "torch_dtype": "bfloat16"}, 30.53, 3.35),
    "Qwen1.5-MoE-A2.7B": ({"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                           "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "moe_intermediate_size": 1408, "num_experts": 60,
                           "num_experts_per_tok": 4, "norm_topk_prob": False, "shared_expert_intermediate_size": 5632,
                           "decoder_sparse_step": 1, "max_window_layers": 21, "use_sliding_window": False,
                           "sliding_window": 32768, "tie_word_embeddings": False, "rope_theta": 1e6,
                           "torch_dtype": "bfloat16"}, 14.32, 2.69),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_configs_give_the_advertised_parameter_counts(name):
    """Qwen3-30B-A3B is 30.5B parameters with 3.3B active, Qwen1.5-MoE-A2.7B 14.3B with 2.7B active (their model
    cards): the mapped config counts both."""
    from jaxtrain.models.flops import count_params

    hf, total, active = RELEASED[name]
    fields = moe_mapping.model_fields(hf)
    counts = count_params(load_config(None, [f"{k}={json.dumps(v)}" for k, v in fields.items()]).model)
    assert counts["total"] / 1e9 == pytest.approx(total, abs=0.005)
    assert counts["active"] / 1e9 == pytest.approx(active, abs=0.005)


@pytest.mark.parametrize("arch, fields, phrase", [
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0]), "mlp_only_layers=[0] in config.json"),
    ("Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=24), "shared_expert_intermediate_size=24"),
    ("Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=3), "decoder_sparse_step=3 with num_hidden_layers=2"),
    ("Qwen2MoeForCausalLM", dict(shared_expert_intermediate_size=16, use_sliding_window=True),
     "use_sliding_window=True"),
    ("Qwen3MoeForCausalLM", dict(num_experts_per_tok=65), "num_experts_per_tok=65 in config.json must be in 1..64"),
    ("Qwen3MoeForCausalLM", dict(attention_bias=True), "attention_bias=True"),
    ("Qwen3MoeForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'"),
], ids=["mlp_only_layers", "shared_not_multiple", "shared_zero", "sparse_step", "qwen2_window", "top_k", "bias",
        "act"])
def test_unsupported_fields_are_refused_in_one_line_naming_them(arch, fields, phrase):
    with pytest.raises(ConfigError) as e:
        _fields(arch, **fields)
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_export_class_holds_the_model():
    """Mixtral where it can, Qwen3-MoE with q/k norms, Qwen2-MoE with a gated shared expert; the class imported
    from where it still holds the model; none: one line naming each class's reason."""
    def arch(*overrides, preferred=None):
        return moe_mapping.moe_architecture(load_config(None, ["model.moe.experts=4", *overrides]).model, preferred)

    assert arch() == "MixtralForCausalLM" and arch(preferred="Qwen3MoeForCausalLM") == "MixtralForCausalLM"
    assert arch("model.qk_norm=true", "model.moe.normalize=false", "model.moe.every=2") == "Qwen3MoeForCausalLM"
    assert arch("model.moe.shared_experts=2", "model.moe.shared_gate=true") == "Qwen2MoeForCausalLM"
    with pytest.raises(ConfigError) as e:
        arch("model.moe.router=sigmoid")
    assert str(e.value).count("model.moe.router=sigmoid") == 3 and "\n" not in str(e.value)


# Qwen2-MoE's options (q/k/v biases, a gated shared expert of 2 x d_ff, every second layer routed, top 4 of 8 narrow
# experts not renormalised, the pooled balance loss) with Qwen3-MoE's q/k norms and a window: all at once.
MOE_OPTIONS = ["model.qkv_bias=true", "model.qk_norm=true", "model.head_dim=32", "model.sliding_window=12",
               "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
               "model.moe.experts=8", "model.moe.top_k=4", "model.moe.d_ff=32",
               "model.moe.shared_experts=2", "model.moe.shared_gate=true", "model.moe.every=2",
               "model.moe.normalize=false", "model.moe.balance_loss=pooled", "model.moe.aux_loss=0.01",
               "model.moe.capacity_factor=0", "data.seq_len=32", "train.global_batch=8", "train.steps=4",
               "train.warmup_steps=2", "train.eval_every=0"]


@pytest.mark.slow  # two train-step compilations: about 50 s on 2 busy cores
def test_the_qwen_moe_options_on_an_expert_mesh_give_one_devices_losses(tmp_path):
    """Sharded over expert 2 x fsdp 2 x tensor 2, the Qwen MoE options train to one device's losses."""
    import jax

    from jaxtrain.train import loop
    from jaxtrain_testing import FAST

    def losses(n, *mesh):
        cfg = load_config(None, [f"run.dir={tmp_path / str(n)}", *FAST, *MOE_OPTIONS, *mesh])
        result = loop.train(cfg, devices=jax.devices()[:n])
        return np.array([result.losses[s] for s in range(1, 5)])

    one = losses(1, "mesh.ici.fsdp=1")
    np.testing.assert_allclose(losses(8, "mesh.ici.expert=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"), one, rtol=1e-4)
    assert one[-1] < one[0]  # it trained


# ---------------------------------------------------------------------------------------------------------------
# Against transformers (the hf-parity extra)

QWEN_MOE = dict(HF_BASE, intermediate_size=48, moe_intermediate_size=16, num_experts=8, head_dim=8,
                router_aux_loss_coef=0.02)
CASES = {
    "qwen3_moe_top4_of_8": ("Qwen3Moe", dict(num_experts_per_tok=4, norm_topk_prob=True)),
    "qwen3_moe_top8_of_16_unnormalised_tied": ("Qwen3Moe", dict(num_experts=16, num_experts_per_tok=8,
                                                                norm_topk_prob=False, tie_word_embeddings=True)),
    "qwen2_moe_shared_sparse_step_2": ("Qwen2Moe", dict(num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                                        num_hidden_layers=4, decoder_sparse_step=2)),
}


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    return torch, transformers


def make_moe_model(path, family, seed=0, **overrides):
    """A random float32 ``<family>ForCausalLM`` of :data:`QWEN_MOE` saved at ``path`` with eager experts
    (:func:`jaxtrain_testing.make_family_model`)."""
    return make_family_model(path, family, QWEN_MOE, seed=seed, moe=True, **overrides)


def tokens(shape=(8, 24), seed=1):
    return np.random.default_rng(seed).integers(0, QWEN_MOE["vocab_size"], size=shape)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_and_the_round_trip_is_bit_exact(hf, tmp_path, case):
    """Import -> logits equal transformers' (1e-4, float32, fsdp over 8 devices); export -> the same class and
    config keys save_pretrained wrote, the same tensor names and bits, loaded cleanly by transformers."""

    torch, transformers = hf
    family, overrides = CASES[case]
    hf_model = make_moe_model(tmp_path / "hf", family, **overrides)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    toks = tokens()
    want = hf_logits(hf_model, toks)
    assert want.std() > 0.1
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), want, atol=1e-4, rtol=0)

    src, out = export_round_trip(cfg, tmp_path)
    assert set(src) - {"transformers_version"} == set(out) - {"rope_theta", "rope_scaling"}, set(src) ^ set(out)
    for key in src:
        if key not in ("transformers_version", "max_position_embeddings", "max_window_layers", "initializer_range"):
            assert out[key] == src[key], key
    back = load_export(tmp_path / "out")
    back.set_experts_implementation("eager")
    np.testing.assert_allclose(hf_logits(back, toks), want, atol=1e-5, rtol=0)


def test_import_reads_fused_expert_tensors_and_routing_matters(hf, tmp_path):
    """A checkpoint holding transformers 5's in-memory names (experts fused into gate_up_proj / down_proj, as a
    state_dict saved without save_pretrained) imports to the same logits on an expert 2 x fsdp 2 x tensor 2 mesh;
    swapping two experts changes them (the comparison can fail)."""
    from safetensors.torch import save_file

    hf_model = make_moe_model(tmp_path / "hf", "Qwen2Moe", seed=6, **CASES["qwen2_moe_shared_sparse_step_2"][1])
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    for name, edit in (("fused", None), ("swapped", (0, 3))):
        s = dict(state)
        if edit:
            for part in ("gate_up_proj", "down_proj"):
                w = s[f"model.layers.1.mlp.experts.{part}"].clone()
                w[list(edit)] = w[list(edit[::-1])]
                s[f"model.layers.1.mlp.experts.{part}"] = w
        os.makedirs(tmp_path / name)
        save_file(s, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        os.link(tmp_path / "hf" / "config.json", tmp_path / name / "config.json")
    toks = tokens()
    want = hf_logits(hf_model, toks)
    cfg = import_dir(tmp_path / "fused", tmp_path / "jt", "runtime.cpu_devices=8", "mesh.ici.fsdp=2",
                     "mesh.ici.expert=2", "mesh.ici.tensor=2")
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), want, atol=1e-4, rtol=0)
    cfg = import_dir(tmp_path / "swapped", tmp_path / "jt2")
    assert np.abs(jax_logits(cfg, tmp_path / "jt2", toks) - want).max() > 1e-2


PROMPTS = [[5, 17, 3, 44, 9, 71, 30, 12, 8, 61, 22], [40, 6], [9, 9, 81, 13, 50, 3]]


@pytest.mark.parametrize("case", ["qwen3_moe_top4_of_8", "qwen2_moe_shared_sparse_step_2"])
def test_greedy_generation_matches_transformers(hf, tmp_path, case):
    """16 new tokens on three prompts of different lengths decoded as one batch (KV cache, experts dropless) equal
    transformers' greedy generate on each prompt alone."""
    from jaxtrain.hf import generate

    torch, _ = hf
    family, overrides = CASES[case]
    hf_model = make_moe_model(tmp_path / "hf", family, seed=3, **overrides)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    eos = QWEN_MOE["eos_token_id"]
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=16, eos_ids=(eos,))
    for prompt, got in zip(PROMPTS, res.new_ids):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=eos,
                                    eos_token_id=eos)
        assert got == out[0, len(prompt):].tolist(), (prompt, got)
    assert any(len(ids) == 16 for ids in res.new_ids)


@pytest.mark.parametrize("case", ["qwen3_moe_top8_of_16_unnormalised_tied", "qwen2_moe_shared_sparse_step_2"])
def test_balance_loss_equals_transformers_aux_loss(hf, tmp_path, case):
    """model.moe.balance_loss=pooled (what the import sets) is transformers' aux_loss (load_balancing_loss_func over
    the MoE layers' router logits, output_router_logits=true), so router_aux_loss_coef keeps its meaning; the
    per-layer form differs."""
    import jax
    from flax import nnx

    from jaxtrain.models import moe, routing

    torch, _ = hf
    family, overrides = CASES[case]
    hf_model = make_moe_model(tmp_path / "hf", family, seed=7, **overrides)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    toks = tokens()
    with torch.no_grad():
        want = float(hf_model(input_ids=torch.as_tensor(toks), output_router_logits=True).aux_loss)
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    with jax.set_mesh(layout.mesh), nnx.logical_axis_rules(layout.rules):
        stats = nnx.jit(lambda m, t: moe.logits_and_stats(m, t)[1])(model, np.asarray(toks, np.int32))
    assert cfg.model.moe.balance_loss == "pooled"
    np.testing.assert_allclose(float(routing.load_balancing_loss(stats, "pooled")), want, rtol=1e-5)
    assert abs(float(routing.load_balancing_loss(stats, "per_layer")) - want) > 1e-4
