"""Grouped matrix multiplication (the experts of a mixture-of-experts layer): ``grouped_matmul(lhs, rhs,
group_sizes)`` multiplies each row block of lhs (rows sorted by group) by its group's matrix.

``jax.lax.ragged_dot`` computes the same thing, but XLA:CPU and (deviceless-compiled) XLA:GPU lower it to a masked
dense matmul over every group: G times the FLOPs and a [G, m, k] temporary. The kernels here do only each row's own
group's work:

  * ``impl="pallas"``: Pallas kernels (``jaxtrain.kernels.gmm.pallas``), on GPU through Pallas' Triton lowering (the
    one both jax 0.10 and 0.11 accept, as for the flash kernels); ``interpret=True`` runs them on CPU.
  * ``impl="triton"``: the same kernels in the Triton language through jax-triton (``jaxtrain.kernels.gmm.triton``);
    CUDA GPU only.
  * ``impl="xla"``: ``jax.lax.ragged_dot`` (float32 accumulation, exact float32): the reference.
  * ``impl="auto"`` (default): "pallas" where JAX's default backend is a GPU, else "xla".

Differentiable through ``jax.custom_vjp``: d_lhs is a grouped matmul of d_out with each group's rhs transposed,
d_rhs the transposed grouped matmul (each group's rows of lhs^T @ d_out reduce into that group's [k, n]); no
gradient for group_sizes. Tiles, warps and stages per kernel and dtype: ``jaxtrain.kernels.gmm.plan``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtrain.kernels.gmm import pallas as gmm_pallas
from jaxtrain.kernels.gmm import triton as gmm_triton
from jaxtrain.kernels.gmm.plan import Plan, make_plan

IMPLS = ("auto", "pallas", "triton", "xla")
DTYPES = ("float32", "bfloat16", "float16")


def _shape(name, x) -> tuple:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(shape)


def validate(lhs, rhs, group_sizes, *, impl: str = "auto", interpret: bool = False) -> None:
    """Raise ValueError naming the first bad argument of ``grouped_matmul``; launch nothing."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    ls, rs, gs = _shape("lhs", lhs), _shape("rhs", rhs), _shape("group_sizes", group_sizes)
    if len(ls) != 2:
        raise ValueError(f"lhs must have rank 2 [m, k], got shape {ls}")
    if len(rs) != 3:
        raise ValueError(f"rhs must have rank 3 [groups, k, n], got shape {rs}")
    if ls[1] != rs[1]:
        raise ValueError(f"contraction mismatch: lhs is [m, k] = {ls}, rhs is [groups, k, n] = {rs}")
    if min(*ls, *rs) < 1:
        raise ValueError(f"empty input: lhs shape {ls}, rhs shape {rs}")
    if gs != (rs[0],):
        raise ValueError(f"group_sizes must have shape [groups] = ({rs[0]},), got {gs}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got dtype {group_sizes.dtype}")
    if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
        raise ValueError(f"lhs and rhs must share a dtype, got {lhs.dtype} and {rhs.dtype}")
    if jnp.dtype(lhs.dtype).name not in DTYPES:
        raise ValueError(f"unsupported dtype {lhs.dtype}: expected float32, bfloat16 or float16")
    if not isinstance(interpret, (bool, np.bool_)):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if interpret and impl != "pallas":
        raise ValueError(f"interpret=True is only available for impl='pallas', got impl={impl!r}")


def resolve_impl(impl: str) -> str:
    """"auto" -> "pallas" where JAX's default backend is a GPU, else "xla"; other names pass through."""
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def ragged_dot_reference(lhs, rhs, group_sizes):
    """``impl="xla"``: jax.lax.ragged_dot with float32 accumulation (exact float32: no TF32 on GPU), in lhs's dtype."""
    out = lax.ragged_dot(lhs, rhs, jnp.asarray(group_sizes, jnp.int32), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def _kernels(plan: Plan):
    return gmm_pallas if plan.impl == "pallas" else gmm_triton


def _forward(lhs, rhs, group_sizes, plan: Plan):
    return _kernels(plan).gmm(lhs, rhs, group_sizes, plan.geometry("fwd"), interpret=plan.interpret,
                              name="grouped_matmul_fwd")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(lhs, rhs, group_sizes, plan: Plan):
    return _forward(lhs, rhs, group_sizes, plan)


def _fwd_rule(lhs, rhs, group_sizes, plan: Plan):
    return _forward(lhs, rhs, group_sizes, plan), (lhs, rhs, group_sizes)


def _bwd_rule(plan: Plan, res, d_out):
    lhs, rhs, group_sizes = res
    kernels = _kernels(plan)
    d_out = d_out.astype(lhs.dtype)
    d_lhs = kernels.gmm(d_out, rhs, group_sizes, plan.geometry("dlhs"), interpret=plan.interpret,
                        name="grouped_matmul_dlhs")
    d_rhs = kernels.tgmm(lhs, d_out, group_sizes, plan.geometry("drhs"), interpret=plan.interpret,
                         out_dtype=rhs.dtype, name="grouped_matmul_drhs")
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_fwd_rule, _bwd_rule)
_jitted = jax.jit(_grouped_matmul, static_argnums=(3,))


def plan_for(lhs_shape, rhs_shape, dtype, *, impl: str, interpret: bool = False, **tiles) -> Plan:
    """The static plan (per-kernel tiles and geometry) of a kernel call on these shapes; ValueError on bad tiles."""
    (m, k), (groups, _, n) = lhs_shape, rhs_shape
    return make_plan(m, k, n, groups, dtype, impl=impl, interpret=interpret, tiles=tiles)


def grouped_matmul(lhs, rhs, group_sizes, *, impl: str = "auto", interpret: bool = False, **tiles):
    """Grouped matmul: out[i] = lhs[i] @ rhs[g(i)], where rows are sorted by group and group g owns the
    group_sizes[g] rows after the previous groups' (ragged_dot's contract). Differentiable w.r.t. lhs and rhs.

    Args:
      lhs: [m, k] (logical axes: tokens sorted by expert, embed), float32 / bfloat16 / float16.
      rhs: [groups, k, n] (experts, embed, mlp), lhs's dtype.
      group_sizes: int [groups], non-negative, sum <= m (a larger sum is clamped to m). Rows past the sum belong to
        no group and give zeros (as jax.lax.ragged_dot), and get zero gradient.
      impl: "auto" (pallas on GPU, else xla), "pallas", "triton" or "xla" (jax.lax.ragged_dot).
      interpret: run the Pallas kernels in the Pallas interpreter (CPU; slow, for testing).
      **tiles: overrides of the kernels' launches (``jaxtrain.kernels.gmm.plan``; defaults by dtype): block_m,
        block_n, block_k (tiles over the forward's m, n, k: powers of two >= 16, clamped to the dimension),
        num_warps, num_stages, band (programs walk output tiles in bands of this many tile rows), for every kernel
        or, suffixed _fwd / _dlhs / _drhs, for one. Checked for every impl, used by pallas and triton.

    Returns:
      [m, n] in lhs's dtype; accumulation in float32 (float32 inputs: exact float32 products, no TF32).

    Raises:
      ValueError: a bad argument (ranks, shapes, dtypes, impl, tiles), before any launch.
      RuntimeError: impl="triton" without a CUDA GPU or without triton / jax-triton.
    """
    validate(lhs, rhs, group_sizes, impl=impl, interpret=interpret)
    impl = resolve_impl(impl)
    plan = plan_for(lhs.shape, rhs.shape, lhs.dtype, impl="pallas" if impl == "xla" else impl,
                    interpret=bool(interpret), **tiles)
    if impl == "xla":
        return ragged_dot_reference(lhs, rhs, group_sizes)
    if impl == "triton":
        reason = availability_error()
        if reason:
            raise RuntimeError(reason)
    return _jitted(lhs, rhs, jnp.asarray(group_sizes, jnp.int32), plan)


def availability_error() -> str | None:
    """Why impl="triton" cannot run here (no CUDA GPU, no triton or jax_triton), or None."""
    from jaxtrain.kernels.flash import triton as flash_triton

    return flash_triton.availability_error()
