"""The grouped matmul (jaxtrain.kernels.grouped_matmul) against a float64 NumPy oracle, on CPU.

The Pallas kernels run in interpret mode, the Triton-language kernels in Triton's CPU interpreter (a child process,
as for the flash kernels); impl="xla" is jax.lax.ragged_dot. The shapes cover uneven group sizes with empty groups,
a group longer than a row tile, a row tile holding eight groups, rows past the sum of the sizes, and m, k, n that
are not tile multiples (the masked paths) as well as ones that are.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.kernels import grouped_matmul
from jaxtrain.kernels.gmm import api as gmm_api
from jaxtrain.kernels.gmm import plan as gmm_plan
from jaxtrain.kernels.gmm import triton as gmm_triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def oracle(lhs, rhs, sizes, d_out):
    """Float64 (out, d_lhs, d_rhs) of out[i] = lhs[i] @ rhs[g(i)], written out group by group. Rows past the sum of
    the sizes belong to no group: out and d_lhs 0 there, and they add nothing to d_rhs."""
    lhs, rhs, d_out = (np.asarray(x, np.float64) for x in (lhs, rhs, d_out))
    (m, k), n = lhs.shape, rhs.shape[2]
    ends = np.minimum(np.cumsum(sizes), m)
    out, d_lhs, d_rhs = np.zeros((m, n)), np.zeros((m, k)), np.zeros(rhs.shape)
    for g, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        out[start:end] = lhs[start:end] @ rhs[g]
        d_lhs[start:end] = d_out[start:end] @ rhs[g].T
        d_rhs[g] = lhs[start:end].T @ d_out[start:end]
    return out, d_lhs, d_rhs


# (name, dtype, m, k, n, group sizes, tile overrides)
CASES = [
    # sum 62 < m = 70: 8 rows past the groups; empty groups inside and at the end; a 37-row group over three 16-row
    # tiles; k = 40 and n = 24 are no tile multiples (masked loads and stores along every axis)
    ("masked-f32", "float32", 70, 40, 24, [20, 0, 37, 5, 0], dict(block_m=16, block_n=16, block_k=16)),
    ("masked-bf16", "bfloat16", 100, 64, 48, [30, 41, 0, 17], dict(block_m=32, block_n=16, block_k=32)),
    # every dimension a tile multiple (the unmasked loads and stores) and sum == m; the first 32-row tile holds
    # eight groups (three of one row), the last group spans tiles
    ("even-f32", "float32", 64, 32, 32, [3, 1, 4, 1, 5, 9, 2, 39], dict(block_m=32, block_n=16, block_k=16)),
]
TRITON_CASES = [("masked-f32", "float32"), ("masked-bf16", "float16"), ("even-f32", "float32")]  # (CASES shape, dtype)
TRITON_IDS = [f"{name}-as-{dtype}" for name, dtype in TRITON_CASES]


def make_inputs(case_id: str, dtype, m, k, n, sizes):
    """Random lhs, rhs, d_out (seeded by the case id) with NaN wherever the kernels must not read: lhs and d_out
    rows past the groups, and the weights of empty groups (the oracle never reads them either)."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    lhs, rhs, d_out = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (len(sizes), k, n), (m, n)))
    total = min(sum(sizes), m)
    lhs[total:] = d_out[total:] = np.nan
    rhs[np.asarray(sizes) == 0] = np.nan
    cast = (lambda x: np.asarray(jnp.asarray(x, dtype), np.float32))  # noqa: E731 - rounded as the kernel sees it
    return cast(lhs), cast(rhs), cast(d_out), np.asarray(sizes, np.int32)


def rel_errors(got, want) -> dict:
    """{name: max |got - want| / max |want|}; NaN anywhere in got gives NaN (a failure)."""
    out = {}
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        assert g.shape == w.shape, name
        out[name] = float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-6)) if np.all(np.isfinite(g)) else np.nan
    return out


def value_and_grads(lhs, rhs, sizes, d_out, dtype, **kwargs):
    """(out, d_lhs, d_rhs) of grouped_matmul through jax.vjp, in one compiled program."""

    @jax.jit
    def run(lhs, rhs, sizes, d_out):
        out, pull = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, **kwargs), lhs, rhs)
        return (out, *pull(d_out))

    return run(*(jnp.asarray(x, dtype) for x in (lhs, rhs)), jnp.asarray(sizes), jnp.asarray(d_out, dtype))


def tolerance(dtype) -> float:
    return 1e-5 if np.dtype(dtype).itemsize == 4 else 1e-2


def test_oracle_matches_ragged_dot_and_its_autodiff():
    """The float64 oracle agrees with jax.lax.ragged_dot and its JAX gradients (NaN-free inputs: ragged_dot
    multiplies every group's weights by masked zeros)."""
    lhs, rhs, d_out, sizes = make_inputs("oracle", "float32", 30, 12, 10, [7, 0, 15, 3])
    lhs, d_out, rhs = np.nan_to_num(lhs), np.nan_to_num(d_out), np.nan_to_num(rhs)

    def ragged(a, b):
        return jax.lax.ragged_dot(a, b, jnp.asarray(sizes), precision=jax.lax.Precision.HIGHEST)

    out, pull = jax.vjp(ragged, jnp.asarray(lhs), jnp.asarray(rhs))
    errors = rel_errors((out, *pull(jnp.asarray(d_out))), oracle(lhs, rhs, sizes, d_out))
    assert max(errors.values()) < 2e-6, errors


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pallas_values_and_grads_in_interpret_mode(case):
    name, dtype, m, k, n, sizes, tiles = case
    lhs, rhs, d_out, sizes = make_inputs(name, dtype, m, k, n, sizes)
    got = value_and_grads(lhs, rhs, sizes, d_out, dtype, impl="pallas", interpret=True, **tiles)
    assert all(jnp.dtype(x.dtype) == jnp.dtype(dtype) for x in got)
    errors = rel_errors(got, oracle(lhs, rhs, sizes, d_out))
    assert max(errors.values()) <= tolerance(dtype), errors  # NaN (a read of rows it must not read) fails too


def test_xla_impl_is_ragged_dot_and_auto_picks_it_on_cpu():
    name, dtype, m, k, n, sizes, _ = CASES[0]
    lhs, rhs, d_out, sizes = make_inputs(name, dtype, m, k, n, sizes)
    lhs, d_out, rhs = np.nan_to_num(lhs), np.nan_to_num(d_out), np.nan_to_num(rhs)
    assert gmm_api.resolve_impl("auto") == "xla"  # no GPU here
    for impl in ("xla", "auto"):
        errors = rel_errors(value_and_grads(lhs, rhs, sizes, d_out, dtype, impl=impl), oracle(lhs, rhs, sizes, d_out))
        assert max(errors.values()) <= 1e-5, (impl, errors)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_default_tiles_on_a_larger_call(dtype):
    """The default tiles (clamped to the call) on 8 experts of uneven sizes, one of them empty."""
    sizes = [40, 7, 0, 90, 33, 1, 60, 52]  # 283 of 300 rows
    lhs, rhs, d_out, sizes = make_inputs(f"default-{dtype}", dtype, 300, 96, 80, sizes)
    got = value_and_grads(lhs, rhs, sizes, d_out, dtype, impl="pallas", interpret=True)
    errors = rel_errors(got, oracle(lhs, rhs, sizes, d_out))
    assert max(errors.values()) <= tolerance(dtype), errors


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("impl", ["pallas", "triton"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_values_and_grads(impl, dtype):
    """The compiled kernels with their default tiles: 8 experts (one empty, one over several row tiles), rows past
    the groups, no dimension a tile multiple."""
    if impl == "triton" and gmm_api.availability_error():
        pytest.skip(gmm_api.availability_error())
    sizes = [130, 0, 402, 77, 1, 160, 95, 100]  # 965 of 1000 rows
    lhs, rhs, d_out, sizes = make_inputs(f"gpu-{impl}-{dtype}", dtype, 1000, 320, 416, sizes)
    errors = rel_errors(value_and_grads(lhs, rhs, sizes, d_out, dtype, impl=impl), oracle(lhs, rhs, sizes, d_out))
    assert max(errors.values()) <= tolerance(dtype), errors


# ----------------------------------------------------------------------------------------------------------------
# Triton-language kernels in Triton's CPU interpreter (child process)
# ----------------------------------------------------------------------------------------------------------------


def _triton_errors() -> dict:
    """Child-process side: each TRITON_CASES call's three kernels through ``gmm_triton.run_gmm`` / ``run_tgmm`` in
    Triton's interpreter on numpy arrays (bf16 dots are not interpretable there); {case: {output: error}}."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from jaxtrain_testing import triton_interpreter_launch

    launch = triton_interpreter_launch()
    by_name = {c[0]: c for c in CASES}
    results = {}
    for (name, dtype), case_id in zip(TRITON_CASES, TRITON_IDS):
        _, _, m, k, n, sizes, tiles = by_name[name]
        lhs, rhs, d_out, sizes = make_inputs(case_id, dtype, m, k, n, sizes)
        lhs, rhs, d_out = (x.astype(dtype) for x in (lhs, rhs, d_out))
        plan = gmm_plan.make_plan(m, k, n, len(sizes), dtype, impl="triton", tiles=tiles)
        got = (gmm_triton.run_gmm(launch, lhs, rhs, sizes, plan.geometry("fwd"), xp=np),
               gmm_triton.run_gmm(launch, d_out, rhs, sizes, plan.geometry("dlhs"), xp=np),
               gmm_triton.run_tgmm(launch, lhs, d_out, sizes, plan.geometry("drhs"), rhs.dtype, xp=np))
        results[case_id] = rel_errors(got, oracle(lhs, rhs, sizes, d_out))
    return results


@pytest.fixture(scope="module")
def triton_results():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    from jaxtrain_testing import triton_interpreter_results  # here: this file also runs, via runpy, outside pytest

    return triton_interpreter_results(__file__, "_triton_errors")


@pytest.mark.parametrize("case_id,dtype", zip(TRITON_IDS, [c[1] for c in TRITON_CASES]), ids=TRITON_IDS)
def test_triton_kernels_in_triton_interpreter(case_id, dtype, triton_results):
    errors = triton_results[case_id]
    assert max(errors.values()) <= tolerance(dtype), errors  # NaN (unwritten, or a forbidden read) fails too


# ----------------------------------------------------------------------------------------------------------------
# Arguments and plans
# ----------------------------------------------------------------------------------------------------------------


def _args(m=8, k=4, n=6, groups=3, dtype=jnp.float32, rhs_dtype=None, sizes_dtype=jnp.int32):
    return (jnp.zeros((m, k), dtype), jnp.zeros((groups, k, n), rhs_dtype or dtype), jnp.zeros((groups,),
                                                                                                sizes_dtype))


@pytest.mark.parametrize("args,kwargs,message", [
    (_args(), dict(impl="cuda"), r"unknown impl 'cuda'"),
    ((jnp.zeros((2, 8, 4)), *_args()[1:]), {}, r"lhs must have rank 2 \[m, k\], got shape \(2, 8, 4\)"),
    ((_args()[0], jnp.zeros((4, 6)), _args()[2]), {}, r"rhs must have rank 3"),
    ((jnp.zeros((8, 5)), *_args()[1:]), {}, r"contraction mismatch"),
    ((*_args()[:2], jnp.zeros((2,), jnp.int32)), {}, r"group_sizes must have shape \[groups\] = \(3,\)"),
    (_args(sizes_dtype=jnp.float32), {}, r"group_sizes must be integers"),
    (_args(rhs_dtype=jnp.bfloat16), {}, r"lhs and rhs must share a dtype"),
    (_args(dtype=jnp.int32), {}, r"unsupported dtype int32"),
    (_args(), dict(impl="triton", interpret=True), r"interpret=True is only available for impl='pallas'"),
    (_args(), dict(block_m=24), r"block_m=24 must be a power of two >= 16"),
    (_args(), dict(num_warps_drhs=3), r"num_warps_drhs=3 must be one of 1, 2, 4, 8, 16"),
    (_args(), dict(block_q=32), r"unknown tile keyword.s. \['block_q'\]"),
    (_args(), dict(impl="xla", band=0), r"band=0 must be >= 1"),
])
def test_bad_arguments_raise_value_error_before_any_launch(args, kwargs, message, monkeypatch):
    def launched(*a, **k):
        raise AssertionError("a kernel was launched")

    for module in (gmm_api.gmm_pallas, gmm_triton):
        monkeypatch.setattr(module, "gmm", launched)
        monkeypatch.setattr(module, "tgmm", launched)
    with pytest.raises(ValueError, match=message):
        grouped_matmul(*args, **kwargs)


def test_triton_impl_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"impl='triton' needs a CUDA GPU, but JAX sees none"):
        grouped_matmul(*_args(), impl="triton")


def test_tile_overrides_per_kernel_win_over_generic_ones_and_tiles_clamp_to_the_call():
    plan = gmm_api.plan_for((300, 96), (8, 96, 40), "bfloat16", impl="pallas", block_m=64, block_m_drhs=32,
                            num_stages_fwd=2)
    assert (plan.fwd.block_m, plan.dlhs.block_m, plan.drhs.block_m) == (64, 64, 32)
    assert (plan.fwd.num_stages, plan.dlhs.num_stages) == (2, gmm_plan.default_tiles("dlhs", "bfloat16").num_stages)
    fwd, dlhs, drhs = (plan.geometry(k) for k in gmm_plan.KINDS)
    # n = 40 clamps a 128-wide tile to 64; the d_lhs kernel's output columns are k (96 -> 128) and its
    # contraction n; d_rhs tiles k x n and steps over rows
    assert (fwd.tm, fwd.tn, fwd.tc, fwd.transpose_w) == (64, 64, 64, False)
    assert (dlhs.rows, dlhs.cols, dlhs.contract, dlhs.transpose_w) == (300, 96, 40, True)
    assert (drhs.p, drhs.q, drhs.tr) == (96, 40, 32)
    assert not fwd.even_m and fwd.programs == 5 * 1


def test_group_tables_list_every_group_a_row_tile_holds():
    """row_tile_groups against a direct count: tile t lists exactly the groups with rows in it (plus empty groups
    that lie inside its range, which the kernels skip); tiles past the groups list none."""
    sizes = np.array([3, 0, 20, 0, 1, 9, 0], np.int32)  # 33 of 48 rows
    offsets = gmm_plan.group_offsets(sizes, 48, np)
    assert offsets.tolist() == [0, 3, 3, 23, 23, 24, 33, 33]
    tiles = gmm_plan.row_tile_groups(offsets, 48, 8, np)
    for t, (lo, hi) in enumerate(tiles):
        rows = set(range(8 * t, 8 * t + 8))
        holding = {g for g in range(len(sizes)) if rows & set(range(offsets[g], offsets[g + 1]))}
        assert holding <= set(range(lo, hi)), (t, lo, hi, holding)
        assert all(sizes[g] == 0 for g in set(range(lo, hi)) - holding), (t, lo, hi)
    assert tiles[-1].tolist() == [7, 7]  # rows 40..47: no group
    assert gmm_plan.group_offsets(np.array([30, 30], np.int32), 48, np).tolist() == [0, 30, 48]  # clamped to m


def test_band_order_visits_every_output_tile_once():
    for tiles_m, tiles_n, band in ((7, 5, 3), (4, 9, 8), (1, 1, 8), (16, 2, 1)):
        seen = [gmm_plan.band_order(pid, tiles_m, tiles_n, band, min) for pid in range(tiles_m * tiles_n)]
        assert sorted(seen) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]


# ----------------------------------------------------------------------------------------------------------------
# Benchmark (python -m jaxtrain.kernels.bench.gmm)
# ----------------------------------------------------------------------------------------------------------------


def test_bench_routing_draws_top_k_distinct_experts_per_token():
    from jaxtrain.kernels.bench import gmm as gmm_bench

    for routing in gmm_bench.ROUTINGS:
        sizes = gmm_bench.group_sizes(routing, 1000, 8, 2)
        assert sizes.sum() == 2000 and sizes.max() <= 1000, sizes  # no token picks an expert twice
    balanced, skewed = (gmm_bench.group_sizes(r, 1000, 8, 2) for r in gmm_bench.ROUTINGS)
    assert balanced.max() < 1.3 * balanced.min() and skewed[0] > 3 * skewed[-1], (balanced, skewed)


def test_bench_refuses_without_a_gpu_and_rejects_bad_arguments(capsys):
    from jaxtrain.kernels.bench import gmm as gmm_bench

    with pytest.raises(SystemExit, match="no GPU visible to JAX"):
        gmm_bench.main([])
    for argv, message in ((["--impls", "pallas,cudnn"], "--impls 'pallas,cudnn' must be a comma-separated subset"),
                          (["--top-k", "9"], "need 1 <= --top-k <= --experts")):
        with pytest.raises(SystemExit) as e:
            gmm_bench.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_smoke_runs_every_implementation(capsys):
    """--smoke on CPU: the Pallas kernels (interpreted), ragged_dot and the dense einsum run and agree with the
    float32 reference to bfloat16 rounding; triton records why it cannot run; every row is a JSON line."""
    from jaxtrain.kernels.bench import gmm as gmm_bench

    rows = gmm_bench.main(["--smoke", "--routing", "balanced", "--projections", "up"])
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == set(gmm_bench.IMPLS)
    for impl in ("pallas", "xla", "dense"):
        r = by_impl[impl]
        assert r["status"] == "ok" and r["fwdbwd_tflops"] > 0, r
        assert r["max_err_fwd"] < 1e-2 and r["max_err_grad"] < 1e-2, r
    assert "GPU" in by_impl["triton"]["status"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["impl"] for r in printed] == [r["impl"] for r in rows]
