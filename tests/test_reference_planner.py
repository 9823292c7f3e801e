"""The planner's time model against hand arithmetic (no compiling): compute time is model FLOPs (hand count, tests/
test_reference_flops.py) per device over peak x efficiency, with rematerialisation's extra forward work; the
optimizer update is memory-bound (gradients, parameters and both moments read, parameters and moments written)."""

import pytest

from jaxtrain.config import load_config
from jaxtrain.config.hardware import Hardware
from jaxtrain.parallel.dims import MESH_AXES, MeshShape
from jaxtrain.planner.cost import model as cost
from jaxtrain_testing import hand_forward_flops_per_token

HW = Hardware(peak_flops=1e15, hbm_bytes=8e10, hbm_bandwidth=2e12, devices_per_node=8, intra_node_bandwidth=4e11,
              inter_node_bandwidth=5e10, compute_efficiency=0.4)
SHAPE = MeshShape(ici=tuple(8 if ax == "fsdp" else 1 for ax in MESH_AXES), dcn=(1,) * len(MESH_AXES))  # fsdp 8


@pytest.mark.parametrize("remat", ["none", "full", "save_matmuls"])
def test_compute_and_optimizer_time_by_hand(remat):
    cfg = load_config("125m", [f"model.remat={remat}", "train.global_batch=16", "data.seq_len=512"])
    est, summary = cost.estimate(cfg, SHAPE, HW, [], params_bytes=1e9, opt_bytes=2e9)
    matmuls, attention = hand_forward_flops_per_token(cfg.model, 512)
    forward = {"none": 0, "full": matmuls + attention, "save_matmuls": attention}[remat]  # recomputed in backward
    flops_per_device = (3 * (matmuls + attention) + forward) * 16 * 512 / 8
    assert est.compute_s == pytest.approx(flops_per_device / (1e15 * 0.4), rel=1e-9)
    # Read: gradients (1e9), parameters (1e9), moments (2e9); written: parameters and moments.
    assert est.optimizer_s == pytest.approx((1e9 + 1e9 + 2e9 + 1e9 + 2e9) / 2e12, rel=1e-9)
    assert (est.ici_s, est.dcn_s, summary) == (0, 0, [])  # no collectives given
    assert est.serial_s == pytest.approx(est.compute_s + est.optimizer_s)
