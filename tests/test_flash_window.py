"""The Pallas flash kernels' sliding window (``window=``): which tiles the loops visit (every tile holding a visible
pair, unmasked only where every pair is visible, none twice) against a NumPy enumeration of the mask; values and
gradients with position offsets (static and traced), GQA and separate segments against a float64 oracle; key tiles
wholly outside the window never read (NaN there reaches nothing); bad windows refused."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.kernels import flash_attention, flash_attention_bwd, flash_attention_fwd
from jaxtrain.kernels.flash.pallas_tiles import kv_ranges, q_ranges

TILES = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def visible(sq, sk, shift, window):
    """bool [sq, sk]: query i (at key position i + shift) sees key j when 0 <= i + shift - j < window."""
    d = (np.arange(sq)[:, None] + shift) - np.arange(sk)[None, :]
    return (d >= 0) & (d < window)


def listed(ranges):
    """{tile: masked?} from [(lo, hi, masked)], failing on a tile listed twice."""
    out: dict[int, bool] = {}
    for lo, hi, masked in ranges:
        for t in range(int(lo), int(hi)):
            assert t not in out, f"tile {t} listed twice in {ranges}"
            out[t] = bool(masked)
    return out


def check_cover(tiles, pairs):
    """Every tile with a visible pair is listed; a tile listed unmasked has every pair visible."""
    for t, block in enumerate(pairs):
        if block.any():
            assert t in tiles, f"tile {t} holds visible pairs but is not visited"
        if t in tiles and not tiles[t]:
            assert block.all(), f"tile {t} is visited unmasked but not every pair in it is visible"


@pytest.mark.parametrize("bq,bk", [(16, 16), (16, 32), (32, 16)])
def test_the_visited_tiles_are_exactly_those_the_window_needs(bq, bk):
    sq = sk = 128
    for shift, window in itertools.product((0, 5, 40, -7), (1, 3, 16, 17, 33, 100, 200)):
        mask = visible(sq, sk, shift, window)
        for i in range(sq // bq):
            tiles = listed(kv_ranges(i, bq, bk, sk // bk, True, shift, False, window))
            rows = mask[i * bq:(i + 1) * bq]
            check_cover(tiles, [rows[:, j * bk:(j + 1) * bk] for j in range(sk // bk)])
            # nothing wholly before the first query's window is visited: the point of the window
            first_key = i * bq + shift - window + 1
            assert all((t + 1) * bk > first_key for t in tiles), (i, shift, window, tiles)
        for j in range(sk // bk):
            tiles = listed(q_ranges(j, bq, bk, sq // bq, True, shift, window))
            cols = mask[:, j * bk:(j + 1) * bk]
            check_cover(tiles, [cols[t * bq:(t + 1) * bq] for t in range(sq // bq)])
            last_query = (j + 1) * bk - 1 - shift + window - 1  # the last query that sees the tile's last key
            assert all(t * bq <= max(last_query, 0) for t in tiles), (j, shift, window, tiles)


def oracle(q, k, v, do, seg_q, seg_k, q_offset, kv_offset, window):
    """Float64 windowed attention of a query block against a key block: o, lse [B, H, Sq], dq, dk, dv."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], h // k.shape[2]
    q, do = np.asarray(q, np.float64), np.asarray(do, np.float64)
    kk, vv = (np.repeat(np.asarray(x, np.float64), g, axis=2) for x in (k, v))
    mask = visible(sq, sk, q_offset - kv_offset, window)[None, None]
    if seg_q is not None:
        mask = mask & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
    logits = np.where(mask, np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d), -np.inf)
    seen = mask.any(-1)
    top = np.where(seen, logits.max(-1), 0.0)[..., None]
    e = np.where(mask, np.exp(logits - top), 0.0)
    den = e.sum(-1, keepdims=True)
    p = e / np.where(den > 0, den, 1.0)
    lse = np.where(seen, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)) + top[..., 0], -np.inf)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dk = (np.einsum("bhqk,bqhd->bkhd", ds, q) / np.sqrt(d)).reshape(b, sk, -1, g, d).sum(3)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do).reshape(b, sk, -1, g, d).sum(3)
    return (np.einsum("bhqk,bkhd->bqhd", p, vv), np.broadcast_to(lse, (b, h, sq)),
            np.einsum("bhqk,bkhd->bqhd", ds, kk) / np.sqrt(d), dk, dv)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


# (sq, sk, q_offset, kv_offset, window, segments): the diagonal and the window's edge crossing a shorter key block;
# queries past the keys by more than the window (rows that see nothing: out 0, lse -inf); separate segments.
CASES = [(40, 24, 30, 10, 9, False), (32, 48, 40, 0, 20, False), (48, 48, 0, 0, 13, True)]


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("case", CASES, ids=[f"sq{c[0]}-sk{c[1]}-qo{c[2]}-ko{c[3]}-w{c[4]}" for c in CASES])
def test_window_values_and_gradients_match_float64(case, traced):
    sq, sk, qo, ko, window, segmented = case
    rng = np.random.default_rng(sq * 1000 + window)
    q, do = (rng.standard_normal((1, sq, 4, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, sk, 2, 32)).astype(np.float32) for _ in range(2))
    seg_q = np.sort(rng.integers(0, 3, (1, sq)), axis=1).astype(np.int32) if segmented else None
    seg_k = np.sort(rng.integers(0, 3, (1, sk)), axis=1).astype(np.int32) if segmented else None
    kw = dict(causal=True, segment_ids=seg_q, kv_segment_ids=seg_k, window=window, interpret=True, **TILES)

    def run(qo, ko):
        o, lse = flash_attention_fwd(q, k, v, q_offset=qo, kv_offset=ko, **kw)
        grads = flash_attention_bwd(q, k, v, o, lse, do, q_offset=qo, kv_offset=ko, **kw)
        return o, lse, grads

    o, lse, grads = jax.jit(run)(jnp.int32(qo), jnp.int32(ko)) if traced else run(qo, ko)
    want = oracle(q, k, v, do, seg_q, seg_k, qo, ko, window)
    assert rel_err(o, want[0]) < 1e-5
    lse, lse_w = np.asarray(lse, np.float64), want[1]
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_w))
    assert np.abs(lse[np.isfinite(lse_w)] - lse_w[np.isfinite(lse_w)]).max() < 1e-5
    for name, got, w in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert rel_err(got, w) < 1e-5, name


def test_key_tiles_outside_the_window_are_never_read():
    """64 tokens in tiles of 16, window 16: for queries 48..63 key tiles 0 and 1 are out of reach, and so on. NaN in
    keys 0..15 (seen only by queries 0..30) must not reach queries 32..63's outputs or the gradients of keys 32..63;
    the flash_attention VJP agrees with the float64 oracle computed on clean keys."""
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((1, 64, 2, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 64, 2, 32)).astype(np.float32) for _ in range(2))
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, :16] = v_nan[:, :16] = np.nan
    kw = dict(window=16, interpret=True, **TILES)
    o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kw), q, k_nan, v_nan)
    dq, dk, dv = vjp(do)
    want = oracle(q, k, v, do, None, None, 0, 0, 16)
    assert rel_err(np.asarray(o)[:, 32:], want[0][:, 32:]) < 1e-5
    assert rel_err(np.asarray(dq)[:, 32:], want[2][:, 32:]) < 1e-5
    assert rel_err(np.asarray(dk)[:, 32:], want[3][:, 32:]) < 1e-5
    assert rel_err(np.asarray(dv)[:, 32:], want[4][:, 32:]) < 1e-5


@pytest.mark.parametrize("kw, message", [
    (dict(window=0), "window must be a positive int or None, got 0"),
    (dict(window=2.5), "window must be a positive int or None, got 2.5"),
    (dict(window=8, causal=False), "window=8 needs causal=True"),
    (dict(window=8, impl="triton"), "window=8 is implemented by impl='pallas' only"),
])
def test_bad_windows_are_refused(kw, message):
    q = jnp.zeros((1, 32, 2, 32))
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q, q, **kw)
