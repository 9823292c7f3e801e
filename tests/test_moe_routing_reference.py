"""The router's figures against float64 NumPy written here (no torch): the per-layer and pooled load-balancing losses,
the z-loss, and padding that is never routed (no slot, no count, no loss), down to a padded chat batch through the
train step. Expected values never come from jaxtrain's own routing code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import MoEConfig
from jaxtrain.data.chat import pack
from jaxtrain.data.tokens import DOC_START, NO_LOSS, PAD, TOKEN_BITS
from jaxtrain.models import moe as moe_lib
from jaxtrain.models import routing
from jaxtrain_testing import random_model


def np_router(logits, k):
    """logits float64 [T, E] -> (softmax probabilities [T, E], top-k experts [T, k], logsumexp [T])."""
    m = logits.max(-1, keepdims=True)
    z = np.exp(logits - m)
    probs = z / z.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    return probs, experts, np.log(z.sum(-1)) + m[:, 0]


def np_balance(layers, k, form):
    """Switch's E x sum_e f_e P_e from float64 logits of each layer [G][T, E]: per layer then the mean, or pooled."""
    e = layers[0].shape[-1]
    counts, probs = [], []
    for logits in layers:
        p, ex, _ = np_router(logits, k)
        counts.append(np.bincount(ex.ravel(), minlength=e).astype(np.float64))
        probs.append(p.sum(0))
    tokens = np.array([lg.shape[0] for lg in layers], np.float64)
    if form == "pooled":
        n = tokens.sum()
        return e * np.sum(np.sum(counts, 0) / n * (np.sum(probs, 0) / n))
    return np.mean([e * np.sum(c / t * (p / t)) for c, p, t in zip(counts, probs, tokens)])


def _stats_of_layers(layers, moe, routed=None, slots=None):
    """jaxtrain's RouterStats [G, ...] of float32 logits per layer [G][B, S, E] (x = logits, router = identity)."""
    e = layers[0].shape[-1]
    out = [routing.route(jnp.asarray(lg, jnp.float32), jnp.eye(e), moe, slots, routed)[1] for lg in layers]
    return jax.tree.map(lambda *a: jnp.stack(a), *out)


@pytest.mark.parametrize("form", ["per_layer", "pooled"])
def test_balance_loss_forms_equal_numpy(form):
    rng = np.random.default_rng(0)
    layers = [rng.normal(size=(64, 8)) * s for s in (0.5, 1.0, 3.0)]
    moe = MoEConfig(experts=8, top_k=2, balance_loss=form)
    stats = _stats_of_layers([lg.reshape(2, 32, 8) for lg in layers], moe)
    want = np_balance(layers, 2, form)
    np.testing.assert_allclose(float(routing.load_balancing_loss(stats, form)), want, rtol=2e-6)
    _, total = moe_lib.objective(jnp.zeros(()), stats, moe)
    np.testing.assert_allclose(float(total["moe_balance_loss"]), want, rtol=2e-6)


def test_layers_collapsing_onto_different_experts_cancel_only_when_pooled():
    """Four layers, each sending every token (top 1) to its own expert: each layer's f and P are one-hot, so a
    layer's loss is E x 1 x 1 = 4 and their mean 4; pooled over layers, f = P = 1/4 each: 4 x 4 x 1/16 = 1, the
    uniform value, blind to the collapse (by hand)."""
    e, t = 4, 16
    layers = [np.full((t, e), -30.0) for _ in range(e)]
    for g, lg in enumerate(layers):
        lg[:, g] = 30.0
    moe = MoEConfig(experts=e, top_k=1)
    stats = _stats_of_layers([lg.reshape(1, t, e) for lg in layers], moe)
    assert float(routing.load_balancing_loss(stats, "per_layer")) == pytest.approx(4.0, rel=1e-6)
    assert float(routing.load_balancing_loss(stats, "pooled")) == pytest.approx(1.0, rel=1e-6)


def test_loss_weights_are_each_terms_own():
    """objective = loss + share x (aux_loss x balance + z_loss x z), each figure times share (by hand)."""
    rng = np.random.default_rng(1)
    layers = [rng.normal(size=(32, 4)) for _ in range(2)]
    moe = MoEConfig(experts=4, top_k=2, aux_loss=0.25, z_loss=0.125)
    stats = _stats_of_layers([lg.reshape(1, 32, 4) for lg in layers], moe)
    balance = np_balance(layers, 2, "per_layer")
    z = np.mean(np.concatenate([np_router(lg, 2)[2] ** 2 for lg in layers]))
    total, figures = moe_lib.objective(jnp.float32(1.5), stats, moe, share=0.5)
    np.testing.assert_allclose(float(total), 1.5 + 0.5 * (0.25 * balance + 0.125 * z), rtol=2e-6)
    np.testing.assert_allclose(float(figures["moe_balance_loss"]), 0.5 * balance, rtol=2e-6)
    np.testing.assert_allclose(float(figures["moe_z_loss"]), 0.5 * z, rtol=2e-6)
    assert float(figures["loss"]) == 1.5


def test_padding_takes_no_slot_and_counts_nowhere():
    """The issue's case: one row of 8 real tokens and 24 pads, 4 experts, top 2, capacity 1 (slots = ceil(1 x 32 x
    2 / 4) = 16 per expert). Pads get no expert and weight 0; the real tokens' choices are all kept (8 x 2 = 16
    assignments, at most 16 per expert) and the statistics are those of the 8 real tokens alone (float64 NumPy)."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(32, 4)) * 2.0
    moe = MoEConfig(experts=4, top_k=2, capacity_factor=1.0)
    slots = routing.slots_per_expert(32, moe)
    assert slots == 16
    routed = jnp.arange(32)[None] < 8
    route, stats = routing.route(jnp.asarray(logits[None], jnp.float32), jnp.eye(4), moe, slots, routed)
    probs, experts, lse = np_router(logits[:8], 2)
    np.testing.assert_array_equal(np.asarray(route.experts[0, :8]), experts)
    np.testing.assert_array_equal(np.asarray(route.experts[0, 8:]), 4)  # the sentinel: no expert
    np.testing.assert_array_equal(np.asarray(route.weights[0, 8:]), 0.0)
    assert float(stats.dropped) == 0.0
    np.testing.assert_array_equal(np.asarray(stats.counts), np.bincount(experts.ravel(), minlength=4))
    np.testing.assert_allclose(np.asarray(stats.prob_sum), probs.sum(0), rtol=1e-6)
    assert float(stats.tokens) == 8.0
    np.testing.assert_allclose(float(stats.z_sum), np.sum(lse ** 2), rtol=1e-6)
    np.testing.assert_allclose(float(routing.load_balancing_loss(stats)), np_balance([logits[:8]], 2, "pooled"),
                               rtol=2e-6)


def test_pads_first_choices_never_beat_real_second_choices():
    """Capacity 2 per expert (4 experts, top 2, 4 tokens, capacity_factor 1: ceil(4 x 2 / 4) = 2): three pads that
    all prefer expert 0 come before the real tokens that want expert 0 second. Unmasked, the pads' first choices
    fill expert 0 and drop the real second choices; masked, every real assignment is kept (by hand)."""
    logits = np.array([[9.0, 8.0, 0.0, 0.0],  # pad: 0 then 1
                       [9.0, 8.0, 0.0, 0.0],  # pad
                       [0.0, 8.0, 9.0, 0.0],  # real: 2 then 1
                       [8.0, 0.0, 0.0, 9.0]])  # real: 3 then 0
    moe = MoEConfig(experts=4, top_k=2, capacity_factor=1.0)
    x = jnp.asarray(logits[None], jnp.float32)
    routed = jnp.asarray([[False, False, True, True]])
    unmasked, _ = routing.route(x, jnp.eye(4), moe, 2)
    masked, stats = routing.route(x, jnp.eye(4), moe, 2, routed)
    assert np.asarray(unmasked.experts)[0, 2:].tolist() == [[2, 4], [3, 4]]  # the second choices dropped
    assert np.asarray(masked.experts)[0, 2:].tolist() == [[2, 1], [3, 0]]
    assert float(stats.dropped) == 0.0 and np.asarray(stats.counts).tolist() == [1, 1, 1, 1]


MOE_CHAT = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=32", "model.moe.aux_loss=0.5",
            "model.moe.z_loss=0.25"]  # dropless: a prefix alone has other slots
SEQ = 12


def _words(rng, real):
    """A chat row of ``real`` example tokens (prompt 2, the rest trained), padded as data/chat.pack pads."""
    ids = rng.integers(5, 61, size=real)
    trained = np.arange(real) >= 2
    return pack([(ids, trained)], SEQ + 1, packed=False)[0][0]


def test_chat_padding_is_flagged_and_never_routed_through_the_step(tmp_path):
    """A padded chat batch's router figures from the train step's own objective equal those of the real tokens
    alone: each row's real prefix run through the model by itself, its statistics summed, the losses in NumPy."""
    from jaxtrain_testing import make_chat_tokenizer

    tok = make_chat_tokenizer(tmp_path / "tok")
    src = tmp_path / "c.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    ts, state, _ = random_model(tmp_path, "data.format=chat", f"data.tokenizer={tok}", f"data.source={src}",
                                f"data.seq_len={SEQ}", "data.pack=false", "train.global_batch=2", *MOE_CHAT, seed=4)
    rng = np.random.default_rng(0)
    reals = (5, 9)
    batch = np.stack([_words(rng, r) for r in reals]).astype(np.int32)
    assert ((batch[0] & PAD) > 0).tolist() == [False] * 5 + [True] * 8  # pack flags exactly the tail
    model_def, params = nnx.split(nnx.merge(ts.layout.graphdef, state).model, nnx.Param)
    with ts.layout.scope():
        _, metrics = jax.jit(lambda p, b: ts._objective(p, model_def, b, ts._trained_tokens(b)))(
            params, jnp.asarray(batch))
        model = nnx.merge(ts.layout.graphdef, state).model
        per_row = [model.forward_with_stats(jnp.asarray(batch[i:i + 1, :r] & TOKEN_BITS))[1]
                   for i, r in enumerate(reals)]
    counts = sum(np.asarray(s.counts, np.float64) for s in per_row)  # [G, E]
    probs = sum(np.asarray(s.prob_sum, np.float64) for s in per_row)
    tokens = sum(np.asarray(s.tokens, np.float64) for s in per_row)
    z = sum(np.asarray(s.z_sum, np.float64) for s in per_row)
    assert tokens.tolist() == [14.0] * counts.shape[0]
    balance = np.mean(4 * np.sum(counts / tokens[:, None] * probs / tokens[:, None], axis=-1))
    np.testing.assert_allclose(float(metrics["moe_balance_loss"]), balance, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["moe_z_loss"]), z.sum() / tokens.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["moe_max_load"]), np.max(counts.max(-1) / counts.mean(-1)), rtol=1e-6)


def test_flags_do_not_collide():
    """Token ids keep 28 bits; the three flags are distinct bits above them."""
    assert TOKEN_BITS == (1 << 28) - 1
    assert len({PAD, DOC_START, NO_LOSS}) == 3 and not (PAD | DOC_START | NO_LOSS) & TOKEN_BITS
