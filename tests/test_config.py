import os

import jax
import pytest
from flax import nnx

from jaxtrain.config import Config, ConfigError, dump_yaml, load_config
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
    ("train.steps=ten", "train.steps='ten' must be an integer"),
    ("train.steps=0", "train.steps=0 must be > 0"),
    ("model.dtype=fp8", "choose one of auto, float32, bfloat16, float16"),
    ("model.remat=some", "choose one of none, full, save_matmuls"),
    ("mesh.ici.tensor=3", "model.n_heads=8 is not divisible by the tensor axis size 3"),
    ("train.global_batch=12", None),  # fine alone: 12 % 1 == 0
    ("data.source=/no/such.bin", "does not exist"),
    ("data.source=notes.txt", "must be 'embedded', 'synthetic' or a .bin/.npy token file"),
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


def test_cpu_devices_default_to_the_fixed_mesh_axes():
    assert cpu_devices_per_process(load_config(None, [])) == 1
    assert cpu_devices_per_process(load_config(None, ["mesh.ici.data=2", "mesh.ici.tensor=2"])) == 4
    assert cpu_devices_per_process(load_config(None, ["runtime.cpu_devices=8"])) == 8


@pytest.mark.parametrize("name, millions", [("tiny", 0.82), ("125m", 123.6), ("1b", 1235.8), ("7b", 6738.4),
                                            ("70b", 68976.6), ("tiny-moe", 2.594), ("mixtral-8x7b", 46702.8)])
def test_shipped_configs_build_the_advertised_model(name, millions):
    cfg = load_config(os.path.join(REPO, f"configs/{name}.yaml"))
    with nnx.use_eager_sharding(False):  # no mesh here: only shapes are wanted
        abstract = nnx.eval_shape(lambda: make_model(resolve_auto(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert actual == count_params(cfg.model)["total"]
    assert actual / 1e6 == pytest.approx(millions, rel=1e-3)
