"""``model.moe.gemm``: the routed experts' grouped matmuls through jaxtrain's Pallas kernel (interpreted on CPU) give
the MoE train step's loss, router losses and gradients of ``jax.lax.ragged_dot`` (the xla gemm), on one device and
on an expert-parallel mesh; the kernel runs per device (a shard_map over every mesh axis); ``auto`` and bad choices
resolve or stop with one line. The kernel's own arithmetic against NumPy: test_grouped_matmul.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.errors import ConfigError
from jaxtrain.models import sidestate
from jaxtrain.models.experts import GroupedMatmul, local_experts
from jaxtrain.parallel.expert import resolve_gemm
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST, run_cli

# One dense and one MoE layer, 4 experts of width 32, top 2: the interpreted kernel stays quick.
SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64",
         "data.seq_len=16", "train.global_batch=4", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=32",
         "model.moe.every=2", "model.moe.z_loss=0.001"]
MESHES = {"one device": (["mesh.ici.fsdp=1"], 1), "expert=2 x fsdp=2": (["mesh.ici.fsdp=2", "mesh.ici.expert=2"], 4)}


def _objective_and_grads(cfg, n):
    """(metrics, gradients) of the train step's objective on a fixed batch, computed on the first ``n`` devices."""
    step = step_lib.setup(cfg, jax.devices()[:n])
    lay = step.layout
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)

    def run(state, words):
        model_def, params = nnx.split(nnx.merge(lay.graphdef, state).model, sidestate.DIFFERENTIATED)
        grad_fn = jax.value_and_grad(step._objective, has_aux=True)
        (_, metrics), grads = grad_fn(params, model_def, words, step._trained_tokens(words))
        return metrics, grads

    with lay.scope():
        lowered = jax.jit(run, in_shardings=(lay.state_sharding, lay.batch_sharding)).lower(
            lay.abstract_state, lay.abstract_batch())
        metrics, grads = lowered.compile()(lay.init_state(), lay.to_device(batch))
    return lowered.as_text(), lay.mesh.axis_names, jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(grads))


@pytest.mark.slow  # about 30 s each: the interpreted kernel
@pytest.mark.parametrize("mesh", list(MESHES))
def test_pallas_gemm_equals_ragged_dot(mesh):
    """Loss, router losses and every gradient with gemm=pallas equal gemm=xla's within float32 rounding."""
    overrides, n = MESHES[mesh]
    got = {g: _objective_and_grads(load_config(None, [*FAST, *SMALL, *overrides, f"model.moe.gemm={g}"]), n)
           for g in ("xla", "pallas")}
    xla_text, _, xla_metrics, xla_grads = got["xla"]
    pallas_text, axes, pallas_metrics, pallas_grads = got["pallas"]
    assert "call @_grouped_matmul" in pallas_text and "call @_grouped_matmul" not in xla_text  # the kernel, or not
    # per device: shard_map manual over every mesh axis (the xla gemm's over the axes that split tokens, experts); on
    # one device, whose axes all have size 1, jax emits no manual computation
    assert n == 1 or set(re.findall(r"manual_axes=\{([^}]*)\}", pallas_text)) == {", ".join(f'"{a}"' for a in axes)}
    for key in ("loss", "moe_balance_loss", "moe_z_loss"):
        np.testing.assert_allclose(pallas_metrics[key], xla_metrics[key], rtol=1e-6, err_msg=key)
    flat_x, flat_p = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (xla_grads, pallas_grads))
    assert [p for p, _ in flat_x] == [p for p, _ in flat_p]
    for (path, gx), (_, gp) in zip(flat_x, flat_p):
        scale = max(float(np.abs(gx).max()), 1e-30)
        np.testing.assert_allclose(gp / scale, gx / scale, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    expert_grads = [g for p, g in flat_x if "w_gate" in jax.tree_util.keystr(p)]
    assert expert_grads and all(np.abs(g).max() > 0 for g in expert_grads)  # the experts were trained


def test_experts_through_the_kernel_equal_ragged_dot():
    """One device's experts (sort, three grouped matmuls, combine) and their gradients: pallas against xla."""
    rng = np.random.default_rng(1)
    t, k, e, d, f = 24, 2, 4, 16, 32
    x = jnp.asarray(rng.normal(size=(2, t // 2, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e + 1, size=(2, t // 2, k)), jnp.int32)  # e: a dropped assignment
    weights = jnp.asarray(rng.uniform(size=(2, t // 2, k)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]

    def run(gmm):
        def loss(x, *ws):
            y = local_experts(x, ids, weights, *ws, gmm=gmm)
            return jnp.sum(y * jnp.cos(y)), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *ws)

    (_, y_ref), g_ref = run(GroupedMatmul("xla"))
    (_, y), g = run(GroupedMatmul("pallas", interpret=True))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(g_ref[1]).max()) > 0


def test_gemm_resolves_per_platform():
    assert resolve_gemm("auto", "gpu") == "pallas" and resolve_gemm("auto", "cpu") == "xla"
    assert resolve_gemm("pallas", "cpu") == "pallas"  # interpreted, as model.attention=pallas
    with pytest.raises(ConfigError, match="model.moe.gemm=triton does not run on cpu devices"):
        resolve_gemm("triton", "cpu")
    with pytest.raises(ConfigError, match="model.moe.gemm=pallas does not run on tpu"):
        resolve_gemm("pallas", "tpu")


def test_triton_gemm_on_cpu_stops_with_one_line(tmp_path):
    out = run_cli("train", "--config", "tiny-moe", f"run.dir={tmp_path / 'run'}", "model.moe.gemm=triton")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: model.moe.gemm=triton does not run on cpu devices: the triton kernel needs a CUDA GPU, pallas a GPU "
        "(or a CPU, interpreted); set model.moe.gemm=xla or auto"]
    assert not (tmp_path / "run").exists()
