import os

import jax
import pytest
from flax import nnx

from jaxtrain.config import Config, ConfigError, config_warnings, dump_yaml, load_config
from jaxtrain.models.flops import count_params
from jaxtrain.models.moe import make_model
from jaxtrain.parallel.dims import cpu_devices_per_process
from jaxtrain.parallel.layout import resolve_auto
from jaxtrain_testing import REPO


def test_tiny_yaml_equals_builtin_defaults():
    assert load_config(os.path.join(REPO, "configs/tiny.yaml")) == Config()


def test_overrides_parse_yaml_values_and_merge_rules():
    cfg = load_config(None, ["train.steps=7", "train.lr=1e-3", "model.tie_embeddings=false",
                             "mesh.rules.embed=null", "mesh.rules.batch=[data]", "model.head_dim=32"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3 and cfg.model.tie_embeddings is False
    assert cfg.mesh.rules["embed"] is None and cfg.mesh.rules["batch"] == ["data"]
    assert cfg.mesh.rules["mlp"] == "tensor"  # untouched rules keep their defaults
    assert cfg.mesh.ici.fsdp == -1  # a partial override of mesh.ici keeps the other axes' defaults


def test_effective_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=11", "mesh.ici.data=2"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("override, message", [
    ("trian.steps=3", "did you mean 'train.steps'"),
    ("model.n_head=4", "did you mean 'model.n_heads'"),
    ("model.moe.expert_d_ff=8", "did you mean 'model.moe.d_ff'"),
    ("train.steps=ten", "train.steps='ten' must be an integer"),
    ("train.steps=0", "train.steps=0 must be > 0"),
    ("model.dtype=fp8", "choose one of auto, float32, bfloat16, float16"),
    ("model.remat=some", "choose one of none, full, save_matmuls"),
    ("mesh.ici.tensor=3", "model.n_heads=8 is not divisible by the tensor axis size 3"),
    ("train.global_batch=12", None),  # fine alone: 12 % 1 == 0
    ("data.source=/no/such.bin", "does not exist"),
    (f"data.source={os.path.join(REPO, 'README.md')}", "must be 'embedded', 'synthetic' or a .bin/.npy token file"),
    ("data.source=no-such-tokens", "data.source='no-such-tokens' does not exist (no file or directory of that name"),
    ("data.mixture=[{source: no/such, weight: 1}]", "source='no/such' does not exist"),
    ("mesh.rules.mlp=model", "unknown mesh axis"),
    ("mesh.ici.data=0", "mesh.ici.data=0 must be >= 1"),
])
def test_bad_values_name_the_value(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_batch_must_divide_over_data_parallel_axes():
    with pytest.raises(ConfigError, match="global_batch=12 .* not divisible by the data-parallel size 8"):
        load_config(None, ["train.global_batch=12", "mesh.ici.data=2", "mesh.ici.fsdp=4"])
    with pytest.raises(ConfigError, match="two_axes|only one mesh axis may be -1"):
        load_config(None, ["mesh.ici.data=-1"])


def test_the_mesh_against_the_devices_is_named_before_the_batch_it_fails_to_divide():
    """fsdp=3 on 8 devices: the mesh not covering the devices is the mistake, not the batch of 16 over 3 (which the
    fixed axes alone would name first). The device count is known before JAX starts on the CPU platform."""
    from jaxtrain.cluster.distributed import cpu_device_count

    overrides = ["runtime.cpu_devices=8", "mesh.ici.fsdp=3"]
    with pytest.raises(ConfigError, match="data-parallel size 3"):  # no device count: the fixed axes' check
        load_config(None, overrides)
    with pytest.raises(ConfigError, match=r"the mesh \(ici.fsdp=3\) has 3 devices but 8 are available"):
        load_config(None, overrides, num_devices=lambda cfg: cpu_device_count(cfg, {"JAX_PLATFORMS": "cpu"}))
    # the -1 axis filled from the devices: fsdp 8 over data 2 is 16 rows per step, not divisible into 12
    with pytest.raises(ConfigError, match="global_batch=12 .* data-parallel size 16"):
        load_config(None, ["train.global_batch=12", "mesh.ici.data=2", "mesh.ici.fsdp=-1"], num_devices=lambda c: 16)
    load_config(None, ["runtime.cpu_devices=6", "mesh.ici.fsdp=3", "mesh.ici.data=2", "train.global_batch=12"],
                num_devices=lambda cfg: cpu_device_count(cfg, {"JAX_PLATFORMS": "cpu"}))


def test_cpu_device_count_is_known_only_on_the_cpu_platform():
    from jaxtrain.cluster.distributed import cpu_device_count

    cfg = load_config(None, ["runtime.cpu_devices=4"])
    assert cpu_device_count(cfg, {"JAX_PLATFORMS": "cpu"}) == 4
    two = {"JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    assert cpu_device_count(cfg, two) == 8  # runtime.cpu_devices counts per process
    assert cpu_device_count(load_config(None, ["mesh.ici.fsdp=2", "mesh.dcn.data=2"]), two) == 4
    assert cpu_device_count(cfg, {"JAX_PLATFORMS": "cuda"}) is None  # GPUs: counted once JAX is up


def test_cpu_devices_default_to_the_fixed_mesh_axes():
    assert cpu_devices_per_process(load_config(None, [])) == 1
    assert cpu_devices_per_process(load_config(None, ["mesh.ici.data=2", "mesh.ici.tensor=2"])) == 4
    assert cpu_devices_per_process(load_config(None, ["runtime.cpu_devices=8"])) == 8


@pytest.mark.parametrize("name, millions", [("tiny", 0.82), ("125m", 123.6), ("1b", 1235.8), ("7b", 6738.4),
                                            ("70b", 68976.6), ("tiny-moe", 2.594), ("mixtral-8x7b", 46702.8),
                                            ("tiny-qwen3", 1.017), ("tiny-qwen3-moe", 2.795),
                                            ("tiny-deepseek-moe", 2.008),
                                            # by hand: tiny's 820,352 + 4 layers x 256 q/k/v biases; + an untied
                                            # output layer of 256 x 128; 32,896 + 4 x (49,408 attention with biases
                                            # + 256 norms + 2,048 router + 16 x 3 x 128 x 96 experts + 3 x 128 x 384
                                            # shared expert + 128 gate)
                                            ("tiny-qwen2.5", 0.821376), ("tiny-mistral", 0.853120),
                                            ("tiny-qwen2-moe", 3.189376),
                                            # 32,768 + 4 x 73,120 (MLA 72,704 + latent norms 160 + 2 norms) + a
                                            # dense MLP 3 x 128 x 384 + 3 x (16 x 3 x 128 x 64 experts + 3 x 128 x
                                            # 128 shared + 128 x 16 router) + 128
                                            ("tiny-deepseek-v3", 1.806080),
                                            # released models: hand counts from their config.json, the published totals
                                            ("qwen2.5-7b", 7615.617), ("qwen3-8b", 8190.735),
                                            ("mistral-7b", 7248.024), ("qwen3-30b-a3b", 30532.123),
                                            ("deepseek-v3", 671000)])  # the model card's 671B, MTP module apart
def test_shipped_configs_build_the_advertised_model(name, millions):
    cfg = load_config(os.path.join(REPO, f"configs/{name}.yaml"))
    with nnx.use_eager_sharding(False):  # no mesh here: only shapes are wanted
        abstract = nnx.eval_shape(lambda: make_model(resolve_auto(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert actual == count_params(cfg.model)["total"]
    assert actual / 1e6 == pytest.approx(millions, rel=1e-3)


@pytest.mark.parametrize("key, suggestion", [
    ("model.moe.expert_d_ff", "model.moe.d_ff"),  # a qualifier before a key's name: the key, not a shared prefix
    ("model.moe.num_experts", "model.moe.experts"),
    ("model.moe.moe_d_ff", "model.moe.d_ff"),
    ("train.warmup_step", "train.warmup_steps"),  # a near-spelling of the whole name beats its last word (steps)
    ("model.n_head", "model.n_heads"),
    ("model.moe.topk", "model.moe.top_k"),
    ("trian.steps", "train.steps"),  # a misspelt section: the whole key
])
def test_an_unknown_key_suggests_the_key_it_names(key, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=1"])
    assert str(e.value) == f"unknown config key {key!r}; did you mean {suggestion!r}?"


def test_experts_not_divisible_by_the_expert_axis_names_what_would_fit():
    """6 experts over an expert axis of 4: the axis sizes that divide 6, or the next multiple of 4 experts."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.moe.experts=6", "mesh.ici.expert=4", "mesh.ici.fsdp=1"])
    assert str(e.value) == ("model.moe.experts=6 is not divisible by the expert axis size 4: make the expert axis "
                            "(mesh.ici.expert x mesh.dcn.expert) one of 1, 2, 3, 6, or model.moe.experts a multiple "
                            "of 4 (e.g. 8)")
    with pytest.raises(ConfigError, match=r"one of 1, 2, 4, 8, or model.moe.experts a multiple of 3 \(e.g. 9\)$"):
        load_config(None, ["model.moe.experts=8", "mesh.ici.expert=3", "mesh.ici.fsdp=1", "train.global_batch=12"])
    load_config(None, ["model.moe.experts=6", "mesh.ici.expert=3", "mesh.ici.fsdp=1", "train.global_batch=12"])


TOP1 = ("model.moe.top_k=1 with model.moe.normalize=true: each token's one routing weight is renormalised to 1, so "
        "the router gets no gradient from the language loss (only from model.moe.aux_loss and z_loss); set "
        "model.moe.normalize=false (the weight is then the router's own score, as in Switch Transformer) or "
        "model.moe.top_k >= 2")
FP8_F32 = ("model.fp8=tensorwise with model.dtype=float32: the projections still multiply in float8 (the same "
           "quantisation, float32 results), but attention, the norms, the embedding and the output projection compute "
           "in float32, which on GPUs costs much of FP8's speed-up; model.dtype=bfloat16 (or auto: bfloat16 on GPUs) "
           "is FP8's usual partner")


@pytest.mark.parametrize("overrides, said", [
    (["model.moe.experts=4", "model.moe.top_k=1"], [TOP1]),  # normalize=true is the default
    (["model.moe.experts=4", "model.moe.top_k=1", "model.moe.router=sigmoid"], [TOP1]),  # s / s = 1 too
    (["model.moe.experts=4", "model.moe.top_k=1", "model.moe.normalize=false"], []),
    (["model.moe.experts=4", "model.moe.top_k=2"], []),
    (["model.moe.top_k=1"], []),  # a dense model: top_k means nothing
    (["model.fp8=tensorwise", "model.dtype=float32"], [FP8_F32]),
    (["model.fp8=rowwise", "model.dtype=float32"], [FP8_F32.replace("tensorwise", "rowwise")]),
    (["model.fp8=tensorwise"], []),  # auto: float32 only on CPUs, where FP8 is emulated for checking anyway
    (["model.fp8=tensorwise", "model.dtype=bfloat16"], []),
    (["model.fp8=none", "model.dtype=float32"], []),
    (["model.fp8=tensorwise", "model.dtype=float32", "model.moe.experts=4", "model.moe.top_k=1"], [TOP1, FP8_F32]),
])
def test_valid_but_doubtful_settings_are_said_at_start_up(overrides, said):
    """Accepted (exit 0), but `train` says these, one line each (tests/test_cli.py sees them on its stderr)."""
    assert config_warnings(load_config(None, overrides)) == said
