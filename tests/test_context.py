"""Context parallelism (jaxtrain/parallel/context.py): the sequence split over the ``context`` mesh axis, ring and
all-gather attention over it, the zigzag load balance, and training that equals the one-device run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxtrain.config import ConfigError, load_config
from jaxtrain.parallel import context
from jaxtrain.parallel.layout import Layout, resolve_auto
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.planner.cost.collectives import stated_collectives
from jaxtrain.planner.cost.hlo import parse_hlo
from jaxtrain.planner.cost.model import group_span
from jaxtrain.train import loop
from jaxtrain.train.step import Step
from jaxtrain_testing import FAST

# -- the schedule ----------------------------------------------------------------------------------------------------


def _counted_pairs(seq: int, n: int, balanced: bool) -> np.ndarray:
    """(query, key) pairs per device, counted from the causal mask itself (independent of the closed form)."""
    order = context.token_order(seq, n, balanced).reshape(n, -1)  # each device's real positions
    return np.array([sum(int(p) + 1 for p in row) for row in order], float)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work_within_5_percent(n):
    seq = 64 * n
    for balanced in (True, False):
        pairs = context.causal_pairs(seq, n, balanced)
        np.testing.assert_allclose(pairs, _counted_pairs(seq, n, balanced))
        assert pairs.sum() == seq * (seq + 1) / 2
    balanced, plain = context.causal_pairs(seq, n, True), context.causal_pairs(seq, n, False)
    assert balanced.max() / balanced.mean() - 1 < 0.05
    # The plain split: the last device does (2n - 1) / n times the average (its n - 1/2 chunk areas of n / 2).
    assert plain.max() / plain.mean() == pytest.approx(2 - 1 / n, rel=0.02)


def test_kv_traffic_counts_the_ring_hops():
    # 2 rows of 1024 tokens, 2 kv heads of 64, bfloat16, ring of 4: each device's block is 2 x 256 x 2 x 64 K and V
    # elements; 3 hops forward; backward 3 K/V hops and 4 float32 dK/dV hops.
    block = 2 * 2 * 256 * 2 * 64
    assert context.kv_traffic(2, 1024, 2, 64, 2, 4, "ring") == (3 * block * 2, 3 * block * 2 + 4 * block * 4)
    assert context.kv_traffic(2, 1024, 2, 64, 2, 1, "ring") == (0.0, 0.0)


def test_token_order_is_a_permutation_of_two_chunks_per_device():
    order = context.token_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    assert order.reshape(4, 2, 2)[0].tolist() == [[0, 1], [14, 15]]  # device 0: the first and the last chunk
    assert context.choose_variant(2) == "allgather" and context.choose_variant(4) == "ring"


@pytest.mark.parametrize("overrides, match", [
    (["mesh.ici.context=4", "mesh.ici.fsdp=2", "mesh.rules.act_seq=fsdp"], "act_seq='fsdp' must be 'context'"),
    (["mesh.ici.context=8", "mesh.ici.fsdp=1", "data.seq_len=40"], "data.seq_len=40 is not divisible by 2 x"),
])
def test_bad_context_layouts_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, num_devices, attention", [
    ([], 8, "cudnn"),  # the default rule act_seq=context on a context axis of 1: nothing split, cuDNN stays
    (["mesh.ici.context=4", "mesh.ici.fsdp=2", "model.head_dim=64"], 8, "flash"),  # ring on the flash kernels
    (["mesh.ici.context=4", "mesh.ici.fsdp=2", "model.head_dim=48", "model.d_model=384"], 8, "xla"),  # no flash dim
    (["mesh.ici.context=4", "mesh.ici.fsdp=2", "model.dtype=float32"], 8, "xla"),
])
def test_auto_attention_on_a_context_axis(overrides, num_devices, attention):
    cfg = resolve_auto(load_config(None, ["model.attention=auto", *overrides]), "gpu", num_devices)
    assert cfg.model.attention == attention or (attention == "flash" and cfg.model.attention in ("pallas", "triton"))


def test_checkpoint_layout_does_not_involve_the_context_axis():
    # The saved tree (shapes, dtypes) is the same with and without context, and no parameter or optimizer leaf is
    # split over it: a run resumes across the two meshes (Orbax restores into the target's shardings).
    layouts = [Layout.build(load_config(None, [*SMALL, *o]), jax.devices()[:8])
               for o in (["mesh.ici.fsdp=4", "mesh.ici.tensor=2"], ["mesh.ici.fsdp=2", "mesh.ici.context=4"])]
    shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), lay.abstract_state) for lay in layouts]
    assert shapes[0] == shapes[1]
    for leaf in jax.tree.leaves(layouts[1].abstract_state):
        assert "context" not in str(leaf.sharding.spec)
    assert layouts[1].dims.local_seq == 16 and layouts[1].token_order is not None and layouts[0].token_order is None


# -- attention against the one-device reference ---------------------------------------------------------------------

def _attention_case(seq=32, batch=2, heads=4, kv_heads=2, head_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, seq, heads, head_dim))
    k, v = (rng.normal(size=(batch, seq, kv_heads, head_dim)) for _ in range(2))
    segments = np.sort(rng.integers(0, 3, size=(batch, seq)), axis=1).astype(np.int32)  # 3 documents per row
    weights = rng.normal(size=q.shape)
    return q, k, v, segments, weights


def _reference(q, k, v, segments, weights, window=None):
    """float64 NumPy: causal, document-masked, grouped-query attention (``window``: keys i - window < j <= i only);
    loss = sum(out * weights) and its grads."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    logits = np.einsum("bqhd,bshd->bhqs", q, kr) / np.sqrt(d)
    gap = np.arange(s)[:, None] - np.arange(s)[None, :]
    visible = (gap >= 0) & (gap < (window or s))
    mask = visible & (segments[:, :, None] == segments[:, None, :])[:, None]
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqs,bshd->bqhd", p, vr)
    dp = np.einsum("bqhd,bshd->bhqs", weights, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    dq = np.einsum("bhqs,bshd->bqhd", ds, kr)
    dk = np.einsum("bhqs,bqhd->bshd", ds, q).reshape(b, s, -1, g, d).sum(3)
    dv = np.einsum("bhqs,bqhd->bshd", p, weights).reshape(b, s, -1, g, d).sum(3)
    return (out * weights).sum(), dq, dk, dv


def _context_grads(overrides, variant, blocks, case, n_devices=8, **kw):
    """(loss, dq, dk, dv, compiled) of context attention on the mesh of ``overrides``, inputs in sequence order."""
    q, k, v, segments, weights = case
    cfg = load_config(None, [*overrides, f"data.seq_len={q.shape[1]}"])
    mesh, shape = build_mesh(cfg, jax.devices()[:n_devices])
    n = shape.axis_sizes["context"]
    order = context.token_order(q.shape[1], n)
    specs = (PartitionSpec(("data", "fsdp"), "context", "tensor"),) * 2 + (PartitionSpec(("data", "fsdp"), "context"),)

    def loss(q, k, v):
        qp, kp, vp, w = (jnp.take(x, order, axis=1) for x in (q, k, v, jnp.asarray(weights, jnp.float32)))
        out = context.context_attention(qp, kp, vp, jnp.take(jnp.asarray(segments), order, axis=1), mesh=mesh,
                                        specs=specs, n=n, variant=variant, blocks=blocks, **kw)
        return (out * w).sum()

    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = fn.lower(*args).compile()
    value, grads = compiled(*args)
    return (value, *grads), compiled, shape


def _check(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=2e-5)


def test_ring_attention_matches_float64_and_permutes_only_along_context():
    # fsdp 2 x context 2 x tensor 2 (heads split): GQA (4 heads on 2 kv heads) and three documents per row.
    case = _attention_case(seq=16)
    got, compiled, shape = _context_grads(["mesh.ici.fsdp=2", "mesh.ici.context=2", "mesh.ici.tensor=2"], "ring",
                                          context.XLA_BLOCKS, case)
    _check(got, _reference(*case))
    stated = stated_collectives(parse_hlo(compiled.as_text()), 8)
    permutes = [c for c in stated.others if c.kind == "collective-permute"]
    assert permutes  # K/V forward, K/V and dK/dV backward
    for c in permutes:
        assert group_span(shape, c.groups)[2] == ["context"], (c.op_name, c.groups.tolist())
    assert not [c for c in stated.others if c.kind == "all-gather"]  # the ring gathers nothing
    # Per device: 1 row of 16 tokens, 1 kv head of 8 (tensor 2 splits the 2), float32, ring of 2. The compiled
    # program sends at least the forward K/V and the backward's float32 dK/dV hops, at most the schedule's figure
    # (XLA may reuse the forward's received K/V in the backward instead of sending them again), plus segment ids.
    sent = sum(c.bytes * c.count for c in permutes)
    forward, backward = context.kv_traffic(1, 16, 1, 8, 4, 2, "ring")
    seg = 8 * 4  # one hop of this device's 8 int32 segment ids
    dkv = 2 * (2 * 8 * 8 * 4)  # 2 hops of float32 dK and dV
    assert forward + dkv + seg <= sent <= forward + backward + 2 * seg


@pytest.mark.slow
@pytest.mark.parametrize("overrides, variant", [
    (["mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.context=2", "mesh.ici.tensor=2"], "allgather"),
    (["mesh.ici.fsdp=1", "mesh.ici.context=8"], "ring"),
    (["mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.context=4"], "ring"),
])
def test_context_attention_variants_match_float64(overrides, variant):
    case = _attention_case(seq=32 if "mesh.ici.context=8" not in overrides else 64)
    got, _, _ = _context_grads(overrides, variant, context.XLA_BLOCKS, case)
    _check(got, _reference(*case))


@pytest.mark.slow
def test_ring_on_the_pallas_kernels_in_interpret_mode_matches_float64():
    case = _attention_case(seq=64, batch=1, heads=2, kv_heads=1, head_dim=32)
    got, _, _ = _context_grads(["mesh.ici.fsdp=1", "mesh.ici.context=2"], "ring",
                               context.kernel_blocks("pallas", interpret=True), case, n_devices=2)
    _check(got, _reference(*case))


@pytest.mark.parametrize("variant, window", [("ring", 6), ("ring", 12), ("allgather", 7)])
def test_a_sliding_window_over_the_context_axis_matches_float64(variant, window):
    """32 tokens over context 4 (8 chunks of 4, zigzag): a window of 6 hides whole chunk pairs (skipped) and puts
    a chunk's last key one position inside some query chunk's window (a skip test off by one drops it), one of 12
    crosses chunks; all-gather attention
    (one key block) masks by the window; GQA and three documents per row."""
    case = _attention_case(seq=32)
    got, _, _ = _context_grads(["mesh.ici.fsdp=2", "mesh.ici.context=4"], variant, context.XLA_BLOCKS, case,
                               window=window)
    _check(got, _reference(*case, window=window))


@pytest.mark.slow
def test_a_sliding_window_on_the_pallas_ring_matches_float64():
    case = _attention_case(seq=64, batch=1, heads=2, kv_heads=1, head_dim=32)
    got, _, _ = _context_grads(["mesh.ici.fsdp=1", "mesh.ici.context=2"], "ring",
                               context.kernel_blocks("pallas", interpret=True), case, n_devices=2, window=20)
    _check(got, _reference(*case, window=20))


# -- training equals the one-device run -------------------------------------------------------------------------------

SMALL = [*FAST, "data.seq_len=64", "train.global_batch=4", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "data.document_mask=true"]


def _two_steps(overrides, n_devices):
    """(loss, grad norm) of two train steps on fixed random batches: the second step sees the first's update."""
    layout = Layout.build(load_config(None, [*SMALL, *overrides]), jax.devices()[:n_devices])
    train = Step(layout).compile(with_eval=False)[0]
    state, rng, out = layout.init_state(), np.random.default_rng(0), []
    for _ in range(2):
        state, metrics = train(state, layout.to_device(rng.integers(0, 256, layout.batch_shape).astype(np.int32)))
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.array(out)


@pytest.mark.slow
def test_context_training_matches_one_device():
    # Context 4 (the ring) with data and remat, context 2 (all-gather) with fsdp and tensor, and inside the
    # pipeline's stage function (GPipe; 1F1B takes the same side input); context 8 alone (the ring, eight hops).
    reference = _two_steps(["mesh.ici.fsdp=1"], 1)
    pipelined = ["mesh.ici.fsdp=1", "mesh.ici.data=2", "mesh.ici.context=2", "mesh.ici.stage=2", "train.microbatches=2"]
    for overrides in (["mesh.ici.fsdp=1", "mesh.ici.data=2", "mesh.ici.context=4", "model.remat=full"],
                      ["mesh.ici.fsdp=2", "mesh.ici.context=2", "mesh.ici.tensor=2"],
                      [*pipelined, "train.pipeline_schedule=gpipe"],
                      ["mesh.ici.fsdp=1", "mesh.ici.context=8"]):
        np.testing.assert_allclose(_two_steps(overrides, 8), reference, rtol=1e-4, err_msg=str(overrides))


@pytest.mark.slow
def test_checkpoints_cross_to_and_from_a_context_mesh(tmp_path):
    """The checkpoint holds no trace of the context split: 3 steps written with context 4 x fsdp 2 resume on fsdp 8
    (no context), and 3 written on fsdp 8 resume with context 4 x fsdp 2, each with the uninterrupted run's next
    losses (float32, 1e-4)."""
    base = [*FAST, "train.eval_every=0", "train.log_every=1", "checkpoint.every=3", "mesh.ici.fsdp=-1",
            "train.warmup_steps=2"]
    ctx, plain = ["mesh.ici.context=4"], []

    def train(run, steps, mesh):
        return loop.train(load_config(None, [f"run.dir={tmp_path / run}", f"train.steps={steps}", *base, *mesh]),
                          devices=jax.devices()[:8])

    full = train("full", 6, ctx)
    for name, first, then in [("ctx-to-plain", ctx, plain), ("plain-to-ctx", plain, ctx)]:
        train(name, 3, first)
        resumed = train(name, 6, then)
        assert resumed.start_step == 3 and sorted(resumed.losses) == [4, 5, 6]
        np.testing.assert_allclose([resumed.losses[s] for s in (4, 5, 6)], [full.losses[s] for s in (4, 5, 6)],
                                   rtol=1e-4, err_msg=name)


# -- memory ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_activation_memory_at_32k_falls_to_an_eighth_with_context_8():
    # One sequence of 32k tokens on 8 devices, the batch not split (mesh.rules.batch=data, data=1): without context
    # every device computes the whole sequence; with context=8 each holds 4k tokens. Read from XLA's analysis.
    small = [*FAST, "data.seq_len=32768", "train.global_batch=1", "model.n_layers=1", "model.d_model=64",
             "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=128", "mesh.rules.batch=data"]
    temps = {}
    for ctx in (1, 8):
        layout = Layout.build(load_config(None, [*small, "mesh.ici.fsdp=-1", f"mesh.ici.context={ctx}"]),
                              jax.devices()[:8])
        train = Step(layout).compile(with_eval=False)[0]
        temps[ctx] = train.memory_analysis().temp_size_in_bytes
    print(f"per-device temporaries at 32k: context=1 {temps[1] / 2**20:.0f} MiB, context=8 {temps[8] / 2**20:.0f} MiB")
    assert temps[8] <= temps[1] / 8 * 1.25
