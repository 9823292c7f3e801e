"""MoE models over pipeline stages (GPipe and 1F1B): the pipelined objective, its router-loss metrics and every
parameter gradient equal the unpipelined step's with the same microbatches on one device, whose router losses come
from each microbatch's own statistics over all its MoE layers, each counting 1 / microbatches
(jaxtrain/train/step.py). With the expert axis as well: tests/test_moe_expert_stages.py."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.models import sidestate
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST

# 4 layers as 2 groups (dense, MoE: every=2), one group per stage; 8 experts of width 32, top 2, dropless, float32.
# Router-loss weights far above the defaults, so that a wrong router statistic moves the gradients visibly.
SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4", "model.d_ff=64",
         "data.seq_len=16", "train.global_batch=8", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.d_ff=32",
         "model.moe.every=2", "model.moe.aux_loss=0.5", "model.moe.z_loss=0.05", "train.microbatches=2"]
MOE_KEYS = ("moe_balance_loss", "moe_z_loss", "moe_max_load", "moe_top_share", "moe_dropped")
LAYOUTS = {
    "stage2 x fsdp4": ["mesh.ici.stage=2", "mesh.ici.fsdp=4"],
    "stage2 x data2 x tensor2, virtual 2, remat full": ["mesh.ici.stage=2", "mesh.ici.data=2", "mesh.ici.fsdp=1",
                                                        "mesh.ici.tensor=2", "model.n_layers=8",
                                                        "train.virtual_stages=2", "model.remat=full"],
    "stage4 x fsdp2, shared experts, capacity 1.0": ["mesh.ici.stage=4", "mesh.ici.fsdp=2", "model.n_layers=8",
                                                     "train.microbatches=4", "train.global_batch=16",
                                                     "model.moe.shared_experts=1", "model.moe.capacity_factor=1.0"],
    "1f1b stage2 x fsdp4": ["mesh.ici.stage=2", "mesh.ici.fsdp=4", "train.pipeline_schedule=1f1b"],
    "1f1b stage2 x data2 x tensor2, virtual 2, remat full": ["mesh.ici.stage=2", "mesh.ici.data=2", "mesh.ici.fsdp=1",
                                                             "mesh.ici.tensor=2", "model.n_layers=8",
                                                             "train.virtual_stages=2", "model.remat=full",
                                                             "train.pipeline_schedule=1f1b"],
    "1f1b stage4 x fsdp2, shared experts, capacity 1.0": ["mesh.ici.stage=4", "mesh.ici.fsdp=2", "model.n_layers=8",
                                                          "train.microbatches=4", "train.global_batch=16",
                                                          "model.moe.shared_experts=1",
                                                          "model.moe.capacity_factor=1.0",
                                                          "train.pipeline_schedule=1f1b"],
}
FAST_LAYOUT = "stage2 x fsdp4"


def _metrics_and_grads(overrides, n):
    """(metrics, gradients as a flat dict of float64 arrays) of one step's objective on the first ``n`` devices,
    from the layout's initial state and a fixed batch: pipelined when the config has stages, else accumulated over
    the same microbatches."""
    step = step_lib.setup(load_config(None, [*FAST, *SMALL, *overrides]), jax.devices()[:n])
    lay = step.layout
    batch = np.random.default_rng(0).integers(0, lay.cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)

    def objective(state, batch):
        model_def, params = nnx.split(nnx.merge(lay.graphdef, state).model, sidestate.DIFFERENTIATED)
        if lay.dims.stages > 1:
            one_f_one_b = lay.cfg.train.pipeline_schedule == "1f1b"
            objective = step._pipelined_1f1b_objective if one_f_one_b else step._pipelined_objective
            (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params, model_def, batch)
            return metrics, grads
        return step._accumulated_grads(params, model_def, batch)

    with lay.scope():
        metrics, grads = jax.jit(objective)(lay.init_state(), lay.to_device(batch))
    flat = {jax.tree_util.keystr(p): np.asarray(jax.device_get(g), np.float64)
            for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, flat


def _train_metrics(overrides, n):
    """The metrics of two train steps (compiled as training compiles them) from the initial state and one batch."""
    step = step_lib.setup(load_config(None, [*FAST, *SMALL, *overrides]), jax.devices()[:n])
    train, _, _ = step.compile(with_eval=False)
    state = step.layout.init_state()
    batch = np.random.default_rng(1).integers(0, step.cfg.model.vocab_size, step.layout.batch_shape, dtype=np.int32)
    out = []
    for _ in range(2):
        state, metrics = train(state, step.layout.to_device(batch))
        out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return out


def _assert_equal(got, want):
    (metrics, grads), (ref_metrics, ref_grads) = got, want
    assert set(metrics) == set(ref_metrics) == {"loss", *MOE_KEYS}
    for key in ref_metrics:
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-4, atol=1e-5 * np.abs(g).max(), err_msg=name)


@pytest.mark.parametrize("layout", [n if n == FAST_LAYOUT else pytest.param(n, marks=pytest.mark.slow)
                                    for n in LAYOUTS])
def test_pipelined_moe_objective_and_gradients_equal_one_device(layout):
    overrides = LAYOUTS[layout]
    sizes = [o for o in overrides if not o.startswith(("mesh.", "train.pipeline_schedule"))]
    want = _metrics_and_grads(["mesh.ici.fsdp=1", "train.accumulate=sharded", *sizes], 1)
    _assert_equal(_metrics_and_grads(overrides, 8), want)


@pytest.mark.slow
def test_router_losses_per_microbatch_differ_from_the_whole_batchs():
    """What the equality above pins down: the whole batch's statistics in one product give another balance loss
    than the mean of the microbatches' (so statistics mixed across microbatches would fail it)."""
    one = ["mesh.ici.fsdp=1", "train.accumulate=sharded"]
    per_microbatch = _metrics_and_grads(one, 1)[0]
    whole = _metrics_and_grads([*one, "train.microbatches=1"], 1)[0]
    assert abs(whole["moe_balance_loss"] / per_microbatch["moe_balance_loss"] - 1) > 1e-4


@pytest.mark.slow
def test_pipelined_moe_train_steps_equal_one_device():
    """Two compiled train steps: the logged loss, router losses, load figures and gradient norm equal one
    device's."""
    want = _train_metrics(["mesh.ici.fsdp=1", "train.accumulate=sharded"], 1)
    got = _train_metrics(LAYOUTS[FAST_LAYOUT], 8)
    for mine, ref in zip(got, want, strict=True):
        assert set(mine) == set(ref) and set(MOE_KEYS) <= set(mine)
        for key in ("loss", "grad_norm", *MOE_KEYS):
            np.testing.assert_allclose(mine[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert got[1]["loss"] != got[0]["loss"]
