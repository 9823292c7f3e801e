"""``model.attention=auto`` on GPU (layout.resolve_auto as a function of platform, dtype, mesh and rules), the
one-line refusal of cuDNN with a sharded sequence, and the checkpoint names on cuDNN's residuals
(model.keep_residuals), checked on CPU with a real custom-VJP attention in place of cuDNN's."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.kernels import mha_reference
from jaxtrain.models.attention import REMAT_POLICIES, keep_residuals
from jaxtrain.parallel.dims import seq_shards
from jaxtrain.parallel.layout import resolve_auto
from jaxtrain_testing import run_cli

FLASH = "triton" if importlib.util.find_spec("jax_triton") else "pallas"


@pytest.mark.parametrize("platform, overrides, num_devices, attention", [
    ("gpu", [], None, "cudnn"),
    ("gpu", ["model.dtype=bfloat16"], 8, "cudnn"),
    ("gpu", ["model.dtype=float16"], 8, "cudnn"),
    # float32: neither cuDNN (no float32 kernel) nor the flash kernels (exact-FMA float32: for checking, not speed).
    ("gpu", ["model.dtype=float32"], 8, "xla"),
    ("gpu", ["model.dtype=float32", "data.document_mask=true"], 8, "xla"),
    ("gpu", ["data.document_mask=true"], 8, FLASH),  # cuDNN takes no segment ids
    # cuDNN takes head dims of multiples of 8 up to 128 on every GPU (256 from Hopper on): others go to the flash
    # kernel where it takes them, else to XLA.
    ("gpu", ["model.head_dim=256"], 8, FLASH),
    ("gpu", ["model.head_dim=160"], 8, "xla"),
    ("gpu", ["model.head_dim=12"], 8, "xla"),
    ("gpu", ["model.head_dim=8"], 8, "cudnn"),
    # act_seq on an axis of size 1 is not sharded: cuDNN stays.
    ("gpu", ["mesh.rules.act_seq=tensor"], 8, "cudnn"),
    ("gpu", ["mesh.rules.act_seq=fsdp", "mesh.ici.fsdp=1", "mesh.ici.data=-1"], 8, "cudnn"),
    # act_seq sharded (fsdp=-1 fills 8 devices; or a fixed tensor=2): neither cuDNN nor the flash kernels.
    ("gpu", ["mesh.rules.act_seq=fsdp"], 8, "xla"),
    ("gpu", ["mesh.rules.act_seq=[tensor]", "mesh.ici.tensor=2"], 8, "xla"),
    ("gpu", ["mesh.rules.act_seq=tensor", "mesh.ici.tensor=2", "data.document_mask=true"], 8, "xla"),
    # Not knowing the device count, an act_seq on the -1 axis may shard: not cuDNN. One device: not sharded.
    ("gpu", ["mesh.rules.act_seq=fsdp"], None, "xla"),
    ("gpu", ["mesh.rules.act_seq=fsdp"], 1, "cudnn"),
    ("cpu", [], 8, "xla"),
    ("tpu", [], 8, "xla"),
])
def test_auto_attention(platform, overrides, num_devices, attention):
    cfg = load_config(None, ["model.attention=auto", "model.head_dim=64", "train.global_batch=8", *overrides])
    resolved = resolve_auto(cfg, platform, num_devices)
    assert resolved.model.attention == attention
    assert resolve_auto(resolved, platform, num_devices).model.attention == attention  # resolving twice


@pytest.mark.parametrize("overrides, num_devices, shards", [
    ([], 8, 1),
    (["mesh.rules.act_seq=fsdp"], 8, 8),
    (["mesh.rules.act_seq=fsdp"], None, None),
    (["mesh.rules.act_seq=[data,tensor]", "mesh.ici.data=2", "mesh.ici.tensor=2"], 8, 4),
    (["mesh.rules.act_seq=[data,tensor]", "mesh.ici.data=2", "mesh.ici.tensor=2"], None, 4),
    (["mesh.rules.act_seq=data", "mesh.dcn.data=2"], None, 2),
])
def test_seq_shards(overrides, num_devices, shards):
    cfg = load_config(None, ["train.global_batch=8", *overrides])
    assert seq_shards(cfg, num_devices) == shards


def test_explicit_cudnn_with_a_sharded_sequence_is_refused():
    cfg = load_config(None, ["model.attention=cudnn", "mesh.rules.act_seq=fsdp", "train.global_batch=8"])
    with pytest.raises(ConfigError, match=r"model.attention=cudnn cannot take a sharded sequence: "
                                          r"mesh.rules.act_seq='fsdp' cuts it into 8 slices"):
        resolve_auto(cfg, "gpu", 8)
    assert resolve_auto(cfg, "gpu", 1).model.attention == "cudnn"  # one device: nothing is cut


def test_explicit_cudnn_with_a_sharded_sequence_exits_2_in_one_line(tmp_path):
    proc = run_cli("train", "model.attention=cudnn", "mesh.rules.act_seq=fsdp", "runtime.cpu_devices=2",
                   f"run.dir={tmp_path}/run", "train.steps=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "mesh.rules.act_seq='fsdp' cuts it into 2 slices" in lines[0]


def _reference(q, k, v):
    return mha_reference(q, k, v, causal=True)


def _layer(fn):
    """A layer around attention (projection in, attention, projection out) under remat policy "full"."""
    def layer(w, x):
        q = (x @ w).reshape(1, 8, 2, 4)
        return jnp.sum(jnp.tanh(fn(q, q[:, :, :1], q[:, :, 1:]).reshape(8, 8) @ w))
    return jax.checkpoint(layer, policy=REMAT_POLICIES["full"], prevent_cse=False)


def test_named_residuals_spare_the_forward_and_keep_the_gradient():
    """A name on a custom-VJP function's result does not save its residuals (its backward reruns the forward);
    keep_residuals names the residuals themselves. The reference attention stands in for cuDNN's: a real
    attention whose backward needs its forward's results."""
    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (8, 8))
    plain, kept = _layer(_reference), _layer(keep_residuals(_reference))
    want, got = (jax.jit(jax.grad(f, argnums=(0, 1)))(w, x) for f in (plain, kept))
    for g, ref in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # The softmax's exp: twice in the gradient's program when the forward is rerun, once when it is not.
    programs = [str(jax.make_jaxpr(jax.grad(f))(w, x)) for f in (plain, kept)]
    assert [p.count(" exp ") for p in programs] == [2, 1]
    assert "name=attn_out" in programs[1] and "name=attn_lse" in programs[1]
    assert "name=attn_" not in programs[0]


# -- cuDNN laid out per device (parallel/attention.py) and its residuals (models/attention.keep_residuals) ----------


@jax.custom_vjp
def _with_placeholder(q, k, v):
    """The reference attention as a custom VJP whose forward also saves an empty array, as cuDNN's saves its bias
    and mask placeholders (bf16[0]): the stand-in for cuDNN on CPU."""
    return _reference(q, k, v)


def _placeholder_fwd(q, k, v):
    out, pull = jax.vjp(_reference, q, k, v)
    return out, (pull, jnp.zeros((0,), q.dtype))


def _placeholder_bwd(residuals, g):
    pull, empty = residuals
    dq, dk, dv = pull(g)
    return dq + empty.sum(), dk, dv


_with_placeholder.defvjp(_placeholder_fwd, _placeholder_bwd)


def test_zero_size_residuals_are_made_again_in_the_backward_not_carried():
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    k, v = q[:, :, :1], q[:, :, 1:]
    def residuals(f):  # the shapes the backward closes over, without running anything
        return [leaf.shape for leaf in jax.eval_shape(lambda: jax.tree.leaves(jax.vjp(f, q, k, v)[1]))]

    carried, kept = residuals(_with_placeholder), residuals(keep_residuals(_with_placeholder))
    assert (0,) in carried and (0,) not in kept
    assert sorted(kept) == sorted(s for s in carried if s != (0,))
    w, x = jax.random.normal(jax.random.key(1), (8, 8)), q.reshape(8, 8)
    want, got = (jax.jit(jax.grad(_layer(f), argnums=(0, 1)))(w, x)
                 for f in (_with_placeholder, keep_residuals(_with_placeholder)))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _stage_loop_grad_jaxpr(attention) -> str:
    """The gradient's jaxpr of a scanned layer stack under a shard_map manual over one of two axes (as the GPipe
    loop is: the forward's residuals cross from its shard_map to the transposed one)."""
    from jax.sharding import AxisType, PartitionSpec

    mesh = jax.make_mesh((2, 4), ("stage", "tensor"), axis_types=(AxisType.Auto,) * 2)

    def loss(w, x):
        def local(w, x):
            def body(h, _):
                q = (h @ w[0]).reshape(1, 8, 2, 4)
                return attention(q, q[:, :, :1], q[:, :, 1:]).reshape(8, 8), None

            return jax.lax.psum(jax.lax.scan(body, x, jnp.arange(2))[0].sum(), "stage")

        return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec("stage"), PartitionSpec()),
                             out_specs=PartitionSpec(), axis_names=frozenset({"stage"}), check_vma=False)(w, x)

    with jax.set_mesh(mesh):
        return str(jax.make_jaxpr(jax.grad(loss))(jnp.full((2, 8, 8), 0.1), jnp.ones((8, 8))))


def test_no_zero_size_value_crosses_the_stage_loop():
    """jax 0.11's Shardy crashes the compiler on a zero-size residual crossing a shard_map (docs/gpu.md, known
    issues): with keep_residuals the only zero-size values are the ones its backward makes."""
    def zero_size(text):
        return [line.strip() for line in text.splitlines() if "f32[0]" in line]

    plain = zero_size(_stage_loop_grad_jaxpr(_with_placeholder))
    assert any("broadcast_in_dim" not in line for line in plain)  # the placeholder travels as a residual
    assert all(re.fullmatch(r"\w+:f32\[0\] = broadcast_in_dim 0\.0:f32\[\]", line)
               for line in zero_size(_stage_loop_grad_jaxpr(keep_residuals(_with_placeholder))))


@pytest.fixture
def cudnn_stand_in(monkeypatch):
    """model.attention=cudnn on CPU: the placeholder-saving reference in place of cuDNN's kernel, wrapped as cuDNN's
    is (keep_residuals); everything around it (MeshAttention's layout, the pipelines) is the real code."""
    import jaxtrain.models.attention as model_attention

    stand_in = keep_residuals(_with_placeholder)
    monkeypatch.setattr(model_attention, "_cudnn_attention", lambda window, scale: stand_in)


def test_cudnn_runs_per_device_under_a_shard_map_over_every_axis(cudnn_stand_in, monkeypatch):
    """On a data 2 x fsdp 2 x tensor 2 mesh the cuDNN path is called per device on its shards (batch over data and
    fsdp, heads over tensor), with the values and gradients of one device."""
    from jaxtrain.parallel.attention import MeshAttention
    from jaxtrain.parallel.layout import Layout

    cfg = load_config(None, ["model.attention=cudnn", "model.head_dim=16", "model.n_heads=4", "model.n_kv_heads=2",
                             "train.global_batch=4", "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"])
    layout = Layout.build(cfg, jax.devices()[:8])
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (4, 16, 4, 16))
    k, v = (jax.random.normal(key, (4, 16, 2, 16)) for key in keys[1:])

    def loss(attention, q, k, v):
        return jnp.sum(jnp.tanh(attention(q, k, v, None)))

    want = jax.jit(jax.value_and_grad(lambda *a: loss(MeshAttention("xla"), *a), argnums=(0, 1, 2)))(q, k, v)
    local_shapes = []

    def spy(q, k, v):
        local_shapes.append(q.shape)
        return _with_placeholder(q, k, v)

    with layout.scope():
        got = jax.jit(jax.value_and_grad(lambda *a: loss(MeshAttention("cudnn"), *a), argnums=(0, 1, 2)))(q, k, v)
        spied = keep_residuals(spy)
        monkeypatch.setattr("jaxtrain.models.attention._cudnn_attention", lambda window, scale: spied)
        jax.make_jaxpr(lambda q, k, v: MeshAttention("cudnn")(q, k, v, None))(q, k, v)
    assert local_shapes == [(1, 16, 2, 16)]  # batch 4 over data x fsdp, 4 heads over tensor
    for g, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-6)


_PIPELINE_BASE = ["model.dtype=float32", "model.param_dtype=float32", "model.head_dim=16", "model.n_heads=4",
                  "model.n_kv_heads=2", "model.d_model=64", "model.d_ff=128", "model.n_layers=4", "data.seq_len=32",
                  "train.global_batch=8", "train.microbatches=4", "model.remat=full"]
_TOKENS = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)


def _one_step(overrides, n_devices):
    """(loss, updated parameters) of one train step from the initial state on the first ``n_devices`` devices."""
    from jaxtrain.train import step as step_lib

    ts = step_lib.setup(load_config(None, [*_PIPELINE_BASE, *overrides]), jax.devices()[:n_devices])
    train, _, _ = ts.compile(with_eval=False)
    state, metrics = train(ts.layout.init_state(), ts.layout.to_device(_TOKENS))
    return float(metrics["loss"]), [np.asarray(x) for x in jax.tree.leaves(state["model"])]


@pytest.fixture(scope="module")
def one_device_step():
    return _one_step(["model.attention=xla", "mesh.ici.fsdp=1"], 1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cudnn_inside_the_stage_loop_trains_as_one_device(cudnn_stand_in, one_device_step, schedule):
    """model.attention=cudnn inside the pipeline's shard_map (manual over stage and the batch axes, tensor
    automatic: where jax 0.11's cuDNN partitioner failed): one train step's loss and updated parameters equal one
    device's with the XLA reference."""
    got_loss, got = _one_step(["model.attention=cudnn", "mesh.ici.stage=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2",
                               f"train.pipeline_schedule={schedule}"], 8)
    want_loss, want = one_device_step
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6)
