"""Flash attention kernels (jaxtrain.kernels.flash_attention) against a float64 oracle, on CPU.

The Pallas kernels run in interpret mode here; the Triton-language kernels run in Triton's CPU interpreter and
are compiled for sm_90 when the `triton` package is importable (skipped otherwise); the compiled GPU paths are
checked only where JAX sees a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtrain.kernels import flash_attention, mha_reference
from jaxtrain.kernels.flash import pallas as flash_pallas
from jaxtrain.kernels.flash import tiling, triton_kernels
from jaxtrain.kernels.flash import triton as flash_triton


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_BLOCKS = dict(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)


# ----------------------------------------------------------------------------------------------------------------
# Float64 oracle and helpers
# ----------------------------------------------------------------------------------------------------------------


def oracle(q, k, v, segment_ids, causal, scale, do):
    """Float64 attention and its gradients, written out by hand (checked against autodiff below).

    q, do [B, S, H, D]; k, v [B, S, KVH, D]; returns o, dq [B, S, H, D] and dk, dv [B, S, KVH, D] (summed over
    the query heads of each group).
    """
    b, s, h, d = q.shape
    g = h // k.shape[2]
    q, do = np.asarray(q, np.float64), np.asarray(do, np.float64)
    kk = np.repeat(np.asarray(k, np.float64), g, axis=2)  # head h -> kv head h // g
    vv = np.repeat(np.asarray(v, np.float64), g, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    mask = np.tril(np.ones((s, s), bool)) if causal else np.ones((s, s), bool)
    mask = mask[None, None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, vv)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = (np.einsum("bhqk,bqhd->bkhd", ds, q) * scale).reshape(b, s, -1, g, d).sum(3)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do).reshape(b, s, -1, g, d).sum(3)
    return o, dq, dk, dv


def make_inputs(case_id: str, b, s, h, kvh, d, dtype, segments=None):
    """Fresh random inputs for each case (seeded from the case id, so a failure reproduces)."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for shape in
                   ((b, s, h, d), (b, s, kvh, d), (b, s, kvh, d), (b, s, h, d)))
    seg = None
    if segments == "packed":  # contiguous documents of random lengths, as a packing data loader makes them
        seg = np.sort(rng.integers(0, max(1, s // 12), (b, s)), axis=1).astype(np.int32)
    elif segments == "scattered":  # ids need not be contiguous: the contract is "same id", nothing more
        seg = rng.integers(0, 3, (b, s)).astype(np.int32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(do), (None if seg is None else jnp.asarray(seg))


def flash_with_grads(q, k, v, seg, do, *, causal, **kwargs):
    """(o, dq, dk, dv) of jaxtrain.kernels.flash_attention through jax.vjp, in one compiled program."""

    @jax.jit
    def run(q, k, v, seg, do):
        o, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=seg, **kwargs),
                          q, k, v)
        return (o, *pull(do))

    return run(q, k, v, seg, do)


def rel_err(got, want) -> float:
    """Max error relative to the largest reference magnitude (absolute where the reference is all zero, as the
    gradients of a one-token sequence are)."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    scale = np.max(np.abs(want))
    return float(np.max(np.abs(got - want)) / (scale if scale > 1e-6 else 1.0))


def check_against_oracle(q, k, v, seg, do, causal, outs, tol, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    want = oracle(np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)),
                  np.asarray(v.astype(jnp.float32)), seg, causal, scale,
                  np.asarray(do.astype(jnp.float32)))
    for name, got, ref in zip(("o", "dq", "dk", "dv"), outs, want):
        assert got.shape == ref.shape, name
        assert np.all(np.isfinite(np.asarray(got, np.float32))), f"{name} has non-finite values"
        err = rel_err(got, ref)
        assert err <= tol, f"{name}: max error {err:.2e} (relative to max |{name}|) > {tol:.0e}"


def test_oracle_matches_autodiff_of_reference():
    """The hand-written float64 oracle agrees with jax.grad of the XLA reference (so it can be trusted)."""
    q, k, v, do, seg = make_inputs("oracle", 2, 24, 4, 2, 64, jnp.float32, "packed")

    @jax.jit
    def reference_with_grads(q, k, v, seg, do):
        o, pull = jax.vjp(lambda q, k, v: mha_reference(q, k, v, causal=True, segment_ids=seg), q, k, v)
        return (o, *pull(do))

    want = oracle(q, k, v, seg, True, 64**-0.5, do)
    for got, ref in zip(reference_with_grads(q, k, v, seg, do), want):
        assert rel_err(got, ref) < 2e-6


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel, interpret mode
# ----------------------------------------------------------------------------------------------------------------

# (batch, seq, heads, kv_heads, head_dim, causal, segments, block sizes, sm_scale)
F32_CASES = [
    (2, 100, 4, 2, 64, False, None, SMALL_BLOCKS, None),  # GQA 2, 100 % 32 != 0
    (1, 77, 8, 2, 128, True, "packed", dict(SMALL_BLOCKS, dkdv_splits=1), None),  # GQA 4 summed in one program
    (1, 130, 8, 1, 64, True, None, dict(block_q=16, block_k=64, block_q_bwd=32, block_k_bwd=16, dkdv_splits=2),
     0.3),  # MQA, the group of 8 split over 2 dk/dv programs
    (1, 45, 8, 1, 128, False, "scattered", SMALL_BLOCKS, None),  # GQA 8 with segments
    (1, 300, 2, 2, 64, True, "packed", dict(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=64), None),
    (2, 1, 2, 2, 64, True, None, SMALL_BLOCKS, None),  # a single token
    (1, 50, 4, 2, 256, True, "packed", SMALL_BLOCKS, None),  # head_dim 256: dk and dv in two passes
    (1, 64, 4, 4, 32, True, None, {}, None),  # the default tiles (clamped to the sequence)
]


@pytest.mark.parametrize("case", F32_CASES, ids=lambda c: "b{}-s{}-h{}-kv{}-d{}-causal{}-{}".format(*c[:7]))
def test_pallas_float32_values_and_grads(case):
    b, s, h, kvh, d, causal, segments, blocks, scale = case
    q, k, v, do, seg = make_inputs(f"f32-{case}", b, s, h, kvh, d, jnp.float32, segments)
    outs = flash_with_grads(q, k, v, seg, do, causal=causal, interpret=True, sm_scale=scale, **blocks)
    assert outs[0].dtype == jnp.float32
    check_against_oracle(q, k, v, seg, do, causal, outs, tol=1e-5, scale=scale)


LOW_PRECISION_CASES = [
    (jnp.bfloat16, 1, 100, 4, 2, 128, True, "packed"),
    (jnp.bfloat16, 2, 33, 8, 1, 64, False, None),
    (jnp.float16, 1, 70, 4, 4, 64, True, "scattered"),
]


@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=lambda c: "{}-b{}-s{}-h{}-kv{}-d{}-causal{}-{}".format(
    jnp.dtype(c[0]).name, *c[1:]))
def test_pallas_low_precision_values_and_grads(case):
    dtype, b, s, h, kvh, d, causal, segments = case
    q, k, v, do, seg = make_inputs(f"lp-{case}", b, s, h, kvh, d, dtype, segments)
    outs = flash_with_grads(q, k, v, seg, do, causal=causal, interpret=True, **SMALL_BLOCKS)
    assert all(x.dtype == dtype for x in outs)
    # The oracle sees the same rounded inputs; what remains is the kernels' bf16/fp16 rounding of p, ds and outputs.
    check_against_oracle(q, k, v, seg, do, causal, outs, tol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_single_token_segments_and_fully_masked_tiles_give_no_nan(causal):
    """Segments of one token, and rows whose first kv tiles are all masked (their segment starts mid-sequence)."""
    s = 70
    seg = np.zeros((1, s), np.int32)
    seg[0, 0] = 7  # a one-token segment at the very start
    seg[0, 1:40] = 1
    seg[0, 40] = 2  # one token alone, at the start of a tile: tiles 0..2 are fully masked for it
    seg[0, 41:69] = 3  # rows 41.. see only masked keys in their first tiles
    seg[0, 69] = 4  # last token alone, in a padded tile
    q, k, v, do, _ = make_inputs(f"single-{causal}", 1, s, 4, 2, 64, jnp.float32)
    seg = jnp.asarray(seg)
    outs = flash_with_grads(q, k, v, seg, do, causal=causal, interpret=True, **SMALL_BLOCKS)
    check_against_oracle(q, k, v, seg, do, causal, outs, tol=1e-5)
    # A token alone in its segment attends to itself only: its output is its own value vector.
    for row in (0, 40, 69):
        np.testing.assert_allclose(outs[0][0, row, :2], v[0, row, :1].repeat(2, axis=0), rtol=1e-6)


def test_causal_never_touches_tiles_above_the_diagonal():
    """Future keys and past queries are NaN: a kernel that loaded (then masked) those tiles would spread the NaN.

    Forward: rows of query tile 0 may only read kv tile 0, so NaN k/v after it must not reach them.
    Backward: dk/dv of kv tiles >= 1 may only read query tiles at or after them, so NaN q/do before must not reach.
    """
    bq = 16
    blocks = dict(block_q=bq, block_k=bq, block_q_bwd=bq, block_k_bwd=bq)
    q, k, v, do, _ = make_inputs("skip", 1, 64, 2, 1, 64, jnp.float32)
    k_nan = k.at[:, bq:].set(jnp.nan)
    v_nan = v.at[:, bq:].set(jnp.nan)
    o = flash_attention(q, k_nan, v_nan, causal=True, interpret=True, **blocks)
    want = oracle(q[:, :bq], k[:, :bq], v[:, :bq], None, True, 64**-0.5, do[:, :bq])[0]
    assert rel_err(o[:, :bq], want) < 1e-5
    assert np.isnan(np.asarray(o[:, bq:])).all()  # later rows do read the NaN keys: the test can fail

    q_nan = q.at[:, :bq].set(jnp.nan)
    do_nan = do.at[:, :bq].set(jnp.nan)
    _, dq, dk, dv = flash_with_grads(q_nan, k, v, None, do_nan, causal=True, interpret=True, **blocks)
    want = oracle(q, k, v, None, True, 64**-0.5, do)
    # Keys >= bq see only rows >= bq, whose inputs are intact, so their gradients equal the oracle's.
    assert rel_err(dk[:, bq:], want[2][:, bq:]) < 1e-5
    assert rel_err(dv[:, bq:], want[3][:, bq:]) < 1e-5
    assert np.isnan(np.asarray(dk[:, :bq])).all()


# ----------------------------------------------------------------------------------------------------------------
# Document masking: tiles of other documents are skipped, not computed and masked
# ----------------------------------------------------------------------------------------------------------------


def _share_an_id(seg_row, block_rows, block_cols):
    """Brute force: [row tiles, col tiles] bool, whether some (row, col) position pair has equal ids."""
    s = len(seg_row)
    rows, cols = -(-s // block_rows), -(-s // block_cols)
    eq = seg_row[:, None] == seg_row[None, :]
    return np.array([[eq[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols].any()
                      for j in range(cols)] for i in range(rows)])


@pytest.mark.parametrize("kind", ["packed", "scattered"])
def test_segment_tile_ranges_cover_every_tile_with_a_shared_id(kind):
    rng = np.random.default_rng(7)
    s, br, bc = 203, 16, 32  # not a multiple of either tile
    if kind == "packed":
        seg = np.cumsum(rng.random((3, s)) < 0.04, axis=1).astype(np.int32)  # as step.document_segments makes them
    else:
        seg = rng.integers(0, 4, (3, s)).astype(np.int32)
    for xp_ranges in (tiling.segment_tile_ranges(seg, br, bc, xp=np),
                      np.asarray(tiling.segment_tile_ranges(jnp.asarray(seg), br, bc))):
        for b in range(seg.shape[0]):
            share = _share_an_id(seg[b], br, bc)
            lo, hi = xp_ranges[b, :, 0], xp_ranges[b, :, 1]
            cols = np.arange(share.shape[1])[None, :]
            inside = (cols >= lo[:, None]) & (cols < hi[:, None])
            assert not (share & ~inside).any()  # skipping is exact: no tile with a shared id is outside
            if kind == "packed":  # consecutive ids: the range is exactly the tiles sharing an id
                np.testing.assert_array_equal(inside, share)


def test_tiles_computed_counts_causal_tiles_sharing_a_document():
    rng = np.random.default_rng(3)
    s, bq, bk = 300, 32, 16
    seg = np.cumsum(rng.random((2, s)) < 0.02, axis=1).astype(np.int32)
    computed, causal_total, total = tiling.tiles_computed(seg, bq, bk, causal=True)
    rows, cols = -(-s // bq), -(-s // bk)
    want_causal = sum(1 for i in range(rows) for j in range(cols) if j * bk <= min((i + 1) * bq, s) - 1)
    want = sum(int(_share_an_id(seg[b], bq, bk)[i, j]) for b in range(2) for i in range(rows) for j in range(cols)
               if j * bk <= min((i + 1) * bq, s) - 1)
    assert (computed, causal_total, total) == (want, 2 * want_causal, 2 * rows * cols)
    assert computed < causal_total


def _two_documents(causal: bool):
    """seq 64, documents [0, 32) and [32, 64); NaN in the inputs of one document must not reach the other."""
    s, half = 64, 32
    seg = jnp.asarray(np.repeat(np.array([[0, 1]], np.int32), half, axis=1))
    q, k, v, do, _ = make_inputs(f"docs-{causal}", 1, s, 4, 2, 32, jnp.float32)
    return s, half, seg, q, k, v, do


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask_skips_tiles_of_other_documents(causal):
    """NaN keys/values in document A: with skipping, document B's rows never load them (computing and masking
    would give 0 * NaN = NaN). Backward: NaN queries/cotangents in B must not reach A's dk/dv or dq."""
    s, half, seg, q, k, v, do = _two_documents(causal)
    blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    nan_a = lambda x: x.at[:, :half].set(jnp.nan)  # noqa: E731
    nan_b = lambda x: x.at[:, half:].set(jnp.nan)  # noqa: E731
    doc = lambda x, sl: np.asarray(x)[:, sl]  # noqa: E731
    a, b = slice(0, half), slice(half, s)
    o = flash_attention(q, nan_a(k), nan_a(v), causal=causal, segment_ids=seg, interpret=True, **blocks)
    want = oracle(doc(q, b), doc(k, b), doc(v, b), None, causal, 32**-0.5, doc(do, b))
    assert rel_err(o[:, b], want[0]) < 1e-5
    _, dq, dk, dv = flash_with_grads(nan_b(q), k, v, seg, nan_b(do), causal=causal, interpret=True, **blocks)
    want = oracle(doc(q, a), doc(k, a), doc(v, a), None, causal, 32**-0.5, doc(do, a))
    for got, ref in zip((dq[:, a], dk[:, a], dv[:, a]), want[1:]):
        assert rel_err(got, ref) < 1e-5


def test_tile_skip_report_on_the_embedded_corpus():
    """python benchmarks/tile_skip.py --seq 4096: every kernel computes some but not all causal tiles (the corpus's
    documents are shorter than the window), and no more than the causal tiles."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tile_skip", os.path.join(REPO, "benchmarks", "tile_skip.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["--seq", "4096"])
    assert {r["kernel"] for r in rows} == set(tiling.KINDS)
    for r in rows:
        assert 0 < r["computed"] < r["causal_tiles"]
        assert r["fraction_of_all"] < r["fraction_of_causal"] < 1


# ----------------------------------------------------------------------------------------------------------------
# Remat: the forward's results are saved under their checkpoint names
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("save_names", [False, True])
def test_remat_policy_can_save_attention_output_and_lse(save_names):
    """With save_only_these_names("attn_out", "attn_lse") the backward reuses the forward kernel's results; with
    nothing_saveable it recomputes them (rerunning the forward kernel)."""
    from jax._src.ad_checkpoint import saved_residuals

    q, k, v, _, _ = make_inputs("remat", 1, 64, 4, 2, 32, jnp.float32)
    policy = (jax.checkpoint_policies.save_only_these_names(*flash_pallas.CHECKPOINT_NAMES) if save_names
              else jax.checkpoint_policies.nothing_saveable)

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, interpret=True) ** 2)

    saved = [what for _, what in saved_residuals(jax.checkpoint(loss, policy=policy), q, k, v)]
    from_kernel = [w for w in saved if "flash_attention" in w]
    assert len(from_kernel) == (2 if save_names else 0), saved  # o and lse, or nothing


# ----------------------------------------------------------------------------------------------------------------
# Memory: no S x S buffer
# ----------------------------------------------------------------------------------------------------------------

SEQ_LONG = 8192


def _seq_by_seq_tensors(hlo_text: str, seq: int) -> list[str]:
    """Tensor types in a StableHLO module with two or more dimensions >= seq (the Triton IR is opaque bytecode)."""
    found = []
    for dims in re.findall(r"tensor<((?:\d+x)+)[a-z]", hlo_text):
        if sum(int(x) >= seq for x in dims.rstrip("x").split("x")) >= 2:
            found.append(dims)
    return found


def test_compiled_program_holds_no_seq_by_seq_buffer():
    """seq 8192: compiled temp memory of the flash program vs the XLA reference, forward and forward+backward.

    On CPU the Pallas kernels compile through the interpreter lowering (a loop over grid steps, each on its
    tiles), so the number says what the program's structure needs, not what a GPU would allocate; the GPU
    program is checked structurally in the next test.
    """
    spec_q = jax.ShapeDtypeStruct((1, SEQ_LONG, 1, 64), jnp.float32)
    s_by_s = SEQ_LONG * SEQ_LONG * 4  # one float32 S x S buffer: 256 MiB
    flash = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True)  # noqa: E731
    ref = lambda q, k, v: mha_reference(q, k, v, causal=True)  # noqa: E731

    def temp_bytes(fn, grad):
        if grad:
            fn = jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
        compiled = jax.jit(fn).trace(spec_q, spec_q, spec_q).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    for grad in (False, True):
        ref_temp, flash_temp = temp_bytes(ref, grad), temp_bytes(flash, grad)
        print(f"seq {SEQ_LONG} {'fwd+bwd' if grad else 'fwd'}: reference temp {ref_temp / 2**20:.1f} MiB, "
              f"flash temp {flash_temp / 2**20:.1f} MiB, one S x S f32 = {s_by_s / 2**20:.0f} MiB")
        assert ref_temp >= s_by_s  # the measurement sees S x S buffers when there are some
        assert flash_temp < s_by_s / 8


def _lower_for_gpu(fn, *specs):
    lower = lambda: jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()  # noqa: E731
    try:
        return lower()  # jax 0.10 falls back to compute capability 9.0 without a GPU
    except RuntimeError as e:
        if "GPU" not in str(e) or HAS_GPU:
            raise
    # jax 0.11 wants to know the target GPU: name an H200 through an abstract mesh (a private class, hence the
    # skip if it moves).
    try:
        from jax._src.mesh import AbstractDevice

        device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    except (ImportError, TypeError) as e:
        pytest.skip(f"cannot name an abstract GPU in this jax to lower Pallas-Triton without a GPU: {e}")
    with jax.sharding.use_abstract_mesh(mesh):
        return lower()


@pytest.mark.parametrize("dtype,d,causal,kvh,segments", [
    (jnp.bfloat16, 128, True, 2, True),
    (jnp.float16, 64, False, 8, False),
])
def test_pallas_lowers_to_triton_for_gpu(dtype, d, causal, kvh, segments):
    """Lower forward+backward for CUDA (Pallas -> Triton IR), from this CPU machine, at seq 8192.

    Every kernel must go through the Triton lowering (which rejects unsupported ops and non-power-of-two tiles),
    and the surrounding XLA program must hold no S x S tensor.
    """
    s = SEQ_LONG - 3  # not a multiple of the tiles, so the padding path is lowered too
    q = jax.ShapeDtypeStruct((2, s, 8, d), dtype)
    kv = jax.ShapeDtypeStruct((2, s, kvh, d), dtype)
    seg = jax.ShapeDtypeStruct((2, s), jnp.int32) if segments else None

    def loss(q, k, v, seg):
        return jnp.sum(flash_attention(q, k, v, causal=causal, segment_ids=seg).astype(jnp.float32))

    text = _lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seg)
    calls = re.findall(r"custom_call @([^\(]+)\(", text)
    assert len(calls) == 3 and all("triton" in c for c in calls), calls  # fwd, dq, dk/dv
    assert not _seq_by_seq_tensors(text, s)
    ref_text = _lower_for_gpu(jax.grad(lambda q, k, v: jnp.sum(mha_reference(q, k, v, causal=causal)),
                                       argnums=(0, 1, 2)), q, kv, kv)
    assert _seq_by_seq_tensors(ref_text, s)  # the scan does find S x S tensors where they exist


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------


def _bad(**over):
    args = dict(q=jnp.zeros((1, 8, 4, 64)), k=jnp.zeros((1, 8, 2, 64)), v=jnp.zeros((1, 8, 2, 64)))
    kwargs = {name: over.pop(name) for name in list(over) if name not in args}
    args.update(over)
    return args, kwargs


BAD_INPUTS = [
    (_bad(q=jnp.zeros((8, 4, 64))), r"q must have rank 4"),
    (_bad(k=jnp.zeros((1, 8, 2, 64, 1))), r"k must have rank 4"),
    (_bad(k=jnp.zeros((1, 8, 3, 64)), v=jnp.zeros((1, 8, 3, 64))), r"heads=4 is not divisible by kv_heads=3"),
    (_bad(v=jnp.zeros((1, 8, 1, 64))), r"k and v must have the same shape"),
    (_bad(k=jnp.zeros((2, 8, 2, 64)), v=jnp.zeros((2, 8, 2, 64))), r"batch mismatch"),
    (_bad(k=jnp.zeros((1, 9, 2, 64)), v=jnp.zeros((1, 9, 2, 64)), segment_ids=jnp.zeros((1, 8), jnp.int32)),
     r"segment_ids alone needs sq == skv"),
    (_bad(segment_ids=jnp.zeros((1, 8), jnp.int32), kv_segment_ids=jnp.zeros((1, 7), jnp.int32)),
     r"kv_segment_ids must have shape \[batch, skv\]"),
    (_bad(kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), r"kv_segment_ids needs segment_ids"),
    (_bad(q_offset=1.5), r"q_offset must be an int"),
    (_bad(kv_offset=jnp.zeros((2,), jnp.int32)), r"kv_offset must be an int or an integer scalar"),
    (_bad(k=jnp.zeros((1, 8, 2, 128)), v=jnp.zeros((1, 8, 2, 128))), r"head_dim mismatch"),
    (_bad(q=jnp.zeros((1, 8, 4, 48)), k=jnp.zeros((1, 8, 2, 48)), v=jnp.zeros((1, 8, 2, 48))),
     r"unsupported head_dim=48"),
    (_bad(impl="cuda"), r"unknown impl 'cuda'"),
    (_bad(k=jnp.zeros((1, 8, 2, 64), jnp.bfloat16)), r"must share a dtype"),
    (_bad(q=jnp.zeros((1, 8, 4, 64), jnp.int32), k=jnp.zeros((1, 8, 2, 64), jnp.int32),
          v=jnp.zeros((1, 8, 2, 64), jnp.int32)), r"unsupported dtype int32"),
    (_bad(segment_ids=jnp.zeros((1, 7), jnp.int32)), r"segment_ids must have shape"),
    (_bad(segment_ids=jnp.zeros((1, 8), jnp.float32)), r"segment_ids must be integers"),
    (_bad(block_q=48), r"block_q=48 must be a power of two"),
    (_bad(block_x=32), r"unknown block-size keyword"),
    (_bad(backend="mosaic_gpu"), r"backend='mosaic_gpu' is not implemented"),
    (_bad(impl="triton", interpret=True), r"interpret=True is only available for impl='pallas'"),
    (_bad(impl="triton", block_q=24), r"block_q=24 must be a power of two"),
    (_bad(impl="triton", block_m=64), r"unknown block-size keyword.s. .'block_m'. for impl='triton'"),
    (_bad(sm_scale=float("nan")), r"sm_scale must be a finite"),
    (_bad(dkdv_splits=3), r"dkdv_splits=3 must be a positive divisor of heads // kv_heads = 2"),
    (_bad(impl="triton", dkdv_splits=0), r"dkdv_splits=0 must be a positive divisor"),
]


@pytest.mark.parametrize("bad,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_raises_value_error_before_any_launch(bad, message, monkeypatch):
    def launched(*a, **k):
        raise AssertionError("a kernel was launched before the input was rejected")

    monkeypatch.setattr(flash_pallas, "_flash_attention", launched)
    monkeypatch.setattr(triton_kernels, "jitted", launched)
    monkeypatch.setattr(flash_triton, "availability_error", launched)
    args, kwargs = bad
    with pytest.raises(ValueError, match=message):
        flash_attention(args["q"], args["k"], args["v"], **kwargs)


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_triton_impl_without_gpu_is_a_clear_error():
    q = jnp.zeros((1, 8, 2, 64))
    with pytest.raises(RuntimeError, match=r"impl='triton' needs a CUDA GPU, but JAX sees none"):
        flash_attention(q, q, q, impl="triton")


def test_triton_impl_without_jax_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a: ["fake-gpu"])  # get past the GPU check
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # makes `import jax_triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or object())
    q = jnp.zeros((1, 8, 2, 64))
    with pytest.raises(RuntimeError, match=r"needs the 'jax_triton' package"):
        flash_attention(q, q, q, impl="triton")


# ----------------------------------------------------------------------------------------------------------------
# Triton-language kernels: Triton's CPU interpreter and an sm_90 compile (need the `triton` package)
# ----------------------------------------------------------------------------------------------------------------

_NP_TO_TRITON = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(np.int32): "i32",
                 np.dtype(ml_dtypes.bfloat16): "bf16"}


# (dtype, batch, seq, heads, kv_heads, head_dim, causal, segments, block sizes)
TRITON_CASES = [
    ("float32", 1, 64, 2, 2, 64, False, None, dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)),
    ("float32", 2, 50, 4, 2, 64, True, "packed", dict(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)),
    ("float32", 1, 40, 8, 1, 32, True, "scattered", dict(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)),
    ("float16", 1, 33, 8, 2, 64, False, "packed", dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)),
    # GQA 4 with the group in one dk/dv program (dkdv_splits=1) and in two (float32 partial sums), document
    # masking with tile skipping over packed documents, separate dq and dk/dv tiles
    ("float32", 1, 96, 8, 2, 32, True, "packed", dict(block_q=16, block_k=16, block_q_dq=32, block_k_dq=16,
                                                     block_q_dkdv=16, block_k_dkdv=32, dkdv_splits=1)),
    ("float32", 2, 80, 8, 2, 32, False, "packed", dict(block_q=16, block_k=32, block_q_dq=16, block_k_dq=16,
                                                      block_q_dkdv=32, block_k_dkdv=16, dkdv_splits=2)),
    # head_dim 256: dk and dv in two passes
    ("float32", 1, 40, 4, 2, 256, True, "packed", dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=32)),
]
TRITON_CASE_IDS = ["{}-b{}-s{}-h{}-kv{}-d{}-causal{}-{}".format(*c[:8]) for c in TRITON_CASES]


def interpreter_launch():
    """The ``launch`` callable of ``flash_triton.run_forward`` / ``run_backward`` for Triton's CPU interpreter
    (child-process side; see ``jaxtrain_testing.triton_interpreter_launch``)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))  # the child runs this file through runpy
    from jaxtrain_testing import triton_interpreter_launch

    return triton_interpreter_launch()


def _triton_interpreter_errors() -> dict:
    """Child-process side: run every TRITON_CASES call (forward and backward kernels) in Triton's interpreter on
    numpy arrays; return {case id: {output name: error vs the oracle}}."""
    launch = interpreter_launch()
    results = {}
    for case, case_id in zip(TRITON_CASES, TRITON_CASE_IDS):
        dtype, b, s, h, kvh, d, causal, segments, blocks = case
        *arrays, seg = make_inputs(f"tri-{case_id}", b, s, h, kvh, d, jnp.float32, segments)
        q, k, v, do = (np.asarray(x).astype(dtype) for x in arrays)
        seg = None if seg is None else np.asarray(seg)
        call = flash_triton.call_config(q.shape, kvh, q.dtype, causal=causal, sm_scale=None,
                                      has_segments=seg is not None, block_sizes=blocks)
        seg_arg = np.zeros(1, np.int32) if seg is None else seg
        o, lse = flash_triton.run_forward(launch, call, q, k, v, seg_arg)
        delta = (o.astype(np.float32) * do.astype(np.float32)).sum(-1).transpose(0, 2, 1)
        dq, dk, dv = flash_triton.run_backward(launch, call, q, k, v, seg_arg, do, lse, delta)
        want = oracle(q, k, v, seg, causal, d**-0.5, do)
        results[case_id] = {name: rel_err(got.astype(np.float32), ref)
                            for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), want)}
    for causal in (False, True):  # document-mask tile skipping: NaN in one document must not reach the other
        s, half, seg, q, k, v, do = (np.asarray(x) if hasattr(x, "shape") else x for x in _two_documents(causal))
        a, b = slice(0, half), slice(half, s)
        blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
        call = flash_triton.call_config(q.shape, k.shape[2], q.dtype, causal=causal, sm_scale=None,
                                      has_segments=True, block_sizes=blocks)
        k_nan, v_nan = k.copy(), v.copy()
        k_nan[:, a] = v_nan[:, a] = np.nan
        o, _ = flash_triton.run_forward(launch, call, q, k_nan, v_nan, seg)
        want_b = oracle(q[:, b], k[:, b], v[:, b], None, causal, 32**-0.5, do[:, b])
        q_nan, do_nan = q.copy(), do.copy()
        q_nan[:, b] = do_nan[:, b] = np.nan
        o_nan, lse = flash_triton.run_forward(launch, call, q_nan, k, v, seg)
        delta = (o_nan * do_nan).sum(-1).transpose(0, 2, 1)
        dq, dk, dv = flash_triton.run_backward(launch, call, q_nan, k, v, seg, do_nan, lse, delta)
        want_a = oracle(q[:, a], k[:, a], v[:, a], None, causal, 32**-0.5, do[:, a])
        results[f"docs-causal{causal}"] = dict(
            o=rel_err(o[:, b], want_b[0]), dq=rel_err(dq[:, a], want_a[1]), dk=rel_err(dk[:, a], want_a[2]),
            dv=rel_err(dv[:, a], want_a[3]))
    return results


@pytest.fixture(scope="module")
def triton_interpreter_results():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    if HAS_GPU:
        pytest.skip("a GPU is present: the jax-triton path is tested instead")
    from jaxtrain_testing import triton_interpreter_results  # here: this file also runs, via runpy, outside pytest

    return triton_interpreter_results(__file__, "_triton_interpreter_errors")


@pytest.mark.parametrize("case_id", TRITON_CASE_IDS)
def test_triton_kernels_in_triton_interpreter(case_id, triton_interpreter_results):
    """The Triton-language kernels and their launch call, run by Triton's CPU interpreter (float32 and float16;
    bf16 dots are not interpretable there: it multiplies the bf16 storage as uint16)."""
    tol = 1e-5 if case_id.startswith("float32") else 2e-3
    errors = triton_interpreter_results[case_id]
    for name, err in errors.items():
        assert err <= tol, f"{name}: error {err} > {tol}"  # NaN (unwritten or non-finite output) fails too


@pytest.mark.parametrize("causal", [False, True])
def test_triton_document_mask_skips_tiles_of_other_documents(causal, triton_interpreter_results):
    """As test_document_mask_skips_tiles_of_other_documents, for the Triton kernels in Triton's interpreter."""
    for name, err in triton_interpreter_results[f"docs-causal{causal}"].items():
        assert err <= 1e-5, f"{name}: error {err}"  # NaN from the other document fails


@pytest.mark.parametrize("dtype,d,causal,segments", [("bfloat16", 128, True, True), ("float32", 64, False, False)])
def test_triton_kernels_compile_for_sm90(dtype, d, causal, segments):
    """Compile every Triton kernel of a forward+backward call to a cubin for sm_90 (no GPU needed), with the
    signature jax-triton would give them, and check the shared memory fits an H100/H200 (228 KiB per SM)."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 replaces compilation")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = {}

    def compile_launch(kernel, inputs, out_shapes, grid, meta, num_warps, num_stages):
        arrays = [np.asarray(x) for x in inputs] + [np.zeros(shape, dt) for shape, dt in out_shapes]
        signature = {name: "*" + _NP_TO_TRITON[a.dtype] for name, a in zip(kernel.arg_names, arrays)}
        signature.update({name: "constexpr" for name in meta})
        result = triton.compile(ASTSource(kernel, signature, constexprs=meta), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        compiled[kernel.fn.__name__] = result
        return arrays[len(inputs):]

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    b, s, h, kvh = 2, 1000, 8, 2
    q, do = (np.zeros((b, s, h, d), np_dtype) for _ in range(2))
    k = v = np.zeros((b, s, kvh, d), np_dtype)
    seg = np.zeros((b, s) if segments else (1,), np.int32)
    triton_kernels.jitted.cache_clear()
    call = flash_triton.call_config(q.shape, kvh, np_dtype, causal=causal, sm_scale=None, has_segments=segments,
                                  block_sizes={})
    o, lse = flash_triton.run_forward(compile_launch, call, q, k, v, seg)
    flash_triton.run_backward(compile_launch, call, q, k, v, seg, do, lse, np.zeros_like(lse))
    assert len(compiled) == 3
    for name, result in compiled.items():
        assert "cubin" in result.asm, name
        assert result.metadata.shared <= 228 * 1024, (name, result.metadata.shared)


def test_triton_caches_in_the_sessions_directory_not_the_home_directory():
    """The compiles above cache under ~/.triton by default; tests/conftest.py points Triton at the session's temporary
    directory (removed at exit) unless the caller chose a place (TRITON_HOME or TRITON_CACHE_DIR)."""
    pytest.importorskip("triton")
    from triton import knobs

    if "TRITON_CACHE_DIR" in os.environ or os.environ.get("TRITON_HOME") != os.environ["XDG_CACHE_HOME"]:
        pytest.skip("the caller chose Triton's cache directory")
    assert knobs.cache.dir == os.path.join(os.environ["XDG_CACHE_HOME"], ".triton", "cache")
    assert os.path.commonpath([knobs.cache.dir, tempfile.gettempdir()]) == tempfile.gettempdir()


# ----------------------------------------------------------------------------------------------------------------
# Compiled GPU paths (only where JAX sees a GPU)
# ----------------------------------------------------------------------------------------------------------------

GPU_CASES = [
    ("pallas", jnp.float32, 2, 300, 8, 2, 128, True, "packed", 1e-5),
    ("pallas", jnp.bfloat16, 1, 1024, 8, 1, 64, False, None, 1e-2),
    ("triton", jnp.float32, 2, 300, 8, 2, 128, True, "packed", 1e-5),
    ("triton", jnp.bfloat16, 1, 1000, 8, 8, 64, True, "scattered", 1e-2),
    ("triton", jnp.bfloat16, 2, 2000, 16, 2, 128, True, "packed", 1e-2),  # GQA 8: dk/dv split over the group
    ("pallas", jnp.bfloat16, 1, 777, 4, 2, 256, True, "packed", 1e-2),  # head_dim 256: dk and dv in two passes
    ("triton", jnp.float32, 1, 513, 4, 4, 256, False, None, 1e-5),
]


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"{c[0]}-{jnp.dtype(c[1]).name}-s{c[3]}-kv{c[5]}-d{c[6]}-causal{c[7]}")
def test_gpu_values_and_grads(case):
    impl, dtype, b, s, h, kvh, d, causal, segments, tol = case
    if impl == "triton" and flash_triton.availability_error():
        pytest.skip(flash_triton.availability_error())
    q, k, v, do, seg = make_inputs(f"gpu-{case}", b, s, h, kvh, d, dtype, segments)
    outs = flash_with_grads(q, k, v, seg, do, causal=causal, impl=impl)
    check_against_oracle(q, k, v, seg, do, causal, outs, tol=tol)


# ----------------------------------------------------------------------------------------------------------------
# Benchmark smoke mode
# ----------------------------------------------------------------------------------------------------------------


def test_bench_smoke_mode_runs_every_implementation_and_writes_reports(tmp_path, capsys):
    from jaxtrain.kernels.bench import flash as bench

    rows = bench.main(["--smoke", "--causal", "true", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    by_impl = {}
    for row in rows:
        by_impl.setdefault(row["impl"], []).append(row)
    assert set(by_impl) == set(bench.IMPLS)
    for row in by_impl["pallas"] + by_impl["xla"]:
        assert row["status"] == "ok", row
        assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 and row["fwd_tflops"] > 0
        assert row["max_err_fwd"] < 0.05 and row["max_err_grad"] < 0.05, row
    if not HAS_GPU:  # failures are recorded per implementation, and the rest go on
        assert all(r["status"].startswith("error") and "GPU" in r["status"] for r in by_impl["triton"])
    csv_text = (tmp_path / "flash_attention_bench.csv").read_text()
    md_text = (tmp_path / "flash_attention_bench.md").read_text()
    assert csv_text.count("\n") == len(rows) + 1
    assert md_text.count("\n| ") >= len(rows)
    assert "pallas" in printed and "xla" in printed


@pytest.mark.slow
def test_gpu_check_script_smoke_runs_every_section(tmp_path):
    """benchmarks/gpu_check.sh --smoke on CPU: every section runs and succeeds (GPU-only parts skip or record
    their reason), and the benchmark and training reports are written."""
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh"), "--smoke", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for section in ("versions and devices", "kernel tests", "TFLOP/s", "training steps", "0 section(s) failed"):
        assert section in proc.stdout
    assert (tmp_path / "bench" / "flash_attention_bench.csv").is_file()
    for impl in ("xla", "pallas"):
        assert (tmp_path / f"train-{impl}" / "summary.json").is_file()
    assert re.search(r"^pallas\s+ok\s", proc.stdout, re.M), proc.stdout[-2000:]


def test_gpu_check_script_rejects_bad_arguments():
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh"), "--fast"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument '--fast'" in proc.stderr
