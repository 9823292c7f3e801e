"""Mixture-of-experts models end to end: parameters as the model creates them (shapes, logical axes, counts), the
train step on expert-parallel meshes against one device, training runs and their metrics, a checkpoint restored on
another expert layout, the routing-collapse warning and its gauges. The layer's arithmetic against NumPy:
test_reference_moe.py; bad ``model.moe`` input: test_bad_inputs.py."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.models.flops import count_params, train_flops_per_token
from jaxtrain.observe.moe import RoutingWatch, collapse_share
from jaxtrain.parallel.layout import Layout
from jaxtrain.train import loop
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST, hand_forward_flops_per_token, logged_losses

# 2 layers (one dense, one MoE: every=2), 8 experts of width 32, top 2; small enough to compile in seconds.
SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64",
         "data.seq_len=16", "train.global_batch=8", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.d_ff=32",
         "model.moe.every=2", "model.moe.aux_loss=0.01", "model.moe.z_loss=0.001"]
MESHES = {"expert=8": ["mesh.ici.fsdp=1", "mesh.ici.expert=8"],
          "expert=4 x fsdp=2": ["mesh.ici.fsdp=2", "mesh.ici.expert=4"],
          "expert=2 x data=2 x tensor=2": ["mesh.ici.fsdp=1", "mesh.ici.expert=2", "mesh.ici.data=2",
                                           "mesh.ici.tensor=2"]}
# Also composed with the context axis (ring attention; a device's part of each sequence is just its tokens) and with
# rematerialisation (the remat unit is a layer group).
MORE = {"expert=2 x context=2 x fsdp=2, remat full": ["mesh.ici.fsdp=2", "mesh.ici.expert=2", "mesh.ici.context=2",
                                                      "model.remat=full"],
        "fsdp=8, every device all experts": ["mesh.ici.fsdp=8"]}
MOE_KEYS = ("moe_balance_loss", "moe_z_loss", "moe_max_load", "moe_top_share", "moe_dropped")


def test_parameters_their_logical_axes_and_count(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}", *FAST, *SMALL, "model.n_layers=4", "model.moe.shared_experts=1",
                             "model.moe.shared_gate=true", "mesh.ici.fsdp=1"])
    layout = Layout.build(cfg, jax.devices()[:1])
    with layout.scope():
        model = nnx.eval_shape(lambda: layout.new_state(0).model)
    params = nnx.state(model, nnx.Param)
    found = {jax.tree_util.keystr(p, simple=True, separator="."): (v.shape, v.get_metadata().get("out_sharding"))
             for p, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))}
    moe = "blocks.moe.mlp."
    assert found[moe + "router"] == ((2, 32, 8), ("layers", "embed", None))
    assert found[moe + "w_gate"] == ((2, 8, 32, 32), ("layers", "experts", "embed", "expert_mlp"))
    assert found[moe + "w_up"] == ((2, 8, 32, 32), ("layers", "experts", "embed", "expert_mlp"))
    assert found[moe + "w_down"] == ((2, 8, 32, 32), ("layers", "experts", "expert_mlp", "embed"))
    assert found[moe + "shared.gate.kernel"] == ((2, 32, 32), ("layers", "embed", "mlp"))
    assert found[moe + "shared_gate"] == ((2, 32, 1), ("layers", "embed", None))
    assert found["blocks.dense.mlp.gate.kernel"] == ((2, 1, 32, 64), ("layers", "sublayers", "embed", "mlp"))
    assert sum(int(np.prod(shape)) for shape, _ in found.values()) == count_params(cfg.model)["total"]


def test_flops_count_active_experts():
    cfg = load_config(None, [*FAST, *SMALL])
    dense = load_config(None, [*FAST, *SMALL, "model.moe.experts=0"])
    m, seq = cfg.model, cfg.data.seq_len
    matmuls, attention = hand_forward_flops_per_token(dense.model, seq)
    # The MoE layer (one of the two) swaps its dense MLP for top_k experts of width 32 and the router.
    moe_mlp = 2 * (m.moe.top_k * 3 * m.d_model * m.moe.d_ff + m.d_model * m.moe.experts)
    expected = 3 * (matmuls + attention - 2 * 3 * m.d_model * m.d_ff + moe_mlp)
    assert train_flops_per_token(m, seq) == pytest.approx(expected, rel=1e-12)
    counts = count_params(m)
    assert counts["experts"] == m.moe.experts * 3 * m.d_model * m.moe.d_ff
    assert counts["total"] - counts["active"] == (m.moe.experts - m.moe.top_k) * 3 * m.d_model * m.moe.d_ff


def _two_steps(cfg, n):
    """Metrics of two train steps from the same initial state and batch on the first ``n`` devices."""
    step = step_lib.setup(cfg, jax.devices()[:n])
    train, _, _ = step.compile(with_eval=False)
    state = step.layout.init_state()
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size, step.layout.batch_shape, dtype=np.int32)
    out = []
    for _ in range(2):
        state, metrics = train(state, step.layout.to_device(batch))
        out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return out


@pytest.fixture(scope="module")
def one_device_steps():
    return _two_steps(load_config(None, [*FAST, *SMALL, "mesh.ici.fsdp=1"]), 1)


@pytest.mark.parametrize("name", [n if n == "expert=4 x fsdp=2" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in {**MESHES, **MORE}])
def test_train_step_on_expert_meshes_equals_one_device(one_device_steps, name):
    """The loss, router losses, load figures and gradient norm of two dropless steps (float32) equal one device's."""
    got = _two_steps(load_config(None, [*FAST, *SMALL, *{**MESHES, **MORE}[name]]), 8)
    for mine, ref in zip(got, one_device_steps):
        assert set(mine) == set(ref) and set(MOE_KEYS) <= set(mine)
        for key in ("loss", "grad_norm", *MOE_KEYS):
            np.testing.assert_allclose(mine[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert got[1]["loss"] != got[0]["loss"]  # the first update changed the model


STEPS = ["train.steps=6", "train.warmup_steps=1", "train.eval_every=0", "train.log_every=1"]


@pytest.mark.slow
def test_training_losses_and_metrics_on_expert_meshes(tmp_path):
    """Six training steps on the issue's three meshes: every logged loss within 1e-5 of one device's, the MoE
    figures in metrics.jsonl."""
    runs = {}
    for name, mesh in {"one device": ["mesh.ici.fsdp=1"], **MESHES}.items():
        cfg = load_config(None, [f"run.dir={tmp_path / name.replace(' ', '')}", *FAST, *SMALL, *STEPS, *mesh])
        loop.train(cfg, devices=jax.devices()[:1 if name == "one device" else 8])
        records = [json.loads(line) for line in open(tmp_path / name.replace(" ", "") / "metrics.jsonl")]
        runs[name] = records
    ref = runs.pop("one device")
    assert all(set(MOE_KEYS) <= set(r) for r in ref) and ref[-1]["loss"] < ref[0]["loss"]
    for name, records in runs.items():
        for mine, theirs in zip(records, ref, strict=True):
            for key in ("loss", *MOE_KEYS):
                np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-5, atol=1e-7, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_checkpoint_restores_on_another_expert_layout(tmp_path):
    """Saved at expert=4, resumed from step 2 at expert=2 x fsdp=2: steps 3 and 4 repeat the uninterrupted run's
    losses (the experts' arrays are resharded on restore)."""
    common = [f"run.dir={tmp_path}", *FAST, *SMALL, "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
              "train.log_every=1", "checkpoint.every=2", "checkpoint.async_save=false"]
    loop.train(load_config(None, [*common, "mesh.ici.fsdp=1", "mesh.ici.expert=4"]), devices=jax.devices()[:4])
    uninterrupted = logged_losses(tmp_path)
    resumed = loop.train(load_config(None, [*common, "mesh.ici.fsdp=2", "mesh.ici.expert=2", "checkpoint.resume=2"]),
                         devices=jax.devices()[:4])
    assert resumed.start_step == 2
    for step in (3, 4):
        np.testing.assert_allclose(resumed.losses[step], uninterrupted[step], rtol=1e-5)


class _Metrics:
    """The parts of jaxtrain.observe.metrics.PrometheusMetrics the watch uses: a registry and the base labels."""

    def __init__(self):
        import prometheus_client as prom

        self.registry, self.base = prom.CollectorRegistry(), {"run": "r", "process": "0", "host": "h"}


def test_routing_collapse_warns_once_per_sustained_collapse(capsys):
    pytest.importorskip("prometheus_client")
    cfg = load_config(None, [*FAST, *SMALL, "observe.moe_collapse_steps=3"])
    assert collapse_share(cfg) == pytest.approx((2 / 8 + 1) / 2)
    metrics = _Metrics()
    watch = RoutingWatch(cfg)
    figures = {"moe_balance_loss": 2.5, "moe_z_loss": 3.0, "moe_max_load": 3.6, "moe_dropped": 0.0}
    shares = [0.3, 0.9, 0.95, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9]  # a blip, then a collapse that lasts
    warned = [step for step, share in enumerate(shares, 1)
              if watch.report(step, {**figures, "moe_top_share": share}, metrics)]
    assert warned == [7] and watch.warnings == 1
    assert "routing collapse" in capsys.readouterr().err
    # with the self-balancing expert bias (DeepSeek-V3), the bias's update rate is what to raise
    biased = RoutingWatch(load_config(None, [*FAST, *SMALL, "observe.moe_collapse_steps=1", "model.moe.router=sigmoid",
                                             "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.002"]))
    said = biased.report(1, {**figures, "moe_top_share": 0.95}, _Metrics())
    assert said and "raise model.moe.bias_update_rate (now 0.002) or lower train.lr" in said
    sample = metrics.registry.get_sample_value
    assert sample("jaxtrain_moe_top_share", metrics.base) == 0.9
    assert sample("jaxtrain_moe_max_load", metrics.base) == 3.6
    assert sample("jaxtrain_moe_collapse_warnings_total", metrics.base) == 1
    assert RoutingWatch(load_config(None, FAST)).report(1, {"loss": 1.0}, _Metrics()) is None
