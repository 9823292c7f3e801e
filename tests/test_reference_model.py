"""The model's arithmetic against independent NumPy (float64) references written from the Llama definition.

Nothing here calls the model's own helpers to produce an expected value: rotary embedding, RMSNorm, grouped-query
causal attention, SwiGLU and the output projection are re-derived below from the published formulas (Llama /
Hugging Face ``LlamaForCausalLM``: ``rotate_half`` layout, ``inv_freq = theta ** -(2i / head_dim)``, query head h
reads kv head ``h // (heads / kv_heads)``, Llama 3.1's frequency scaling from Meta's recipe). The weights are
random, with norm scales far from 1 and a large ``norm_eps``, so that a dropped scale, a misplaced epsilon, a
swapped projection or a wrong GQA grouping moves the logits by far more than float32 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.models.llama import rope_frequencies, rotary
from jaxtrain.train import step as step_lib
from jaxtrain_testing import REFERENCE_SMALL, random_model

# ---------------------------------------------------------------------------------------------------------------
# NumPy reference (float64)


def np_inv_freq(head_dim, theta):
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def np_llama3_inv_freq(head_dim, theta, factor, low, high, old_len):
    """transformers' ``_compute_llama3_parameters``, transcribed."""
    inv = np_inv_freq(head_dim, theta)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def np_rope(x, inv_freq, positions):
    """x [b, s, h, d] at positions [b, s]: HF's ``x * cos + rotate_half(x) * sin`` with cos/sin tiled twice."""
    ang = positions[..., None].astype(np.float64) * inv_freq  # [b, s, d/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, :, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, :, None, :]
    half = x.shape[-1] // 2
    rotate_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotate_half * sin


def np_rmsnorm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_segments(inputs, eos):
    """Documents end with their eos token: a token's segment is the number of eos tokens strictly before it."""
    out = np.zeros_like(inputs)
    for b, row in enumerate(inputs):
        seen = 0
        for i, t in enumerate(row):
            out[b, i] = seen
            seen += int(t == eos)
    return out


def np_forward(w, m, tokens, segments=None):
    """Logits float64 [batch, seq, vocab] of a Llama decoder with weights ``w`` (nested dict, stacked layers)."""
    b, s = tokens.shape
    heads, kv, hd = m.n_heads, m.n_kv_heads, m.resolved_head_dim
    inv_freq = np_inv_freq(hd, m.rope_theta)
    positions = np.broadcast_to(np.arange(s), (b, s))
    allowed = np.tril(np.ones((s, s), bool))[None]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    x = w["embed"]["embedding"][tokens]
    blk = w["blocks"]
    for layer in range(m.n_layers):
        h = np_rmsnorm(x, blk["attn_norm"]["scale"][layer], m.norm_eps)
        q = np.einsum("bse,ehd->bshd", h, blk["attn"]["q"]["kernel"][layer])
        k = np.einsum("bse,ehd->bshd", h, blk["attn"]["k"]["kernel"][layer])
        v = np.einsum("bse,ehd->bshd", h, blk["attn"]["v"]["kernel"][layer])
        q, k = np_rope(q, inv_freq, positions), np_rope(k, inv_freq, positions)
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)  # HF repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = np.where(allowed[:, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", p, v)
        x = x + np.einsum("bqhd,hde->bqe", o, blk["attn"]["o"]["kernel"][layer])
        h = np_rmsnorm(x, blk["mlp_norm"]["scale"][layer], m.norm_eps)
        gate = h @ blk["mlp"]["gate"]["kernel"][layer]
        up = h @ blk["mlp"]["up"]["kernel"][layer]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ blk["mlp"]["down"]["kernel"][layer]
    x = np_rmsnorm(x, w["final_norm"]["scale"], m.norm_eps)
    return x @ w["embed"]["embedding"].T if m.tie_embeddings else x @ w["unembed"]["kernel"]


def np_next_token_loss(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


# ---------------------------------------------------------------------------------------------------------------
# Rotary


def test_rope_frequencies_match_the_llama_formula():
    m = load_config(None, REFERENCE_SMALL).model
    np.testing.assert_allclose(np.asarray(rope_frequencies(m)), np_inv_freq(24, 300.0), rtol=1e-6)


def test_llama3_scaled_frequencies_match_transformers_formula():
    # head_dim 64, theta 5e5: wavelengths from 2*pi to ~1e6, so all three regimes (kept, interpolated, stretched)
    # occur for original_max_len 8192 (thresholds 2048 and 8192).
    m = load_config(None, ["model.head_dim=64", "model.rope_theta=500000", "model.rope_scaling.type=llama3",
                           "model.rope_scaling.factor=8", "model.rope_scaling.original_max_len=8192"]).model
    expected = np_llama3_inv_freq(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    wavelen = 2 * np.pi / np_inv_freq(64, 500000.0)
    assert (wavelen < 2048).any() and ((wavelen > 2048) & (wavelen < 8192)).any() and (wavelen > 8192).any()
    np.testing.assert_allclose(np.asarray(rope_frequencies(m)), expected, rtol=1e-5)


def test_rotary_matches_numpy_and_preserves_norms():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 3, 24)).astype(np.float32)
    inv = np_inv_freq(24, 300.0)
    positions = np.array([np.arange(9), np.arange(9)[::-1] + 5])  # explicit, per-row positions
    got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(inv, jnp.float32), jnp.asarray(positions)))
    np.testing.assert_allclose(got, np_rope(x.astype(np.float64), inv, positions), atol=2e-5)
    # Each (i, i + d/2) pair is rotated, so every vector keeps its length ...
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # ... and the default positions are 0 .. seq-1 (position 0 is the identity).
    default = np.asarray(rotary(jnp.asarray(x), jnp.asarray(inv, jnp.float32)))
    np.testing.assert_allclose(default, np_rope(x.astype(np.float64), inv, np.broadcast_to(np.arange(9), (2, 9))),
                               atol=2e-5)
    np.testing.assert_array_equal(default[:, 0], x[:, 0])


def test_rotary_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(1, 1, 1, 24)), rng.normal(size=(1, 1, 1, 24))
    inv = jnp.asarray(np_inv_freq(24, 300.0), jnp.float32)

    def score(m, n):
        qm = rotary(jnp.asarray(q, jnp.float32), inv, jnp.array([[m]]))
        kn = rotary(jnp.asarray(k, jnp.float32), inv, jnp.array([[n]]))
        return float(jnp.sum(qm * kn))

    assert score(7, 3) == pytest.approx(score(11, 7), rel=1e-4) == pytest.approx(score(4, 0), rel=1e-4)
    assert abs(score(7, 3) - score(3, 7)) > 1e-3  # and on its sign: rotary is not symmetric in m - n


# ---------------------------------------------------------------------------------------------------------------
# Whole model


def _logits(ts, state, tokens, segments=None):
    def forward(state, tokens, segments):
        return nnx.merge(ts.layout.graphdef, state).model(tokens, segments)

    with ts.layout.scope():
        return np.asarray(jax.jit(forward)(state, jnp.asarray(tokens), None if segments is None else
                                           jnp.asarray(segments)))


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_numpy_float64_forward(tmp_path, tied):
    ts, state, w = random_model(tmp_path, f"model.tie_embeddings={str(tied).lower()}")
    assert ("unembed" in w) != tied
    tokens = np.random.default_rng(2).integers(0, 61, size=(3, 12))
    expected = np_forward(w, ts.cfg.model, tokens)
    got = _logits(ts, state, tokens)
    # float32 against float64 through 2 layers with O(1) activations: errors ~1e-5 of the logits' scale.
    scale = np.abs(expected).max()
    assert scale > 1.0  # the check is not on vanishing numbers
    np.testing.assert_allclose(got, expected, atol=2e-5 * scale, rtol=1e-4)


def test_document_masked_logits_match_numpy(tmp_path):
    ts, state, w = random_model(tmp_path, "model.tie_embeddings=false", seed=3)
    tokens = np.array([[5, 9, 0, 7, 7, 3, 0, 0, 12, 40, 2, 8], [0, 4, 4, 4, 9, 11, 0, 13, 14, 0, 60, 1],
                       [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    segments = np_segments(tokens, 0)
    expected = np_forward(w, ts.cfg.model, tokens, segments)
    got = _logits(ts, state, tokens, segments)
    np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=1e-4)
    unmasked = np_forward(w, ts.cfg.model, tokens)
    assert np.abs(unmasked[:2] - expected[:2]).max() > 1e-2  # the masks in this example do change the logits


@pytest.mark.parametrize("document_mask", [False, True])
def test_eval_loss_is_next_token_cross_entropy_of_the_reference_logits(tmp_path, document_mask):
    """eval_step on a batch int [b, seq+1]: inputs tokens[:, :-1], targets tokens[:, 1:], segments cut after eos."""
    ts, state, w = random_model(tmp_path, f"data.document_mask={str(document_mask).lower()}", "data.eos_id=3",
                                 seed=4)
    rng = np.random.default_rng(5)
    batch = rng.integers(0, 61, size=(3, 13))
    batch[:, [2, 6, 7]] = 3  # documents of several lengths, and an empty one
    inputs, targets = batch[:, :-1], batch[:, 1:]
    segments = np_segments(inputs, 3) if document_mask else None
    expected = np_next_token_loss(np_forward(w, ts.cfg.model, inputs, segments), targets)
    with ts.layout.scope():
        got = float(jax.jit(ts.eval_step)(state, jnp.asarray(batch, jnp.int32)))
    assert got == pytest.approx(expected, rel=2e-5)


def test_initial_parameters_follow_the_documented_init(tmp_path):
    """Normal(0, init_std) for embeddings and input projections; the residual branches' output projections (o, down)
    scaled by 1 / sqrt(2 * n_layers) (GPT-2); norm scales 1. Measured on the tiny config's fresh state."""
    cfg = load_config(None, [f"run.dir={tmp_path}", "model.dtype=float32", "mesh.ici.fsdp=1",
                             "model.tie_embeddings=false"])
    ts = step_lib.setup(cfg, jax.devices()[:1])
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(ts.layout.init_state()["model"]))
    std, layers = cfg.model.init_std, cfg.model.n_layers
    blk = params["blocks"]
    expected = {"embedding": (params["embed"]["embedding"], std), "unembed": (params["unembed"]["kernel"], std),
                "q": (blk["attn"]["q"]["kernel"], std), "k": (blk["attn"]["k"]["kernel"], std),
                "v": (blk["attn"]["v"]["kernel"], std), "gate": (blk["mlp"]["gate"]["kernel"], std),
                "up": (blk["mlp"]["up"]["kernel"], std),
                "o": (blk["attn"]["o"]["kernel"], std / (2 * layers) ** 0.5),
                "down": (blk["mlp"]["down"]["kernel"], std / (2 * layers) ** 0.5)}
    for name, (w, s) in expected.items():
        # >= 16k samples each: the sample std is within ~1% of the true one; 5% separates 0.02 from 0.0071.
        assert w.size >= 16_000 and abs(w.mean()) < 0.05 * s, name
        assert w.std() == pytest.approx(s, rel=0.05), name
    for layer in range(layers):  # layers are initialised independently, not copies of one another
        assert not np.array_equal(blk["mlp"]["up"]["kernel"][layer], blk["mlp"]["up"]["kernel"][0]) or layer == 0
    for scale in (blk["attn_norm"]["scale"], blk["mlp_norm"]["scale"], params["final_norm"]["scale"]):
        np.testing.assert_array_equal(scale, 1.0)
