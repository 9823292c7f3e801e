"""DeepSeek-V3 checkpoints in and out (jaxtrain/hf/deepseek.py): the config mapping and its refusals (default suite,
no transformers), then against transformers itself (small random DeepseekV3ForCausalLM models built from configs and
saved with save_pretrained, nothing downloaded; skipped without the hf-parity extra)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a hub, whatever the machine's settings

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxtrain.checkpoint import format as ckpt  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.hf import convert, deepseek  # noqa: E402
from jaxtrain_testing import (  # noqa: E402
    HF_BASE,
    config_variant,
    export_round_trip,
    hf_logits,
    import_dir,
    jax_logits,
    load_export,
    make_family_model,
    run_cli,
)

# A tiny DeepSeek-V3: MLA with a query latent, a dense first layer, then 2 MoE layers of 8 routed experts (top 3
# within the 2 best of 4 groups) and one shared expert. num_key_value_heads = heads: transformers' MLA expands k and v
# per head (its eager attention breaks otherwise), and jaxtrain's n_kv_heads must equal n_heads.
DEEPSEEK = dict(HF_BASE, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, rms_norm_eps=1e-6, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

# ---------------------------------------------------------------------------------------------------------------
# The config mapping, without transformers


def _fields(**kw):
    return deepseek.model_fields_from_hf({"architectures": ["DeepseekV3ForCausalLM"], **DEEPSEEK, **kw})


def test_config_maps_onto_latent_attention_and_deepseek_routing():
    """Each DeepSeek-V3 field lands on its jaxtrain option; head_dim (transformers writes the rotary width there)
    and num_key_value_heads do not; q_lora_rank null stays null; first_k_dense_replace >= the layers is dense."""
    f = _fields(num_key_value_heads=128, head_dim=8)
    want = {"model.kv_lora_rank": 16, "model.q_lora_rank": 24, "model.qk_nope_head_dim": 16,
            "model.qk_rope_head_dim": 8, "model.v_head_dim": 16, "model.head_dim": None, "model.n_kv_heads": 4,
            "model.d_ff": 96, "model.moe.experts": 8, "model.moe.top_k": 3, "model.moe.d_ff": 16,
            "model.moe.shared_experts": 1, "model.moe.shared_gate": False, "model.moe.every": 1,
            "model.moe.router": "sigmoid", "model.moe.normalize": True, "model.moe.routed_scaling_factor": 2.5,
            "model.moe.n_group": 4, "model.moe.topk_group": 2, "model.moe.expert_bias": True,
            "model.moe.capacity_factor": 0.0, "model.norm_eps": 1e-6, "model.moe.first_dense": 1}
    assert {k: f[k] for k in want} == want
    assert _fields(q_lora_rank=None)["model.q_lora_rank"] is None
    assert _fields(first_k_dense_replace=0)["model.moe.first_dense"] == 0
    assert _fields(first_k_dense_replace=3)["model.moe.experts"] == 0
    # MTP layers: transformers' DeepseekV3Config reads num_mtp_layers as an alias and defaults to 1
    assert [deepseek.mtp_layers(c) for c in ({}, {"num_mtp_layers": 2}, {"num_nextn_predict_layers": 0})] == [1, 2, 0]
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in f.items()])  # a valid jaxtrain config
    assert cfg.model.mla and cfg.model.moe.expert_bias


@pytest.mark.parametrize("fields, phrase", [
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 in config.json"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config (quant_method='fp8')"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40}), "rope scaling 'yarn'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' in config.json (supported: 'sigmoid')"),
    (dict(topk_method="greedy"), "topk_method='greedy' in config.json (supported: 'noaux_tc')"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 in config.json must be in 1..8"),
    (dict(n_routed_experts=0), "n_routed_experts=0 in config.json must be an integer >= 1"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_interleave="yes"), "rope_interleave='yes'"),
], ids=["eps", "fp8", "bias", "yarn", "scoring", "topk_method", "top_k", "experts", "act", "interleave"])
def test_unsupported_fields_are_refused_in_one_line_naming_them(fields, phrase):
    with pytest.raises(ConfigError) as e:
        _fields(**fields)
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3) less its yarn rope scaling and FP8 quantization (refused above).
RELEASED = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
            "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_theta": 10000, "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "moe_layer_freq": 1, "torch_dtype": "bfloat16"}


def test_the_released_config_gives_the_advertised_parameter_counts():
    """DeepSeek-V3 is 671B parameters with 37B active per token (its model card; the 14B of its MTP module come on
    top, and are not imported): the mapped config, 3 dense layers and 58 MoE ones, counts both."""
    from jaxtrain.models.flops import count_params

    m = load_config(None, [f"{k}={json.dumps(v)}" for k, v in deepseek.model_fields_from_hf(RELEASED).items()]).model
    assert (m.moe.first_dense, m.moe_layers) == (3, 58)
    counts = count_params(m)
    assert counts["total"] / 1e9 == pytest.approx(671.0, abs=0.05)
    assert 37.0 <= counts["active"] / 1e9 < 38.0


MLA = ["model.kv_lora_rank=16", "model.q_lora_rank=24", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
       "model.v_head_dim=16", "model.n_kv_heads=8", "model.norm_eps=1e-6", "model.moe.experts=8",
       "model.moe.shared_experts=1", "model.moe.router=sigmoid", "model.moe.expert_bias=true"]


@pytest.mark.parametrize("extra, phrase", [
    ("model.moe.router=softmax", "model.moe.router=softmax"),
    ("model.norm_eps=1e-5", "model.norm_eps=1e-05"),
    ("model.moe.expert_bias=false", "model.moe.expert_bias=false"),
    ("model.moe.shared_experts=0", "model.moe.shared_experts=0"),
    ("model.moe.every=2", "model.moe.every=2"),
])
def test_export_refuses_latent_attention_models_deepseek_cannot_hold(extra, phrase):
    """An MLA model goes to DeepseekV3ForCausalLM (no other class has MLA); what that class cannot hold is refused
    in one line before anything is written."""
    m = load_config(None, [*MLA, extra]).model
    with pytest.raises(ConfigError) as e:
        deepseek.hf_config_from_model(m)
    assert phrase in str(e.value) and "DeepseekV3ForCausalLM" in str(e.value) and "\n" not in str(e.value)
    assert deepseek.problem(load_config(None, MLA).model) is None


# ---------------------------------------------------------------------------------------------------------------
# Against transformers (the hf-parity extra)

CASES = {
    "q_latent_first_dense_top3_of_8_in_2_of_4_groups": {},
    "direct_q_all_moe_tied_unnormalised": dict(q_lora_rank=None, tie_word_embeddings=True, norm_topk_prob=False,
                                               routed_scaling_factor=1.5, n_group=2, topk_group=1,
                                               num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=0),
    # every layer dense, with Llama 3's rope scaling (the 24 tokens reach past original_max_position_embeddings)
    "dense_llama3_rope": dict(first_k_dense_replace=3, rope_parameters=dict(
        rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8)),
}


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    return torch, transformers


def make_deepseek(path, seed=0, **overrides):
    """A random float32 DeepseekV3ForCausalLM of :data:`DEEPSEEK` saved at ``path`` (eager experts, norms and the
    router spread: :func:`jaxtrain_testing.make_family_model`), its e_score_correction_bias drawn N(0, 0.5) (as large
    as the spread of the sigmoid scores, so that it changes which experts are chosen)."""
    import torch

    model = make_family_model(path, "DeepseekV3", DEEPSEEK, seed=seed, moe=True, **overrides)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def tokens(shape=(8, 24), seed=1):
    return np.random.default_rng(seed).integers(0, DEEPSEEK["vocab_size"], size=shape)


# Float32 on both sides; the sums run in different orders (XLA's einsums, torch's matmuls and its per-expert loop),
# which moves logits of magnitude up to ~4 by a few 1e-6 (measured over the three cases: 2.5e-6 to 3.8e-6, at most
# 1.2e-6 of the largest logit); 2e-5 (5e-6 of it) leaves that a 5x margin and is far below what a wrong expert, a
# misplaced rotary row or a missing bias changes (> 1e-2: test_expert_bias_and_the_rotary_layout_matter).
ATOL = 2e-5
_MOE_KEYS = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
             "topk_group", "norm_topk_prob", "routed_scaling_factor"}


SHARDED = "direct_q_all_moe_tied_unnormalised"  # imported on an 8-device mesh: 24-30 s on 2 busy cores


# The default pass keeps the DeepSeek-shaped case (MLA, a dense first layer, group routing); the 8-device mesh and the
# all-dense Llama 3 rope cases run in the slow pass (the default pass is near its 10-minute cap).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in (SHARDED, "dense_llama3_rope")
                                  else c for c in CASES])
def test_logits_match_transformers_and_the_round_trip_is_bit_exact(hf, tmp_path, case):
    """Import -> logits equal transformers' (float32; the all-MoE case on expert 2 x fsdp 2 x tensor 2, heads split
    over tensor); export -> the class and config keys save_pretrained wrote (no MTP layers), the same tensor names
    and bits, loaded cleanly by transformers with the same logits."""
    hf_model = make_deepseek(tmp_path / "hf", **CASES[case])
    mesh = ["runtime.cpu_devices=8", "mesh.ici.expert=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"]
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", *(mesh if case == SHARDED else []))
    dense = case == "dense_llama3_rope"
    assert cfg.model.mla and cfg.model.moe.experts == (0 if dense else 8)
    toks = tokens()
    want = hf_logits(hf_model, toks)
    assert want.std() > 0.1
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), want, atol=ATOL, rtol=0)

    src, out = export_round_trip(cfg, tmp_path)
    assert set(src) - {"transformers_version"} == set(out) - {"rope_theta", "rope_scaling"}, set(src) ^ set(out)
    skip = {"transformers_version", "initializer_range", "num_nextn_predict_layers"}
    for key in set(src) - skip - (_MOE_KEYS if dense else set()):
        assert out[key] == src[key], key
    assert out["num_nextn_predict_layers"] == 0 and out["rope_interleave"] is True
    back = load_export(tmp_path / "out")
    back.set_experts_implementation("eager")
    np.testing.assert_allclose(hf_logits(back, toks), want, atol=1e-6, rtol=0)


@pytest.mark.slow  # three imports: 7-18 s on 2 busy cores
def test_expert_bias_and_the_rotary_layout_matter(hf, tmp_path):
    """The comparisons above can fail: zeroing e_score_correction_bias changes the logits (it changes which experts
    are chosen), and so does reading the same tensors as rope_interleave=false; that layout itself imports to
    transformers' logits for it."""
    from safetensors.numpy import load_file, save_file

    _, transformers = hf
    hf_model = make_deepseek(tmp_path / "hf", seed=4)
    toks = tokens()
    want = hf_logits(hf_model, toks)
    t = load_file(str(tmp_path / "hf" / "model.safetensors"))
    os.makedirs(tmp_path / "nobias")
    save_file({k: np.zeros_like(v) if k.endswith("e_score_correction_bias") else v for k, v in t.items()},
              str(tmp_path / "nobias" / "model.safetensors"), metadata={"format": "pt"})
    os.link(tmp_path / "hf" / "config.json", tmp_path / "nobias" / "config.json")
    cfg = import_dir(tmp_path / "nobias", tmp_path / "jt_nobias")
    assert np.abs(jax_logits(cfg, tmp_path / "jt_nobias", toks) - want).max() > 1e-2

    plain = config_variant(tmp_path / "hf", tmp_path / "plain", lambda c: c.update(rope_interleave=False))
    cfg = import_dir(plain, tmp_path / "jt_plain")
    got = jax_logits(cfg, tmp_path / "jt_plain", toks)
    assert np.abs(got - want).max() > 1e-2
    reference = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    reference.set_experts_implementation("eager")
    np.testing.assert_allclose(got, hf_logits(reference, toks), atol=ATOL, rtol=0)


PROMPTS = [[5, 17, 3, 44, 9, 71, 30, 12, 8, 61, 22], [40, 6], [9, 9, 81, 13, 50, 3]]


def _hf_greedy(torch, model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=2,
                             eos_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["q_latent_first_dense_top3_of_8_in_2_of_4_groups",
                                  pytest.param(SHARDED, marks=pytest.mark.slow)])  # 7-15 s each on 2 busy cores
def test_greedy_generation_matches_transformers(hf, tmp_path, case):
    """16 new tokens on three prompts of different lengths decoded as one batch (the latent cache split between
    the dense first layer and the MoE layers, experts dropless) equal transformers' greedy generate on each prompt
    alone."""
    from jaxtrain.hf import generate

    torch, _ = hf
    hf_model = make_deepseek(tmp_path / "hf", seed=3, **CASES[case])
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=16, eos_ids=(DEEPSEEK["eos_token_id"],))
    for prompt, got in zip(PROMPTS, res.new_ids):
        assert got == _hf_greedy(torch, hf_model, prompt, 16), (prompt, got)
    assert any(len(ids) == 16 for ids in res.new_ids)


def _with_mtp_layer(src, dst):
    """A copy of the Hugging Face directory ``src`` at ``dst`` holding one multi-token-prediction layer as DeepSeek's
    checkpoints do (model.layers.{num_hidden_layers}: a decoder layer and its eh_proj, enorm, hnorm, shared_head),
    ``num_nextn_predict_layers: 1``. Returns the names of the tensors added."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(src / "model.safetensors"))
    n, d = DEEPSEEK["num_hidden_layers"], DEEPSEEK["hidden_size"]
    mtp = {k.replace("model.layers.0.", f"model.layers.{n}."): v + 1 for k, v in t.items()
           if k.startswith("model.layers.0.")}
    mtp.update({f"model.layers.{n}.eh_proj.weight": np.ones((d, 2 * d), np.float32),
                f"model.layers.{n}.enorm.weight": np.ones(d, np.float32),
                f"model.layers.{n}.hnorm.weight": np.ones(d, np.float32),
                f"model.layers.{n}.shared_head.norm.weight": np.ones(d, np.float32),
                f"model.layers.{n}.shared_head.head.weight": np.ones((DEEPSEEK["vocab_size"], d), np.float32)})
    os.makedirs(dst)
    save_file({**t, **mtp}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with open(src / "config.json") as f:
        cfg = json.load(f)
    with open(dst / "config.json", "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 1}, f)
    return sorted(mtp)


@pytest.mark.slow  # five CLI processes, each importing JAX: 25-45 s on 2 busy cores
def test_the_commands_skip_mtp_layers_generate_and_round_trip(hf, tmp_path):
    """convert from-hf of a checkpoint with an MTP layer: one log line says it is skipped, the logits are
    transformers'; generate --prompt-ids is transformers' greedy; convert to-hf writes the source's tensors bit for
    bit without the MTP layer. Without num_nextn_predict_layers the same tensors are refused, and so is rms_norm_eps
    1e-5 (exit 2, one line naming it, nothing written)."""
    torch, _ = hf
    hf_model = make_deepseek(tmp_path / "hf", seed=5)
    added = _with_mtp_layer(tmp_path / "hf", tmp_path / "mtp")
    r = run_cli("convert", "from-hf", str(tmp_path / "mtp"), "--out", str(tmp_path / "jt"))
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "multi-token-prediction" in line]
    assert len(said) == 1 and f"skipped {len(added)} tensors" in said[0], r.stderr
    cfg = load_config(str(tmp_path / "jt" / "config.yaml"), ["data.threads=0"])
    toks = tokens()
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), hf_logits(hf_model, toks), atol=ATOL, rtol=0)

    prompt = PROMPTS[0]
    r = run_cli("generate", "--checkpoint", str(tmp_path / "jt"), "--prompt-ids", ",".join(map(str, prompt)),
                "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["new_ids"] == _hf_greedy(torch, hf_model, prompt, 12)

    r = run_cli("convert", "to-hf", str(tmp_path / "jt"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file

    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert sorted(after) == sorted(before)
    assert all(np.array_equal(after[k].view(np.uint32), before[k].view(np.uint32)) for k in before)

    bad_inputs = [("mtp", dict(num_nextn_predict_layers=0), "unsupported feature: tensor 'model.layers.3."),
                  ("eps", dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 in config.json")]
    for name, edit, phrase in bad_inputs:
        bad = config_variant(tmp_path / "mtp", tmp_path / f"bad_{name}", lambda c, edit=edit: c.update(edit))
        r = run_cli("convert", "from-hf", str(bad), "--out", str(tmp_path / f"jt_{name}"), timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, r.stderr)
        assert phrase in lines[0] and not (tmp_path / f"jt_{name}").exists(), (name, r.stderr)


@pytest.mark.slow  # a train-step compilation: about 60 s on 2 busy cores
def test_a_trained_tiny_deepseek_v3_exports_to_transformers_logits(hf, tmp_path):
    """configs/tiny-deepseek-v3.yaml (MLA, a dense first layer, sigmoid routing in groups, shared experts), trained
    3 steps so that its expert bias has moved off zero, exports as a DeepseekV3ForCausalLM whose logits equal
    jaxtrain's own; the bias exported is the one the steps left."""
    import jax
    from safetensors.numpy import load_file

    from jaxtrain.train import loop
    from jaxtrain_testing import FAST

    cfg = load_config("tiny-deepseek-v3", [f"run.dir={tmp_path / 'run'}", *FAST, "data.seq_len=32",
                                           "train.global_batch=8", "train.steps=3", "train.eval_every=0"])
    loop.train(cfg, devices=jax.devices()[:1])
    directory, step = ckpt.resolve(str(tmp_path / "run"))
    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    bias = load_file(str(tmp_path / "out" / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert np.abs(bias).max() > 0  # 0.01 a step (bias_update_rate): the steps moved it
    toks = np.random.default_rng(2).integers(0, cfg.model.vocab_size, size=(8, 32))
    back = load_export(tmp_path / "out")
    back.set_experts_implementation("eager")
    np.testing.assert_allclose(hf_logits(back, toks), jax_logits(cfg, tmp_path / "run", toks), atol=ATOL, rtol=0)
