"""Flash multi-head self-attention in Pallas: forward, backward and ``jax.custom_vjp``.

Shapes: q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] with kv_heads dividing heads;
query head h reads kv head h // (heads // kv_heads). Output [batch, seq, heads, head_dim] in q's dtype.

Algorithm (FlashAttention-2):
  * forward: one program per (query tile, batch, head), the query tile on the fastest grid axis (so programs
    running together read the same K/V from L2) and, under ``causal``, in reverse (the longest rows start first);
    online softmax over kv tiles in a ``fori_loop`` with float32 accumulators; the log-sum-exp (base 2) of every
    row is written for the backward. Under ``causal`` the loop stops at the diagonal and only the tiles the
    diagonal crosses pay for a mask; the unmasked loop runs before the masked one.
  * document masking (``segment_ids``): XLA computes, per query tile, the range of kv tiles whose segment ids can
    match (``tiling.segment_tile_ranges``) and the kernels loop over that range only, so tiles of other
    documents are skipped, not computed and masked.
  * backward: ``delta = rowsum(o * do)`` in XLA as an elementwise product and a float32 sum (not a matmul, so no
    TF32 can creep in), then two kernels with their own tiles: dq per (query tile, batch, head) looping over kv
    tiles, and dk/dv per (kv tile, batch, kv head) looping over the query heads of its group and their query
    tiles, so the group sum happens in registers and no per-query-head dk/dv is ever materialised. dk/dv works
    on S transposed ([kv, q]): P^T and dS^T come out of the matmuls in the layout the next matmul wants.
  * float32 inputs get exact float32 dots (``precision=HIGHEST``): the Triton lowering would otherwise make
    every default-precision float32 dot a TF32 one (about 1e-3 relative error).
  * grouped-query attention by BlockSpec index maps (query head h -> kv head h // group in the forward and dq
    kernels; kv head j -> the query-head block [j*group, (j+1)*group) in the dk/dv kernel). k and v are never
    repeated in memory.
  * with ``jax.checkpoint`` (remat), the output and the log-sum-exp carry the checkpoint names ``attn_out`` and
    ``attn_lse``, so a policy that saves them keeps the backward from rerunning the forward kernel.
  * any sequence length: the wrapper pads the sequence up to a multiple of the block sizes and the kernels
    mask padded keys; padded query rows are sliced away (their cotangent is zero, so they add nothing to
    dk/dv).
  * masked logits take a large finite negative value instead of -inf, so a row never sees ``exp(-inf + inf)``:
    every real query row has at least one visible key (itself), which wipes out the contributions of fully
    masked tiles seen before it through the running-max correction; no NaN can arise.

Where the parts live: this module holds the ``jax.custom_vjp``, the padding and the entry points; the kernels are in
``pallas_forward`` (forward) and ``pallas_backward`` (dq, dk/dv), what each does per tile (loop bounds, masks,
dots, operand order) in ``pallas_tiles``, the static call configuration in ``pallas_launch``, and what the Triton
implementation shares with this one in ``common``.

GPU lowering: Pallas' Triton backend, selected with ``jax.experimental.pallas.triton.CompilerParams``: the one
``pl.pallas_call`` lowering that both jax 0.10.2 (CI) and 0.11.2 (the GPU machine) accept, and one that lowers
without a GPU (``lowering_platforms=("cuda",)``; see ``tools/compile_check.py``). jax 0.11 deprecates it with a
warning and still lowers it (0.12 still has it). Mosaic GPU is no way out within ``pl.pallas_call``: jax 0.10.2
lowers a ``pl.pallas_call`` through Mosaic GPU (its default GPU lowering there, deprecated with a warning in favour
of ``plgpu.kernel``), jax 0.11.2 no longer does (``plgpu.CompilerParams`` fail to lower; its default is the Triton
backend), and a Mosaic GPU kernel is a different program (warpgroup matmuls on shared-memory refs, TMA copies).
``backend=`` is the switch for another lowering ("mosaic_gpu" is refused with the reason) and ``impl="triton"``
(official Triton + jax-triton, the road JAX's note recommends) keeps the same contract.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Re-exported ("X as X"): the model and ring attention import CHECKPOINT_NAMES from here, tests SUPPORTED_HEAD_DIMS.
from jaxtrain.kernels.flash.common import CHECKPOINT_NAMES as CHECKPOINT_NAMES
from jaxtrain.kernels.flash.common import (
    LN2,
    LOG2E,
    backward_lse,
    may_have_empty_rows,
    named_forward,
    row_dot,
    split_shift,
)
from jaxtrain.kernels.flash.pallas_backward import backward_kernels
from jaxtrain.kernels.flash.pallas_forward import forward
from jaxtrain.kernels.flash.pallas_launch import BACKENDS, CallConfig, backend_error, call_config
from jaxtrain.kernels.flash.tiling import SUPPORTED_HEAD_DIMS as SUPPORTED_HEAD_DIMS


def _backward(cfg: CallConfig, res, do):
    q, k, v, seg_q, seg_k, shift, o, lse = res
    if cfg.empty_rows:
        lse = backward_lse(lse)
    dq, dk, dv = backward_kernels(q, k, v, seg_q, seg_k, shift, do, lse, row_dot(o, do), cfg)
    return dq, dk, dv, None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash_padded(q, k, v, seg_q, seg_k, shift, cfg: CallConfig):
    return named_forward(forward, q, k, v, seg_q, seg_k, shift, cfg)[0]


def _flash_padded_fwd(q, k, v, seg_q, seg_k, shift, cfg: CallConfig):
    o, lse = named_forward(forward, q, k, v, seg_q, seg_k, shift, cfg)
    return o, (q, k, v, seg_q, seg_k, shift, o, lse)


_flash_padded.defvjp(_flash_padded_fwd, _backward)


def _pad_to(x, length: int, value=0.0, mode="constant"):
    """Pad axis 1 of x up to ``length`` (None passes through)."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _pad_inputs(q, k, v, seg_q, seg_k, cfg: CallConfig):
    """Pad queries to cfg.padded_q and keys to cfg.padded_k. Padded keys are masked by position and padded rows are
    sliced away; repeating the last segment id keeps the document-mask tile ranges as tight as without padding.
    seg_k None with segments: the keys' ids are the queries' (self-attention)."""
    q = _pad_to(q, cfg.padded_q)
    k, v = _pad_to(k, cfg.padded_k), _pad_to(v, cfg.padded_k)
    seg_q_p = _pad_to(seg_q, cfg.padded_q, mode="edge")
    seg_k_p = seg_q_p if seg_k is None else _pad_to(seg_k, cfg.padded_k, mode="edge")
    return q, k, v, seg_q_p, seg_k_p


@functools.partial(jax.jit, static_argnames=("cfg",))
def _flash_attention(q, k, v, seg_q, seg_k, shift, cfg: CallConfig):
    q, k, v, seg_q, seg_k = _pad_inputs(q, k, v, seg_q, seg_k, cfg)
    out = _flash_padded(q, k, v, seg_q, seg_k, shift, cfg)
    return out[:, : cfg.seq_q] if cfg.padded_q != cfg.seq_q else out


@functools.partial(jax.jit, static_argnames=("cfg",))
def _fwd_entry(q, k, v, seg_q, seg_k, shift, cfg: CallConfig):
    q, k, v, seg_q, seg_k = _pad_inputs(q, k, v, seg_q, seg_k, cfg)
    o, lse = forward(q, k, v, seg_q, seg_k, shift, cfg)
    return o[:, : cfg.seq_q], lse[:, :, : cfg.seq_q] * LN2  # natural log; -inf stays -inf


@functools.partial(jax.jit, static_argnames=("cfg",))
def _bwd_entry(q, k, v, out, lse, do, seg_q, seg_k, shift, cfg: CallConfig):
    delta = _pad_to(row_dot(out, do).transpose(0, 2, 1), cfg.padded_q).transpose(0, 2, 1)
    lse = _pad_to(backward_lse(lse * LOG2E).transpose(0, 2, 1), cfg.padded_q, jnp.inf).transpose(0, 2, 1)
    do = _pad_to(do, cfg.padded_q)
    q, k, v, seg_q, seg_k = _pad_inputs(q, k, v, seg_q, seg_k, cfg)
    dq, dk, dv = backward_kernels(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg)
    return dq[:, : cfg.seq_q], dk[:, : cfg.seq_k], dv[:, : cfg.seq_k]


def _prepare(q, k, *, causal, segment_ids, kv_segment_ids, q_offset, kv_offset, sm_scale, interpret, backend,
             block_sizes, out_dtype=None, grad_dtype=None, window=None):
    if backend not in BACKENDS:
        raise ValueError(backend_error(backend))
    static_shift, traced = split_shift(q_offset, kv_offset)
    if not causal:
        static_shift, traced = 0, None
    cfg = call_config(q.shape, q.dtype, causal=causal, sm_scale=sm_scale, has_segments=segment_ids is not None,
                      interpret=interpret, backend=backend, block_sizes=block_sizes, kv_heads=k.shape[2],
                      seq_k=k.shape[1], shift=static_shift,
                      empty_rows=may_have_empty_rows(causal, static_shift, kv_segment_ids is not None,
                                                     window, q.shape[1] != k.shape[1]),
                      out_dtype=out_dtype, grad_dtype=grad_dtype, window=window)
    seg_q = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    seg_k = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    return cfg, seg_q, seg_k, traced


def flash_attention_pallas(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                           kv_offset=0, sm_scale: float | None = None, interpret: bool = False,
                           backend: str = "triton", window: int | None = None, **block_sizes):
    """Pallas flash attention. Inputs are assumed validated (see ``jaxtrain.kernels.flash.api.flash_attention``).

    Args:
      q: [batch, sq, heads, head_dim]; k, v: [batch, skv, kv_heads, head_dim].
      segment_ids: optional int [batch, sq]; kv_segment_ids: int [batch, skv] (None: segment_ids).
      q_offset, kv_offset: positions of the first query / key (ints, or traced int32 scalars).
      interpret: run the kernels with the Pallas interpreter (CPU).
      backend: GPU lowering, "triton" (Pallas' Triton backend); see the module docstring.
      window: with causal, a sliding window (q - window < k <= q); key tiles outside it are never visited.
      block_sizes: fields of ``jaxtrain.kernels.flash.tiling.BlockSizes``.

    Returns:
      [batch, sq, heads, head_dim] in q's dtype; differentiable w.r.t. q, k, v.
    """
    cfg, seg_q, seg_k, shift = _prepare(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                        q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale,
                                        interpret=interpret, backend=backend, block_sizes=block_sizes,
                                        window=window)
    return _flash_attention(q, k, v, seg_q, seg_k, shift, cfg)


def flash_attention_fwd_pallas(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                               kv_offset=0, sm_scale: float | None = None, interpret: bool = False,
                               backend: str = "triton", out_dtype=None, window: int | None = None,
                               **block_sizes):
    """-> (out [batch, sq, heads, head_dim] in out_dtype or q's, lse [batch, heads, sq] float32, natural log)."""
    cfg, seg_q, seg_k, shift = _prepare(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                        q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale,
                                        interpret=interpret, backend=backend, block_sizes=block_sizes,
                                        out_dtype=out_dtype, window=window)
    return _fwd_entry(q, k, v, seg_q, seg_k, shift, cfg)


def flash_attention_bwd_pallas(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None,
                               kv_segment_ids=None, q_offset=0, kv_offset=0, sm_scale: float | None = None,
                               interpret: bool = False, backend: str = "triton", grad_dtype=None,
                               window: int | None = None, **block_sizes):
    """-> (dq [batch, sq, heads, head_dim], dk, dv [batch, skv, kv_heads, head_dim]) of this key block, from the
    final (merged) out and natural-log lse [batch, heads, sq]; in grad_dtype or the inputs' dtype."""
    cfg, seg_q, seg_k, shift = _prepare(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                        q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale,
                                        interpret=interpret, backend=backend, block_sizes=block_sizes,
                                        grad_dtype=grad_dtype, window=window)
    return _bwd_entry(q, k, v, out, jnp.asarray(lse, jnp.float32), dout, seg_q, seg_k, shift, cfg)

