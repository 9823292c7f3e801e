"""FP8 in the routed experts (jaxtrain/models/fp8_experts.py): the grouped matmuls against a float64 NumPy reference
of the same quantisation (as test_fp8.py does for the dense projections; rowwise's per-row, per-expert-column and
per-group scales computed here in NumPy), the MoE train step's float8 ragged_dots, its figures on an expert-parallel
mesh against one device's, and the routed experts' stated precision where they stay in the compute dtype."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_fp8 import R5, R8, U32, _amax, _dot, _quantize, _scale

from jaxtrain.config import load_config
from jaxtrain.models import fp8
from jaxtrain.models.fp8_experts import grouped_fp8, precision_note
from jaxtrain.parallel.layout import Layout, resolve_auto
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST

GROUPS = np.array([5, 0, 9, 6], np.int32)  # 20 rows in groups, 4 past them (padding, dropped assignments)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    m, k, n = 24, 32, 16
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, 1)))
    w = 0.02 * rng.standard_normal((len(GROUPS), k, n)) * np.exp(rng.uniform(-2, 2, (len(GROUPS), 1, n)))
    g = 1e-4 * rng.standard_normal((m, n))
    return x.astype(np.float32), w.astype(np.float32), g.astype(np.float32)


def _reference(x, w, g, history=None):
    """(y, dx, dw) as (value, bound term) pairs in float64: per-tensor scales from the rows inside the groups."""
    ends = np.cumsum(GROUPS)
    rows = ends[-1]
    amaxes = [_amax(x[:rows]), _amax(w), _amax(g[:rows])]
    if history is not None:
        amaxes = [h.max() if h.max() > 0 else a for h, a in zip(history, amaxes)]
    sx, sw, sg = (float(_scale(a, d)) for a, d in zip(amaxes, (R8, R8, R5)))
    xq, wq = (np.asarray(_quantize(a, s, R8), np.float64) for a, s in ((x, sx), (w, sw)))
    gq = np.asarray(_quantize(g, sg, R5), np.float64)
    y, dx, dw = (np.zeros(s) for s in ((x.shape[0], w.shape[2]), x.shape, w.shape))
    by, bdx, bdw = np.zeros_like(y), np.zeros_like(dx), np.zeros_like(dw)
    for e, (lo, hi) in enumerate(zip(ends - GROUPS, ends)):
        y[lo:hi], by[lo:hi] = xq[lo:hi] @ wq[e] * sx * sw, np.abs(xq[lo:hi]) @ np.abs(wq[e]) * sx * sw
        dx[lo:hi], bdx[lo:hi] = gq[lo:hi] @ wq[e].T * sg * sw, np.abs(gq[lo:hi]) @ np.abs(wq[e].T) * sg * sw
        dw[e], bdw[e] = xq[lo:hi].T @ gq[lo:hi] * sx * sg, np.abs(xq[lo:hi].T) @ np.abs(gq[lo:hi]) * sx * sg
    return (y, by), (dx, bdx), (dw, bdw), [a * (amaxes[2] > 0) for a in (_amax(x[:rows]), _amax(w), _amax(g[:rows]))]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_grouped_fp8_matches_float64_reference(recipe):
    x, w, g = _data()
    history = None
    if recipe == "delayed":  # a history whose maxima differ from the current amaxes
        history = np.zeros((3, 4), np.float32)
        history[:, 1] = [2 * _amax(x[:20]), 0.5 * _amax(w), 3 * _amax(g[:20])]

    def f(x, w, *h):
        return grouped_fp8(x, w, jnp.asarray(GROUPS), recipe, h[0] if h else None)

    args = (x, w) if history is None else (x, w, history)
    y, pull = jax.vjp(jax.jit(f), *args)
    grads = pull(jnp.asarray(g))
    ref = _reference(x, w, g, history)
    for got, (want, bound) in zip((y, grads[0], grads[1]), ref[:3]):
        k = x.shape[1] if got.shape == y.shape else max(x.shape[0], w.shape[2])
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= (k + 4) * U32 * bound + 1e-30)
    assert np.all(np.asarray(y)[20:] == 0) and np.all(np.asarray(grads[0])[20:] == 0)  # rows past the groups
    if recipe == "delayed":
        seen = np.asarray(grads[2])
        np.testing.assert_array_equal(seen[:, 0], np.asarray(ref[3], np.float32).ravel())
        assert not seen[:, 1:].any()


def _reference_rowwise(x, w, g):
    """(y, dx, dw) as (value, bound term) pairs in float64 for rowwise scales (torchao's float8 rowwise grouped
    GEMM, gradients e5m2): y per row of x and per expert and column of w (amaxes over K); dx per row of g and per
    expert and row of w (over N); dw per group and column of x and of g (over that group's rows)."""
    ends = np.cumsum(GROUPS)
    y, dx, dw = (np.zeros(s) for s in ((x.shape[0], w.shape[2]), x.shape, w.shape))
    by, bdx, bdw = np.zeros_like(y), np.zeros_like(dx), np.zeros_like(dw)
    sx, sg = _scale(_amax(x, 1), R8), _scale(_amax(g, 1), R5)  # [M, 1]
    for e, (lo, hi) in enumerate(zip(ends - GROUPS, ends)):
        if hi == lo:  # an expert no row chose: no output rows, a zero weight gradient
            continue
        xs, gs, we = x[lo:hi], g[lo:hi], w[e]
        y[lo:hi], by[lo:hi] = _dot(xs, we, sx[lo:hi], _scale(_amax(we, 0), R8), R8, R8)
        dx[lo:hi], bdx[lo:hi] = _dot(gs, we.T, sg[lo:hi], _scale(_amax(we.T, 0), R8), R5, R8)
        dw[e], bdw[e] = _dot(xs.T, gs, _scale(_amax(xs.T, 1), R8), _scale(_amax(gs, 0), R5), R8, R5)
    return (y, by), (dx, bdx), (dw, bdw)


def _worst(got, want, k):
    """The largest |got - value| over its float32 accumulation bound (k + 4) 2^-24 (|aq| @ |bq|) scales."""
    value, bound = want
    return float(np.max(np.abs(np.asarray(got, np.float64) - value) / ((k + 4) * U32 * bound + 1e-30)))


def test_grouped_rowwise_matches_float64_reference():
    """The rowwise grouped matmul and both gradients within the float32 accumulation bound of the float64 reference
    (contraction K for y, N for dx, the group's rows for dw); per-tensor scales would miss it (the reference sees
    the difference), and so would whole-column scales for dw; the rows past the groups and the expert without rows
    get zeros."""
    x, w, g = _data(1)
    y, pull = jax.vjp(jax.jit(lambda x, w: grouped_fp8(x, w, jnp.asarray(GROUPS), "rowwise")), x, w)
    dx, dw = pull(jnp.asarray(g))
    ref = _reference_rowwise(x, w, g)
    ks = (x.shape[1], w.shape[2], int(GROUPS.max()))
    for got, want, k in zip((y, dx, dw), ref, ks):
        assert _worst(got, want, k) <= 1, _worst(got, want, k)
    tensorwise = _reference(x, w, g)
    assert all(_worst(got, want, k) > 1 for got, want, k in zip((y, dx, dw), tensorwise[:3], ks))
    # and so would the weight gradient's column scales taken over all rows instead of each group's own
    ends = np.cumsum(GROUPS)
    sx_all, sg_all = _scale(_amax(x[:20].T, 1), R8), _scale(_amax(g[:20], 0), R5)
    all_rows = [_dot(x[lo:hi].T, g[lo:hi], sx_all, sg_all, R8, R5) for lo, hi in zip(ends - GROUPS, ends) if hi > lo]
    assert _worst(np.asarray(dw)[GROUPS > 0], tuple(np.stack(p) for p in zip(*all_rows)), ks[2]) > 1
    assert not np.asarray(y)[20:].any() and not np.asarray(dx)[20:].any() and not np.asarray(dw)[1].any()
    # rowwise keeps small rows and columns that one scale per tensor rounds away: closer to the exact product
    exact = np.zeros_like(ref[0][0])
    for e, (lo, hi) in enumerate(zip(ends - GROUPS, ends)):
        exact[lo:hi] = x[lo:hi].astype(np.float64) @ w[e].astype(np.float64)
    rel = {name: np.linalg.norm(r[0][0][:20] - exact[:20], axis=1) / np.linalg.norm(exact[:20], axis=1)
           for name, r in (("rowwise", ref), ("tensorwise", tensorwise))}
    assert rel["rowwise"].max() < rel["tensorwise"].max()


SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64",
         "data.seq_len=16", "train.global_batch=8", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=32",
         "model.moe.every=2"]


def _step(cfg, n):
    """(lowered text, metrics of two steps, the experts' histories after them) on the first ``n`` devices."""
    step = step_lib.setup(cfg, jax.devices()[:n])
    lay = step.layout
    train, _, _ = step.compile(with_eval=False)
    state = lay.init_state()
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)
    metrics = []
    for _ in range(2):
        state, m = train(state, lay.to_device(batch))
        metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
    hist = [np.asarray(jax.device_get(v)) for p, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.filter_state(state, fp8.Fp8Meta))) if "mlp" in jax.tree_util.keystr(p)
        and "moe" in jax.tree_util.keystr(p) and "attn" not in jax.tree_util.keystr(p)]
    return train.as_text(), metrics, hist


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_moe_step_multiplies_routed_experts_in_float8(recipe):
    """The step's routed experts: forward e4m3 x e4m3, input gradient e5m2 x e4m3, weight gradient e4m3 x e5m2, for
    gate, up and down (jax 0.10.2 lowers ragged_dot on CPU to dots over [E, rows, ...] operands, the rows masked per
    group: 4 experts x 256 assignments here)."""
    cfg = load_config(None, [*FAST, *SMALL, "mesh.ici.fsdp=1", f"model.fp8={recipe}"])
    step = step_lib.setup(cfg, jax.devices()[:1])
    with step.layout.scope():
        text = jax.jit(step.train_step).lower(step.layout.abstract_state, step.layout.abstract_batch()).as_text()
    experts = [line for line in text.splitlines() if "dot_general" in line and "tensor<4x256x" in line]
    pairs = [tuple(re.findall(r"tensor<[0-9x]+x(\w+)>", line.split(" : ")[-1])[:2]) for line in experts]
    counts = {p: pairs.count(p) for p in set(pairs)}
    assert counts == {("f8E4M3FN", "f8E4M3FN"): 3, ("f8E5M2", "f8E4M3FN"): 3, ("f8E4M3FN", "f8E5M2"): 3}, counts
    # and without FP8 the same dots are float32: the pattern finds the experts
    plain = step_lib.setup(load_config(None, [*FAST, *SMALL, "mesh.ici.fsdp=1"]), jax.devices()[:1])
    with plain.layout.scope():
        text = jax.jit(plain.train_step).lower(plain.layout.abstract_state, plain.layout.abstract_batch()).as_text()
    plain_experts = [line for line in text.splitlines() if "dot_general" in line and "tensor<4x256x" in line]
    assert len(plain_experts) >= 9 and not any("f8" in line for line in plain_experts)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_experts_on_expert_mesh_equal_one_device(recipe):
    """Scales are the whole tensors' (amaxes reduced over the per-device region): loss, gradient norm and the
    experts' histories (filled by the steps) on expert=2 x fsdp=2 equal one device's."""
    base = [*FAST, *SMALL, f"model.fp8={recipe}"]
    _, ref, ref_hist = _step(load_config(None, [*base, "mesh.ici.fsdp=1"]), 1)
    _, got, got_hist = _step(load_config(None, [*base, "mesh.ici.fsdp=2", "mesh.ici.expert=2"]), 4)
    if recipe == "delayed":  # one MoE layer: [layers, gate/up/down, x/w/g, H], two steps observed
        assert len(ref_hist) == 1 and ref_hist[0].shape[:3] == (1, 3, 3)
        assert (ref_hist[0][0, :, :, :2] > 0).all() and not ref_hist[0][0, :, :, 2:].any()
    for mine, want in zip(got, ref):
        for key in ("loss", "grad_norm", "moe_balance_loss"):
            np.testing.assert_allclose(mine[key], want[key], rtol=2e-5, err_msg=key)
    for a, b in zip(got_hist, ref_hist):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.slow
def test_rowwise_experts_on_expert_meshes_equal_one_device():
    """Rowwise amaxes reduced over what splits their own slice only: a group's rows over fsdp (expert=2 x fsdp=2),
    the hidden width over tensor (expert=2 x tensor=2), never over expert. Loss, gradient norm and balance loss of
    two steps within rtol 1e-6 of one device's (measured: at most 1.6e-7, float32 rounding; reducing a group's
    columns over no axis or over every axis, or the hidden width over none, moves the second step's gradient norm
    by 1.7e-4, 3.5e-5 and 1.9e-4)."""
    base = [*FAST, *SMALL, "model.fp8=rowwise"]
    _, ref, _ = _step(load_config(None, [*base, "mesh.ici.fsdp=1"]), 1)
    for layout in (["mesh.ici.fsdp=2", "mesh.ici.expert=2"], ["mesh.ici.fsdp=1", "mesh.ici.expert=2",
                                                              "mesh.ici.tensor=2"]):
        _, got, _ = _step(load_config(None, [*base, *layout]), 4)
        for mine, want in zip(got, ref):
            for key in ("loss", "grad_norm", "moe_balance_loss"):
                np.testing.assert_allclose(mine[key], want[key], rtol=1e-6, err_msg=f"{layout} {key}")


def test_routed_experts_precision_is_stated():
    """ragged_dot multiplies every recipe in float8 (nothing to say); the grouped-matmul kernels leave the routed
    experts in the compute dtype whatever the recipe: said in one line, and no history."""
    for recipe in ("tensorwise", "rowwise", "delayed"):
        assert precision_note(load_config(None, [*FAST, *SMALL, f"model.fp8={recipe}"]).model) is None
    kernel = load_config(None, [*FAST, *SMALL, "model.fp8=rowwise", "model.moe.gemm=pallas"]).model
    assert precision_note(kernel) == (
        "model.fp8: routed experts stay in float32 (the pallas grouped-matmul kernel takes no float8 operands; "
        "model.moe.gemm=xla multiplies them in float8 through ragged_dot)")
    gpu = resolve_auto(load_config(None, [*SMALL, "model.fp8=rowwise"]), "gpu", 8)
    assert gpu.model.moe.gemm == "pallas"
    assert precision_note(gpu.model) == (
        "model.fp8: routed experts stay in bfloat16 (the pallas grouped-matmul kernel takes no float8 operands; "
        "model.moe.gemm=xla multiplies them in float8 through ragged_dot)")
    lay = Layout.build(load_config(None, [*FAST, *SMALL, "mesh.ici.fsdp=1", "model.fp8=delayed",
                                          "model.moe.gemm=pallas"]), jax.devices()[:1])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.filter_state(lay.abstract_state, fp8.Fp8Meta)))]
    assert paths and not any("'mlp'" in p and "'moe'" in p for p in paths)  # attention's histories only


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_flops_count_routed_experts_only_where_they_multiply_in_float8(recipe):
    from jaxtrain.models.flops import fp8_flops_per_token

    m = {g: load_config(None, [*SMALL, f"model.fp8={recipe}", f"model.moe.gemm={g}"]).model for g in ("xla", "pallas")}
    routed = 3 * 2 * 1 * 2 * 3 * 32 * 32  # train x 2 FLOPs x one MoE layer x top 2 x gate, up, down x d x F
    assert fp8_flops_per_token(m["xla"], 16) - fp8_flops_per_token(m["pallas"], 16) == routed
