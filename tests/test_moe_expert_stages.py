"""The expert axis combined with pipeline stages (GPipe and 1F1B, virtual stages): each device keeps its own experts
inside the stages and the tokens travel to them (jaxtrain/parallel/pipeline.py ``loop_specs``,
jaxtrain/parallel/expert.py), the experts' gradients summed over the other batch axes only. The objective, its router
metrics and every parameter gradient, and the metrics of two compiled train steps, equal one device's with the same
microbatches (float32, dropless). Equality on one device is the reference: an expert's weights summed over the
expert axis as well (or not over fsdp) would double or halve its gradient, and an expert run on the wrong tokens
would change the loss."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_moe_pipeline import MOE_KEYS, SMALL, _assert_equal, _metrics_and_grads, _train_metrics

from jaxtrain.config import load_config
from jaxtrain.parallel.layout import Layout
from jaxtrain.parallel.pipeline import loop_specs
from jaxtrain_testing import FAST

LAYOUTS = {
    "stage2 x expert2 x fsdp2": ["mesh.ici.stage=2", "mesh.ici.expert=2", "mesh.ici.fsdp=2"],
    "stage2 x expert4": ["mesh.ici.stage=2", "mesh.ici.expert=4", "mesh.ici.fsdp=1"],
    "stage2 x expert2 x fsdp2, virtual 2, all_gather": ["mesh.ici.stage=2", "mesh.ici.expert=2", "mesh.ici.fsdp=2",
                                                        "model.n_layers=8", "train.virtual_stages=2",
                                                        "model.moe.dispatch=all_gather"],
    "stage2 x expert4, virtual 2": ["mesh.ici.stage=2", "mesh.ici.expert=4", "mesh.ici.fsdp=1", "model.n_layers=8",
                                    "train.virtual_stages=2"],
    # tensor stays with the partitioner inside the loop: the experts' width split by a nested shard_map over it
    "stage2 x expert2 x tensor2": ["mesh.ici.stage=2", "mesh.ici.expert=2", "mesh.ici.fsdp=1", "mesh.ici.tensor=2"],
}
SCHEDULES = {"gpipe": [], "1f1b": ["train.pipeline_schedule=1f1b"]}


def _one_device(overrides):
    sizes = [o for o in overrides if not o.startswith(("mesh.", "train.pipeline_schedule"))]
    return ["mesh.ici.fsdp=1", "train.accumulate=sharded", *sizes]


# The two layouts under both schedules; the other three under one each, the schedules taking turns (CI time).
CASES = [(n, s) for n in list(LAYOUTS)[:2] for s in SCHEDULES] + [
    ("stage2 x expert2 x fsdp2, virtual 2, all_gather", "1f1b"), ("stage2 x expert4, virtual 2", "gpipe"),
    ("stage2 x expert2 x tensor2", "1f1b")]


@pytest.mark.slow  # about a minute each on 2 cores
@pytest.mark.parametrize("layout, schedule", CASES)
def test_experts_over_stages_objective_and_gradients_equal_one_device(layout, schedule):
    overrides = [*LAYOUTS[layout], *SCHEDULES[schedule]]
    want = _metrics_and_grads(_one_device(overrides), 1)
    _assert_equal(_metrics_and_grads(overrides, 8), want)


def test_experts_stay_split_over_the_expert_axis_inside_the_stages():
    """The chunks enter the loop split over stage and, on the experts' dimension only, over expert (the router and
    the dense layers' weights gathered over the batch axes)."""
    cfg = load_config(None, [*FAST, *SMALL, *LAYOUTS["stage2 x expert4"]])
    layout = Layout.build(cfg, jax.devices()[:8])
    with layout.scope():
        blocks = nnx.state(nnx.eval_shape(lambda: layout.new_state(0).model).blocks)
    specs = loop_specs(blocks, layout)
    flat = {jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): s
            for p, s in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))}
    for name in ("moe.mlp.w_gate", "moe.mlp.w_up", "moe.mlp.w_down"):
        assert flat[name] == P(None, "stage", None, "expert", None, None), name
    assert flat["moe.mlp.router"] == P(None, "stage", None, None, None)
    assert flat["dense.mlp.gate.kernel"] == P(None, "stage", None, None, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_experts_over_stages_train_steps_equal_one_device(schedule):
    """Two compiled train steps on stage=2 x expert=4: the loss, router losses, load figures and gradient norm of
    each step equal one device's."""
    overrides = [*LAYOUTS["stage2 x expert4"], *SCHEDULES[schedule]]
    want = _train_metrics(_one_device(overrides), 1)
    got = _train_metrics(overrides, 8)
    for mine, ref in zip(got, want, strict=True):
        assert set(MOE_KEYS) <= set(mine)
        for key in ("loss", "grad_norm", *MOE_KEYS):
            np.testing.assert_allclose(mine[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert got[1]["loss"] != got[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_expert_bias_over_expert_stages_equals_one_device(schedule):
    """DeepSeek's expert-selection bias (observed state through the pipelines, models/sidestate.py) on stage=2 x
    expert=2 x fsdp=2: a large update rate moves the second step's routing; both steps' figures equal one device's,
    so the load the bias observes is the whole step's (not one device's tokens, nor counted twice)."""
    overrides = [*LAYOUTS["stage2 x expert2 x fsdp2"], *SCHEDULES[schedule], "model.moe.expert_bias=true",
                 "model.moe.bias_update_rate=0.5"]
    want = _train_metrics(_one_device(overrides), 1)
    got = _train_metrics(overrides, 8)
    for mine, ref in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", *MOE_KEYS):
            np.testing.assert_allclose(mine[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert got[1]["moe_max_load"] != got[0]["moe_max_load"]
