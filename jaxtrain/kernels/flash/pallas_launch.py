"""Launch planning of the Pallas flash kernels (``jaxtrain.kernels.flash.pallas``): the static configuration of a
call (per-kernel tiles, warps and stages, padded lengths, the dk/dv split of a GQA group, the causal shift) and the
compiler parameters of the GPU lowering. No kernel code here."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxtrain.kernels.flash.tiling import BlockSizes, Launch, choose_splits, clamp_tile

BACKENDS = ("triton",)


@dataclasses.dataclass(frozen=True)
class CallConfig:
    """Everything static about one call; hashable so it can be a jit static / custom_vjp nondiff argument."""

    causal: bool
    sm_scale: float
    seq_q: int  # true (unpadded) query length
    seq_k: int  # true key length
    padded_q: int
    padded_k: int
    fwd: Launch
    dq: Launch
    dkdv: Launch
    splits: int  # dk/dv programs per GQA group (float32 partial sums added by XLA when > 1)
    has_segments: bool
    interpret: bool
    backend: str
    # q_offset - kv_offset (the causal mask is q_pos + shift >= k_pos) when static; None: traced, read by the
    # kernels from an int32 [1] operand.
    shift: int | None = 0
    empty_rows: bool = False  # a query row may see no key (offsets, separate key segments): out 0, lse -inf
    out_dtype: str | None = None  # forward output (None: q's dtype)
    grad_dtype: str | None = None  # dq, dk, dv (None: the inputs' dtype)
    window: int | None = None  # causal sliding window: q - window < k <= q (None: every earlier key)

    @property
    def padded(self) -> bool:  # keys past seq_k exist and must be masked
        return self.padded_k != self.seq_k


def compiler_params(cfg: CallConfig, launch: Launch):
    """The ``compiler_params`` of one kernel's ``pl.pallas_call`` (None in interpret mode)."""
    if cfg.interpret:
        return None
    if cfg.backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)
    raise ValueError(f"unknown Pallas backend {cfg.backend!r}")  # validated earlier; kept for safety


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_config(q_shape, kv_heads: int, dtype, *, causal: bool, sm_scale: float, has_segments: bool,
                interpret: bool, backend: str, sizes: BlockSizes, seq_k: int | None = None, shift: int | None = 0,
                empty_rows: bool = False, out_dtype=None, grad_dtype=None, window: int | None = None) -> CallConfig:
    """Per-kernel launches (defaults by dtype and head_dim, user overrides, query tiles clamped to the query length
    and key tiles to the key length), the padded lengths (multiples of every tile: all are powers of two, so the
    largest is their lcm) and the dk/dv split of a GQA group."""
    batch, seq_q, heads, head_dim = q_shape
    seq_k = seq_q if seq_k is None else seq_k
    launches = sizes.launches(dtype, head_dim, seq_q, seq_k)
    if (causal and shift is None and head_dim == 128 and np.dtype(dtype).itemsize == 2
            and sizes.block_k_dkdv is None and sizes.block_k_bwd is None):
        # The 16-bit d128 dk/dv kernel sits at 254-255 registers; a traced shift spills it (572 B, sm_90a,
        # tools/compile_check.py ring cases), a 64-key tile does not (173 registers).
        launches["dkdv"] = dataclasses.replace(launches["dkdv"], block_k=clamp_tile(64, seq_k))
    tile = max(max(x.block_q, x.block_k) for x in launches.values())
    group = heads // kv_heads
    # Not in interpret mode (CPU): more programs gain nothing there and partial sums cost memory.
    splits = sizes.splits(group, lambda: 1 if interpret else choose_splits(batch, seq_k, kv_heads, group,
                                                                          launches["dkdv"].block_k))
    name = (lambda t: None if t is None else jnp.dtype(t).name)  # noqa: E731
    return CallConfig(causal=causal, sm_scale=float(sm_scale), seq_q=seq_q, seq_k=seq_k,
                      padded_q=_round_up(seq_q, tile), padded_k=_round_up(seq_k, tile), splits=splits,
                      has_segments=has_segments, interpret=interpret, backend=backend,
                      shift=shift if causal else 0, empty_rows=empty_rows, out_dtype=name(out_dtype),
                      grad_dtype=name(grad_dtype), window=window if causal else None, **launches)


def call_config(q_shape, dtype, *, causal: bool, sm_scale: float | None, has_segments: bool, interpret: bool = False,
                backend: str = "triton", block_sizes: dict | None = None, kv_heads: int | None = None,
                seq_k: int | None = None, shift: int | None = 0, empty_rows: bool = False, out_dtype=None,
                grad_dtype=None, window: int | None = None) -> CallConfig:
    """The static configuration of a call; ValueError on bad block sizes. q_shape [batch, seq, heads, head_dim]."""
    sizes = BlockSizes.from_kwargs(block_sizes or {}, "pallas")
    d = q_shape[-1]
    scale = d**-0.5 if sm_scale is None else sm_scale
    return make_config(tuple(q_shape), kv_heads or q_shape[2], dtype, causal=causal, sm_scale=scale,
                       has_segments=has_segments, interpret=interpret, backend=backend, sizes=sizes, seq_k=seq_k,
                       shift=shift, empty_rows=empty_rows, out_dtype=out_dtype, grad_dtype=grad_dtype,
                       window=window)


def backend_error(backend) -> str:
    """Why ``backend`` cannot lower the Pallas kernels (the message of the ValueError callers raise)."""
    if backend == "mosaic_gpu":
        return ("backend='mosaic_gpu' is not implemented: these kernels are written for Pallas' Triton lowering, "
                "and jax 0.11 has no Mosaic GPU lowering of pl.pallas_call (jax 0.10 still has one, deprecated in "
                "favour of plgpu.kernel); Mosaic GPU needs a separate plgpu.kernel program with warpgroup matmuls "
                "and TMA. Use backend='triton', or impl='triton' (official Triton via jax-triton).")
    return f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}"
