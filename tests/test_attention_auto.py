"""``model.attention=auto`` on GPU (layout.resolve_auto as a function of platform, dtype, mesh and rules), the
one-line refusal of cuDNN with a sharded sequence, and the checkpoint names on cuDNN's residuals
(model.keep_residuals), checked on CPU with a real custom-VJP attention in place of cuDNN's."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.kernels import mha_reference
from jaxtrain.models.attention import REMAT_POLICIES, keep_residuals
from jaxtrain.parallel.dims import seq_shards
from jaxtrain.parallel.layout import resolve_auto
from jaxtrain_testing import run_cli

FLASH = "triton" if importlib.util.find_spec("jax_triton") else "pallas"


@pytest.mark.parametrize("platform, overrides, num_devices, attention", [
    ("gpu", [], None, "cudnn"),
    ("gpu", ["model.dtype=bfloat16"], 8, "cudnn"),
    ("gpu", ["model.dtype=float16"], 8, "cudnn"),
    # float32: neither cuDNN (no float32 kernel) nor the flash kernels (exact-FMA float32: for checking, not speed).
    ("gpu", ["model.dtype=float32"], 8, "xla"),
    ("gpu", ["model.dtype=float32", "data.document_mask=true"], 8, "xla"),
    ("gpu", ["data.document_mask=true"], 8, FLASH),  # cuDNN takes no segment ids
    # act_seq on an axis of size 1 is not sharded: cuDNN stays.
    ("gpu", ["mesh.rules.act_seq=tensor"], 8, "cudnn"),
    ("gpu", ["mesh.rules.act_seq=fsdp", "mesh.ici.fsdp=1", "mesh.ici.data=-1"], 8, "cudnn"),
    # act_seq sharded (fsdp=-1 fills 8 devices; or a fixed tensor=2): neither cuDNN nor the flash kernels.
    ("gpu", ["mesh.rules.act_seq=fsdp"], 8, "xla"),
    ("gpu", ["mesh.rules.act_seq=[tensor]", "mesh.ici.tensor=2"], 8, "xla"),
    ("gpu", ["mesh.rules.act_seq=tensor", "mesh.ici.tensor=2", "data.document_mask=true"], 8, "xla"),
    # Not knowing the device count, an act_seq on the -1 axis may shard: not cuDNN. One device: not sharded.
    ("gpu", ["mesh.rules.act_seq=fsdp"], None, "xla"),
    ("gpu", ["mesh.rules.act_seq=fsdp"], 1, "cudnn"),
    ("cpu", [], 8, "xla"),
    ("tpu", [], 8, "xla"),
])
def test_auto_attention(platform, overrides, num_devices, attention):
    cfg = load_config(None, ["model.attention=auto", "model.head_dim=64", "train.global_batch=8", *overrides])
    resolved = resolve_auto(cfg, platform, num_devices)
    assert resolved.model.attention == attention
    assert resolve_auto(resolved, platform, num_devices).model.attention == attention  # resolving twice


@pytest.mark.parametrize("overrides, num_devices, shards", [
    ([], 8, 1),
    (["mesh.rules.act_seq=fsdp"], 8, 8),
    (["mesh.rules.act_seq=fsdp"], None, None),
    (["mesh.rules.act_seq=[data,tensor]", "mesh.ici.data=2", "mesh.ici.tensor=2"], 8, 4),
    (["mesh.rules.act_seq=[data,tensor]", "mesh.ici.data=2", "mesh.ici.tensor=2"], None, 4),
    (["mesh.rules.act_seq=data", "mesh.dcn.data=2"], None, 2),
])
def test_seq_shards(overrides, num_devices, shards):
    cfg = load_config(None, ["train.global_batch=8", *overrides])
    assert seq_shards(cfg, num_devices) == shards


def test_explicit_cudnn_with_a_sharded_sequence_is_refused():
    cfg = load_config(None, ["model.attention=cudnn", "mesh.rules.act_seq=fsdp", "train.global_batch=8"])
    with pytest.raises(ConfigError, match=r"model.attention=cudnn cannot take a sharded sequence: "
                                          r"mesh.rules.act_seq='fsdp' cuts it into 8 slices"):
        resolve_auto(cfg, "gpu", 8)
    assert resolve_auto(cfg, "gpu", 1).model.attention == "cudnn"  # one device: nothing is cut


def test_explicit_cudnn_with_a_sharded_sequence_exits_2_in_one_line(tmp_path):
    proc = run_cli("train", "model.attention=cudnn", "mesh.rules.act_seq=fsdp", "runtime.cpu_devices=2",
                   f"run.dir={tmp_path}/run", "train.steps=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "mesh.rules.act_seq='fsdp' cuts it into 2 slices" in lines[0]


def _reference(q, k, v):
    return mha_reference(q, k, v, causal=True)


def _layer(fn):
    """A layer around attention (projection in, attention, projection out) under remat policy "full"."""
    def layer(w, x):
        q = (x @ w).reshape(1, 8, 2, 4)
        return jnp.sum(jnp.tanh(fn(q, q[:, :, :1], q[:, :, 1:]).reshape(8, 8) @ w))
    return jax.checkpoint(layer, policy=REMAT_POLICIES["full"], prevent_cse=False)


def test_named_residuals_spare_the_forward_and_keep_the_gradient():
    """A name on a custom-VJP function's result does not save its residuals (its backward reruns the forward);
    keep_residuals names the residuals themselves. The reference attention stands in for cuDNN's: a real
    attention whose backward needs its forward's results."""
    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (8, 8))
    plain, kept = _layer(_reference), _layer(keep_residuals(_reference))
    want, got = (jax.jit(jax.grad(f, argnums=(0, 1)))(w, x) for f in (plain, kept))
    for g, ref in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # The softmax's exp: twice in the gradient's program when the forward is rerun, once when it is not.
    programs = [str(jax.make_jaxpr(jax.grad(f))(w, x)) for f in (plain, kept)]
    assert [p.count(" exp ") for p in programs] == [2, 1]
    assert "name=attn_out" in programs[1] and "name=attn_lse" in programs[1]
    assert "name=attn_" not in programs[0]
