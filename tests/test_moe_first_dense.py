"""``model.moe.first_dense`` (DeepSeek-V3's first_k_dense_replace): the first k layers dense, then the groups of
``model.moe.every``. The parameters it adds (shapes, logical axes, a count by hand), its forward against the same
layers built another way (one dense layer then one MoE layer is also ``every=2``'s one group: weights copied across,
the logits must agree), decoding through the cache against the full forward, a sharded train step against one
device's, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.models.flops import count_params
from jaxtrain.models.moe import make_model
from jaxtrain.parallel.layout import resolve_auto
from jaxtrain.train import loop
from jaxtrain_testing import FAST, run_cli

# d_model 32, d_ff 48 (the dense layers), 4 experts of 16 top 2 and a shared one; DeepSeek-style sigmoid groups.
SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48", "model.vocab_size=64",
         "model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=16", "model.moe.shared_experts=1",
         "model.moe.router=sigmoid", "model.moe.n_group=2", "model.moe.topk_group=1",
         "model.moe.routed_scaling_factor=2.5", "model.moe.expert_bias=true", "data.seq_len=16",
         "train.global_batch=8", "model.init_std=0.2"]


def _model_cfg(*overrides):
    return resolve_auto(load_config(None, [*FAST, *SMALL, *overrides]), "cpu").model


def _make(m, seed=0):
    with nnx.use_eager_sharding(False):
        return make_model(m, rngs=nnx.Rngs(seed))


def _leaves(model):
    state = nnx.state(model, nnx.Param)
    return {jax.tree_util.keystr(p, simple=True, separator="."): v
            for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))}


def test_parameters_their_logical_axes_and_count():
    m = _model_cfg("model.n_layers=3", "model.moe.first_dense=1")
    with nnx.use_eager_sharding(False):
        found = {k: (v.shape, v.get_metadata().get("out_sharding"))
                 for k, v in _leaves(nnx.eval_shape(lambda: make_model(m, rngs=nnx.Rngs(0)))).items()}
    assert found["first_dense.mlp.gate.kernel"] == ((1, 32, 48), ("sublayers", "embed", "mlp"))
    assert found["first_dense.attn.q.kernel"] == ((1, 32, 4, 8), ("sublayers", "embed", "heads", "head_dim"))
    assert found["blocks.moe.mlp.w_gate"] == ((2, 4, 32, 16), ("layers", "experts", "embed", "expert_mlp"))
    assert not any(k.startswith("blocks.dense") for k in found)  # every=1: no dense layers inside the groups
    # By hand: attention 2 x 32 x 8 x (4 + 2) = 3,072 and 2 norms of 32 a layer; the dense MLP 3 x 32 x 48 = 4,608;
    # an MoE MLP 4 experts + 1 shared of 3 x 32 x 16 = 7,680 and the router 32 x 4 = 128; embedding 64 x 32 (tied)
    # and the final norm.
    layer = 3_072 + 64
    want = (layer + 4_608) + 2 * (layer + 7_680 + 128) + 64 * 32 + 32
    assert sum(int(np.prod(shape)) for shape, _ in found.values()) == count_params(m)["total"] == want
    assert m.moe_layers == 2


def _copied_logits(tokens):
    """(logits of first_dense=1 every=1, of first_dense=0 every=2 with the same weights), 2 layers each: dense then
    MoE."""
    first = _make(_model_cfg("model.n_layers=2", "model.moe.first_dense=1"), 1)
    grouped = _make(_model_cfg("model.n_layers=2", "model.moe.every=2"), 2)
    src, dst = _leaves(first), _leaves(grouped)
    for name, var in dst.items():
        other = name.replace("blocks.dense.", "first_dense.")
        value = src[other][...]
        var[...] = value[None] if name.startswith("blocks.dense.") else value  # [G=1, every - 1 = 1, ...]
    assert set(src) == {n.replace("blocks.dense.", "first_dense.") for n in dst}
    bias = np.array([[0.3, -0.2, 0.1, 0.0]], np.float32)  # the selection bias too, nonzero: it picks experts
    first.blocks.moe.mlp.expert_bias[...] = bias
    grouped.blocks.moe.mlp.expert_bias[...] = bias
    return jax.jit(first)(tokens), jax.jit(grouped)(tokens)


def test_the_dense_layers_before_the_groups_equal_a_group_of_every_2():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)))
    a, b = _copied_logits(tokens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(jnp.std(a)) > 0.1  # not a degenerate, near-constant output


@pytest.mark.slow  # ~10 s on 2 cores; test_hf_deepseek's greedy generation covers the split cache in the default pass
def test_decoding_through_the_cache_equals_the_full_forward():
    m = _model_cfg("model.n_layers=3", "model.moe.first_dense=1")
    model = _make(m)
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)))
    full = jax.jit(model)(tok)
    cache = model.init_cache(2, 14)
    assert cache["k"].shape == (3, 2, 14, 2, 8)
    decode = jax.jit(lambda t, pos, c: model(t, positions=pos, cache=c))
    prefill, cache = decode(tok[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
    steps = [prefill]
    for i in range(8, 12):
        logits, cache = decode(tok[:, i:i + 1], jnp.full((2, 1), i), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=2e-5)
    assert cache["k"].shape == (3, 2, 14, 2, 8)


def _losses(tmp_path, n, *mesh):
    cfg = load_config(None, [f"run.dir={tmp_path}", *FAST, *SMALL, "model.n_layers=3", "model.moe.first_dense=1",
                             "data.source=synthetic", "train.steps=3", "train.warmup_steps=1", "train.eval_every=0",
                             *mesh])
    result = loop.train(cfg, devices=jax.devices()[:n])
    return np.array([result.losses[s] for s in (1, 2, 3)])


@pytest.mark.slow  # ~20-40 s on 2 cores
def test_an_expert_fsdp_mesh_gives_one_devices_losses(tmp_path):
    one = _losses(tmp_path / "one", 1, "mesh.ici.fsdp=1")
    mesh = _losses(tmp_path / "mesh", 4, "mesh.ici.fsdp=2", "mesh.ici.expert=2")
    np.testing.assert_allclose(mesh, one, rtol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.first_dense=4"], "model.moe.first_dense=4 must be between 0 and model.n_layers - 1 = 3"),
    (["model.moe.first_dense=1", "model.moe.every=2"],
     "model.n_layers - model.moe.first_dense = 3 is not a multiple of model.moe.every=2"),
    (["model.moe.first_dense=2", "mesh.ici.stage=2", "mesh.ici.fsdp=1", "train.microbatches=2"],
     "model.moe.first_dense=2 is not supported yet with pipeline stages (mesh stage=2)"),
])
def test_bad_values_exit_2_in_one_line(tmp_path, overrides, message):
    r = run_cli("train", f"run.dir={tmp_path}", *SMALL, "model.n_layers=4", *overrides)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
