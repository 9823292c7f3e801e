"""Config rules whose bugs do not show in a CPU run: "auto" resolution per platform, batch divisibility with
microbatches, and the device peak rates MFU divides by (datasheet numbers written out here)."""

import pytest

from jaxtrain.config import ConfigError, hardware, load_config
from jaxtrain.parallel.layout import resolve_auto


@pytest.mark.parametrize("platform, overrides, dtype, attention", [
    ("cpu", [], "float32", "xla"),
    ("gpu", [], "bfloat16", "cudnn"),  # 16-bit, no document mask: cuDNN's fused kernel
    ("gpu", ["data.document_mask=true", "model.head_dim=64"], "bfloat16", "pallas"),  # cuDNN takes no segment ids
    ("gpu", ["data.document_mask=true"], "bfloat16", "xla"),  # head dim 16: no flash kernel for it
    ("gpu", ["model.dtype=float32", "model.head_dim=64"], "float32", "xla"),  # no float32 cuDNN; flash f32 is exact FMA
    ("gpu", ["model.dtype=float32", "model.head_dim=64", "mesh.rules.act_seq=fsdp"], "float32", "xla"),
    ("tpu", [], "bfloat16", "xla"),
    ("gpu", ["model.dtype=float16", "model.attention=xla"], "float16", "xla"),  # concrete values pass through
])
def test_auto_resolution_per_platform(platform, overrides, dtype, attention):
    cfg = load_config(None, ["model.dtype=auto", "model.attention=auto", *overrides])
    m = resolve_auto(cfg, platform).model
    assert (m.dtype, m.attention) == (dtype, attention)
    assert resolve_auto(resolve_auto(cfg, platform), "cpu").model.attention == attention  # resolving twice


def test_each_microbatch_must_split_over_the_data_parallel_devices():
    # 8 rows / 4 microbatches = 2 rows per microbatch cannot split over 4 data-parallel devices.
    with pytest.raises(ConfigError, match=r"global_batch=8 \(/4 microbatches = 2\) is not divisible by the "
                                          r"data-parallel size 4"):
        load_config(None, ["train.global_batch=8", "train.microbatches=4", "mesh.ici.data=2", "mesh.ici.fsdp=2"])
    load_config(None, ["train.global_batch=16", "train.microbatches=4", "mesh.ici.data=2", "mesh.ici.fsdp=2"])


@pytest.mark.parametrize("device_kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12),  # dense BF16, SXM (1,979 TFLOPS is the 2:4-sparse figure)
    ("NVIDIA H200", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA B200", 2.25e15),
    ("cpu", None),
    ("TFRT_CPU_0", None),
])
def test_peak_flops_per_device_kind_are_the_dense_bf16_datasheet_numbers(device_kind, peak):
    assert hardware.peak_flops(device_kind) == peak
