"""The optimizer and the train step's update against a hand-written reference of their documented semantics.

Documented (docs/training.md "The step and the loop", state.make_optimizer): global-norm clipping of the gradients,
then AdamW
(bias-corrected moments, decoupled weight decay on kernels and embeddings, none on norm scales) at a learning rate
that warms up linearly (step s of the warmup at lr * s / warmup_steps, 1-based) and then follows a cosine to
lr * min_lr_ratio at decay_steps, constant after. The reference below is plain NumPy float64, written from those
sentences; optax is not used to build the expected values.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.optim.state import make_optimizer
from jaxtrain_testing import random_model

OPT = ["train.lr=0.05", "train.warmup_steps=2", "train.decay_steps=5", "train.min_lr_ratio=0.2",
       "train.weight_decay=0.3", "train.b1=0.8", "train.b2=0.9", "train.grad_clip=0.5"]
EPS = 1e-8  # optax.adamw's default, which make_optimizer keeps


def hand_lr(step, lr, warmup, decay, min_ratio):
    """Learning rate of 1-based step ``step``."""
    if step <= warmup:
        return lr * step / warmup
    progress = min(step - warmup, decay - warmup) / (decay - warmup)
    end = lr * min_ratio
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * progress))


def test_schedule_values_at_given_steps():
    t = load_config(None, ["train.lr=0.01", "train.warmup_steps=4", "train.decay_steps=10",
                           "train.min_lr_ratio=0.1"]).train
    _, schedule = make_optimizer(t)
    # schedule(count) is the rate of the update with optax count `count`, i.e. of step count + 1.
    expected = {1: 0.0025, 2: 0.005, 4: 0.01, 7: 0.001 + 0.009 * 0.5, 10: 0.001, 11: 0.001, 50: 0.001}
    for step, lr in expected.items():
        assert float(schedule(step - 1)) == pytest.approx(lr, rel=1e-6), step
        assert hand_lr(step, 0.01, 4, 10, 0.1) == pytest.approx(lr, rel=1e-12)


class HandAdamW:
    """Clip by global norm, then AdamW; ``decay(name)`` says which leaves (by path) are decayed."""

    def __init__(self, t, decay):
        self.t, self.decay, self.step = t, decay, 0
        self.mu = self.nu = None

    def update(self, params: dict, grads: dict) -> dict:
        t = self.t
        self.step += 1
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        factor = min(1.0, t.grad_clip / norm) if t.grad_clip > 0 else 1.0
        grads = {k: g * factor for k, g in grads.items()}
        if self.mu is None:
            self.mu = {k: np.zeros_like(g) for k, g in grads.items()}
            self.nu = {k: np.zeros_like(g) for k, g in grads.items()}
        lr = hand_lr(self.step, t.lr, t.warmup_steps, t.decay_steps, t.min_lr_ratio)
        out = {}
        for k, g in grads.items():
            self.mu[k] = t.b1 * self.mu[k] + (1 - t.b1) * g
            self.nu[k] = t.b2 * self.nu[k] + (1 - t.b2) * g * g
            m_hat = self.mu[k] / (1 - t.b1 ** self.step)
            v_hat = self.nu[k] / (1 - t.b2 ** self.step)
            decay = t.weight_decay * params[k] if self.decay(k) else 0.0
            out[k] = params[k] - lr * (m_hat / (np.sqrt(v_hat) + EPS) + decay)
        return out


def _is_decayed(name: str) -> bool:
    return not name.endswith("_norm/scale")


def _flat(tree) -> dict:
    """{"blocks/attn_norm/scale": float64 array, ...} (NNX's Variable ``.value`` level dropped)."""
    def name(path):
        keys = (str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        return "/".join(k for k in keys if k != "value")

    return {name(path): np.asarray(leaf, np.float64) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_make_optimizer_is_clip_then_adamw_without_decay_on_norm_scales():
    t = load_config(None, OPT).train
    tx, _ = make_optimizer(t)
    rng = np.random.default_rng(0)
    shapes = {"blocks": {"attn_norm": {"scale": (2, 6)}, "mlp": {"up": {"kernel": (2, 6, 5)}}},
              "embed": {"embedding": (7, 6)}, "final_norm": {"scale": (6,)}}
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s) + 1.0, jnp.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref = HandAdamW(t, _is_decayed)
    expected = _flat(params)
    for step in range(1, 8):  # warmup, cosine, and past the horizon
        # Gradients well away from zero (no sign ambiguity in Adam's first step) and large: clipping is active.
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) + 2.0, jnp.float32), params)
        updates, state = update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        expected = ref.update(expected, _flat(grads))
        got = _flat(params)
        for k in expected:
            np.testing.assert_allclose(got[k], expected[k], rtol=2e-6, atol=2e-6, err_msg=f"step {step} {k}")


STEP_LAYOUTS = {
    "one-device": (1, []),
    # Gradient accumulation must give the step of the whole batch: same loss, gradient norm and update.
    "microbatches-unreduced": (4, ["mesh.ici.data=2", "mesh.ici.fsdp=2", "train.global_batch=8",
                                   "train.microbatches=2", "train.accumulate=unreduced"]),
    "microbatches-sharded": (4, ["mesh.ici.data=2", "mesh.ici.fsdp=2", "train.global_batch=8",
                                 "train.microbatches=2", "train.accumulate=sharded"]),
}


@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
def test_train_steps_apply_clipped_adamw_to_the_model_gradients(tmp_path, layout):
    """Four compiled train steps on random weights: loss, pre-clip gradient norm, learning rate, and every parameter
    after each step equal the hand reference fed with the gradient of the model's next-token loss on the whole
    batch (computed here with jax.grad of a loss written in this test)."""
    devices, overrides = STEP_LAYOUTS[layout]
    ts, state, _ = random_model(tmp_path, *OPT, "model.tie_embeddings=false", *overrides, seed=7, devices=devices)
    t = ts.cfg.train
    with ts.layout.scope():
        train_step, _, _ = ts.compile(state)
    model_def = nnx.split(nnx.merge(ts.layout.graphdef, state).model)[0]

    def loss_fn(params, tokens):
        logits = nnx.merge(model_def, params)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    with ts.layout.scope():
        loss_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    ref = HandAdamW(t, _is_decayed)
    rng = np.random.default_rng(8)
    for step in range(1, 5):
        batch = jnp.asarray(rng.integers(0, 61, size=(t.global_batch, 13)), jnp.int32)
        with ts.layout.scope():
            loss, grads = loss_and_grad(state["model"], batch)
        before = _flat(state["model"])
        expected = ref.update(before, _flat(grads))
        grad_norm = math.sqrt(sum(float(np.sum(g * g)) for g in _flat(grads).values()))
        state, metrics = train_step(state, jax.device_put(batch, ts.layout.batch_sharding))
        assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
        assert float(metrics["grad_norm"]) == pytest.approx(grad_norm, rel=1e-4)
        assert grad_norm > t.grad_clip  # clipping was active
        assert float(metrics["learning_rate"]) == pytest.approx(hand_lr(step, t.lr, t.warmup_steps, t.decay_steps,
                                                             t.min_lr_ratio), rel=1e-6)
        got = _flat(state["model"])
        assert sorted(got) == sorted(expected) and sum(not _is_decayed(k) for k in got) == 3
        for k in expected:
            # Parameters move by ~lr = 0.05 per step; float32 rounding leaves them within ~1e-7 of the reference
            # (single elements with a near-zero gradient, which Adam divides by its own size, up to ~1e-6).
            np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=2e-5, err_msg=f"step {step} {k}")
