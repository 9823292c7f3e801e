"""What the Pallas and the Triton flash kernels share on the JAX side: constants, the checkpoint names of the
forward's results, ``delta = rowsum(o * do)``, the causal shift of a call's offsets and the handling of query rows
that see no key.

Both implementations keep the log-sum-exp in base 2 inside their kernels (exp2 is the cheap instruction) and give
callers the natural log (``LN2`` / ``LOG2E`` convert).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

# Finite, so that fully masked tiles give exp2(MASK - MASK) = 1 rather than NaN (see flash_pallas' docstring).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
CHECKPOINT_NAMES = ("attn_out", "attn_lse")  # names of the saved forward results under jax.checkpoint


def named_forward(forward, *args):
    """forward(*args) -> (o, lse) with the checkpoint names ``attn_out`` / ``attn_lse``: a remat policy that saves
    them keeps the backward from rerunning the forward kernel."""
    o, lse = forward(*args)
    return checkpoint_name(o, CHECKPOINT_NAMES[0]), checkpoint_name(lse, CHECKPOINT_NAMES[1])


def row_dot(o, do):
    """delta [B, H, S] float32 = sum_d o * do, as an elementwise product and a float32 sum (o, do [B, S, H, D]).

    Not an einsum: XLA may lower a contraction to a (TF32) matmul on GPU; this is a fused reduction."""
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def backward_lse(lse):
    """The backward kernels' log-sum-exp: a row without a visible key (-inf) becomes +inf, so its p = exp2(s - lse)
    is 0, not inf (and no 0 * inf = NaN reaches dk / dv)."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def split_shift(q_offset, kv_offset):
    """(static shift or None, traced shift int32 [1] or None) for the causal mask q_offset + i >= kv_offset + j:
    Python ints stay static (compiled into the kernels), anything else becomes an operand."""
    if isinstance(q_offset, (int, np.integer)) and isinstance(kv_offset, (int, np.integer)):
        return int(q_offset) - int(kv_offset), None
    return None, (jnp.asarray(q_offset, jnp.int32) - jnp.asarray(kv_offset, jnp.int32)).reshape(1)


def may_have_empty_rows(causal: bool, static_shift: int | None, separate_kv_segments: bool,
                        window: int | None = None, lengths_differ: bool = False) -> bool:
    """Can a query row see no key? Only with separate key segments or a causal shift that is traced or < 0 (with
    a shift >= 0 every row sees key 0 or its own position), or a sliding window that a shift or a query past the
    last key can move off every key."""
    slid = window is not None and (static_shift != 0 or lengths_differ)
    return separate_kv_segments or (causal and (static_shift is None or static_shift < 0 or slid))
