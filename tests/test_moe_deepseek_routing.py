"""DeepSeek-V3 routing (model.moe.expert_bias, bias_update_rate, n_group, topk_group, routed_scaling_factor,
seq_aux_loss; docs/moe.md): the choice and weights against float64 NumPy written here from the paper's equations
and against transformers' DeepseekV3TopkRouter; the sequence-wise balance loss against NumPy; the bias update against
hand-worked loads; the bias through the train step (its load summed over microbatches, data-parallel groups and
pipeline stages, one device's values on sharded meshes, never touched by the optimizer, restored exactly on resume);
bad values exit 2. Expected values never come from jaxtrain's routing code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import MoEConfig, load_config
from jaxtrain.models import moe as moe_lib
from jaxtrain.models import routing
from jaxtrain.train import loop
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST, run_cli

DEEPSEEK = dict(experts=16, top_k=4, router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)


def np_choice(logits, bias, *, top_k, n_group, topk_group, sigmoid=True, normalize=True, scale=1.0):
    """DeepSeek-V3's gate in float64 from logits [T, E] and a bias [E]: (the chosen experts [T, k], best first;
    their weights [T, k]). Scores s = sigmoid(logits) (or softmax); experts chosen by s + b within the topk_group
    groups of highest top-2 sums; weights from s alone, normalised, times the scaling factor."""
    logits = np.asarray(logits, np.float64)
    if sigmoid:
        s = 1 / (1 + np.exp(-logits))
    else:
        z = np.exp(logits - logits.max(-1, keepdims=True))
        s = z / z.sum(-1, keepdims=True)
    t, e = s.shape
    choice = s + np.asarray(bias, np.float64)
    grouped = choice.reshape(t, n_group, e // n_group)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1) if e // n_group >= 2 else grouped[..., 0]
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, n_group), bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    masked = np.where(mask[..., None], grouped, -np.inf).reshape(t, e)
    experts = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(s, experts, axis=-1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return experts, w * scale


def np_seq_loss(logits, experts, routed, k):
    """Mean over sequences (with routed tokens) of DeepSeek-V3's sum_i f_i P_i, logits [B, S, E], experts [B, S, k],
    routed bool [B, S]: f_i = E / (k T) x (tokens choosing i), P_i = mean over tokens of s_i / sum_j s_j."""
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    sn = s / s.sum(-1, keepdims=True)
    e = s.shape[-1]
    losses = []
    for b in range(s.shape[0]):
        r = routed[b]
        t = r.sum()
        if t == 0:
            continue
        c = np.bincount(experts[b][r].ravel(), minlength=e)
        losses.append(np.sum(e / (k * t) * c * sn[b][r].mean(0)))
    return float(np.mean(losses))


def _route(logits, moe, bias=None, routed=None):
    """jaxtrain's routing of float32 logits [B, S, E] (x = logits, router = identity)."""
    e = logits.shape[-1]
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    return routing.route(jnp.asarray(logits, jnp.float32), jnp.eye(e), moe, None, routed, b)


CASES = {"sigmoid, bias, 4 groups keep 2, scale 2.5": (DEEPSEEK, True),
         "sigmoid, bias, no groups, not normalised": (dict(DEEPSEEK, n_group=1, topk_group=1, normalize=False), True),
         "softmax, groups, no bias": (dict(DEEPSEEK, router="softmax"), False),
         "sigmoid, 8 groups keep 3, top 6": (dict(DEEPSEEK, n_group=8, topk_group=3, top_k=6), True)}


@pytest.mark.parametrize("name", list(CASES))
def test_choice_and_weights_equal_numpy(name):
    kw, with_bias = CASES[name]
    moe = MoEConfig(**kw)
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 48, moe.experts)).astype(np.float32)
    bias = (rng.normal(size=moe.experts) * 0.3).astype(np.float32) if with_bias else np.zeros(moe.experts, np.float32)
    got, _ = _route(logits, moe, bias if with_bias else None)
    want_e, want_w = np_choice(logits.reshape(-1, moe.experts), bias, top_k=moe.top_k, n_group=moe.n_group,
                               topk_group=moe.topk_group, sigmoid=moe.router == "sigmoid", normalize=moe.normalize,
                               scale=moe.routed_scaling_factor)
    np.testing.assert_array_equal(np.asarray(got.experts).reshape(want_e.shape), want_e)
    np.testing.assert_allclose(np.asarray(got.weights).reshape(want_w.shape), want_w, rtol=2e-6)


def test_bias_steers_the_choice_only():
    """A bias of +10 on expert 5 puts it in every token's choice, weighted by its own unbiased score; the same logits
    without the bias mostly choose other experts."""
    moe = MoEConfig(experts=8, top_k=2, router="sigmoid", normalize=False)
    logits = np.random.default_rng(2).normal(size=(1, 32, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[5] = 10.0
    got, _ = _route(logits, moe, bias)
    experts, weights = np.asarray(got.experts), np.asarray(got.weights)
    assert np.all(experts[..., 0] == 5)
    np.testing.assert_allclose(weights[..., 0], 1 / (1 + np.exp(-logits[..., 5].astype(np.float64))), rtol=2e-6)
    plain, _ = _route(logits, moe)
    assert np.mean(np.asarray(plain.experts) == 5) < 0.5


def test_group_limit_excludes_a_better_expert_of_a_weaker_group():
    """Hand-worked, 2 groups of 4, keep 1, top 2: group 0's best two sum to 0.9 + 0.8 over group 1's 0.95 + 0.1,
    so expert 4 (0.95, the best single score) is out."""
    s = np.array([0.9, 0.8, 0.1, 0.1, 0.95, 0.1, 0.1, 0.1])
    logits = np.log(s / (1 - s)).astype(np.float32)[None, None]
    moe = MoEConfig(experts=8, top_k=2, router="sigmoid", n_group=2, topk_group=1, normalize=False)
    got, _ = _route(logits, moe)
    np.testing.assert_array_equal(np.asarray(got.experts)[0, 0], [0, 1])


def test_matches_transformers_deepseek_v3_gate():
    """transformers' DeepseekV3TopkRouter (random weights and correction bias, built from a config, no download):
    the same experts and weights (sets of experts: torch.topk(sorted=False) gives them in no set order)."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = DeepseekV3Config(hidden_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    gate = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(16, 24, generator=g) * 0.5)
        gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    x = torch.randn(2, 20, 24, generator=g)
    _, hf_w, hf_idx = gate(x)
    moe = MoEConfig(**DEEPSEEK, expert_bias=True)
    got, _ = routing.route(jnp.asarray(x.numpy()), jnp.asarray(gate.weight.detach().numpy().T), moe, None, None,
                           jnp.asarray(gate.e_score_correction_bias.numpy()))
    order = np.argsort(hf_idx.numpy(), axis=-1)
    want_e = np.take_along_axis(hf_idx.numpy(), order, -1)
    want_w = np.take_along_axis(hf_w.detach().numpy(), order, -1)
    mine_e, mine_w = np.asarray(got.experts).reshape(-1, 4), np.asarray(got.weights).reshape(-1, 4)
    mine_order = np.argsort(mine_e, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(mine_e, mine_order, -1), want_e)
    np.testing.assert_allclose(np.take_along_axis(mine_w, mine_order, -1), want_w, rtol=1e-5)


def test_sequence_wise_balance_loss_equals_numpy():
    """Per sequence of its routed tokens, averaged over sequences and layers, a fully padded sequence counted
    nowhere; the objective adds it weighted by seq_aux_loss alone."""
    moe = MoEConfig(**DEEPSEEK, expert_bias=True, seq_aux_loss=0.3, aux_loss=0.0)
    rng = np.random.default_rng(3)
    routed = np.ones((3, 24), bool)
    routed[1, 15:] = False
    routed[2] = False
    layers, want = [], []
    for scale in (0.5, 2.0):
        logits = (rng.normal(size=(3, 24, 16)) * scale).astype(np.float32)
        bias = (rng.normal(size=16) * 0.2).astype(np.float32)
        experts, _ = np_choice(logits.reshape(-1, 16), bias, top_k=4, n_group=4, topk_group=2)
        want.append(np_seq_loss(logits, experts.reshape(3, 24, 4), routed, 4))
        layers.append(_route(logits, moe, bias, jnp.asarray(routed))[1])
    stats = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    np.testing.assert_allclose(float(routing.seq_balance_loss(stats)), np.mean(want), rtol=2e-6)
    total, _ = moe_lib.objective(jnp.zeros(()), stats, moe)
    np.testing.assert_allclose(float(total), 0.3 * np.mean(want), rtol=2e-6)


def test_bias_update_against_hand_worked_loads():
    """Loads [6, 2, 4, 4] (mean 4): the busy expert's bias down by the rate, the idle one's up, the average ones
    kept; per layer, float32."""
    bias = np.array([[0.0, 0.5, -0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    load = np.array([[6, 2, 4, 4], [0, 0, 0, 12]], np.float32)
    got = np.asarray(routing.update_bias(jnp.asarray(bias), jnp.asarray(load), 0.01))
    want = np.array([[0 - np.float32(0.01), 0.5 + np.float32(0.01), -0.25, 0.0],
                     [np.float32(0.01), np.float32(0.01), np.float32(0.01), -np.float32(0.01)]], np.float32)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32


def test_the_bias_cotangent_is_the_load_of_counted_tokens():
    """The bias's "gradient" is the hand-counted choices of the counted tokens, whatever the loss's scale; nothing
    when the output's cotangent is zero (an idle pipeline iteration)."""
    s = np.array([[[0.9, 0.1, 0.5, 0.2], [0.1, 0.9, 0.8, 0.2], [0.3, 0.2, 0.1, 0.7]]], np.float32)  # [1, 3, 4]
    counted = jnp.asarray([[1.0, 1.0, 0.0]])
    sel = routing.Selection(top_k=2, n_group=1, topk_group=1)

    def f(bias, scale):
        top, _ = routing.biased_choice(jnp.asarray(s), bias, counted, sel)
        return scale * jnp.sum(top)

    # token 0 chooses 0, 2; token 1 chooses 1, 2; token 2 (not counted) 3, 0
    np.testing.assert_array_equal(jax.grad(f)(jnp.zeros(4), 7.0), [1.0, 1.0, 2.0, 0.0])
    np.testing.assert_array_equal(jax.grad(f)(jnp.zeros(4), 0.0), [0.0, 0.0, 0.0, 0.0])


# ------------------------------------------------------------------------------------------------ the train step
SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64",
         "data.seq_len=16", "train.global_batch=8", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.d_ff=32",
         "model.moe.every=1", "model.moe.router=sigmoid", "model.moe.expert_bias=true", "model.moe.n_group=4",
         "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5", "model.moe.seq_aux_loss=0.01",
         "model.moe.aux_loss=0", "model.moe.bias_update_rate=0.01", "train.warmup_steps=1",
         "train.accumulate=sharded"]
MOE_KEYS = ("moe_balance_loss", "moe_z_loss", "moe_max_load", "moe_top_share", "moe_dropped")


def _biases(state) -> np.ndarray:
    found = [np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state) if "expert_bias" in
             jax.tree_util.keystr(p)]
    assert len(found) == 1
    return found[0]


def _steps(overrides, n, steps=2, state_edit=None):
    """[(metrics, the expert biases [G, E] after the step)] of ``steps`` train steps from the initial state on the
    first ``n`` devices, one fixed batch."""
    step = step_lib.setup(load_config(None, [*FAST, *SMALL, *overrides]), jax.devices()[:n])
    train, _, _ = step.compile(with_eval=False)
    state = step.layout.init_state()
    if state_edit is not None:
        state = state_edit(state)
    batch = np.random.default_rng(0).integers(0, step.cfg.model.vocab_size, step.layout.batch_shape, dtype=np.int32)
    out = []
    for _ in range(steps):
        state, metrics = train(state, step.layout.to_device(batch))
        out.append(({k: float(v) for k, v in jax.device_get(metrics).items()}, _biases(state)))
    return out, step, state


@pytest.mark.slow
def test_first_update_is_the_sign_of_the_whole_batchs_load():
    """After one step the bias is rate x sign(mean - load), load the initial model's choices over the whole batch
    (counted here from the model's own router statistics), the same whether the batch ran as one microbatch or
    two (the loads add up; a per-microbatch update would differ)."""
    cfg = load_config(None, [*FAST, *SMALL, "mesh.ici.fsdp=1"])
    step = step_lib.setup(cfg, jax.devices()[:1])
    state = step.layout.init_state()
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size, step.layout.batch_shape, dtype=np.int32)
    model = nnx.merge(step.layout.graphdef, state).model
    _, stats = model.forward_with_stats(jnp.asarray(batch[:, :-1]))
    load = np.asarray(stats.counts, np.float64)  # [G, E]
    assert load.sum() == 2 * 8 * 16 * 2  # G x rows x seq x top_k
    want = (0.01 * np.sign(load.mean(-1, keepdims=True) - load)).astype(np.float32)
    for micro in ("1", "2"):
        (_, bias), = _steps(["mesh.ici.fsdp=1", f"train.microbatches={micro}"], 1, steps=1)[0]
        np.testing.assert_allclose(bias, want, rtol=1e-6, atol=0, err_msg=f"microbatches={micro}")
    assert np.any(want != 0)


def _set_bias(state, value):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.full(x.shape, value, x.dtype) if "expert_bias" in jax.tree_util.keystr(p) else x, state)


def test_the_optimizer_leaves_the_bias_alone():
    """With bias_update_rate=0 and AdamW's weight decay on, a non-zero bias is exactly what it was after three steps
    that changed the parameters; the optimizer holds no state for it."""
    out, step, state = _steps(["mesh.ici.fsdp=1", "model.moe.bias_update_rate=0", "train.weight_decay=0.1"], 1,
                              steps=3, state_edit=lambda s: _set_bias(s, 0.25))
    for _, bias in out:
        np.testing.assert_array_equal(bias, np.full(bias.shape, 0.25, np.float32))
    assert out[2][0]["loss"] != out[0][0]["loss"]
    opt_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state["opt"])]
    assert opt_paths and not any("expert_bias" in p for p in opt_paths)


SHARDED = {"expert=2 x fsdp=2": (["mesh.ici.fsdp=2", "mesh.ici.expert=2"], 4),
           "expert=2 x data=2, microbatches 2": (["mesh.ici.fsdp=1", "mesh.ici.expert=2", "mesh.ici.data=2",
                                                  "train.microbatches=2"], 4),
           "stage=2 x fsdp=2 (GPipe), microbatches 2": (["mesh.ici.stage=2", "mesh.ici.fsdp=2",
                                                          "train.microbatches=2"], 4),
           "stage=2 x data=2 (1F1B), microbatches 2": (["mesh.ici.stage=2", "mesh.ici.fsdp=1", "mesh.ici.data=2",
                                                         "train.microbatches=2", "train.pipeline_schedule=1f1b"], 4)}


@pytest.mark.parametrize("name", [n if n == "expert=2 x fsdp=2" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SHARDED])
def test_sharded_losses_and_biases_equal_one_device(name):
    """Two steps (float32, dropless): loss, router figures and the biases after each step equal one device's with
    the same microbatches."""
    overrides, n = SHARDED[name]
    micro = [o for o in overrides if o.startswith("train.microbatches")]
    ref, _, _ = _steps(["mesh.ici.fsdp=1", *micro], 1)
    got, _, _ = _steps(overrides, n)
    for (mine, bias), (theirs, ref_bias) in zip(got, ref):
        for key in ("loss", "grad_norm", *MOE_KEYS):
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_array_equal(bias, ref_bias)
    assert np.any(got[1][1] != got[0][1])  # the second step moved the bias again


def _observed_load(overrides, n):
    """The expert bias's cotangent [G, E] (the step's observed load) of one step's objective on the first ``n``
    devices, from the initial state and the fixed batch, by the step's own path (pipelined, accumulated or one)."""
    from jaxtrain.models import sidestate

    step = step_lib.setup(load_config(None, [*FAST, *SMALL, *overrides]), jax.devices()[:n])
    lay = step.layout
    batch = np.random.default_rng(0).integers(0, lay.cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)

    def grads_of(state, batch):
        model_def, params = nnx.split(nnx.merge(lay.graphdef, state).model, sidestate.DIFFERENTIATED)
        if lay.dims.stages > 1:
            fn = step._pipelined_1f1b_objective if lay.cfg.train.pipeline_schedule == "1f1b" else \
                step._pipelined_objective
            return jax.grad(fn, has_aux=True)(params, model_def, batch)
        if lay.cfg.train.microbatches > 1:
            return step._accumulated_grads(params, model_def, batch)[1]
        return jax.grad(step._objective, has_aux=True)(params, model_def, batch, step._trained_tokens(batch))

    with lay.scope():
        grads = jax.jit(grads_of)(lay.init_state(), lay.to_device(batch))
    return _biases(grads), batch, step


@pytest.mark.parametrize("name", ["one device, microbatches 2",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in ("one device", *SHARDED))])
def test_observed_load_is_the_whole_batchs_count_on_every_layout(name):
    """What the step observes for the bias is each layer's choices over the whole global batch, counted once: the
    counts of the initial model's router on the whole batch, adding up to rows x seq x top_k per layer (a sum over
    groups or microbatches missed or repeated would scale it, which the sign of the update would hide)."""
    overrides, n = {"one device": ([], 1), "one device, microbatches 2": (["train.microbatches=2"], 1),
                    **SHARDED}[name]
    load, batch, step = _observed_load(["mesh.ici.fsdp=1", *overrides] if n == 1 else overrides, n)
    model = nnx.merge(step.layout.graphdef, step.layout.init_state()).model
    with step.layout.scope():
        _, stats = jax.jit(lambda m, t: m.forward_with_stats(t))(model, jnp.asarray(batch[:, :-1]))
    want = np.asarray(stats.counts)
    assert want.shape == (2, 8) and np.all(want.sum(-1) == 8 * 16 * 2)
    np.testing.assert_array_equal(load, want)


@pytest.mark.slow
def test_bias_restored_exactly_on_resume(tmp_path):
    """Four steps in one run, and two plus a resumed second call: the restored bias is the one saved at step 2 bit
    for bit, and the losses and the final biases equal the uninterrupted run's."""
    import orbax.checkpoint as ocp

    def cfg(run, steps):
        return load_config(None, [f"run.dir={tmp_path / run}", *FAST, *SMALL, "mesh.ici.fsdp=1", f"train.steps={steps}",
                                  "checkpoint.every=2", "checkpoint.async_save=false", "train.eval_every=0",
                                  "train.log_every=1"])

    one = jax.devices()[:1]
    full = loop.train(cfg("full", 4), devices=one)
    first = loop.train(cfg("resumed", 2), devices=one)

    def saved_bias(run, step):
        return _biases(ocp.PyTreeCheckpointer().restore(str(tmp_path / run / "checkpoints" / str(step) / "state")))

    from jaxtrain.checkpoint import format as ckpt
    ts = step_lib.setup(cfg("resumed", 4), one)
    state, start, _ = ckpt.restore(ckpt.choose_restore(ts.cfg, ts.layout.abstract_state), ts.layout.abstract_state,
                                   ts.layout.init_state)
    assert start == 2 and np.any(saved_bias("full", 2) != 0)
    np.testing.assert_array_equal(_biases(state), saved_bias("full", 2))
    resumed = loop.train(cfg("resumed", 4), devices=one)
    assert {**first.losses, **resumed.losses} == full.losses
    np.testing.assert_array_equal(saved_bias("resumed", 4), saved_bias("full", 4))


def _bias_variables(overrides):
    """{path: (shape, dtype, logical axes)} of the model's expert-bias variables, built abstractly."""
    from jaxtrain.parallel.layout import Layout

    layout = Layout.build(load_config(None, [*FAST, *overrides, "mesh.ici.fsdp=1"]), jax.devices()[:1])
    with layout.scope():
        model = nnx.eval_shape(lambda: layout.new_state(0).model)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {jax.tree_util.keystr(p, simple=True, separator="."): (v.shape, v.dtype, v.get_metadata()["out_sharding"],
                                                                   type(v))
            for p, v in leaves if "expert_bias" in jax.tree_util.keystr(p)}


def test_bias_is_float32_state_per_layer_and_absent_by_default():
    """model.moe.expert_bias: one float32 [G, E] ExpertBias (not an nnx.Param) under the MoE layers, even with
    bfloat16 parameters; without the option, none (the defaults leave routing as it was: the default run's step is
bit-identical to the one before these options, checked once by hand, see the commit)."""
    found = _bias_variables([*SMALL, "model.param_dtype=bfloat16"])
    assert found == {"blocks.moe.mlp.expert_bias": ((2, 8), jnp.float32, ("layers", None), routing.ExpertBias)}
    assert not issubclass(routing.ExpertBias, nnx.Param)
    assert _bias_variables(SMALL[:10]) == {}
    cfg = load_config(None, [*FAST, *SMALL[:10], "mesh.ici.fsdp=1"])
    m = cfg.model.moe
    assert (m.expert_bias, m.seq_aux_loss, m.n_group, m.topk_group, m.routed_scaling_factor) == (False, 0, 1, 1, 1.0)


BAD = {"groups not dividing the experts": (["model.moe.n_group=3"], "model.moe.n_group=3 does not divide"),
       "topk_group above n_group": (["model.moe.n_group=2", "model.moe.topk_group=3"],
                                    "model.moe.topk_group=3 must be between 1 and model.moe.n_group=2"),
       "top_k above the kept groups' experts": (["model.moe.n_group=4", "model.moe.topk_group=1", "model.moe.top_k=3"],
                                                "model.moe.top_k=3 is more than the 2 experts"),
       "one expert per group": (["model.moe.n_group=8", "model.moe.topk_group=4"], "leaves 1 expert per group"),
       "negative update rate": (["model.moe.bias_update_rate=-0.1"], "model.moe.bias_update_rate=-0.1 must be >= 0"),
       "zero scaling factor": (["model.moe.routed_scaling_factor=0"], "model.moe.routed_scaling_factor=0.0 must be"),
       "negative seq_aux_loss": (["model.moe.seq_aux_loss=-1"], "model.moe.seq_aux_loss=-1.0 must be >= 0")}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_routing_options_exit_2_with_one_line(tmp_path, name):
    overrides, expected = BAD[name]
    proc = run_cli("train", f"run.dir={tmp_path / 'run'}", "model.moe.experts=8", *overrides)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("error: ") and expected in lines[-1], lines[-1]
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert not (tmp_path / "run").exists()
