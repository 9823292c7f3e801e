"""FP8 matmuls (jaxtrain/models/fp8.py) against a float64 NumPy reference of the same quantisation, Flax's FP8 dot
as a peer for the delayed recipe, the state helpers' max rule, and the lowered train step's float8 dots.

The reference: scales in float32 (amax / max, as XLA computes them), x / scale in float32, clipped and rounded to
nearest even by ml_dtypes (the quantised values compared bit for bit), the matmuls exact in float64. The device's
results must lie within a float32 accumulation bound of it: (K + 4) * 2^-24 * (|aq| @ |bq|) * scales.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtrain.models import fp8, sidestate

U32 = 2.0**-24  # float32 unit roundoff
R8, R5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


# ---------------------------------------------------------------------------------------------------- reference
def _fmax(dtype):
    return np.float32(ml_dtypes.finfo(dtype).max)


def _scale(amax, dtype):
    amax = np.asarray(amax, np.float32)
    s = (amax / _fmax(dtype)).astype(np.float32)
    return np.where((amax > 0) & np.isfinite(amax), s, np.float32(1)).astype(np.float32)


def _quantize(x, s, dtype):
    q = np.clip(np.asarray(x, np.float32) / np.asarray(s, np.float32), -_fmax(dtype), _fmax(dtype))
    return q.astype(np.float32).astype(dtype)


def _amax(x, axis=None):
    return np.max(np.abs(np.asarray(x, np.float32)), axis=axis, keepdims=axis is not None)


def _dot(a, b, sa, sb, a_dtype, b_dtype):
    """(a @ b of the quantised operands, dequantised, float64; the |a| @ |b| bound term)."""
    aq = np.asarray(_quantize(a, sa, a_dtype), np.float64)
    bq = np.asarray(_quantize(b, sb, b_dtype), np.float64)
    s = np.asarray(sa, np.float64) * np.asarray(sb, np.float64)
    return aq @ bq * s, np.abs(aq) @ np.abs(bq) * s


def reference(recipe, x, w, g, history=None):
    """(y, dx, dw) as (value, bound term) pairs of x [M, K] @ w [K, N] with upstream gradient g [M, N]."""
    x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
    if recipe == "rowwise":  # every dot: a scale per row of its left operand, per column of its right one
        return (_dot(x, w, _scale(_amax(x, 1), R8), _scale(_amax(w, 0), R8), R8, R8),
                _dot(g, w.T, _scale(_amax(g, 1), R5), _scale(_amax(w.T, 0), R8), R5, R8),
                _dot(x.T, g, _scale(_amax(x.T, 1), R8), _scale(_amax(g, 0), R5), R8, R5))
    amaxes = [_amax(x), _amax(w), _amax(g)]
    if recipe == "delayed":  # the history's max, or the current amax while it is empty
        amaxes = [h.max() if h.max() > 0 else a for h, a in zip(history, amaxes)]
    sx, sw, sg = _scale(amaxes[0], R8), _scale(amaxes[1], R8), _scale(amaxes[2], R5)
    return (_dot(x, w, sx, sw, R8, R8), _dot(g, w.T, sg, sw, R5, R8), _dot(x.T, g, sx, sg, R8, R5))


# ---------------------------------------------------------------------------------------------------- helpers
def _data(shape_x=(48, 96), n=40, seed=0):
    """x spread over rows (so that rowwise and tensorwise scales differ), w of init scale, g of gradient scale."""
    rng = np.random.default_rng(seed)
    k = shape_x[-1]
    x = rng.standard_normal(shape_x) * np.exp(rng.uniform(-3, 3, (*shape_x[:-1], 1)))
    w = 0.02 * rng.standard_normal((k, n)) * np.exp(rng.uniform(-2, 2, (1, n)))
    g = 1e-4 * rng.standard_normal((*shape_x[:-1], n))
    return x.astype(np.float32), w.astype(np.float32), g.astype(np.float32)


def _run(recipe, x, w, g, history=None, nl=1):
    """(y, dx, dw, history cotangent) of fp8_dot with upstream gradient g."""
    args = (x, w) if history is None else (x, w, history)

    def f(*a):
        return fp8.fp8_dot(a[0], a[1], nl, recipe, a[2] if history is not None else None)

    y, pull = jax.vjp(jax.jit(f), *args)
    grads = pull(jnp.asarray(g, y.dtype))
    return (np.asarray(y, np.float64), *(np.asarray(d, np.float64) for d in grads[:2]),
            np.asarray(grads[2]) if history is not None else None)


def _within(got, want, k):
    value, bound = want
    err, tol = np.abs(got - value), (k + 4) * U32 * bound + 1e-30
    assert np.all(err <= tol), f"max err {err.max():.3g}, worst ratio {np.max(err / tol):.3g}"


def _check(recipe, history=None, seed=0):
    x, w, g = _data(seed=seed)
    y, dx, dw, _ = _run(recipe, x, w, g, history)
    for got, want, k in zip((y, dx, dw), reference(recipe, x, w, g, history), (96, 40, 48)):
        _within(got, want, k)


# ---------------------------------------------------------------------------------------------------- numerics
def test_quantize_is_bit_exact_round_to_nearest_even():
    x, _, _ = _data()
    edge = [448.0, -448.0, 464.0, 1e6, 0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1.0625, 1.1875]  # ties, saturation
    x = np.concatenate([x.ravel(), edge]).astype(np.float32)
    for dtype, rdtype, s in ((fp8.E4M3, R8, 0.37), (fp8.E5M2, R5, 1e-3), (fp8.E4M3, R8, 1.0)):
        got = np.asarray(jax.jit(fp8.quantize, static_argnums=2)(x, jnp.float32(s), dtype))
        want = _quantize(x, np.float32(s), rdtype)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_current_scaling_matches_the_float64_reference(recipe):
    _check(recipe)


@pytest.mark.parametrize("filled", [False, True])
def test_delayed_matches_the_float64_reference_and_observes_amaxes(filled):
    x, w, g = _data(seed=2)
    history = np.zeros((3, 4), np.float32)
    if filled:  # earlier steps saw larger and smaller values than now
        history[0, :2] = [2 * _amax(x), 0.5]
        history[1, 1] = 0.7 * _amax(w)
        history[2, 1:3] = [3 * _amax(g), 0.1 * _amax(g)]
    _check("delayed", history, seed=2)
    observed = _run("delayed", x, w, g, history)[3]
    want = np.zeros_like(history)
    want[:, 0] = [_amax(x), _amax(w), _amax(g)]
    np.testing.assert_array_equal(observed, want)
    pushed = np.asarray(fp8.push_observed(jnp.asarray(history), jnp.asarray(observed)))
    np.testing.assert_array_equal(pushed, np.concatenate([want[:, :1], history[:, :-1]], axis=1))
    # a use whose output gradient is all zero (a pipeline's idle iteration) observes nothing
    assert not _run("delayed", x, w, np.zeros_like(g), history)[3].any()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_projection_shapes_equal_the_matrix_form(recipe):
    """LinearGeneral's shapes: x [b, s, heads, head_dim] . w [heads, head_dim, d] contracts two axes; the result
    and the gradients are those of the [b s, heads head_dim] @ [heads head_dim, d] matrix form's reference."""
    x, w, g = _data(shape_x=(24, 96), n=24, seed=3)
    history = np.zeros((3, 4), np.float32) if recipe == "delayed" else None
    y, dx, dw, _ = _run(recipe, x.reshape(4, 6, 8, 12), w.reshape(8, 12, 24), g.reshape(4, 6, 24), history, nl=2)
    ref = reference(recipe, x, w, g, history)
    for got, want, k in zip((y.reshape(24, 24), dx.reshape(24, 96), dw.reshape(96, 24)), ref, (96, 24, 24)):
        _within(got, want, k)


def test_bfloat16_operands_give_the_compute_dtype_within_a_rounding():
    x, w, g = _data(seed=4)
    xb, wb, gb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, g))
    y, pull = jax.vjp(jax.jit(lambda x, w: fp8.fp8_dot(x, w, 1, "tensorwise")), xb, wb)
    dx, dw = pull(gb)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    ref = reference("tensorwise", *(np.asarray(a, np.float32) for a in (xb, wb, gb)))
    for got, (value, bound) in zip((y, dx, dw), ref):
        # the product rounded to bfloat16, times the scale (rounded to bfloat16 too), rounded again
        tol = 3 * 2.0**-8 * np.abs(value) + 2.0**-7 * np.abs(bound) * 2.0**-8 + 1e-30
        assert np.all(np.abs(np.asarray(got, np.float64) - value) <= tol)


def test_rowwise_keeps_rows_that_tensorwise_flushes():
    """Rows spanning more binades than e4m3 holds: one scale per tensor flushes the small rows, one per row keeps
    them (the point of the recipe)."""
    x, w, g = _data(seed=1)
    xs = x * np.exp2(np.linspace(-16, 4, x.shape[0]))[:, None].astype(np.float32)
    exact = xs.astype(np.float64) @ w.astype(np.float64)
    worst = [np.max(np.abs(_run(r, xs, w, g)[0] - exact).max(1) / np.abs(exact).max(1))
             for r in ("rowwise", "tensorwise")]
    assert worst[0] < 0.1 < 0.5 < worst[1], worst


def test_delayed_agrees_with_flax_fp8_scaled_dot_general():
    """Peer: Flax's delayed-scaling dot (flax.linen.fp8_ops) with the same non-empty histories gives the same
    numbers up to float32 rounding (it computes a scale as 1 / (max / amax), one rounding more than amax / max)."""
    from flax.linen import fp8_ops

    x, w, g = _data(seed=5)
    history = np.zeros((3, 4), np.float32)
    history[0, 2], history[1, 1], history[2, 3] = 2 * _amax(x), 0.9 * _amax(w), 4 * _amax(g)
    one = jnp.ones((1,), jnp.float32)

    def flax_dot(x, w):
        return fp8_ops.fp8_scaled_dot_general(
            x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, lhs_scale=one, rhs_scale=one,
            grad_scale=one, lhs_amax_history=history[0], rhs_amax_history=history[1], grad_amax_history=history[2])

    y, pull = jax.vjp(jax.jit(flax_dot), x, w)
    want = (y, *pull(jnp.asarray(g)))
    got = _run("delayed", x, w, g, history)[:3]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------- state rules
def test_histories_combine_by_max_and_the_rest_by_sum():
    tree = {"w": jnp.array([1.0, 2.0]), "q": {fp8.META_NAME: jnp.array([[3.0, 0.0]])}}
    other = {"w": jnp.array([0.5, 0.5]), "q": {fp8.META_NAME: jnp.array([[1.0, 0.0]])}}
    out = sidestate.combine(tree, other)
    np.testing.assert_array_equal(out["w"], [1.5, 2.5])
    np.testing.assert_array_equal(out["q"][fp8.META_NAME], [[3.0, 0.0]])
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), tree, other)
    red = sidestate.reduce_groups(stacked)
    np.testing.assert_array_equal(red["w"], [1.5, 2.5])
    np.testing.assert_array_equal(red["q"][fp8.META_NAME], [[3.0, 0.0]])


def test_split_carry_and_fan_out_take_the_max_of_their_uses_cotangents():
    def two_uses(m):
        a, b = sidestate.split_carry({fp8.META_NAME: m})
        a, b = a[fp8.META_NAME], b[fp8.META_NAME]
        return jnp.sum(a * jnp.array([3.0, 1.0])) + jnp.sum(b * jnp.array([2.0, 5.0]))

    np.testing.assert_array_equal(jax.grad(two_uses)(jnp.zeros(2)), [3.0, 5.0])  # a sum would give [5, 6]

    def fanned(m):
        return jnp.sum(sidestate.fan_out({fp8.META_NAME: m}, 3)[fp8.META_NAME] * jnp.array([[1.0], [4.0], [2.0]]))

    np.testing.assert_array_equal(jax.grad(fanned)(jnp.zeros(2)), [4.0, 4.0])  # a sum would give [7, 7]


# ---------------------------------------------------------------------------------------------------- the program
# A dot_general's operand element types in StableHLO, anchored on the dims so that "40xf8E5M2" reads f8E5M2.
DOT = re.compile(r"stablehlo\.dot_general\b[^\n]*?:\s*\(tensor<(?:[0-9?]+x)*(\w+)>, tensor<(?:[0-9?]+x)*(\w+)>\)")
F8_DOTS = {("f8E4M3FN", "f8E4M3FN"): "forward", ("f8E5M2", "f8E4M3FN"): "input gradient",
           ("f8E4M3FN", "f8E5M2"): "weight gradient"}


def dot_operand_types(text: str) -> dict[tuple[str, str], int]:
    """Count of each (lhs, rhs) element-type pair of the dot_generals in a lowered StableHLO module."""
    counts: dict[tuple[str, str], int] = {}
    for pair in DOT.findall(text):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def _lowered_train_step(make_config, recipe, *extra):
    from jaxtrain.train import step as step_lib

    ts = step_lib.setup(make_config(f"model.fp8={recipe}", "model.fp8_amax_history=4", "mesh.ici.fsdp=1", *extra),
                        jax.devices()[:1])
    lay = ts.layout
    with lay.scope():  # the compiled step's own function and shardings, lowered only: XLA:CPU upcasts f8 later
        return jax.jit(ts.train_step, in_shardings=(lay.state_sharding, lay.batch_sharding)).lower(
            lay.abstract_state, lay.abstract_batch()).as_text()


@pytest.mark.parametrize("recipe", ["none", "tensorwise", "rowwise", "delayed"])
def test_the_train_step_multiplies_the_projections_in_fp8(make_config, recipe):
    """The lowered train step (before XLA, whose CPU backend converts float8 to float32 for its own dots) holds,
    per scanned layer body, one e4m3 x e4m3 forward, one e5m2 x e4m3 input-gradient and one e4m3 x e5m2
    weight-gradient dot for each of the 7 projections (q, k, v, o, gate, up, down), and no float8 dot is replaced
    by a wider one: the attention's and the output projection's dots stay in the compute dtype (float32 here)."""
    counts = dot_operand_types(_lowered_train_step(make_config, recipe))
    f8 = {pair: n for pair, n in counts.items() if any(t.startswith("f8") for t in pair)}
    if recipe == "none":
        assert not f8 and counts
        return
    assert f8 == {pair: 7 for pair in F8_DOTS}, f8
    # what stays wide: the output projection (tied embedding: logits and its two gradients) and attention's two
    # batched dots with their four gradients; with FP8 off the same program has those plus 21 projection dots
    wide = sum(n for pair, n in counts.items() if pair not in f8)
    assert wide == sum(dot_operand_types(_lowered_train_step(make_config, "none")).values()) - 21


# ---------------------------------------------------------------------------------------------------- bad input
class _Device:
    """What check_devices reads of a jax.Device, for kinds this machine does not have."""

    def __init__(self, platform, kind, cc=None):
        self.platform, self.device_kind = platform, kind
        if cc is not None:
            self.compute_capability = cc


@pytest.mark.parametrize(("device", "error"), [
    (_Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), "compute capability 8.9 or later.*has 8.0"),
    (_Device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), None),
    (_Device("gpu", "NVIDIA L4", "8.9"), None),
    (_Device("gpu", "NVIDIA B200", "10.0"), None),
    (_Device("cuda", "NVIDIA H100 80GB HBM3"), None),  # a compile-only device: its hardware file has an FP8 rate
    (_Device("cuda", "NVIDIA A100-SXM4-80GB"), "no FP8 rate in its hardware file"),
    (_Device("tpu", "TPU v5p"), "not on tpu devices"),
    (_Device("cpu", "cpu"), None),  # XLA:CPU emulates float8: tests and checks
])
def test_fp8_is_refused_where_xla_would_not_multiply_in_fp8(device, error):
    from jaxtrain.errors import ConfigError

    fp8.check_devices("none", [device])
    if error is None:
        fp8.check_devices("tensorwise", [device])
    else:
        with pytest.raises(ConfigError, match=error):
            fp8.check_devices("delayed", [device])


def test_the_cost_model_puts_the_projections_at_the_fp8_rate():
    """7B on H100: the projections' share of the model FLOPs at 1,979 TFLOP/s, the rest at 989 (hand count); the
    A100's file has no FP8 rate, so planning FP8 there is refused."""
    from jaxtrain.config import ConfigError, load_config
    from jaxtrain.config.hardware import load_hardware
    from jaxtrain.planner.cost.model import fp8_share, peak_rate
    from jaxtrain.planner.search.target import fp8_notes

    cfg = load_config("7b", ["model.fp8=tensorwise"])
    m, seq = cfg.model, cfg.data.seq_len
    hd = m.resolved_head_dim
    proj = m.n_layers * (m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff)
    total = proj + m.d_model * m.vocab_size + m.n_layers * 2 * seq * m.n_heads * hd / 2
    assert fp8_share(cfg) == pytest.approx(proj / total, rel=1e-12)
    h100 = load_hardware("h100-8x")
    want = 1 / (proj / total / 1978.9e12 + (1 - proj / total) / 989.4e12)
    assert peak_rate(cfg, h100) == pytest.approx(want, rel=1e-12)
    assert peak_rate(load_config("7b", []), h100) == 989.4e12
    assert "FP8 peak 1,979 TFLOP/s" in fp8_notes(cfg, h100)[0]
    with pytest.raises(ConfigError, match="a100-8x .* lacks"):
        fp8_notes(cfg, load_hardware("a100-8x"))
