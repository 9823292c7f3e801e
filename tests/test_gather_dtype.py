"""train.gather_dtype: unreduced accumulation gathers the parameters the model casts at use in the compute dtype.
Casting them first changes no value (loss and gradients bit-identical, dense and MoE, bfloat16); XLA:GPU's compiled
step (where a GPU compiler is installed) gathers those parameters in 2 bytes and the embedding in 4 (counted by hand
from the parameter shapes); training with either setting gives the same losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.models import precision, sidestate
from jaxtrain.parallel.layout import Layout
from jaxtrain.train.step import Step

BF16 = ["model.dtype=bfloat16", "train.eval_batches=1", "data.threads=0"]


def _params(layout):
    train_state = nnx.merge(layout.graphdef, layout.init_state())
    return nnx.split(train_state.model, sidestate.DIFFERENTIATED)


@pytest.mark.parametrize("name, extra", [
    ("tiny", ["model.qk_norm=true", "model.qkv_bias=true", "model.tie_embeddings=false"]),
    pytest.param("tiny-moe", [], marks=pytest.mark.slow),
    # FP8: the amax histories ride with the parameters and stay float32, and gather_dtype keeps every parameter
    # float32 (precision.gather_dtype: for FP8 runs it would change nothing either way)
    pytest.param("tiny", ["model.fp8=delayed"], marks=pytest.mark.slow),
])
def test_casting_first_changes_no_value(name, extra):
    layout = Layout.build(load_config(name, [*BF16, "mesh.ici.fsdp=1", *extra]), jax.devices()[:1])
    step = Step(layout)
    model_def, params = _params(layout)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, layout.batch_shape).astype(np.int32))
    def float32(state, kind):
        leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return {jax.tree_util.keystr(p) for p, v in leaves if isinstance(v, kind) and v.value.dtype == jnp.float32}

    dtype = precision.gather_dtype(layout.cfg.model)
    assert dtype == (jnp.float32 if "model.fp8=delayed" in extra else jnp.bfloat16)
    narrow = precision.narrowed(params, dtype)
    kept = {k for k in float32(params, nnx.Param) if dtype == jnp.float32 or "'router'" in k or "'embedding'" in k}
    assert float32(narrow, nnx.Param) == kept
    side = float32(params, nnx.Variable) - float32(params, nnx.Param)  # FP8 amax histories, the expert bias
    assert float32(narrow, nnx.Variable) - float32(narrow, nnx.Param) == side
    with layout.scope():
        loss_and_grads = jax.jit(jax.value_and_grad(
            lambda p: step._loss(p, model_def, batch, step._trained_tokens(batch))))
        loss, grads = loss_and_grads(params)
        loss_n, grads_n = loss_and_grads(narrow)
    assert float(loss) == float(loss_n)
    for g, g_n in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_n)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_n, np.float32))


MESH = ["mesh.ici.data=2", "mesh.ici.fsdp=2", "train.microbatches=2", "train.global_batch=8"]


def _gathered(gather_dtype, compiler):
    """(XLA:GPU's all-gather bytes by dtype of one step on 4 H100s, the layout) for ``train.gather_dtype``."""
    import importlib.util
    import os
    import tempfile

    from jaxtrain.planner.xla_gpu import deviceless

    tool_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools/collective_dtypes.py")
    spec = importlib.util.spec_from_file_location("collective_dtypes", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg = load_config("tiny", [*BF16, *MESH, f"train.gather_dtype={gather_dtype}"])
    with tempfile.TemporaryDirectory() as tmp:
        hlo = os.path.join(tmp, "step.hlo")
        deviceless.compile_layout(compiler, cfg, "h100", 1, 4, hlo_path=hlo)
        with open(hlo) as f:
            found = tool.bytes_by_dtype(f.read(), 4)
    layout = Layout.build(cfg, jax.devices()[:4])
    return {dtype: n for (kind, dtype), n in found.items() if kind == "all-gather"}, layout


@pytest.mark.slow
def test_the_pre_loop_all_gather_moves_the_compute_dtype_on_xla_gpu():
    """XLA:GPU's own compile (deviceless; XLA:CPU moves the cast behind the gather and widens 16-bit collectives,
    so only the GPU program can show it): with ``compute`` the gather moves 2 bytes an element but the embedding's,
    with ``float32`` 4 bytes each."""
    from jaxtrain.planner.xla_gpu import deviceless

    compiler, why = deviceless.find_compiler()
    if compiler is None:
        pytest.skip(f"no XLA:GPU compiler ({why}); docs/planning.md says how to install one")
    narrow, layout = _gathered("compute", compiler)
    wide, _ = _gathered("float32", compiler)
    # every parameter sharded over fsdp is gathered once per step (norm scales are replicated: nothing to gather)
    sizes = {jax.tree_util.keystr(p): leaf.size for p, leaf in jax.tree_util.tree_leaves_with_path(
        layout.abstract_params) if "fsdp" in str(leaf.sharding.spec)}
    embedding = sum(n for k, n in sizes.items() if "'embedding'" in k)
    total = sum(sizes.values())
    assert embedding and total > embedding
    assert wide == {"f32": 4 * total}
    assert narrow == {"bf16": 2 * (total - embedding), "f32": 4 * embedding}


@pytest.mark.slow
def test_training_losses_equal_with_either_gather_dtype(tmp_path):
    from jaxtrain.train import loop

    losses = []
    for gather in ("compute", "float32"):
        cfg = load_config("tiny", [*BF16, *MESH, f"train.gather_dtype={gather}", "train.steps=50",
                                   "train.eval_every=0", f"run.dir={tmp_path / gather}"])
        result = loop.train(cfg, devices=jax.devices()[:4])
        losses.append(np.array([result.losses[s] for s in range(1, 51)]))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-2)  # bfloat16 tolerance
    assert losses[0][-1] < losses[0][0]
