"""Public entry point: ``jaxtrain.kernels.flash_attention`` validates its inputs, then dispatches to a kernel.

Implementations:
  * ``impl="pallas"`` (default): ``jaxtrain.kernels.flash.pallas``; ``interpret=True`` runs it on CPU; on GPU it lowers
    through Pallas' Triton backend (``backend="triton"``; see that module's docstring for why).
  * ``impl="triton"``: ``jaxtrain.kernels.flash.triton``, the Triton language through jax-triton; CUDA GPU only.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels.flash import pallas as flash_pallas
from jaxtrain.kernels.flash import pallas_launch, triton_launch
from jaxtrain.kernels.flash import triton as flash_triton
from jaxtrain.kernels.flash.tiling import SUPPORTED_HEAD_DIMS

IMPLS = ("pallas", "triton")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _shape(name, x):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(shape)


def _check_offset(name, x):
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int or an int32 scalar array, got {x!r}")
    if isinstance(x, (int, np.integer)):
        return
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or tuple(shape) != () or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must be an int or an integer scalar array, got {x!r}")


def _check_dtype(name, dtype):
    if dtype is not None and jnp.dtype(dtype) not in {jnp.dtype(t) for t in DTYPES}:
        raise ValueError(f"{name}={dtype!r} is not supported: expected None, float32, bfloat16 or float16")


def validate(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0, sm_scale=None,
             impl="pallas", interpret=False, backend="triton", out_dtype=None, grad_dtype=None, window=None):
    """Raise ValueError naming the first problem with the arguments of ``flash_attention``; launch nothing."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    qs, ks, vs = _shape("q", q), _shape("k", k), _shape("v", v)
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {s}")
    if ks != vs:
        raise ValueError(f"k and v must have the same shape, got k {ks} and v {vs}")
    (b, s, h, d), (kb, kss, kvh, kd) = qs, ks
    if kb != b:
        raise ValueError(f"batch mismatch: q has batch {b}, k and v have batch {kb}")
    if kd != d:
        raise ValueError(f"head_dim mismatch: q has head_dim {d}, k and v have head_dim {kd}")
    if min(b, s, kss, h, kvh) < 1:
        raise ValueError(f"empty input: q shape {qs}, k shape {ks}")
    if h % kvh:
        raise ValueError(f"heads={h} is not divisible by kv_heads={kvh}: each kv head must serve a whole group "
                         "of query heads")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"unsupported head_dim={d} for impl={impl!r}: supported {SUPPORTED_HEAD_DIMS} "
                         "(GPU tiles must be powers of two)")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if dtypes.pop() not in {jnp.dtype(t) for t in DTYPES}:
        raise ValueError(f"unsupported dtype {q.dtype}: expected float32, bfloat16 or float16")
    for name, ids, want in (("segment_ids", segment_ids, (b, s)), ("kv_segment_ids", kv_segment_ids, (b, kss))):
        if ids is None:
            continue
        seg_shape = _shape(name, ids)
        if seg_shape != want:
            raise ValueError(f"{name} must have shape [batch, {'sq' if name == 'segment_ids' else 'skv'}] = "
                             f"{want}, got {seg_shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got dtype {ids.dtype}")
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' ids); pass both or neither")
    if segment_ids is not None and kv_segment_ids is None and kss != s:
        raise ValueError(f"segment_ids alone needs sq == skv (got sq {s}, skv {kss}); pass kv_segment_ids for "
                         "the keys")
    _check_offset("q_offset", q_offset)
    _check_offset("kv_offset", kv_offset)
    _check_dtype("out_dtype", out_dtype)
    _check_dtype("grad_dtype", grad_dtype)
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if sm_scale is not None and (not isinstance(sm_scale, numbers.Real) or not np.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite real number or None, got {sm_scale!r}")
    _check_window(window, causal, impl)
    if impl == "triton" and interpret:
        raise ValueError("interpret=True is only available for impl='pallas'; impl='triton' runs on a CUDA GPU")
    if impl == "pallas" and backend not in pallas_launch.BACKENDS:
        raise ValueError(pallas_launch.backend_error(backend))
    if impl == "triton" and backend != "triton":
        raise ValueError(f"backend={backend!r} applies to impl='pallas' only")


def _check_window(window, causal, impl) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a sliding window is a causal mask's lower edge)")
    if impl != "pallas":
        raise ValueError(f"window={window} is implemented by impl='pallas' only (impl={impl!r})")


def launch_settings(q_shape, kv_heads: int, dtype, *, causal: bool = True, has_segments: bool = False,
                    impl: str = "pallas", seq_k: int | None = None, traced_offsets: bool = False,
                    **block_sizes) -> dict:
    """How each kernel of a call would be launched: {"fwd" | "dq" | "dkdv": {block_q, block_k, num_warps,
    num_stages}} (block_q: query tile, block_k: key tile), for q_shape [batch, seq, heads, head_dim], keys of
    length seq_k (None: seq), offsets traced or static."""
    shift = None if traced_offsets else 0
    if impl == "pallas":
        cfg = pallas_launch.call_config(q_shape, dtype, causal=causal, sm_scale=None, has_segments=has_segments,
                                        block_sizes=block_sizes, kv_heads=kv_heads, seq_k=seq_k, shift=shift)
        launches = {kind: getattr(cfg, kind) for kind in ("fwd", "dq", "dkdv")}
    elif impl == "triton":
        p = triton_launch.call_config(q_shape, kv_heads, dtype, causal=causal, sm_scale=None,
                                      has_segments=has_segments, block_sizes=block_sizes, seq_k=seq_k, shift=shift)
        launches = {"fwd": p.fwd_launch, "dq": p.dq_launch, "dkdv": p.dkdv_launch}
    else:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    return {kind: dataclasses.asdict(launch) for kind, launch in launches.items()}


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                    kv_offset=0, sm_scale: float | None = None, impl: str = "pallas", interpret: bool = False,
                    backend: str = "triton", window: int | None = None, **block_sizes):
    """Flash multi-head attention with grouped-query support, differentiable w.r.t. q, k and v.

    Args:
      q: [batch, sq, heads, head_dim], float32 / bfloat16 / float16.
      k, v: [batch, skv, kv_heads, head_dim], same dtype; kv_heads divides heads and query head h reads kv head
        h // (heads // kv_heads) (multi-query attention is kv_heads == 1). skv may differ from sq (a query block
        against another key block, as ring attention does).
      causal: query i sees key j only when q_offset + i >= kv_offset + j.
      segment_ids: optional int [batch, sq]; a query sees only keys with the same id (packed sequences).
      kv_segment_ids: optional int [batch, skv], the keys' ids (None: segment_ids, which then needs sq == skv).
      q_offset, kv_offset: absolute positions of the first query / key: Python ints (compiled in) or traced int32
        scalars (e.g. from ``lax.axis_index`` inside ``shard_map``; passed to the kernels as an operand).
      sm_scale: softmax scale; default 1 / sqrt(head_dim).
      window: with causal, a sliding window: query i sees key j only when 0 <= (q_offset + i) - (kv_offset + j)
        < window (Mistral's and transformers' sliding_window); key tiles wholly outside it are skipped. None: no
        lower bound. impl="pallas" only.
      impl: "pallas" (Pallas kernel; CPU via interpret=True, GPU via Pallas' Triton lowering) or "triton"
        (Triton language via jax-triton; CUDA GPU only).
      interpret: run the Pallas kernels in the Pallas interpreter (CPU; slow, for testing).
      backend: GPU lowering of the Pallas kernels; "triton" is the one implemented.
      **block_sizes: overrides of the per-kernel tiles and launch parameters (defaults by dtype and head_dim in
        ``jaxtrain.kernels.flash.tiling``), the same names for both impls: block_q (query tile), block_k (key tile)
        of the forward kernel; block_q_bwd, block_k_bwd (both backward kernels); block_q_dq, block_k_dq, block_q_dkdv,
        block_k_dkdv (one of them); num_warps, num_stages, dkdv_splits. Tiles are powers of two >= 16 and are
        clamped to the sequence.

    Returns:
      [batch, sq, heads, head_dim] in q's dtype; a query row that sees no key gives 0. Softmax statistics and
      accumulators are float32. Under ``jax.checkpoint`` the output and the log-sum-exp carry the checkpoint names
      "attn_out" and "attn_lse" (``common.CHECKPOINT_NAMES``): a policy saving them
      (``save_only_these_names`` or combined with another policy) keeps the backward from rerunning the forward
      kernel.

    Raises:
      ValueError: a bad argument (rank, shapes, head_dim, dtype, impl, block sizes), before any launch.
      RuntimeError: impl="triton" without a CUDA GPU or without triton / jax-triton installed.
    """
    kw = dict(causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
              kv_offset=kv_offset, sm_scale=sm_scale, window=window)
    validate(q, k, v, impl=impl, interpret=interpret, backend=backend, **kw)
    kw["causal"] = bool(causal)
    if impl == "pallas":
        return flash_pallas.flash_attention_pallas(q, k, v, interpret=interpret, backend=backend, **kw,
                                                   **block_sizes)
    kw.pop("window")  # validate() allowed only None for triton
    return flash_triton.flash_attention_triton(q, k, v, **kw, **block_sizes)


def flash_attention_fwd(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                        kv_offset=0, sm_scale: float | None = None, impl: str = "pallas", interpret: bool = False,
                        backend: str = "triton", out_dtype=None, window: int | None = None, **block_sizes):
    """The forward kernel alone, for callers that merge several key blocks (ring attention): same arguments as
    ``flash_attention``.

    Returns:
      out [batch, sq, heads, head_dim] in out_dtype (None: q's dtype; float32 lets the caller merge partial
      results exactly), and lse [batch, heads, sq] float32: the natural log of the softmax denominator (sm_scale
      included). A query row with no visible key: out 0, lse -inf. Not differentiable (see flash_attention_bwd).
    """
    kw = dict(causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
              kv_offset=kv_offset, sm_scale=sm_scale, window=window)
    validate(q, k, v, impl=impl, interpret=interpret, backend=backend, out_dtype=out_dtype, **kw)
    kw["causal"] = bool(causal)
    if impl == "pallas":
        return flash_pallas.flash_attention_fwd_pallas(q, k, v, interpret=interpret, backend=backend,
                                                       out_dtype=out_dtype, **kw, **block_sizes)
    kw.pop("window")  # validate() allowed only None for triton
    return flash_triton.flash_attention_fwd_triton(q, k, v, out_dtype=out_dtype, **kw, **block_sizes)


def flash_attention_bwd(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None, kv_segment_ids=None,
                        q_offset=0, kv_offset=0, sm_scale: float | None = None, impl: str = "pallas",
                        interpret: bool = False, backend: str = "triton", grad_dtype=None, window: int | None = None,
                        **block_sizes):
    """The backward kernels alone: this key block's contributions to the gradients, given the *final* out and lse
    (merged over every key block by the caller) and dout [batch, sq, heads, head_dim].

    Returns:
      dq [batch, sq, heads, head_dim] (this block's share; sum over blocks), dk and dv [batch, skv, kv_heads,
      head_dim] (summed over each kv head's query group), in grad_dtype (None: the inputs' dtype; float32 lets
      the caller accumulate over blocks). Rows with lse -inf contribute nothing.
    """
    kw = dict(causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
              kv_offset=kv_offset, sm_scale=sm_scale, window=window)
    validate(q, k, v, impl=impl, interpret=interpret, backend=backend, grad_dtype=grad_dtype, **kw)
    b, sq, h, _ = q.shape
    for name, x, want in (("out", out, q.shape), ("dout", dout, q.shape), ("lse", lse, (b, h, sq))):
        if _shape(name, x) != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)}, got {_shape(name, x)}")
    kw["causal"] = bool(causal)
    if impl == "pallas":
        return flash_pallas.flash_attention_bwd_pallas(q, k, v, out, lse, dout, interpret=interpret,
                                                       backend=backend, grad_dtype=grad_dtype, **kw, **block_sizes)
    kw.pop("window")  # validate() allowed only None for triton
    return flash_triton.flash_attention_bwd_triton(q, k, v, out, lse, dout, grad_dtype=grad_dtype, **kw,
                                                   **block_sizes)
