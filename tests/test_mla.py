"""Multi-head latent attention (model.kv_lora_rank): one layer against transformers' DeepseekV3Attention (float32,
random small config built here, both rotary layouts, with and without the query latent), the XLA reference with a v
head dim of its own against float64 NumPy, the parameter count by hand, decoding from the compressed cache against
the full forward's greedy continuation, a data x fsdp x tensor mesh giving one device's losses, and the refusals."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ConfigError, load_config
from jaxtrain.kernels import mha_reference
from jaxtrain.models.attention import Local
from jaxtrain.models.flops import attention_flops_per_token, count_params
from jaxtrain.models.mla import LatentAttention, deinterleave_rope
from jaxtrain.parallel.layout import resolve_auto
from jaxtrain_testing import FAST, REPO, run_cli

# 4 heads of q/k 8 + 8 and v 12, latents 16 (kv) and 32 (q): every width different, so a transposed copy fails.
SMALL = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4", "model.kv_lora_rank=16",
         "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=12", "model.norm_eps=1e-6",
         "model.dtype=float32"]


def _hf_layer(q_lora_rank, interleave, seed=0):
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    torch.manual_seed(seed)
    c = DeepseekV3Config(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                         v_head_dim=12, rope_theta=10000.0, rms_norm_eps=1e-6, rope_interleave=interleave,
                         attn_implementation="eager")
    layer = hf.DeepseekV3Attention(c, 0).float()
    with torch.no_grad():
        for name, p in layer.named_parameters():  # norm scales too: ones would hide a missing norm
            p.copy_(torch.randn_like(p) * (0.5 if "layernorm" in name else 0.2) + (1.0 if "layernorm" in name else 0))
    return layer, hf.DeepseekV3RotaryEmbedding(c)


def _copy_into(layer, hf_layer, interleave):
    """transformers' [out, in] weights into the LatentAttention's kernels, the rotary rows de-interleaved where
    DeepSeek's layout interleaves them."""
    w = {k: v.detach().numpy().T for k, v in hf_layer.state_dict().items()}  # [in, out]
    fix = (lambda a, nope: deinterleave_rope(a, nope, 8)) if interleave else (lambda a, nope: a)
    q_name = "q_proj.weight" if "q_proj.weight" in w else "q_b_proj.weight"
    q = fix(w[q_name], 8).reshape(-1, 4, 16)
    if q_name == "q_proj.weight":
        layer.q.kernel[...] = jnp.asarray(q)
    else:
        layer.q_a.kernel[...] = jnp.asarray(w["q_a_proj.weight"])
        layer.q_a_norm.scale[...] = jnp.asarray(hf_layer.q_a_layernorm.weight.detach().numpy())
        layer.q_b.kernel[...] = jnp.asarray(q)
    layer.kv_a.kernel[...] = jnp.asarray(fix(w["kv_a_proj_with_mqa.weight"], 16))
    layer.kv_a_norm.scale[...] = jnp.asarray(hf_layer.kv_a_layernorm.weight.detach().numpy())
    layer.kv_b.kernel[...] = jnp.asarray(w["kv_b_proj.weight"].reshape(16, 4, 20))
    layer.o.kernel[...] = jnp.asarray(w["o_proj.weight"].reshape(4, 12, 64))


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_latent", "q_direct"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half_split"])
def test_one_layer_equals_transformers_deepseek_v3_attention(q_lora_rank, interleave):
    import torch

    hf_layer, rotary = _hf_layer(q_lora_rank, interleave)
    q_opt = [] if q_lora_rank is None else [f"model.q_lora_rank={q_lora_rank}"]
    cfg = load_config(None, [*SMALL, *q_opt]).model
    with nnx.use_eager_sharding(False):
        layer = LatentAttention(cfg, jnp.float32, jnp.float32, attention=Local("xla"), rngs=nnx.Rngs(0))
    _copy_into(layer, hf_layer, interleave)
    x = np.random.default_rng(1).normal(size=(2, 11, 64)).astype(np.float32)
    xt = torch.from_numpy(x)
    positions = torch.arange(11)[None].expand(2, 11)
    mask = torch.full((11, 11), float("-inf")).triu(1)[None, None].expand(2, 1, 11, 11)
    with torch.no_grad():
        want = hf_layer(xt, rotary(xt, positions), mask)[0].numpy()
    got = np.asarray(layer(jnp.asarray(x), None))
    assert np.abs(want).max() > 0.1  # not a vanishing output that would pass any comparison
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_reference_attention_takes_a_v_head_dim_of_its_own():
    """mha_reference with q/k heads of 24 and v heads of 16 (softmax scale 1/sqrt(24)) against a float64 loop, with
    two packed documents."""
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(2, 9, 4, 24)), rng.normal(size=(2, 9, 4, 24)), rng.normal(size=(2, 9, 4, 16))
    seg = np.array([[0] * 9, [0] * 4 + [1] * 5])
    want = np.zeros((2, 9, 4, 16))
    for b in range(2):
        for h in range(4):
            for i in range(9):
                keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
                logits = np.array([q[b, i, h] @ k[b, j, h] for j in keys]) / np.sqrt(24)
                p = np.exp(logits - logits.max())
                want[b, i, h] = (p / p.sum()) @ v[b, keys, h]
    got = mha_reference(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_parameter_count_and_attention_flops_by_hand():
    """tiny-mla by hand: per layer q_a 128x96 + norm 96 + q_b 96x8x24, kv_a 128x72 + norm 64, kv_b 64x8x32,
    o 8x16x128 = 72,864; MLP 3x128x384 = 147,456; two norms 256; x4 layers + embedding 256x128 + final norm 128."""
    from jaxtrain.models.moe import make_model

    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"))
    m = resolve_auto(cfg, "cpu").model
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make_model(m, rngs=nnx.Rngs(0)))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert actual == count_params(m)["total"] == 4 * (72_864 + 147_456 + 256) + 256 * 128 + 128 == 915_200
    direct = load_config(None, [*SMALL]).model  # no query latent: q 64x4x16, kv_a 64x24 + 16, kv_b 16x4x20, o 4x12x64
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make_model(direct, rngs=nnx.Rngs(0)))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    layer = 64 * 4 * 16 + 64 * 24 + 16 + 16 * 4 * 20 + 4 * 12 * 64 + 3 * 64 * 384 + 2 * 64
    assert actual == count_params(direct)["total"] == 4 * layer + 256 * 64 + 64
    # QK^T over 24-wide heads and PV over 16-wide ones, causal: 4 layers x 2 x 128 x 8 x (24 + 16) / 2 per token
    assert attention_flops_per_token(m, 128) == 4 * 2 * 128 * 8 * (24 + 16) / 2


@pytest.mark.slow  # ~20-90 s on 2 cores
def test_decoding_from_the_compressed_cache_equals_the_full_forward(tmp_path):
    """Greedy decoding through the latent cache ([layers, batch, max_len, 64] and [.., 8]: no K/V), prompts of
    different lengths prefilled as one batch and then one token per step as ``generate`` drives the model, gives the
    tokens that the full forward (no cache) over prompt + continuation picks greedily at every place."""
    from jaxtrain.parallel.layout import Layout

    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"),
                      [f"run.dir={tmp_path}", *FAST, "model.init_std=0.3", "mesh.ici.fsdp=1"])
    layout = Layout.build(cfg, jax.devices()[:1])
    model = nnx.merge(layout.model_graphdef(), layout.init_state()["model"])
    prompts, new = [[5, 17, 3, 44, 9, 71, 30], [40, 6]], 12
    tokens = np.zeros((2, 7), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    with layout.scope():
        cache = model.init_cache(2, 7 + new)
        assert cache["k"].shape == (4, 2, 19, 64) and cache["v"].shape == (4, 2, 19, 8)
        decode = jax.jit(lambda t, pos, c: model(t, positions=pos, cache=c))
        logits, cache = decode(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(7), (2, 7)), cache)
        tok = np.asarray(logits)[np.arange(2), lengths - 1].argmax(-1)
        got = [[int(t)] for t in tok]
        for i in range(new - 1):  # each row's next token goes in at its own position (rows are ragged)
            logits, cache = decode(jnp.asarray(tok[:, None]), jnp.asarray((lengths + i)[:, None]), cache)
            tok = np.asarray(logits)[:, 0].argmax(-1)
            for row, t in zip(got, tok):
                row.append(int(t))
        # The full forward over prompt + continuation: causal, so its argmax at each place is the greedy choice
        # after that prefix; every decoded token must be it.
        for prompt, row in zip(prompts, got):
            logits = np.asarray(jax.jit(model)(jnp.asarray([prompt + row])))[0]
            assert row == logits[len(prompt) - 1:-1].argmax(-1).tolist(), (prompt, row)
    assert len(set(got[0])) > 1  # not one repeated token
    # what `python -m jaxtrain generate` runs: its cache from the model's own cache shapes, the same tokens
    from jaxtrain.hf import generate

    assert generate.generate(model, layout, prompts, max_new_tokens=new).new_ids == got


MESH_OPTS = ["model.n_layers=2", "data.seq_len=64", "train.global_batch=8", "train.steps=6", "train.warmup_steps=2",
             "train.eval_every=0"]


def _losses(tmp_path, n, *mesh):
    from jaxtrain.train import loop

    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"),
                      [f"run.dir={tmp_path / 'run'}", *FAST, *MESH_OPTS, *mesh])
    result = loop.train(cfg, devices=jax.devices()[:n])
    return np.array([result.losses[s] for s in range(1, 7)])


@pytest.mark.slow  # ~20-90 s on 2 cores
def test_a_data_fsdp_tensor_mesh_gives_one_devices_losses(tmp_path):
    one = _losses(tmp_path / "one", 1, "mesh.ici.fsdp=1")
    mesh = _losses(tmp_path / "mesh", 8, "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2")
    np.testing.assert_allclose(mesh, one, rtol=1e-4)
    assert one[-1] < one[0]  # it trained


@pytest.mark.parametrize("overrides, message", [
    (["model.kv_lora_rank=0"], "model.kv_lora_rank=0 must be > 0 (or null: standard attention)"),
    (["model.q_lora_rank=-4"], "model.q_lora_rank=-4 must be > 0 (or null: queries projected directly)"),
    (["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim=7 must be even (rotary pairs)"),
    (["model.v_head_dim=0"], "model.v_head_dim=0 must be"),
    (["model.n_kv_heads=4"], "model.n_kv_heads=4 must equal model.n_heads=8 with multi-head latent attention"),
    (["model.head_dim=32"], "model.head_dim=32 does not apply to multi-head latent attention"),
    (["model.qk_norm=true"], "model.qk_norm=true does not combine with multi-head latent attention"),
    (["model.attention=cudnn"], "model.attention=cudnn cannot take multi-head latent attention's v head dim (16) "
                                "differing from q/k's (24); use xla or auto"),
    (["model.attention=pallas"], "model.attention=pallas cannot take"),
    (["model.attention=triton"], "model.attention=triton cannot take"),
    (["mesh.ici.context=2"], "mesh.ici.context=2: ring attention takes one head dim"),
])
def test_bad_options_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"), overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_kernel_attention_exits_2_in_one_line(tmp_path):
    proc = run_cli("train", "--config", "jaxtrain/configs/tiny-mla.yaml", "model.attention=pallas",
                   f"run.dir={tmp_path}/run", "train.steps=1", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model.attention=pallas cannot take multi-head latent attention's v head dim" in lines[0]


def test_auto_attention_is_xla_on_gpus():
    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"),
                      ["model.attention=auto", "model.dtype=bfloat16", "mesh.ici.fsdp=1"])
    assert resolve_auto(cfg, "gpu", 1).model.attention == "xla"
    plain = load_config(None, ["model.attention=auto", "model.dtype=bfloat16", "mesh.ici.fsdp=1"])
    assert resolve_auto(plain, "gpu", 1).model.attention == "cudnn"  # the same config without MLA: a kernel


def _moe_mla():
    """tiny-deepseek-moe with MLA (DeepSeek-V3's pairing) and FP8 projections, resolved for the CPU."""
    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-deepseek-moe.yaml"), [
        "model.n_kv_heads=8", "model.kv_lora_rank=32", "model.q_lora_rank=48", "model.qk_nope_head_dim=16",
        "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.dtype=float32", "model.fp8=tensorwise",
        "model.moe.gemm=xla"])
    return resolve_auto(cfg, "cpu").model


def test_moe_layers_take_mla_counted_by_hand():
    """The MoE model's parameter count and FP8 FLOPs with MLA in its layers."""
    from jaxtrain.models.flops import fp8_flops_per_token
    from jaxtrain.models.moe import make_model

    m = _moe_mla()
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make_model(m, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == count_params(m)["total"]
    # attention per layer: q_a 128x48, q_b 48x8x24, kv_a 128x40, kv_b 32x8x32, o 8x16x128 = 45,056; MLP: 2 shared and
    # 4 routed experts of 3x128x64; x 4 layers, forward and backward (3 x 2 FLOPs a weight)
    assert fp8_flops_per_token(m, 128) == 6 * 4 * (45_056 + (2 + 4) * 3 * 128 * 64)


@pytest.mark.slow  # ~35 s on 2 cores
def test_moe_layers_with_mla_prefill_through_the_latent_cache():
    """The MoE model with MLA and FP8 projections: the prefill through the latent cache equals the forward without."""
    from jaxtrain.models.moe import make_model

    with nnx.use_eager_sharding(False):
        model = make_model(_moe_mla(), rngs=nnx.Rngs(0))
    tok = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 10)))
    full = model(tok)
    cached, cache = model(tok, positions=jnp.broadcast_to(jnp.arange(10), (2, 10)), cache=model.init_cache(2, 12))
    assert cache["k"].shape == (4, 2, 12, 32) and cache["v"].shape == (4, 2, 12, 8)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=1e-5)
