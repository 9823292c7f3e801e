"""Sharded training is proven by comparing against the unsharded run on the same inputs."""

import json

import jax
import numpy as np
import pytest

from jaxtrain.train import loop
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST, MESHES, hand_forward_flops_per_token

STEPS = ["train.steps=8", "train.warmup_steps=2", "train.eval_every=0"]


def _losses(make_config, overrides, n_devices):
    cfg = make_config(*STEPS, *overrides)
    result = loop.train(cfg, devices=jax.devices()[:n_devices])
    return np.array([result.losses[s] for s in range(1, 9)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from jaxtrain.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path_factory.mktemp('ref')}", *FAST, *STEPS, "mesh.ici.fsdp=1"])
    result = loop.train(cfg, devices=jax.devices()[:1])
    return np.array([result.losses[s] for s in range(1, 9)])


# Layouts whose parts the others already cover (data parallelism alone; tensor with fsdp or data; the dcn device
# order, also in test_mesh) run in the slow pass, to keep the default suite near 10 minutes on 2 cores.
SLOW_MESHES = {"data=8", "fsdp=4,tensor=2", "data=2,tensor=4", "dcn data=2 x ici fsdp=4"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MESHES else n for n in MESHES])
def test_losses_match_single_device(make_config, reference, name, tmp_path):
    losses = _losses(make_config, MESHES[name], 8)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    assert losses[-1] < losses[0]  # it trained
    # Per-device figures divide by the 8 devices (the one-device run in test_train_loop cannot tell).
    cfg = make_config()
    tokens = cfg.train.global_batch * cfg.data.seq_len
    matmuls, attention = hand_forward_flops_per_token(cfg.model, cfg.data.seq_len)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 8]
    for r in records:
        assert r["tokens_per_second_per_device"] == pytest.approx(tokens / r["step_seconds"] / 8, rel=1e-9)
        assert r["tflops_per_device"] == pytest.approx(3 * (matmuls + attention) * tokens / r["step_seconds"] / 8e12,
                                                       rel=1e-9)


# Slow pass: both accumulation modes' numbers are checked against a hand-written AdamW (test_reference_optim) by
# default.
@pytest.mark.slow
@pytest.mark.parametrize("accumulate", ["unreduced", "sharded"])
def test_gradient_accumulation_matches_one_big_batch(make_config, reference, accumulate):
    losses = _losses(make_config, ["train.microbatches=4", "mesh.ici.data=2", "mesh.ici.fsdp=2",
                                   f"train.accumulate={accumulate}"], 4)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)


def _shard_shapes(tree):
    return jax.tree.map(lambda x: x.addressable_shards[0].data.shape, tree)


def test_parameters_and_optimizer_state_are_sharded_as_the_rules_say(make_config):
    cfg = make_config("mesh.ici.fsdp=4", "mesh.ici.tensor=2")
    trainer = step_lib.setup(cfg, jax.devices()[:8])
    state = trainer.layout.init_state()
    m = cfg.model
    params = state["model"]
    L, E, V, F, H, K, D = m.n_layers, m.d_model, m.vocab_size, m.d_ff, m.n_heads, m.n_kv_heads, m.resolved_head_dim
    expected = {
        ("embed", "embedding"): (V // 2, E // 4),  # (vocab: tensor, embed: fsdp)
        ("blocks", "mlp", "gate", "kernel"): (L, E // 4, F // 2),
        ("blocks", "mlp", "down", "kernel"): (L, F // 2, E // 4),
        ("blocks", "attn", "q", "kernel"): (L, E // 4, H // 2, D),
        ("blocks", "attn", "k", "kernel"): (L, E // 4, K // 2, D),
        ("blocks", "attn", "o", "kernel"): (L, H // 2, D, E // 4),
        ("blocks", "attn_norm", "scale"): (L, E),
    }
    opt_state = state["opt"]["opt_state"]
    # adamw's first and second moments mirror the parameter tree: find them by path suffix.
    def names(path):
        keys = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        return tuple(k for k in keys if k not in (".value", "value"))

    flat_opt = {names(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]}
    for path, shard in expected.items():
        leaf = params
        for k in path:
            leaf = leaf[k]
        assert leaf[...].addressable_shards[0].data.shape == shard, path
        moments = [v for p, v in flat_opt.items() if p[-len(path):] == path]
        assert len(moments) == 2, (path, list(flat_opt)[:5])  # mu and nu
        for mom in moments:
            assert mom.addressable_shards[0].data.shape == shard, ("opt", path)


def test_fsdp8_holds_an_eighth_of_the_embedding_per_device(make_config):
    cfg = make_config("mesh.ici.fsdp=8")
    state = step_lib.setup(cfg, jax.devices()[:8]).layout.init_state()
    table = state["model"]["embed"]["embedding"][...]
    assert {s.data.shape for s in table.addressable_shards} == {(cfg.model.vocab_size, cfg.model.d_model // 8)}
    assert len({s.device for s in table.addressable_shards}) == 8


@pytest.mark.parametrize("remat", ["full", pytest.param("save_matmuls", marks=pytest.mark.slow)])
def test_rematerialisation_does_not_change_the_numbers(make_config, reference, remat):
    losses = _losses(make_config, [f"model.remat={remat}", "mesh.ici.fsdp=2"], 2)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


@pytest.mark.slow
def test_bfloat16_compute_with_float32_parameters_trains(make_config, reference):
    cfg = make_config(*STEPS, "model.dtype=bfloat16", "mesh.ici.fsdp=1")
    trainer = step_lib.setup(cfg, jax.devices()[:1])
    assert trainer.cfg.model.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(trainer.layout.abstract_state["model"])} == {np.dtype("float32")}
    result = loop.train(cfg, devices=jax.devices()[:1])
    losses = np.array([result.losses[s] for s in range(1, 9)])
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    # bfloat16 matmuls track float32 closely over the first steps (measured: within 6e-4 of the loss for steps
    # 1-5). Step 6 alone is 2.1% off here (jax 0.10.2, CPU), steps 7 and 8 0.26% and 0.20%: rounding differences
    # do not compound, so the end is held to 5e-3, not the 2e-2 that would let a loss computed in bfloat16 through.
    np.testing.assert_allclose(losses[:5], reference[:5], rtol=2e-3)
    np.testing.assert_allclose(losses[6:], reference[6:], rtol=5e-3)
    assert abs(losses[5] / reference[5] - 1) < 3e-2
