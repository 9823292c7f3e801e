"""Flash multi-head self-attention in the Triton language, launched from JAX with ``jax_triton.triton_call``.

Same contract as ``flash_pallas`` (see ``api.flash_attention``): q [batch, seq, heads, head_dim],
k, v [batch, seq, kv_heads, head_dim], output [batch, seq, heads, head_dim] in q's dtype, differentiable through
``jax.custom_vjp``. GPU only.

This is the road JAX's own deprecation note for the Pallas Triton backend points to (official Triton + jax-triton),
kept beside the Pallas kernel so that either can carry on if the other's toolchain moves.

Kernels (FlashAttention-2, contiguous [B, S, H, D] layouts, base-2 exponentials), each with its own tiles, warps
and stages (``jaxtrain.kernels.flash.tiling``):
  * forward (``_fwd_kernel_src``): grid (query tiles, batch*heads), the query tile on the fastest axis so that
    programs running together share K/V in L2, reversed under causal so the longest rows start first; online softmax
    over kv tiles with float32 accumulators; writes o and the base-2 log-sum-exp [B, H, S]. Causal: tiles above the
    diagonal are never visited (loop bound), the unmasked tiles run first and only the diagonal ones are masked.
  * dq (``_dq_kernel_src``): grid (query tiles, batch*heads), same order; loops over kv tiles. Its loop and the
    forward's load each key tile and mask its scores through one helper (``_key_tile_src``).
  * dk/dv (``_dkdv_kernel_src``): grid (kv tiles, batch*kv_heads*splits); loops over query heads of the group and
    their query tiles, so dk and dv are summed over the heads that share a kv head in registers. It works on S
    transposed ([kv, q]): P^T and dS^T come out of the matmuls in the layout the next matmul takes, with no
    transpose through shared memory; the unmasked query tiles run before the masked diagonal ones. When there are
    too few kv tiles x kv heads to fill the GPU (tensor parallelism leaves few kv heads per device), the group is
    split over ``splits`` programs that write float32 partial sums, added by XLA.
  * document masking: with segment ids, XLA computes per tile the range of tiles on the other side whose ids can
    match (``tiling.segment_tile_ranges``); the loops cover only that range, so other documents' tiles are skipped.
  * ``delta = rowsum(o * do)`` is an elementwise product and a float32 sum in XLA.
Any sequence length: loads and stores are masked (constexpr ``EVEN`` skips the masks when the tiles divide the
sequence). Masked logits take a large finite negative value, so no row ever computes ``exp(-inf + inf)``. Float32
inputs use exact float32 dots (``input_precision="ieee"``), never TF32.

The kernel bodies are in ``jaxtrain.kernels.flash.triton_kernels``, their launch planning (tiles, grids, constexprs) in
``jaxtrain.kernels.flash.triton_launch``, and what this implementation shares with the Pallas one in
``jaxtrain.kernels.flash.common``; this module runs the launch sequence and ties it to JAX. ``triton`` and
``jax_triton`` are imported only when a kernel is launched, so this module imports without them.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np

from jaxtrain.kernels.flash import triton_kernels
from jaxtrain.kernels.flash.common import (
    LN2,
    LOG2E,
    backward_lse,
    may_have_empty_rows,
    named_forward,
    row_dot,
    split_shift,
)
from jaxtrain.kernels.flash.triton_launch import CallConfig
from jaxtrain.kernels.flash.triton_launch import (
    call_config as call_config,  # re-exported: tests plan calls through here
)

# --------------------------------------------------------------------------------------------------------------
# Launch sequence, written against a `launch` callable so the same call configuration runs under jax-triton (GPU)
# or Triton's CPU interpreter (tests): launch(kernel, inputs, out_shapes [(shape, dtype)], grid, constexprs, num_warps,
# num_stages) -> list of outputs.
# --------------------------------------------------------------------------------------------------------------


def _ranges_arg(call: CallConfig, seg, seg_k, kind: str):
    """The RANGES operand: document-mask tile ranges with segments, else a one-element dummy never read."""
    if call.has_segments:
        return call.tile_ranges(seg, kind, seg_k)
    return seg  # the [1] int32 dummy


def _operands(call: CallConfig, seg, seg_k, offs):
    """(SEG, SEGK, OFFS): the queries' and keys' segment ids (seg_k None: seg) and the traced shift (offs None:
    a dummy never read, the shift being static)."""
    dummy = seg.reshape(-1)[:1]
    return seg, seg if seg_k is None else seg_k, dummy if offs is None else offs


def run_forward(launch, call: CallConfig, q, k, v, seg, seg_k=None, offs=None):
    """-> (o [B, S, H, D] in call.out_dtype or q's, lse [B, H, S] float32 base 2, -inf for rows without a visible
    key). ``seg`` is int32 [B, S] or a dummy [1]; seg_k int32 [B, Sk] (None: seg); offs int32 [1], the traced
    q_offset - kv_offset (None: static, in ``call``)."""
    grid, meta, lp = call.forward()
    seg, seg_k, offs = _operands(call, seg, seg_k, offs)
    o, lse = launch(triton_kernels.jitted().fwd, (q, k, v, seg, seg_k, _ranges_arg(call, seg, seg_k, "fwd"), offs),
                    [(q.shape, call.out_dtype or q.dtype), ((call.batch, call.heads, call.seq), np.float32)],
                    grid, meta, lp.num_warps, lp.num_stages)
    return o, lse


def run_backward(launch, call: CallConfig, q, k, v, seg, do, lse, delta, seg_k=None, offs=None):
    """-> (dq, dk, dv) in call.grad_dtype or the inputs' dtype. ``delta`` = rowsum(o * do) as float32 [B, H, S];
    ``lse`` base 2, +inf (not -inf) for rows without a visible key so that their p is 0."""
    kern = triton_kernels.jitted()
    grid, meta, lp = call.dq()
    seg, seg_k, offs = _operands(call, seg, seg_k, offs)
    grad_dtype = call.grad_dtype or q.dtype
    (dq,) = launch(kern.dq, (q, k, v, seg, seg_k, _ranges_arg(call, seg, seg_k, "dq"), offs, do, lse, delta),
                   [(q.shape, grad_dtype)], grid, meta, lp.num_warps, lp.num_stages)
    inputs = (q, k, v, seg, seg_k, _ranges_arg(call, seg, seg_k, "dkdv"), offs, do, lse, delta)
    # With splits, float32 partial sums [splits, B, Sk, KVH, D] that XLA adds up.
    outs = [(k.shape, grad_dtype)] * 2 if call.splits == 1 else [((call.splits, *k.shape), np.float32)] * 2
    dk: Any = None  # set by the pass that computes it
    dv: Any = None
    for grid, meta, lp in call.dkdv():  # a pass leaves the output it does not compute unwritten
        got = launch(kern.dkdv, inputs, outs, grid, meta, lp.num_warps, lp.num_stages)
        dk = got[0] if meta["WANT_DK"] else dk
        dv = got[1] if meta["WANT_DV"] else dv
    if call.splits > 1:
        dk, dv = dk.sum(0).astype(grad_dtype), dv.sum(0).astype(grad_dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------------
# JAX side
# --------------------------------------------------------------------------------------------------------------


def availability_error() -> str | None:
    """Why impl='triton' cannot run here, or None when it can (a CUDA GPU, triton and jax_triton importable)."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return (f"impl='triton' needs a CUDA GPU, but JAX sees none (backend: {jax.default_backend()}); "
                "use impl='pallas' (interpret=True runs it on CPU)")
    for module, hint in (("triton", "pip install triton"), ("jax_triton", "pip install jax-triton")):
        try:
            __import__(module)
        except ImportError as e:
            return f"impl='triton' needs the '{module}' package, which is not importable ({e}); {hint}"
    return None


def _jax_triton_launch(kernel, inputs, out_shapes, grid, meta, num_warps, num_stages):
    import jax
    import jax_triton as jt

    outs = jt.triton_call(
        *inputs, kernel=kernel, out_shape=[jax.ShapeDtypeStruct(s, d) for s, d in out_shapes], grid=grid,
        num_warps=num_warps, num_stages=num_stages, **meta)
    return list(outs)


def _custom_vjp():
    import jax

    def forward(q, k, v, seg, seg_k, offs, call):
        return run_forward(_jax_triton_launch, call, q, k, v, seg, seg_k, offs)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def attention(q, k, v, seg, seg_k, offs, call):
        return forward(q, k, v, seg, seg_k, offs, call)[0]

    def fwd(q, k, v, seg, seg_k, offs, call):
        o, lse = named_forward(forward, q, k, v, seg, seg_k, offs, call)  # checkpoint names attn_out / attn_lse
        return o, (q, k, v, seg, seg_k, offs, o, lse)

    def bwd(call, res, do):
        q, k, v, seg, seg_k, offs, o, lse = res
        lse = backward_lse(lse) if call.empty_rows else lse
        dq, dk, dv = run_backward(_jax_triton_launch, call, q, k, v, seg, do, lse, row_dot(o, do), seg_k, offs)
        return dq, dk, dv, None, None, None

    def fwd_entry(q, k, v, seg, seg_k, offs, call):
        o, lse = forward(q, k, v, seg, seg_k, offs, call)
        return o, lse * LN2  # natural log; -inf stays -inf

    def bwd_entry(q, k, v, out, lse, do, seg, seg_k, offs, call):
        lse2 = backward_lse(lse.astype("float32") * LOG2E)
        return run_backward(_jax_triton_launch, call, q, k, v, seg, do, lse2, row_dot(out, do), seg_k, offs)

    attention.defvjp(fwd, bwd)
    return types.SimpleNamespace(attention=jax.jit(attention, static_argnums=(6,)),
                                 fwd=jax.jit(fwd_entry, static_argnums=(6,)),
                                 bwd=jax.jit(bwd_entry, static_argnums=(9,)))


_jitted = None


def _prepare(q, k, *, causal, segment_ids, kv_segment_ids, q_offset, kv_offset, sm_scale, block_sizes,
             out_dtype=None, grad_dtype=None):
    """-> (jitted functions, call config, seg, seg_k, offs) for a validated call; RuntimeError without a GPU."""
    global _jitted
    static_shift, offs = split_shift(q_offset, kv_offset) if causal else (0, None)
    call = call_config(q.shape, k.shape[2], q.dtype, causal=causal, sm_scale=sm_scale,
                       has_segments=segment_ids is not None, block_sizes=block_sizes, seq_k=k.shape[1],
                       shift=static_shift, empty_rows=may_have_empty_rows(causal, static_shift,
                                                                          kv_segment_ids is not None),
                       out_dtype=out_dtype, grad_dtype=grad_dtype)
    reason = availability_error()
    if reason:
        raise RuntimeError(reason)
    import jax.numpy as jnp

    triton_kernels.jitted()
    if _jitted is None:
        _jitted = _custom_vjp()
    # jax-triton passes arrays only; a kernel without segments gets a one-element dummy it never reads.
    seg = jnp.zeros((1,), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    seg_k = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    return _jitted, call, seg, seg_k, offs


def flash_attention_triton(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                           kv_offset=0, sm_scale: float | None = None, **block_sizes):
    """Triton flash attention via jax-triton. Inputs are assumed validated (see ``api.flash_attention``).

    Args:
      q: [batch, sq, heads, head_dim]; k, v: [batch, skv, kv_heads, head_dim]; segment_ids: int [batch, sq];
      kv_segment_ids: int [batch, skv] (None: segment_ids); q_offset, kv_offset: ints or traced int32 scalars.
      block_sizes: fields of ``jaxtrain.kernels.flash.tiling.BlockSizes``.

    Returns:
      [batch, sq, heads, head_dim] in q's dtype. Raises RuntimeError when no GPU / triton / jax_triton.
    """
    jitted, call, seg, seg_k, offs = _prepare(q, k, causal=causal, segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                                              kv_offset=kv_offset, sm_scale=sm_scale, block_sizes=block_sizes)
    return jitted.attention(q, k, v, seg, seg_k, offs, call)


def flash_attention_fwd_triton(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                               kv_offset=0, sm_scale: float | None = None, out_dtype=None, **block_sizes):
    """-> (out [batch, sq, heads, head_dim], lse [batch, heads, sq] float32 natural log); see
    jaxtrain.kernels.flash.api."""
    jitted, call, seg, seg_k, offs = _prepare(q, k, causal=causal, segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                                              kv_offset=kv_offset, sm_scale=sm_scale, block_sizes=block_sizes,
                                              out_dtype=out_dtype)
    return jitted.fwd(q, k, v, seg, seg_k, offs, call)


def flash_attention_bwd_triton(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None,
                               kv_segment_ids=None, q_offset=0, kv_offset=0, sm_scale: float | None = None,
                               grad_dtype=None, **block_sizes):
    """-> (dq, dk, dv) of this key block from the final out and lse; see
    jaxtrain.kernels.flash.api.flash_attention_bwd."""
    jitted, call, seg, seg_k, offs = _prepare(q, k, causal=causal, segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                                              kv_offset=kv_offset, sm_scale=sm_scale, block_sizes=block_sizes,
                                              grad_dtype=grad_dtype)
    return jitted.bwd(q, k, v, out, lse, dout, seg, seg_k, offs, call)
