"""What a run trains: the model's parameters and AdamW's state, as one NNX graph, and the learning-rate schedule.

Apart from the step (``step.py``) so that the layout (``layout.py``) can build the abstract, sharded state without
the step, and the step can take its facts from the layout.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jaxtrain.config import TrainConfig
from jaxtrain.models.llama import Transformer


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """The learning rate of the update optax counts as ``count`` (from 0): linear warmup, then cosine decay.

    Indexed by the step being taken (1-based), so the first step already moves the parameters: step s <
    warmup_steps runs at lr * s / warmup_steps, step warmup_steps at lr, then the cosine down to lr * min_lr_ratio
    at decay_steps, and that rate after it.
    """
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps, decay_steps=t.decay_steps,
        end_value=t.lr * t.min_lr_ratio)
    return lambda count: base(count + 1)


def make_optimizer(t: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW on :func:`lr_schedule` after global-norm clipping, that schedule). Norm scales and biases (q/k/v's,
    model.qkv_bias) are not decayed."""

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(n in jax.tree_util.keystr(path) for n in ("'scale'", "'bias'")), params)

    schedule = lr_schedule(t)
    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
    # A step whose gradients (or loss: the train step folds it in) are not finite changes neither the parameters
    # nor the moments and schedule count (optax skips it inside a lax.cond). The loop stops after
    # train.max_nonfinite_steps in a row, long before optax's own limit, past which it would apply the update anyway.
    return optax.apply_if_finite(tx, max_consecutive_errors=2**30), schedule


class TrainState(nnx.Module):
    """Model parameters and optimizer state (sharded like the parameters), as one graph for split/merge."""

    def __init__(self, model: Transformer, tx: optax.GradientTransformation):
        self.model = model
        self.opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
