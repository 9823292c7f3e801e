"""MoE layers against an independent float64 NumPy reference with a hand-written backward (routing, capacity,
SwiGLU experts, the load-balancing and z losses), on one device and expert-parallel on 8 emulated devices; the
load-balancing loss against transformers'.

The reference loops over tokens and their assignments: no sorting, no grouped matmul, no dispatch. The JAX side is
jaxtrain's own: ``routing.route``, ``experts.local_experts`` and ``parallel.expert.MeshExperts`` under shard_map.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.config import MoEConfig, default_rules
from jaxtrain.models import routing
from jaxtrain.models.experts import local_experts
from jaxtrain.parallel.dims import MESH_AXES
from jaxtrain.parallel.expert import MeshExperts
from jaxtrain.parallel.mesh import rules_from_config

# --------------------------------------------------------------------------------------------------------------
# NumPy reference (float64)


def _silu(a):
    return a / (1.0 + np.exp(-a))


def _dsilu(a):
    s = 1.0 / (1.0 + np.exp(-a))
    return s * (1.0 + a * (1.0 - s))


def np_route(x, wr, k, router, normalize):
    """x [T, d] -> (logits, scores, probs, experts [T, k], weights [T, k], denominators [T, 1])."""
    logits = x @ wr
    if router == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = probs = z / z.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        probs = scores / scores.sum(-1, keepdims=True)
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(scores, experts, -1)
    denom = chosen.sum(-1, keepdims=True) if normalize else np.ones_like(chosen[:, :1])
    return logits, scores, probs, experts, chosen / denom, denom


def np_keep(experts, e, slots, seq):
    """Which assignments fit: per sequence of ``seq`` tokens, ``slots`` per expert, first choices first."""
    t, k = experts.shape
    keep = np.zeros((t, k), bool)
    for start in range(0, t, seq):
        used = np.zeros(e, int)
        for slot in range(k):
            for tok in range(start, start + seq):
                if used[experts[tok, slot]] < slots:
                    keep[tok, slot] = True
                    used[experts[tok, slot]] += 1
    return keep


def np_moe(x, wr, wg, wu, wd, g, *, k, router="softmax", normalize=True, slots=None, seq=None, aux_w=0.0, z_w=0.0):
    """objective = sum(out * g) + aux_w * load balancing + z_w * z-loss over tokens x [T, d] (sequences of ``seq``).
    Returns (out, objective, grads of x/wr/wg/wu/wd, info)."""
    x, wr, wg, wu, wd, g = (np.asarray(a, np.float64) for a in (x, wr, wg, wu, wd, g))
    t, e = x.shape[0], wr.shape[1]
    logits, scores, probs, experts, weights, denom = np_route(x, wr, k, router, normalize)
    keep = np.ones_like(experts, bool) if slots is None else np_keep(experts, e, slots, seq)
    out, dx = np.zeros_like(x), np.zeros_like(x)
    dwg, dwu, dwd, dweights = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd), np.zeros_like(weights)
    for tok in range(t):
        for slot in range(k):
            if not keep[tok, slot]:
                continue
            ex = experts[tok, slot]
            a, b = x[tok] @ wg[ex], x[tok] @ wu[ex]
            h = _silu(a) * b
            y = h @ wd[ex]
            out[tok] += weights[tok, slot] * y
            dweights[tok, slot] = g[tok] @ y
            dy = weights[tok, slot] * g[tok]
            dwd[ex] += np.outer(h, dy)
            dh = wd[ex] @ dy
            da, db = dh * b * _dsilu(a), dh * _silu(a)
            dwg[ex] += np.outer(x[tok], da)
            dwu[ex] += np.outer(x[tok], db)
            dx[tok] += wg[ex] @ da + wu[ex] @ db
    dchosen = dweights / denom
    if normalize:
        dchosen -= (dweights * weights).sum(-1, keepdims=True) / denom
    dscores = np.zeros_like(scores)
    np.put_along_axis(dscores, experts, dchosen, -1)
    counts = np.bincount(experts.reshape(-1), minlength=e).astype(np.float64)
    aux = e * np.sum(counts / t * probs.mean(0))
    dprobs = np.broadcast_to(aux_w * e * counts / t / t, probs.shape).copy()
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    zl = np.mean(lse ** 2)
    dlogits = z_w * 2 * lse[:, None] * np.exp(logits - lse[:, None]) / t
    if router == "softmax":
        ds = dscores + dprobs
        dlogits += scores * (ds - (ds * scores).sum(-1, keepdims=True))
    else:
        ds = dscores + (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / scores.sum(-1, keepdims=True)
        dlogits += ds * scores * (1 - scores)
    dx += dlogits @ wr.T
    objective = np.sum(out * g) + aux_w * aux + z_w * zl
    grads = {"x": dx, "router": x.T @ dlogits, "w_gate": dwg, "w_up": dwu, "w_down": dwd}
    return out, objective, grads, {"counts": counts, "dropped": (~keep).sum(), "aux": aux, "z": zl}


def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    x, wr, g = rng.normal(size=(8, 6)), rng.normal(size=(6, 5)), rng.normal(size=(8, 6))
    wg, wu, wd = rng.normal(size=(5, 6, 7)), rng.normal(size=(5, 6, 7)), rng.normal(size=(5, 7, 6))
    for router in ("softmax", "sigmoid"):
        kw = dict(k=2, router=router, aux_w=0.4, z_w=0.2)
        args = dict(x=x, wr=wr, wg=wg, wu=wu, wd=wd)
        grads = np_moe(g=g, **args, **kw)[2]
        for name, ours, idx in (("x", "x", (1, 2)), ("wr", "router", (3, 1)), ("wd", "w_down", (3, 1, 2))):
            up = {n: v.copy() for n, v in args.items()}
            down = {n: v.copy() for n, v in args.items()}
            up[name][idx] += 1e-6
            down[name][idx] -= 1e-6
            numeric = (np_moe(g=g, **up, **kw)[1] - np_moe(g=g, **down, **kw)[1]) / 2e-6
            np.testing.assert_allclose(grads[ours][idx], numeric, rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------------------------------------------
# jaxtrain's layer (routing + experts + losses) against it

B, S, D = 8, 12, 16


def _params(e, f, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    p = {"router": jax.random.normal(keys[0], (D, e), dtype) * 0.5,
         "w_gate": jax.random.normal(keys[1], (e, D, f), dtype) * 0.3,
         "w_up": jax.random.normal(keys[2], (e, D, f), dtype) * 0.3,
         "w_down": jax.random.normal(keys[3], (e, f, D), dtype) * 0.3}
    return p, jax.random.normal(keys[4], (B, S, D), dtype), jax.random.normal(keys[5], (B, S, D), dtype)


def _objective(moe, experts_fn):
    def f(p, x, g):
        slots = routing.slots_per_expert(x.shape[1], moe)
        route, stats = routing.route(x, p["router"], moe, slots)
        y = experts_fn(x, route.experts, route.weights, p["w_gate"], p["w_up"], p["w_down"], slots)
        obj = (jnp.sum(y * g) + moe.aux_loss * routing.load_balancing_loss(stats)
               + moe.z_loss * routing.z_loss(stats))
        return obj, (y, stats)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _reference(moe, p, x, g):
    return np_moe(np.asarray(x).reshape(-1, D), p["router"], p["w_gate"], p["w_up"], p["w_down"],
                  np.asarray(g).reshape(-1, D), k=moe.top_k, router=moe.router, normalize=moe.normalize,
                  slots=routing.slots_per_expert(S, moe), seq=S, aux_w=moe.aux_loss, z_w=moe.z_loss)


def _check(moe, got, ref, rtol):
    (obj, (y, stats)), (gp, gx) = got
    out, objective, grads, info = ref
    np.testing.assert_allclose(y.reshape(-1, D), out, rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(obj, objective, rtol=rtol)
    np.testing.assert_array_equal(stats.counts, info["counts"])
    assert float(stats.dropped) == info["dropped"]
    np.testing.assert_allclose(gx.reshape(-1, D), grads["x"], rtol=rtol, atol=rtol * 1e-2)
    for name in gp:
        np.testing.assert_allclose(gp[name], grads[name], rtol=rtol, atol=rtol * 1e-2, err_msg=name)


CASES = {
    "softmax": MoEConfig(experts=8, top_k=2, aux_loss=0.3, z_loss=0.05),
    "sigmoid-top3-capacity-1.0": MoEConfig(experts=6, top_k=3, router="sigmoid", capacity_factor=1.0, aux_loss=0.3,
                                           z_loss=0.05),
    "softmax-unnormalised": MoEConfig(experts=8, top_k=2, normalize=False, aux_loss=0.1),
    "sigmoid-top3": MoEConfig(experts=6, top_k=3, router="sigmoid", aux_loss=0.3, z_loss=0.05),
    "capacity-1.25-top1": MoEConfig(experts=4, top_k=1, capacity_factor=1.25),
}
SLOW_CASES = {"softmax-unnormalised", "sigmoid-top3", "capacity-1.25-top1"}  # paths the first two also take


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_one_device_layer_float64(name):
    moe = CASES[name]
    with jax.enable_x64(True):
        p, x, g = _params(moe.experts, 24, jnp.float64)
        got = _objective(moe, local_experts)(p, x, g)
        ref = _reference(moe, p, x, g)
        if moe.capacity_factor:
            assert ref[3]["dropped"] > 0, "the capacity case should drop assignments"
        _check(moe, got, ref, 1e-9)


# (data, fsdp, expert, tensor) on 8 devices: the three meshes.
MESHES = {"expert=8": (1, 1, 8, 1), "expert=4 x fsdp=2": (1, 2, 4, 1), "expert=2 x data=2 x tensor=2": (2, 1, 2, 2)}


def _mesh(sizes):
    named = dict(zip(("data", "fsdp", "expert", "tensor"), sizes))
    shape = tuple(named.get(a, 1) for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def _sharded(mesh, p, x, g):
    """Parameters stored as the model stores them (experts over expert, embed over fsdp, d_ff over tensor), tokens
    over (data, fsdp, expert)."""
    specs = {"router": PartitionSpec("fsdp"), "w_gate": PartitionSpec("expert", "fsdp", "tensor"),
             "w_up": PartitionSpec("expert", "fsdp", "tensor"), "w_down": PartitionSpec("expert", "tensor", "fsdp")}
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert")))
    return ({k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()}, jax.device_put(x, rows),
            jax.device_put(g, rows))


def _on_mesh(mesh, fn, *args):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules_from_config(default_rules())):
        return fn(*args)


# Each dispatch on each mesh is covered once by default (float64 against NumPy, or float32 against one device);
# the rest of the grid runs in the slow pass.
SHARDED = [("expert=8", "all_to_all", 0.0), ("expert=4 x fsdp=2", "all_gather", 0.0),
           ("expert=2 x data=2 x tensor=2", "all_to_all", 1.0)]
SHARDED += [pytest.param(m, d, c, marks=pytest.mark.slow) for m in MESHES for d in ("all_to_all", "all_gather")
            for c in (0.0, 1.0) if (m, d, c) not in SHARDED]


@pytest.mark.parametrize("mesh_name,dispatch,capacity", SHARDED)
def test_expert_parallel_layer_float64(mesh_name, dispatch, capacity):
    """Forward, routing statistics and gradients of the expert-parallel layer against the reference: the same
    numbers whatever the mesh (the capacity counts per sequence, so drops do not depend on it either)."""
    moe = MoEConfig(experts=8, top_k=2, aux_loss=0.2, z_loss=0.05, capacity_factor=capacity)
    with jax.enable_x64(True):
        p, x, g = _params(moe.experts, 8, jnp.float64)
        mesh = _mesh(MESHES[mesh_name])
        got = _on_mesh(mesh, _objective(moe, MeshExperts(dispatch)), *_sharded(mesh, p, x, g))
        ref = _reference(moe, p, x, g)
        assert (ref[3]["dropped"] > 0) == (capacity > 0)
        _check(moe, got, ref, 1e-9)


@pytest.mark.parametrize("dispatch", ["all_to_all", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_worst_case_routing_is_dropless(dispatch):
    """Every token routed to experts 0 and 1 (one device's experts under expert=4): the case the static buffers are
    sized for; float32, equal to one device's."""
    moe = MoEConfig(experts=8, top_k=2)
    p, x, g = _params(moe.experts, 8, jnp.float32)
    x = x.at[..., 0].set(3.0)
    p = dict(p, router=p["router"].at[0, :2].add(20.0))
    (_, (y1, stats)), _ = _objective(moe, local_experts)(p, x, g)
    assert float(stats.counts[0] + stats.counts[1]) == B * S * 2
    mesh = _mesh(MESHES["expert=4 x fsdp=2"])
    (_, (y2, _)), _ = _on_mesh(mesh, _objective(moe, MeshExperts(dispatch)), *_sharded(mesh, p, x, g))
    # Both float32 runs against the float64 reference, at a tolerance from float32's epsilon and the output's scale
    # (a sum of d_ff products per expert): they differ from each other by their summation orders, not the code.
    out = _reference(moe, p, x, g)[0]
    tol = 64 * np.finfo(np.float32).eps * np.abs(out).max()
    for y in (y1, y2):
        np.testing.assert_allclose(np.asarray(y, np.float64).reshape(out.shape), out, rtol=0, atol=tol)


@pytest.mark.slow  # importing torch and transformers takes seconds
def test_load_balancing_loss_equals_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers, e, k = 3, 8, 2
    logits = np.random.default_rng(0).normal(size=(layers, B * S, e)).astype(np.float32)
    moe = MoEConfig(experts=e, top_k=k)
    stats = []
    for lg in logits:  # the router's own arithmetic on logits given directly (x = logits, router = identity)
        _, st = routing.route(jnp.asarray(lg).reshape(B, S, e), jnp.eye(e), moe, None)
        stats.append(st)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats)
    theirs = float(load_balancing_loss_func(tuple(torch.from_numpy(lg) for lg in logits), e, k))
    np.testing.assert_allclose(float(routing.load_balancing_loss(stacked, "pooled")), theirs, rtol=1e-6)
    per_layer = np.mean([float(routing.load_balancing_loss(st)) for st in stats])
    np.testing.assert_allclose(float(routing.load_balancing_loss(stacked, "per_layer")), per_layer, rtol=1e-6)
    assert abs(per_layer - theirs) > 1e-6  # the default, per layer, is not transformers' pooled value
