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


def _float64_attention(q, k, v, seg):
    """Causal attention with documents ``seg`` [batch, seq], softmax scale 1/sqrt(q's head dim), a float64 loop."""
    b_n, s_n, h_n = q.shape[:3]
    want = np.zeros((b_n, s_n, h_n, v.shape[-1]))
    for b in range(b_n):
        for h in range(h_n):
            for i in range(s_n):
                keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
                logits = np.array([q[b, i, h] @ k[b, j, h] for j in keys]) / np.sqrt(q.shape[-1])
                p = np.exp(logits - logits.max())
                want[b, i, h] = (p / p.sum()) @ v[b, keys, h]
    return want


def _qkv(seq, rng=None):
    rng = np.random.default_rng(2) if rng is None else rng
    return rng.normal(size=(2, seq, 4, 24)), rng.normal(size=(2, seq, 4, 24)), rng.normal(size=(2, seq, 4, 16))


def test_the_reference_attention_takes_a_v_head_dim_of_its_own():
    """mha_reference with q/k heads of 24 and v heads of 16 (softmax scale 1/sqrt(24)) against a float64 loop, with
    two packed documents."""
    q, k, v = _qkv(9)
    seg = np.array([[0] * 9, [0] * 4 + [1] * 5])
    got = mha_reference(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), _float64_attention(q, k, v, seg), atol=1e-5)


def test_the_flash_kernel_takes_mla_padded_to_its_head_dim():
    """The Pallas flash kernel (interpreted) through Local: q/k of 24 and v of 16 zero-padded to its 32, the scale
    kept at 1/sqrt(24): the output equals the float64 loop, and q, k, v's gradients equal the XLA reference's (itself
    checked against the loop above), with two packed documents."""
    q, k, v = _qkv(32)
    seg = np.array([[0] * 32, [0] * 13 + [1] * 19])
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    kernel, reference = Local("pallas", interpret=True), Local("xla")
    out = kernel(*args, jnp.asarray(seg))
    assert out.shape == (2, 32, 4, 16)
    np.testing.assert_allclose(np.asarray(out), _float64_attention(q, k, v, seg), atol=2e-5)
    cot = jnp.asarray(np.random.default_rng(5).normal(size=out.shape), jnp.float32)

    def grads(attend):
        return jax.grad(lambda *a: jnp.sum(attend(*a, jnp.asarray(seg)) * cot), argnums=(0, 1, 2))(*args)

    for got, want in zip(grads(kernel), grads(reference)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5)


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
    (["model.attention=cudnn", "model.qk_nope_head_dim=256"], "model.attention=cudnn takes head dims up to 256, "
                                                               "not multi-head latent attention's q/k 264 and v 16"),
    (["model.attention=pallas", "model.qk_nope_head_dim=250"], "model.attention=pallas takes head dims up to 256"),
    (["model.attention=triton", "model.v_head_dim=272"], "model.attention=triton takes head dims up to 256"),
    (["mesh.ici.context=2"], "mesh.ici.context=2: ring attention takes one head dim"),
])
def test_bad_options_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"), overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_kernel_attention_too_wide_exits_2_in_one_line(tmp_path):
    proc = run_cli("train", "--config", "jaxtrain/configs/tiny-mla.yaml", "model.attention=pallas",
                   "model.qk_nope_head_dim=256", f"run.dir={tmp_path}/run", "train.steps=1", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model.attention=pallas takes head dims up to 256, not multi-head latent attention's q/k 264" in lines[0]


@pytest.mark.parametrize("overrides, want", [
    ([], "cudnn"),  # q/k 24, v 16: cuDNN at 24
    (["data.document_mask=true"], "flash"),  # cuDNN's entry takes no segments: the flash kernel at 32
    (["model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64", "model.v_head_dim=128"], "flash"),  # DeepSeek-V3
    (["model.qk_nope_head_dim=250"], "xla"),  # 258 wide: no kernel takes it
])
def test_auto_attention_on_gpus_by_the_padded_head_dim(overrides, want):
    """DeepSeek-V3's 192 / 128 pads to 192 on cuDNN (beyond 128: not every GPU's) and 256 on the flash kernels."""
    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"),
                      ["model.attention=auto", "model.dtype=bfloat16", "mesh.ici.fsdp=1", *overrides])
    got = resolve_auto(cfg, "gpu", 1).model.attention
    assert got in (("pallas", "triton") if want == "flash" else (want,))


@pytest.mark.slow  # ~20 s on 2 cores
def test_a_model_with_flash_mla_equals_the_xla_model():
    """tiny-mla's shape, one layer: logits and every parameter's gradient with the Pallas kernel (interpreted, MLA
    padded) equal the XLA reference's."""
    from jaxtrain.models.moe import make_model

    cfg = load_config(os.path.join(REPO, "jaxtrain/configs/tiny-mla.yaml"),
                      ["model.n_layers=1", "model.dtype=float32", "model.attention=pallas", "model.init_std=0.2"])
    m = resolve_auto(cfg, "cpu").model
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)))

    def logits_and_grads(attention):
        with nnx.use_eager_sharding(False):
            model = make_model(m, rngs=nnx.Rngs(0), attention=attention)
        graphdef, params = nnx.split(model, nnx.Param)
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tok) ** 2)  # noqa: E731
        return model(tok), jax.grad(loss)(params)

    (a, ga), (b, gb) = logits_and_grads(Local("pallas", interpret=True)), logits_and_grads(Local("xla"))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=1e-4)


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
