"""model.reduce_dtype: the dtype of the projections' weight gradients, hence of their reduction over the batch axes.

"float32" leaves the forward values and the input gradients bit-identical to "compute" and gives the weight gradient
a NumPy float64 x^T g of the compute-dtype operands computes, to float32 accuracy (where "compute" is off by
bfloat16's rounding); XLA's partitioner then reduces float32 weight gradients where it reduced bfloat16 ones
(XLA:CPU's partitioned step; XLA:GPU's compiled one where a GPU compiler is installed); training with either setting,
and the float32 one on data 2 x fsdp 2 or one device, gives the same losses within bfloat16's tolerance."""

import glob
import importlib.util
import os
import tempfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.errors import ConfigError
from jaxtrain.models import precision
from jaxtrain.parallel.layout import Layout
from jaxtrain.train.step import Step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = ["model.dtype=bfloat16", "train.eval_batches=1", "data.threads=0"]
MESH = ["mesh.ici.data=2", "mesh.ici.fsdp=2", "train.global_batch=8"]


def _projection(kind: str, dtype, reduce_dtype: str):
    """(apply(params, x) -> y, params, x's shape, the kernel's name) of one projection as the decoder builds it."""
    rngs = nnx.Rngs(0)
    if kind == "linear":  # an MLP projection: x [b, s, 64] -> [b, s, 48]
        m = nnx.Linear(64, 48, use_bias=True, dtype=dtype, rngs=rngs)
        shape, name = (3, 8, 64), "kernel"
    elif kind == "general":  # attention's output projection: x [b, s, heads, head_dim] -> [b, s, 32]
        m = nnx.LinearGeneral((4, 16), 32, axis=(-2, -1), dtype=dtype, rngs=rngs)
        shape, name = (3, 8, 4, 16), "kernel"
    else:  # the tied output projection: x [b, s, 32] -> logits [b, s, vocab 40]
        m = nnx.Embed(40, 32, dtype=dtype, rngs=rngs)
        shape, name = (3, 8, 32), "embedding"
    precision.use_reduce_dtype(SimpleNamespace(reduce_dtype=reduce_dtype), m)
    graphdef, params = nnx.split(m)

    def apply(p, x):
        module = nnx.merge(graphdef, p)
        if kind != "tied":
            return module(x)
        return precision.attend(module, x) if reduce_dtype == "float32" else module.attend(x)

    return apply, params, shape, name


def _forward_and_grads(kind, dtype, reduce_dtype):
    """y, the kernel's gradient and x's gradient for a random x and cotangent; also the compute-dtype x and g."""
    apply, params, shape, name = _projection(kind, dtype, reduce_dtype)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    y, vjp = jax.vjp(jax.jit(apply), params, x)
    g = jnp.asarray(rng.standard_normal(y.shape), y.dtype)
    d_params, dx = vjp(g)
    return y, d_params[name][...], dx, x.astype(dtype), g, params[name][...]


@pytest.mark.parametrize("kind", ["linear", "general", "tied"])
def test_float32_weight_gradient_matches_float64_with_forward_and_input_gradient_unchanged(kind):
    y_c, dw_c, dx_c, x16, g16, w = _forward_and_grads(kind, jnp.bfloat16, "compute")
    y_f, dw_f, dx_f, _, _, _ = _forward_and_grads(kind, jnp.bfloat16, "float32")
    assert y_f.dtype == y_c.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y_f, np.float32), np.asarray(y_c, np.float32))
    np.testing.assert_array_equal(np.asarray(dx_f), np.asarray(dx_c))
    assert dw_f.dtype == dw_c.dtype == jnp.float32  # the parameter's dtype either way; what differs is the rounding
    # the reference: x^T g over every token, in float64, of the bfloat16 operands both settings multiply
    x64 = np.asarray(x16, np.float64).reshape(24, -1)  # 3 x 8 tokens
    g64 = np.asarray(g16, np.float64).reshape(24, -1)
    ref = x64.T @ g64  # [in, out]
    ref = ref.T if kind == "tied" else ref.reshape(w.shape)  # the table is [vocab, embed]
    scale = np.linalg.norm(ref)
    err_f = np.linalg.norm(np.asarray(dw_f, np.float64) - ref) / scale
    err_c = np.linalg.norm(np.asarray(dw_c, np.float64) - ref) / scale
    assert err_f < 1e-6  # float32 accumulation of 24 products each exact in float32
    assert err_c > 1e-4  # rounded to bfloat16 (2^-9 relative): what "float32" must not do


def test_weight_gradient_of_any_dimension_numbers_matches_numpy():
    """Batch axes and contractions out of order (x [b, s, i, j] . w [b, j, o, i] -> [b, s, o]): the weight gradient
    in w's own axis order, against a float64 einsum of the bfloat16 operands."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 4)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 4, 6, 3)), jnp.float32)
    dims = (((3, 2), (1, 3)), ((0,), (0,)))
    y, vjp = jax.vjp(lambda x, w: precision.float32_grad_dot(x, w, dims), x, w)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    dx, dw = vjp(g)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w.astype(jnp.bfloat16), g))
    np.testing.assert_allclose(np.asarray(y, np.float64), np.einsum("bsij,bjoi->bso", x64, w64), rtol=1e-2, atol=3e-2)
    ref = np.einsum("bsij,bso->bjoi", x64, g64)
    assert dw.shape == w.shape and dw.dtype == jnp.float32
    assert np.linalg.norm(np.asarray(dw, np.float64) - ref) / np.linalg.norm(ref) < 1e-6
    np.testing.assert_allclose(np.asarray(dx, np.float64), np.einsum("bso,bjoi->bsij", g64, w64), rtol=1e-2,
                               atol=3e-2)  # bfloat16 output


@pytest.mark.parametrize("kind", ["linear", "general", "tied"])
def test_float32_compute_changes_nothing(kind):
    compute, wide = (_forward_and_grads(kind, jnp.float32, rd) for rd in ("compute", "float32"))
    for a, b in zip(compute[:3], wide[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_projections_keep_their_dot_and_the_output_projection_takes_float32():
    """With model.fp8 the float8 dot computes the attention and MLP projections' weight gradients; the untied
    output projection, which FP8 does not take, gets the float32 one."""
    from jaxtrain.models.fp8 import Fp8Dot
    from jaxtrain.models.llama import Transformer

    cfg = load_config("tiny", [*BF16, "model.fp8=tensorwise", "model.reduce_dtype=float32",
                               "model.tie_embeddings=false", "mesh.ici.fsdp=1"])
    with Layout.build(cfg, jax.devices()[:1]).scope():
        model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    attn, mlp = model.blocks.attn, model.blocks.mlp
    for projection in (attn.q, attn.k, attn.v, attn.o, mlp.gate, mlp.up, mlp.down):
        assert isinstance(projection.dot_general, Fp8Dot)
    assert model.unembed.dot_general is precision.float32_grad_dot
    assert model.unembed.promote_dtype is precision.kernel_kept


def test_float32_reduce_dtype_needs_float32_parameters():
    with pytest.raises(ConfigError, match="model.reduce_dtype=float32 needs model.param_dtype=float32"):
        load_config("tiny", ["model.reduce_dtype=float32", "model.param_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="model.reduce_dtype.*'bfloat16'.*compute.*float32"):
        load_config("tiny", ["model.reduce_dtype=bfloat16"])


def _tool():
    spec = importlib.util.spec_from_file_location("collective_dtypes", os.path.join(REPO, "tools/collective_dtypes.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _partitioned_reductions(reduce_dtype: str) -> dict[tuple[str, str], int]:
    """{(kind, dtype): bytes} of the reducing collectives of tiny's bfloat16 train step on data 2 x fsdp 2, as
    XLA's SPMD partitioner emits them. XLA:CPU widens every 16-bit all-reduce to float32 afterwards
    (its all-reduce-promotion pass), so the program it finally runs cannot show the dtype: the partitioner's output,
    dumped during the compile, is read instead (the LLVM back end at its cheapest: only the HLO matters here)."""
    cfg = load_config("tiny", [*BF16, *MESH, f"model.reduce_dtype={reduce_dtype}"])
    step = Step(Layout.build(cfg, jax.devices()[:4]))
    lay = step.layout
    options = {"xla_dump_hlo_pass_re": "spmd-partitioning", "xla_backend_optimization_level": 0,
               "xla_llvm_disable_expensive_passes": True}
    with tempfile.TemporaryDirectory() as tmp, lay.scope():
        jax.jit(step.train_step, in_shardings=(lay.state_sharding, lay.batch_sharding)).lower(
            lay.abstract_state, lay.abstract_batch()).compile(compiler_options={"xla_dump_to": tmp, **options})
        [path] = glob.glob(os.path.join(tmp, "*jit_train_step*after_spmd-partitioning*.txt"))
        with open(path) as f:
            found = _tool().bytes_by_dtype(f.read(), 4)
    return {key: n for key, n in found.items() if key[0] in ("all-reduce", "reduce-scatter") and key[1] != "pred"}


@pytest.mark.slow  # 8-10 s: the default pass keeps the float64 checks of the weight gradient itself
def test_the_partitioner_reduces_float32_weight_gradients_under_float32():
    """XLA:CPU's partitioner all-reduces (it emits no reduce-scatter here) every weight gradient over data x fsdp:
    bfloat16 ones under "compute"; under "float32" the same arrays in float32 and no 16-bit reduction left."""
    compute, wide = _partitioned_reductions("compute"), _partitioned_reductions("float32")
    assert compute.get(("all-reduce", "bf16"), 0) > 0
    assert {dtype for _, dtype in wide} == {"f32"}
    assert {kind for kind, _ in compute} == {kind for kind, _ in wide} == {"all-reduce"}
    # the same arrays, each bfloat16 one now twice as wide
    assert wide[("all-reduce", "f32")] == compute[("all-reduce", "f32")] + 2 * compute[("all-reduce", "bf16")]


@pytest.mark.slow
def test_xla_gpu_reduce_scatters_float32_weight_gradients_under_float32():
    """XLA:GPU's own compile (deviceless, 4 H100s, data 2 x fsdp 2): the FSDP reduce-scatters and data all-reduces
    move bfloat16 weight gradients under "compute", the same arrays in float32 under "float32"; the all-gathers
    (the forward's bfloat16 weights) do not change."""
    from jaxtrain.planner.xla_gpu import deviceless

    compiler, why = deviceless.find_compiler()
    if compiler is None:
        pytest.skip(f"no XLA:GPU compiler ({why}); docs/planning.md says how to install one")
    found = {}
    for rd in ("compute", "float32"):
        cfg = load_config("tiny", [*BF16, *MESH, f"model.reduce_dtype={rd}"])
        with tempfile.TemporaryDirectory() as tmp:
            hlo = os.path.join(tmp, "step.hlo")
            deviceless.compile_layout(compiler, cfg, "h100", 1, 4, hlo_path=hlo)
            with open(hlo) as f:
                found[rd] = {k: n for k, n in _tool().bytes_by_dtype(f.read(), 4).items() if k[1] != "pred"}
    compute, wide = found["compute"], found["float32"]
    assert compute[("reduce-scatter", "bf16")] > 0 and compute[("all-reduce", "bf16")] > 0
    assert not [k for k in wide if k[0] != "all-gather" and k[1] != "f32"]
    for kind in ("reduce-scatter", "all-reduce"):
        assert wide[(kind, "f32")] == compute.get((kind, "f32"), 0) + 2 * compute[(kind, "bf16")]
    assert {k: n for k, n in wide.items() if k[0] == "all-gather"} == \
        {k: n for k, n in compute.items() if k[0] == "all-gather"}


def _losses(tmp_path, name, overrides, devices):
    from jaxtrain.train import loop

    cfg = load_config("tiny", [*BF16, *overrides, "train.global_batch=8", "train.steps=50", "train.eval_every=0",
                               f"run.dir={tmp_path / name}"])
    result = loop.train(cfg, devices=jax.devices()[:devices])
    return np.array([result.losses[s] for s in range(1, 51)])


@pytest.mark.slow
def test_training_losses_agree_with_either_reduce_dtype(tmp_path):
    compute = _losses(tmp_path, "compute", [*MESH, "model.reduce_dtype=compute"], 4)
    wide = _losses(tmp_path, "float32", [*MESH, "model.reduce_dtype=float32"], 4)
    one = _losses(tmp_path, "one", ["mesh.ici.fsdp=1", "model.reduce_dtype=float32"], 1)
    assert compute[0] == wide[0]  # the same parameters and a bit-identical forward
    assert not np.array_equal(compute, wide)  # the weight gradients, and so the later steps, do differ
    # Early on the runs differ by the weight gradients' rounding (2^-9 relative, float32 sums on four devices or
    # one) carried through AdamW's step: far below one bfloat16 ulp of the loss (2^-8 relative; measured 1.5e-5
    # between the settings, 2.7e-5 between four devices and one, over the first 10 steps).
    np.testing.assert_allclose(wide[:10], compute[:10], rtol=5e-4)
    np.testing.assert_allclose(wide[:10], one[:10], rtol=5e-4)
    # Past ~20 steps at this learning rate the tiny bfloat16 model amplifies any difference (the same setting on
    # four devices and on one differs by up to 5% at a single step), so the runs are compared on where they end:
    # the mean loss of the last 10 steps (measured within 0.51% of each other).
    for other in (compute, one):
        assert abs(wide[-10:].mean() / other[-10:].mean() - 1) < 1e-2
    assert compute[-1] < compute[0] and wide[-1] < wide[0]
