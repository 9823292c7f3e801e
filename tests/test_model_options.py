"""The decoder's family options (q/k/v biases, per-head q/k norms, an explicit head dim, a sliding window): the
window against a float64 NumPy reference, the refusals where an attention cannot take it, and every option on a
data x fsdp x tensor mesh (and, slow, a pipeline of 2 stages and ring attention over a context axis) giving one
device's losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models.attention import Local
from jaxtrain.models.llama import cached_attention
from jaxtrain.parallel.layout import resolve_auto
from jaxtrain.train import loop
from jaxtrain_testing import FAST


def numpy_window_attention(q, k, v, segments, window):
    """float64 causal GQA with a sliding window, one (batch, head, query) at a time: query i sees key j when
    i - window < j <= i and both are in the same segment."""
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros((b, s, h, d))
    for r in range(b):
        for hh in range(h):
            for i in range(s):
                keys = [j for j in range(s) if i - window < j <= i and segments[r, j] == segments[r, i]]
                logits = np.array([q[r, i, hh] @ k[r, j, hh // group] for j in keys]) / np.sqrt(d)
                p = np.exp(logits - logits.max())
                out[r, i, hh] = (p / p.sum()) @ v[r, keys, hh // group]
    return out


def test_sliding_window_attention_equals_a_float64_reference():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 13, 4, 8)), rng.normal(size=(2, 13, 2, 8)), rng.normal(size=(2, 13, 2, 8))
    segments = np.array([[0] * 13, [0] * 6 + [1] * 7])
    for window in (1, 4, 13):
        want = numpy_window_attention(q, k, v, segments, window)
        got = Local("xla", window=window)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(segments))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # the decoding path: queries at positions 9..12 over a cache holding positions 0..12 (and stale slots after)
    cache_k = np.concatenate([k, rng.normal(size=(2, 3, 2, 8))], axis=1)
    cache_v = np.concatenate([v, rng.normal(size=(2, 3, 2, 8))], axis=1)
    positions = np.broadcast_to(np.arange(9, 13), (2, 4))
    want = numpy_window_attention(q, k, v, np.zeros((2, 13), int), 4)[:, 9:]
    got = cached_attention(*(jnp.asarray(x, jnp.float32) for x in (q[:, 9:], cache_k, cache_v)),
                           jnp.asarray(positions), 4)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["model.sliding_window=0"], "model.sliding_window=0 must be > 0 (or null: full causal attention)"),
    (["model.sliding_window=64", "model.attention=triton", "model.head_dim=64"],
     "model.attention=triton has no sliding-window mask (model.sliding_window=64); use model.attention=pallas"),
])
def test_a_window_an_attention_cannot_take_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_auto_attention_keeps_a_kernel_with_a_window_on_gpus():
    """model.attention=auto on a GPU with a window: cuDNN (its sliding-window mask), or with document masking the
    Pallas flash kernel (the Triton-language one has no window mask), never a silent fall back to XLA's."""
    base = ["model.attention=auto", "model.dtype=bfloat16", "mesh.ici.fsdp=1", "model.sliding_window=32"]
    assert resolve_auto(load_config(None, base), "gpu", 1).model.attention == "cudnn"
    packed = load_config(None, [*base, "data.document_mask=true", "model.head_dim=64"])
    assert resolve_auto(packed, "gpu", 1).model.attention == "pallas"


@pytest.mark.parametrize("impl", ["pallas", "xla-entry"])
def test_the_window_kernels_equal_the_float64_reference(impl):
    """The Pallas flash kernel (interpreted; its float32 tiles of 32 over 40 tokens padded to 64, so the window's
    edge crosses tiles) and
    ``jax.nn.dot_product_attention`` with the arguments cuDNN gets (its XLA implementation: the same window
    convention) against the NumPy loop above; head dim 32, GQA 2."""
    from jaxtrain.models.attention import window_kwargs

    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 40, 4, 32)), rng.normal(size=(2, 40, 2, 32)), rng.normal(size=(2, 40, 2, 32))
    segments = np.array([[0] * 40, [0] * 19 + [1] * 21])
    x = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    for window in (1, 5, 17, 40):
        if impl == "pallas":
            got = Local("pallas", interpret=True, window=window)(*x, jnp.asarray(segments))
            want = numpy_window_attention(q, k, v, segments, window)
        else:  # no segments: cuDNN's entry takes none
            got = jax.nn.dot_product_attention(*x, implementation="xla", **window_kwargs(window))
            want = numpy_window_attention(q, k, v, np.zeros_like(segments), window)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


# Qwen3-shaped (q/k norms, head_dim 32 != d_model / heads) with Qwen2's q/k/v biases and a window shorter than the
# sequence: every option at once.
OPTIONS = ["model.qk_norm=true", "model.qkv_bias=true", "model.head_dim=32", "model.sliding_window=24",
           "model.n_layers=2", "data.seq_len=64", "train.global_batch=8", "train.steps=6", "train.warmup_steps=2",
           "train.eval_every=0"]


def _losses(tmp_path, n, *mesh):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", *FAST, *OPTIONS, *mesh])
    result = loop.train(cfg, devices=jax.devices()[:n])
    return np.array([result.losses[s] for s in range(1, 7)])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("one"), 1, "mesh.ici.fsdp=1")


@pytest.mark.parametrize("n, mesh", [
    (8, ["mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"]),
    pytest.param(4, ["mesh.ici.stage=2", "mesh.ici.fsdp=2", "train.microbatches=2"], marks=pytest.mark.slow),
    # ring attention: 64 tokens in 4 chunks of 16 and a window of 24, so some chunk pairs are wholly hidden
    pytest.param(4, ["mesh.ici.context=2", "mesh.ici.fsdp=2"], marks=pytest.mark.slow),
], ids=["data2_fsdp2_tensor2", "stage2_fsdp2", "context2_fsdp2"])
def test_every_option_on_a_mesh_gives_one_devices_losses(one_device, tmp_path, n, mesh):
    np.testing.assert_allclose(_losses(tmp_path, n, *mesh), one_device, rtol=1e-4)
    assert one_device[-1] < one_device[0]  # it trained


def test_the_parameter_count_includes_biases_and_norm_scales():
    from flax import nnx

    from jaxtrain.models.flops import count_params
    from jaxtrain.models.moe import make_model

    cfg = load_config(None, [*OPTIONS, "model.dtype=float32"])
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make_model(cfg.model, rngs=nnx.Rngs(0)))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    plain = load_config(None, [o for o in OPTIONS if "qk" not in o]).model
    m = cfg.model
    assert actual == count_params(m)["total"] == count_params(plain)["total"] + m.n_layers * 32 * (8 + 4 + 4 + 2)
