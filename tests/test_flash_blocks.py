"""Flash kernels on blocks of a sequence (what ring attention calls): query / key position offsets (static and
traced), sq != skv, separate query and key segment ids, the forward and backward entries
(``jaxtrain.kernels.flash_attention_fwd`` / ``flash_attention_bwd``), against a float64 oracle; partial results over two
key blocks merged by their log-sum-exp equal attention over the concatenated keys; tiles hidden by the causal mask
or by the segments are skipped (NaN in them reaches nothing).

Pallas runs in interpret mode; the Triton-language kernels in Triton's CPU interpreter (a child process, as in
``test_flash_attention``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.kernels import flash_attention, flash_attention_bwd, flash_attention_fwd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILES = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def block_oracle(q, k, v, seg_q, seg_k, causal, q_offset, kv_offset, do, scale=None):
    """Float64 attention of a query block against a key block and its gradients, written out by hand.

    q, do [B, Sq, H, D]; k, v [B, Sk, KVH, D]; seg_q [B, Sq] / seg_k [B, Sk] or None. Query i sees key j when
    q_offset + i >= kv_offset + j (causal) and their ids are equal. A row that sees no key: o 0, lse -inf, no
    gradient. Returns o, lse [B, H, Sq] (natural log), dq, dk, dv (dk, dv summed over each query group).
    """
    b, sq, h, d = q.shape
    sk, g = k.shape[1], h // k.shape[2]
    scale = d**-0.5 if scale is None else scale
    q, do = np.asarray(q, np.float64), np.asarray(do, np.float64)
    kk = np.repeat(np.asarray(k, np.float64), g, axis=2)
    vv = np.repeat(np.asarray(v, np.float64), g, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    mask = np.ones((b, 1, sq, sk), bool)
    if causal:
        mask &= ((q_offset + np.arange(sq))[:, None] >= (kv_offset + np.arange(sk))[None, :])[None, None]
    if seg_q is not None:
        mask &= (np.asarray(seg_q)[:, None, :, None] == np.asarray(seg_k)[:, None, None, :])
    logits = np.where(mask, logits, -np.inf)
    seen = mask.any(-1)  # [B, 1, Sq]
    top = np.where(seen[..., None], logits.max(-1, keepdims=True), 0.0)
    e = np.where(mask, np.exp(logits - top), 0.0)
    den = e.sum(-1, keepdims=True)
    p = e / np.where(den > 0, den, 1.0)
    lse = np.where(seen, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)) + top[..., 0], -np.inf)
    o = np.einsum("bhqk,bkhd->bqhd", p, vv)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = (np.einsum("bhqk,bqhd->bkhd", ds, q) * scale).reshape(b, sk, -1, g, d).sum(3)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do).reshape(b, sk, -1, g, d).sum(3)
    return o, np.broadcast_to(lse, (b, h, sq)), dq, dk, dv


def block_inputs(case_id, b, sq, sk, h, kvh, d, segments):
    """Random inputs seeded from the case id; segments: None or "separate" (packed ids, drawn apart for queries
    and keys, so that some query rows share no id with the key block)."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in
                   ((b, sq, h, d), (b, sk, kvh, d), (b, sk, kvh, d), (b, sq, h, d)))
    seg_q = seg_k = None
    if segments == "separate":
        seg_q = np.sort(rng.integers(0, 4, (b, sq)), axis=1).astype(np.int32)
        seg_k = np.sort(rng.integers(1, 5, (b, sk)), axis=1).astype(np.int32)
    return q, k, v, do, seg_q, seg_k


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def lse_err(got, want):
    """Max error of a log-sum-exp, NaN where -inf rows disagree (so a wrong empty row fails the test)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.array_equal(np.isneginf(got), np.isneginf(want)) or np.isnan(got).any():
        return float("nan")
    finite = ~np.isneginf(want)
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0))


def merge_blocks(parts):
    """Merge (o float32 [B, Sq, H, D], lse [B, H, Sq]) of several key blocks into the attention over all of them,
    as ring attention does: lse = logaddexp over blocks, o = sum of o_i * exp(lse_i - lse); rows with no key in any
    block stay 0 / -inf. Works on numpy or jax arrays."""
    xp = jnp if isinstance(parts[0][0], jax.Array) else np
    lse = parts[0][1]
    for _, l in parts[1:]:
        lse = xp.logaddexp(lse, l)
    safe = xp.where(xp.isneginf(lse), 0.0, lse)
    o = sum(o_i * xp.exp(xp.where(xp.isneginf(l_i), -xp.inf, l_i - safe)).transpose(0, 2, 1)[..., None]
            for o_i, l_i in parts)
    return o, lse


# (batch, sq, skv, heads, kv_heads, head_dim, causal, q_offset, kv_offset, segments)
BLOCK_CASES = [
    # a later query block against an earlier, shorter key block: the diagonal crosses it (GQA 2)
    (1, 40, 24, 4, 2, 32, True, 30, 10, None),
    # an earlier query block against a later key block: rows before every key see nothing (lse -inf, out 0)
    (1, 32, 48, 4, 1, 32, True, 5, 20, "separate"),
    # bidirectional attention between blocks, separate segment ids (some rows share no id with the block)
    (2, 24, 40, 2, 2, 32, False, 0, 0, "separate"),
]
BLOCK_IDS = ["b{}-sq{}-skv{}-h{}-kv{}-d{}-causal{}-qo{}-ko{}-{}".format(*c) for c in BLOCK_CASES]


def _pallas_block(case, case_id, traced):
    b, sq, sk, h, kvh, d, causal, qo, ko, segments = case
    q, k, v, do, seg_q, seg_k = block_inputs(case_id, b, sq, sk, h, kvh, d, segments)
    kw = dict(causal=causal, segment_ids=seg_q, kv_segment_ids=seg_k, interpret=True, **TILES)

    def run(q, k, v, qo, ko):
        o, lse = flash_attention_fwd(q, k, v, q_offset=qo, kv_offset=ko, **kw)
        grads = flash_attention_bwd(q, k, v, o, lse, do, q_offset=qo, kv_offset=ko, **kw)
        vjp = jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, q_offset=qo, kv_offset=ko, **kw) * do),
                       argnums=(0, 1, 2))(q, k, v)
        return o, lse, grads, vjp

    if traced:  # offsets as traced int32 scalars (as inside shard_map), passed to the kernels as an operand
        o, lse, grads, vjp = jax.jit(run)(q, k, v, jnp.int32(qo), jnp.int32(ko))
    else:
        o, lse, grads, vjp = run(q, k, v, qo, ko)
    want = block_oracle(q, k, v, seg_q, seg_k, causal, qo, ko, do)
    return o, lse, grads, vjp, want


def _block_params():
    """(case, traced) pairs, in the slow pass (interpret mode compiles every kernel variant: seconds each; the
    default suite has the two-block merge and the hidden tiles, which cover traced offsets, sq != skv, separate
    segments and GQA)."""
    return [pytest.param(case, traced, id=f"{'traced' if traced else 'static'}-{case_id}", marks=pytest.mark.slow)
            for case, case_id in zip(BLOCK_CASES, BLOCK_IDS) for traced in (False, True)]


@pytest.mark.parametrize("case,traced", _block_params())
def test_pallas_block_values_and_grads_match_float64(case, traced):
    """Offsets (static and traced), sq != skv, separate query / key segments, GQA, causal and not: out, lse, the
    backward entry's dq/dk/dv and flash_attention's gradient against the float64 oracle, no NaN anywhere."""
    o, lse, grads, vjp, (o_w, lse_w, *grads_w) = _pallas_block(case, BLOCK_IDS[BLOCK_CASES.index(case)], traced)
    for got in (o, lse, *grads, *vjp):
        assert not np.isnan(np.asarray(got)).any()
    assert rel_err(o, o_w) < 1e-5
    assert lse_err(lse, lse_w) < 1e-5
    for name, got, g_grads, want in zip(("dq", "dk", "dv"), grads, vjp, grads_w):
        assert rel_err(got, want) < 1e-5, name
        assert rel_err(g_grads, want) < 1e-5, name


def _two_block_inputs():
    """A query block of 2c tokens at positions [c, 3c) against keys [0, 2c) in two blocks of c (one wholly visible,
    one crossed by the diagonal: equal shapes, so both calls share their compiled kernels), with packed documents
    crossing the block boundaries; GQA 2. seg: the ids of positions [0, 3c)."""
    c = 16
    rng = np.random.default_rng(7)
    q, do = (rng.standard_normal((1, 2 * c, 4, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2 * c, 2, 32)).astype(np.float32) for _ in range(2))
    seg = np.sort(rng.integers(0, 4, (1, 3 * c)), axis=1).astype(np.int32)
    return c, q, k, v, do, seg


def test_pallas_two_key_blocks_merged_by_lse_equal_attention_over_all_keys():
    """Ring attention's arithmetic: fwd per key block (float32 out, traced offsets), merged by lse; bwd per block
    from the merged out / lse, dq summed and dk / dv concatenated = float64 attention over the concatenated keys."""
    c, q, k, v, do, seg = _two_block_inputs()
    blocks = [(0, slice(0, c)), (c, slice(c, 2 * c))]
    seg_q = seg[:, c:3 * c]
    kw = dict(causal=True, segment_ids=seg_q, interpret=True, **TILES)

    @jax.jit
    def ring(q, k, v, do, offsets):
        parts = [flash_attention_fwd(q, k[:, s], v[:, s], kv_segment_ids=seg[:, s], q_offset=offsets[0],
                                     kv_offset=offsets[i + 1], out_dtype=jnp.float32, **kw)
                 for i, (_, s) in enumerate(blocks)]
        o, lse = merge_blocks(parts)
        grads = [flash_attention_bwd(q, k[:, s], v[:, s], o, lse, do, kv_segment_ids=seg[:, s],
                                     q_offset=offsets[0], kv_offset=offsets[i + 1], grad_dtype=jnp.float32, **kw)
                 for i, (_, s) in enumerate(blocks)]
        dq = sum(g[0] for g in grads)
        return o, lse, dq, jnp.concatenate([g[1] for g in grads], 1), jnp.concatenate([g[2] for g in grads], 1)

    got = ring(q, k, v, do, jnp.array([c, 0, c], jnp.int32))
    want = block_oracle(q, k, v, seg_q, seg[:, :2 * c], True, c, 0, do)
    assert got[0].dtype == jnp.float32 and got[3].dtype == jnp.float32
    assert rel_err(got[0], want[0]) < 1e-5 and lse_err(got[1], want[1]) < 1e-5
    for g, w in zip(got[2:], want[2:]):
        assert rel_err(g, w) < 1e-5


def _hidden_tiles_inputs():
    """Keys [0, 64) in tiles of 16 against queries at positions 16..47 with one document (id 1) over the queries
    and keys 16..63: key tile 3 (48..63) is wholly hidden by the causal mask, key tile 0 (id 0) wholly by the
    segments; both hold NaN in K and V, which any computation of theirs (even p = 0 times V) spreads."""
    rng = np.random.default_rng(11)
    q, do = (rng.standard_normal((1, 32, 2, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 64, 2, 32)).astype(np.float32) for _ in range(2))
    seg_q = np.ones((1, 32), np.int32)
    seg_k = np.ones((1, 64), np.int32)
    seg_k[:, :16] = 0
    k_nan, v_nan = k.copy(), v.copy()
    for tile in (slice(0, 16), slice(48, 64)):
        k_nan[:, tile] = v_nan[:, tile] = np.nan
    return q, k, v, k_nan, v_nan, do, seg_q, seg_k


@pytest.mark.parametrize("traced", [pytest.param(False, marks=pytest.mark.slow), True], ids=["static", "traced"])
def test_pallas_tiles_hidden_by_causal_offsets_or_segments_are_skipped(traced):
    q, k, v, k_nan, v_nan, do, seg_q, seg_k = _hidden_tiles_inputs()
    kw = dict(causal=True, segment_ids=seg_q, kv_segment_ids=seg_k, interpret=True, **TILES)

    def run(qo, ko):
        o, lse = flash_attention_fwd(q, k_nan, v_nan, q_offset=qo, kv_offset=ko, **kw)
        return o, lse, flash_attention_bwd(q, k_nan, v_nan, o, lse, do, q_offset=qo, kv_offset=ko, **kw)

    o, lse, (dq, dk, dv) = jax.jit(run)(jnp.int32(16), jnp.int32(0)) if traced else run(16, 0)
    want = block_oracle(q, k, v, seg_q, seg_k, True, 16, 0, do)
    assert rel_err(o, want[0]) < 1e-5 and rel_err(dq, want[2]) < 1e-5
    visible = slice(16, 48)
    assert rel_err(dk[:, visible], want[3][:, visible]) < 1e-5
    assert rel_err(dv[:, visible], want[4][:, visible]) < 1e-5
    assert not np.isnan(np.asarray(dk)).any() and not np.isnan(np.asarray(dv)).any()


def test_bad_fwd_bwd_arguments_raise_value_error():
    q = jnp.zeros((1, 32, 2, 32))
    k = jnp.zeros((1, 16, 2, 32))
    with pytest.raises(ValueError, match="out_dtype=.*int32.* is not supported"):
        flash_attention_fwd(q, k, k, out_dtype=jnp.int32, interpret=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 32\)"):
        flash_attention_bwd(q, k, k, q, jnp.zeros((1, 2, 16)), q, interpret=True)


# ----------------------------------------------------------------------------------------------------------------
# Triton-language kernels in Triton's CPU interpreter (child process)
# ----------------------------------------------------------------------------------------------------------------


def _triton_block_errors() -> dict:
    """Child-process side: the BLOCK_CASES, the two-block merge and the hidden tiles through the Triton kernels
    (``flash_triton.run_forward`` / ``run_backward`` with the traced-shift operand for odd cases, the static
    shift for the others); returns {check: {output: error}}."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_flash_attention import interpreter_launch

    from jaxtrain.kernels.flash import triton as flash_triton
    from jaxtrain.kernels.flash.common import LN2, LOG2E, may_have_empty_rows

    launch = interpreter_launch()

    def run(q, k, v, do, seg_q, seg_k, causal, qo, ko, traced, out=None, lse=None):
        shift = qo - ko
        call = flash_triton.call_config(
            q.shape, k.shape[2], q.dtype, causal=causal, sm_scale=None, has_segments=seg_q is not None,
            block_sizes=TILES, seq_k=k.shape[1], shift=None if traced else shift,
            empty_rows=may_have_empty_rows(causal, None if traced else shift, seg_k is not None))
        seg = np.zeros(1, np.int32) if seg_q is None else seg_q
        offs = np.array([shift], np.int32) if traced else None
        o, lse2 = flash_triton.run_forward(launch, call, q, k, v, seg, seg_k, offs)
        o, lse_nat = (o, lse2 * LN2) if out is None else (out, lse)
        delta = (o.astype(np.float32) * do).sum(-1).transpose(0, 2, 1)
        lse_b = np.where(np.isneginf(lse_nat), np.inf, lse_nat * LOG2E).astype(np.float32)
        grads = flash_triton.run_backward(launch, call, q, k, v, seg, do, lse_b, delta, seg_k, offs)
        return o, lse_nat, grads

    results = {}
    for i, (case, case_id) in enumerate(zip(BLOCK_CASES, BLOCK_IDS)):
        b, sq, sk, h, kvh, d, causal, qo, ko, segments = case
        q, k, v, do, seg_q, seg_k = block_inputs(case_id, b, sq, sk, h, kvh, d, segments)
        o, lse, grads = run(q, k, v, do, seg_q, seg_k, causal, qo, ko, traced=i % 2 == 1)
        want = block_oracle(q, k, v, seg_q, seg_k, causal, qo, ko, do)
        results[case_id] = dict(o=rel_err(o, want[0]), lse=lse_err(lse, want[1]),
                                **{n: rel_err(g, w) for n, g, w in zip(("dq", "dk", "dv"), grads, want[2:])})
    c, q, k, v, do, seg = _two_block_inputs()
    seg_q = seg[:, c:3 * c]
    blocks = [(0, slice(0, c)), (c, slice(c, 2 * c))]
    parts = [run(q, k[:, s], v[:, s], do, seg_q, seg[:, s], True, c, ko, traced=True)[:2] for ko, s in blocks]
    o, lse = merge_blocks(parts)
    grads = [run(q, np.ascontiguousarray(k[:, s]), np.ascontiguousarray(v[:, s]), do, seg_q,
                 np.ascontiguousarray(seg[:, s]), True, c, ko, traced=True, out=o, lse=lse)[2] for ko, s in blocks]
    want = block_oracle(q, k, v, seg_q, seg[:, :2 * c], True, c, 0, do)
    results["two-blocks"] = dict(o=rel_err(o, want[0]), lse=lse_err(lse, want[1]),
                                 dq=rel_err(grads[0][0] + grads[1][0], want[2]),
                                 dk=rel_err(np.concatenate([g[1] for g in grads], 1), want[3]),
                                 dv=rel_err(np.concatenate([g[2] for g in grads], 1), want[4]))
    q, k, v, k_nan, v_nan, do, seg_q, seg_k = _hidden_tiles_inputs()
    want = block_oracle(q, k, v, seg_q, seg_k, True, 16, 0, do)
    for traced in (False, True):
        o, lse, (dq, dk, dv) = run(q, k_nan, v_nan, do, seg_q, seg_k, True, 16, 0, traced)
        visible = slice(16, 48)
        results[f"hidden-tiles-traced{traced}"] = dict(
            o=rel_err(o, want[0]), dq=rel_err(dq, want[2]), dk=rel_err(dk[:, visible], want[3][:, visible]),
            dv=rel_err(dv[:, visible], want[4][:, visible]),
            nan=float(np.isnan(dk).any() or np.isnan(dv).any()))
    return results


@pytest.fixture(scope="module")
def triton_block_results():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    from jaxtrain_testing import triton_interpreter_results  # here: this file also runs, via runpy, outside pytest

    return triton_interpreter_results(__file__, "_triton_block_errors")


TRITON_CHECKS = BLOCK_IDS + ["two-blocks", "hidden-tiles-tracedFalse", "hidden-tiles-tracedTrue"]


@pytest.mark.slow
@pytest.mark.parametrize("check", TRITON_CHECKS)
def test_triton_blocks_in_triton_interpreter(check, triton_block_results):
    """The Triton kernels with offsets (static for even cases, traced for odd), sq != skv, separate segments, the
    two-block merge, and skipped hidden tiles (NaN in them reaches nothing) against float64."""
    errors = triton_block_results[check]
    assert errors.pop("nan", 0.0) == 0.0
    bad = {name: e for name, e in errors.items() if not e < 1e-5}  # NaN fails too
    assert not bad, f"{check}: {bad}"
