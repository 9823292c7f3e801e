"""The grouped matmul in the Triton language (``impl="triton"``), launched from JAX with ``jax_triton.triton_call``:
the same two kernels as the Pallas impl (``gmm`` for the forward and d_lhs, ``tgmm`` for d_rhs; see
``jaxtrain.kernels.gmm.pallas``), bodies in ``jaxtrain.kernels.gmm.triton_kernels``. CUDA GPU only.

The launch sequence is written against a ``launch`` callable, as the flash kernels' is, so the same code runs under
jax-triton (GPU) and Triton's CPU interpreter (the tests): launch(kernel, inputs, out_shapes [(shape, dtype)], grid,
constexprs, num_warps, num_stages) -> list of outputs. ``xp`` is the array module the group tables are computed
with (None: jax.numpy).
"""

from __future__ import annotations

from jaxtrain.kernels.gmm import triton_kernels as gmm_triton_kernels
from jaxtrain.kernels.gmm.plan import GmmGeometry, TgmmGeometry, group_offsets, row_tile_groups


def _precision(geo) -> str:
    # float32 users get exact float32 dots; Triton's default for float32 dots would be TF32. 16-bit ignores it.
    return "ieee" if geo.float32 else "tf32"


def gmm_constexprs(geo: GmmGeometry) -> dict:
    return dict(ROWS=geo.rows, COLS=geo.cols, CONTRACT=geo.contract, TILES_M=geo.tiles_m, TILES_N=geo.tiles_n,
                TM=geo.tm, TN=geo.tn, TC=geo.tc, BAND=geo.band, TRANSPOSE_W=geo.transpose_w, EVEN_M=geo.even_m,
                EVEN_N=geo.even_n, EVEN_C=geo.even_c, INPUT_PRECISION=_precision(geo))


def tgmm_constexprs(geo: TgmmGeometry) -> dict:
    return dict(P=geo.p, Q=geo.q, TILES_P=geo.tiles_p, TILES_Q=geo.tiles_q, TR=geo.tr, TP=geo.tp, TQ=geo.tq,
                BAND=geo.band, EVEN_P=geo.even_p, EVEN_Q=geo.even_q, INPUT_PRECISION=_precision(geo))


def run_gmm(launch, a, w, group_sizes, geo: GmmGeometry, xp=None):
    """out [rows, cols] in a's dtype = a [rows, contract] @ W_g per row's group (0 past the groups)."""
    offsets = group_offsets(group_sizes, geo.rows, xp)
    tiles = row_tile_groups(offsets, geo.rows, geo.tm, xp)
    (out,) = launch(gmm_triton_kernels.jitted().gmm, (a, w, offsets, tiles), [((geo.rows, geo.cols), a.dtype)],
                    (geo.programs,), gmm_constexprs(geo), geo.num_warps, geo.num_stages)
    return out


def run_tgmm(launch, a, b, group_sizes, geo: TgmmGeometry, out_dtype, xp=None):
    """out [groups, p, q] in out_dtype: out[g] = a[rows of g]^T @ b[rows of g]."""
    offsets = group_offsets(group_sizes, geo.rows, xp)
    (out,) = launch(gmm_triton_kernels.jitted().tgmm, (a, b, offsets), [((geo.groups, geo.p, geo.q), out_dtype)],
                    (geo.programs,), tgmm_constexprs(geo), geo.num_warps, geo.num_stages)
    return out


def _jax_triton_launch(kernel, inputs, out_shapes, grid, meta, num_warps, num_stages):
    import jax
    import jax_triton as jt

    outs = jt.triton_call(*inputs, kernel=kernel, out_shape=[jax.ShapeDtypeStruct(s, d) for s, d in out_shapes],
                          grid=grid, num_warps=num_warps, num_stages=num_stages, **meta)
    return list(outs)


def gmm(a, w, group_sizes, geo: GmmGeometry, *, interpret: bool = False, name: str = ""):
    """``gmm_pallas.gmm``'s contract, through jax-triton (``interpret`` and ``name`` are unused: GPU only)."""
    return run_gmm(_jax_triton_launch, a, w, group_sizes, geo)


def tgmm(a, b, group_sizes, geo: TgmmGeometry, *, out_dtype, interpret: bool = False, name: str = ""):
    """``gmm_pallas.tgmm``'s contract, through jax-triton."""
    return run_tgmm(_jax_triton_launch, a, b, group_sizes, geo, out_dtype)
