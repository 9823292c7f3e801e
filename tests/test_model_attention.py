"""model.attention: the flash kernel (Pallas, interpreted on CPU) trains exactly like the XLA reference."""

import jax
import numpy as np
import pytest

from jaxtrain.config import FLASH_HEAD_DIMS, ConfigError, load_config
from jaxtrain.kernels.flash import pallas as flash_pallas
from jaxtrain.train import loop

BASE = ["model.dtype=float32", "model.param_dtype=float32", "train.steps=5", "train.eval_every=0",
        "train.eval_batches=1", "model.head_dim=32", "data.seq_len=64", "train.global_batch=8", "data.threads=0",
        "checkpoint.every=0"]


def _losses(tmp_path, name, devices, *overrides):
    cfg = load_config(None, [f"run.dir={tmp_path / name}", *BASE, *overrides])
    result = loop.train(cfg, devices=jax.devices()[:devices])
    return np.array([result.losses[s] for s in range(1, 6)])


@pytest.mark.slow
def test_pallas_matches_xla_with_document_masking_sharded_and_not(tmp_path):
    xla = _losses(tmp_path, "xla", 1, "model.attention=xla", "data.document_mask=true", "mesh.ici.fsdp=1")
    # The kernel runs under shard_map: batch over data, heads over tensor.
    sharded = _losses(tmp_path, "pallas4", 4, "model.attention=pallas", "data.document_mask=true",
                      "mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.tensor=2")
    np.testing.assert_allclose(sharded, xla, rtol=1e-5)
    unmasked = _losses(tmp_path, "nomask", 1, "model.attention=xla", "mesh.ici.fsdp=1")
    assert not np.allclose(unmasked[1:], xla[1:], rtol=1e-6)  # the mask really changes what attends to what


def test_attention_config_errors():
    with pytest.raises(ConfigError, match="model.attention=pallas needs a head dim in"):
        load_config(None, ["model.attention=pallas"])  # tiny head dim 16
    with pytest.raises(ConfigError, match="cudnn cannot mask documents"):
        load_config(None, ["model.attention=cudnn", "data.document_mask=true"])
    assert FLASH_HEAD_DIMS == flash_pallas.SUPPORTED_HEAD_DIMS
