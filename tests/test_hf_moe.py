"""Hugging Face import and export of mixture-of-experts models (Mixtral) against ``transformers`` itself (CPU torch;
tiny random models built with torch.manual_seed and saved with save_pretrained, nothing downloaded)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a hub, whatever the machine's settings

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtrain.checkpoint import format as ckpt  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.hf import convert, generate  # noqa: E402
from jaxtrain.hf import mapping as hf_mapping  # noqa: E402
from jaxtrain_testing import config_variant, hf_logits, import_dir, jax_logits, randomize_norms, run_cli  # noqa: E402

torch.set_num_threads(1)

MIXTRAL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
               router_aux_loss_coef=0.02)
PROMPTS = [[5, 17, 3, 44, 9, 71, 30, 12, 8, 61, 22], [40, 6], [9, 9, 81, 13, 50, 3]]


def make_mixtral(path, seed=0, **overrides):
    """A random float32 MixtralForCausalLM saved at ``path``, with eager experts (transformers' reference loop);
    norm scales randomised so that each one matters."""
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**MIXTRAL, **overrides})).eval()
    model.set_experts_implementation("eager")
    randomize_norms(model)
    model.save_pretrained(path)
    return model


def load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                    dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.set_experts_implementation("eager")
    return model.eval()




def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=MIXTRAL["eos_token_id"], eos_token_id=MIXTRAL["eos_token_id"])
    return out[0, len(prompt):].tolist()


def tokens(shape=(8, 24), seed=1):
    return np.random.default_rng(seed).integers(0, MIXTRAL["vocab_size"], size=shape)


def saved_names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return set(f.keys())


@pytest.mark.parametrize("case", ["untied_top2_of_4", "tied_top1_of_3"])
def test_import_logits_match_transformers_and_round_trip(tmp_path, case):
    """Import -> the MoE config and logits equal transformers' (1e-4, as for Llama); export -> the per-expert
    tensors save_pretrained writes, transformers loads them cleanly -> logits equal (1e-5)."""
    overrides = {} if case == "untied_top2_of_4" else dict(tie_word_embeddings=True, num_local_experts=3,
                                                           num_experts_per_tok=1)
    hf_model = make_mixtral(tmp_path / "hf", **overrides)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in saved_names(tmp_path / "hf")  # legacy layout
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")  # default mesh: fsdp over all 8 test devices
    moe = cfg.model.moe
    assert (moe.experts, moe.top_k, moe.every, moe.d_ff, moe.aux_loss, moe.balance_loss) == (
        hf_model.config.num_local_experts, hf_model.config.num_experts_per_tok, 1, 48, 0.02, "pooled")
    toks = tokens((8, 40))  # MoE layers split the batch over the 8 devices (shard_map: evenly)
    want = hf_logits(hf_model, toks)
    got = jax_logits(cfg, tmp_path / "jt", toks)
    assert want.std() > 0.1  # logits that vary, so that the comparison can fail
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    directory, step = ckpt.resolve(str(tmp_path / "jt"))
    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    assert saved_names(tmp_path / "out") == saved_names(tmp_path / "hf")
    back = load_hf(tmp_path / "out")
    assert type(back).__name__ == "MixtralForCausalLM"
    np.testing.assert_allclose(hf_logits(back, toks), want, atol=1e-5, rtol=0)
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["num_local_experts"] == moe.experts and saved["router_aux_loss_coef"] == 0.02
    assert saved["eos_token_id"] == 2 and saved["bos_token_id"] == 1


def test_routing_matters(tmp_path):
    """The comparison above can fail: swapping two experts' weights in the checkpoint changes the logits."""
    from safetensors.numpy import load_file, save_file

    hf_model = make_mixtral(tmp_path / "hf")
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for part in ("w1", "w2", "w3"):
        a, b = (f"model.layers.0.block_sparse_moe.experts.{j}.{part}.weight" for j in (0, 1))
        w[a], w[b] = w[b], w[a]
    os.makedirs(tmp_path / "swapped")
    save_file(w, str(tmp_path / "swapped" / "model.safetensors"), metadata={"format": "pt"})
    os.link(tmp_path / "hf" / "config.json", tmp_path / "swapped" / "config.json")
    cfg = import_dir(tmp_path / "swapped", tmp_path / "jt")
    toks = tokens()
    assert np.abs(jax_logits(cfg, tmp_path / "jt", toks) - hf_logits(hf_model, toks)).max() > 1e-2


@pytest.mark.parametrize("mesh", [[], ["runtime.cpu_devices=8", "mesh.ici.fsdp=2", "mesh.ici.expert=2",
                                       "mesh.ici.tensor=2"]], ids=["one_device", "fsdp2_expert2_tensor2"])
def test_greedy_matches_transformers(tmp_path, mesh):
    """24 new tokens for three prompts of different lengths decoded as one batch (KV cache, experts dropless) equal
    transformers' greedy generate on each prompt alone."""
    hf_model = make_mixtral(tmp_path / "hf", seed=3, num_hidden_layers=3)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", *mesh)
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=24, eos_ids=(MIXTRAL["eos_token_id"],))
    for prompt, got in zip(PROMPTS, res.new_ids):
        assert got == hf_greedy(hf_model, prompt, 24), prompt
    assert any(len(ids) == 24 for ids in res.new_ids)  # some row ran the full length


def test_generate_is_dropless_whatever_the_capacity(tmp_path):
    """An imported model fine-tuned with a capacity factor still decodes dropless: with model.moe.capacity_factor
    small enough to drop most assignments in a forward pass, generation equals transformers' greedy output."""
    hf_model = make_mixtral(tmp_path / "hf", seed=4)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", "model.moe.capacity_factor=0.5")
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    toks = tokens((8, 32))
    dropped = jax_logits(cfg, tmp_path / "jt", toks)  # the training forward drops assignments
    assert np.abs(dropped - hf_logits(hf_model, toks)).max() > 1e-2
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=16, eos_ids=(MIXTRAL["eos_token_id"],))
    for prompt, got in zip(PROMPTS, res.new_ids):
        assert got == hf_greedy(hf_model, prompt, 16), prompt


@pytest.mark.slow
def test_cli_from_hf_generate_to_hf(tmp_path):
    """The commands themselves: convert from-hf, generate --prompt-ids (greedy, equal to transformers'), and
    convert to-hf loaded by transformers with equal logits."""
    hf_model = make_mixtral(tmp_path / "hf", seed=5)
    r = run_cli("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "jt"))
    assert r.returncode == 0, r.stderr
    prompt = PROMPTS[0]
    r = run_cli("generate", "--checkpoint", str(tmp_path / "jt"), "--prompt-ids", ",".join(map(str, prompt)),
                "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["new_ids"] == hf_greedy(hf_model, prompt, 12)
    r = run_cli("convert", "to-hf", str(tmp_path / "jt"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    toks = tokens()
    np.testing.assert_allclose(hf_logits(load_hf(tmp_path / "out"), toks), hf_logits(hf_model, toks), atol=1e-5,
                               rtol=0)


def _qwen2_moe(path):
    """A tiny Qwen2-MoE whose layer 1 is dense by mlp_only_layers (which jaxtrain refuses) saved at ``path``."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64, mlp_only_layers=[1])
    transformers.Qwen2MoeForCausalLM(cfg).save_pretrained(path)


def _bad_inputs(tmp):
    """(name, SRC directory, the phrase the one-line error must contain)."""
    make_mixtral(tmp / "good")
    _qwen2_moe(tmp / "qwen2_moe")
    cases = [("qwen2-moe mlp_only_layers", tmp / "qwen2_moe", "unsupported feature: mlp_only_layers=[1]")]

    def variant(name, edit):
        return config_variant(tmp / "good", tmp / name, edit)

    cases.append(("sliding window", variant("window", lambda c: c.update(sliding_window=16)),
                  "sliding-window attention (sliding_window=16)"))
    cases.append(("top-k", variant("topk", lambda c: c.update(num_experts_per_tok=5)),
                  "num_experts_per_tok=5 in config.json must be in 1..4"))
    cases.append(("expert count", variant("experts", lambda c: c.update(num_local_experts=8)),
                  "model.layers.0.block_sparse_moe.gate.weight has shape [4, 32] but config.json implies [8, 32]"))
    return cases


def test_bad_configs_in_process(tmp_path):
    """Each refusal names what does not fit (the same checks the command runs before touching a device)."""
    for name, src, phrase in _bad_inputs(tmp_path):
        with pytest.raises(ConfigError) as e:
            import_dir(src, tmp_path / f"out_{name.replace(' ', '_')}")
        assert phrase in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
        assert not (tmp_path / f"out_{name.replace(' ', '_')}").exists()


@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path):
    for name, src, phrase in _bad_inputs(tmp_path):
        out = tmp_path / f"out_{name.replace(' ', '_')}"
        r = run_cli("convert", "from-hf", str(src), "--out", str(out), timeout=120)
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], (name, r.stderr)
        assert not out.exists(), name


def test_export_refuses_moe_models_no_class_can_hold(tmp_path):
    """Settings no MoE class (Mixtral, Qwen3-MoE, Qwen2-MoE) can hold are refused before anything is written."""
    base = ["model.moe.experts=4", "model.n_layers=2"]
    for extra, phrase in [("model.moe.every=2", "model.moe.every=2"),
                          ("model.moe.shared_experts=1", "model.moe.shared_gate=false"),
                          ("model.moe.router=sigmoid", "model.moe.router=sigmoid"),
                          ("model.moe.normalize=false", "model.moe.normalize=false")]:
        cfg = load_config(None, base + [extra])
        with pytest.raises(ConfigError, match="no Hugging Face form: MixtralForCausalLM: ") as e:
            convert.export_hf(cfg, str(tmp_path / "nowhere"), 0, {"config": {}}, str(tmp_path / "out"))
        assert phrase in str(e.value)
        assert not (tmp_path / "out").exists()


def test_llama_mapping_still_refuses_experts_in_a_llama_config():
    with pytest.raises(ConfigError, match="mixture of experts"):
        hf_mapping.model_fields_from_hf({"architectures": ["LlamaForCausalLM"], "num_local_experts": 8})


def test_import_reads_transformers_fused_expert_tensors(tmp_path):
    """A checkpoint holding transformers 5's in-memory names (experts fused into gate_up_proj / down_proj, as a
    state_dict saved without save_pretrained) imports to the same logits."""
    from safetensors.torch import save_file

    hf_model = make_mixtral(tmp_path / "hf", seed=6)
    os.makedirs(tmp_path / "fused")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    os.link(tmp_path / "hf" / "config.json", tmp_path / "fused" / "config.json")
    cfg = import_dir(tmp_path / "fused", tmp_path / "jt", "runtime.cpu_devices=8", "mesh.ici.fsdp=2",
                     "mesh.ici.expert=2", "mesh.ici.tensor=2")
    toks = tokens()
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), hf_logits(hf_model, toks), atol=1e-4, rtol=0)
