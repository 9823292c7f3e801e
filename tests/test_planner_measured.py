"""The planner's measured rates (jaxtrain/configs/hardware/measured/): the H200 file holds exactly the figures
docs/results.md records for the one H200 run, the step model prices each kind of work at them, and the prediction for
the 1B step on one H200 is within 10% of the step time measured there. Expected values are read from docs/results.md
or worked by hand here, never taken from the planner."""

import dataclasses
import os
import re

import pytest

from jaxtrain.config import load_config
from jaxtrain.config.hardware import load_hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.planner.cost import measured as measured_lib
from jaxtrain.planner.cost import model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _h200_section() -> str:
    with open(os.path.join(REPO, "docs", "results.md")) as f:
        text = f.read()
    start = text.index("## The first GPU run: one H200")
    return text[start:text.index("\n## ", start + 1)]


def _cells(row_start: str) -> list[str]:
    """The cells of the markdown row of the H200 section that starts with ``row_start``."""
    line = next(line for line in _h200_section().splitlines() if line.startswith(row_start))
    return [c.strip() for c in line.strip("|").split("|")]


def _one_gpu_1b():
    cfg = load_config("1b", ["train.global_batch=4", "mesh.ici.fsdp=1"], num_devices=lambda c: 1)
    from jaxtrain.parallel.layout import resolve_auto

    cfg = resolve_auto(cfg, "gpu")
    return cfg, MeshShape.resolve(cfg.mesh, 1)


def test_the_h200_file_holds_the_figures_results_md_records():
    m = measured_lib.for_hardware(load_hardware("h200-8x"))
    assert m is not None and m.date == "2026-12-04" and m.source == "docs/results.md#the-first-gpu-run-one-h200"
    assert "H200" in m.machine and "driver 580.159.04" in m.machine and "jax 0.11.2" in m.machine
    # Attention, TFLOP/s forward / forward + backward, columns cuDNN, Triton, Pallas, XLA
    for row, head_dim in (("| head dim 64", 64), ("| head dim 128", 128)):
        cells = _cells(row)
        for impl, cell in zip(("cudnn", "triton", "pallas", "xla"), cells[1:]):
            rate = m.attention_rate(impl, head_dim)
            if cell == "not reached":
                assert rate is None
                continue
            fwd, both = (float(x) * 1e12 for x in cell.split(" / "))
            assert rate is not None and (rate.fwd, rate.fwd_bwd) == (fwd, both), (impl, head_dim)
    assert len(m.attention) == 7
    # the bf16 matmul: the Triton grouped matmul's forward + backward
    assert m.matmul == {"bfloat16": float(_cells("| Triton (`impl=\"triton\"`)")[2]) * 1e12}
    assert "triton" in m.matmul_what["bfloat16"] and "kernels.bench.gmm" in m.matmul_what["bfloat16"]
    assert m.hbm_bandwidth is None  # not measured there


def test_plan_on_one_h200_predicts_the_measured_1b_step_within_10_percent():
    measured_ms = float(_cells("| BF16 |")[1])  # docs/results.md: the 1B step, 4 x 4096 tokens, one H200
    assert measured_ms == 272.7
    assert "4 x 4096\ntokens a step" in _h200_section()
    cfg, shape = _one_gpu_1b()
    assert (cfg.model.attention, cfg.model.remat, cfg.train.global_batch, cfg.data.seq_len) == \
        ("cudnn", "save_matmuls", 4, 4096)
    # 1B parameters by hand: 128,256 x 2,048 + 16 x (2,048 x 64 x 80 + 3 x 2,048 x 8,192 + 4,096) + 2,048
    n = 1_235_814_400
    est, _ = model.estimate(cfg, shape, load_hardware("h200-8x"), [], 4 * n, 8 * n)
    assert abs(est.serial_s * 1e3 / measured_ms - 1) < 0.10, est


def test_the_measured_step_model_by_hand():
    """The 1B on one H200: weight matmuls (6 FLOPs a weight and token) at the measured 605 TFLOP/s, attention's
    forward + backward (3.5 forwards) at 307 (save_matmuls keeps cuDNN's named output: no forward is rerun), the
    AdamW update's 28 bytes a parameter at the datasheet's 4.8 TB/s; the XLA reference's attention, which remat
    does rerun, once more at its forward rate."""
    cfg, shape = _one_gpu_1b()
    tokens = 4 * 4096
    weights = 16 * (2048 * 64 * (2 * 32 + 2 * 8) + 3 * 2048 * 8192) + 2048 * 128256
    attn_fwd = 16 * 2 * 2 * 4096 * 32 * 64 / 2 * tokens
    hand = 6 * weights * tokens / 605e12 + attn_fwd * 3.5 / 307e12
    hw = load_hardware("h200-8x")
    parts = model.measured_compute(cfg, shape, hw, "cudnn")
    assert parts is not None and parts.sources == {"matmul": "measured", "attention": "measured: cudnn, head dim 64"}
    assert sum(parts.seconds.values()) == pytest.approx(hand, rel=1e-12)
    assert model.compute_seconds(cfg, shape, hw, "cudnn") == pytest.approx(hand, rel=1e-12)
    n = 1_235_814_400
    est, _ = model.estimate(cfg, shape, hw, [], 4 * n, 8 * n, attention="cudnn")
    assert est.optimizer_s == pytest.approx(28 * n / 4.8e12, rel=1e-12)
    # the Pallas kernel's measured rates instead: forward + backward at 191, forward at 228
    pallas = model.measured_compute(cfg, shape, hw, "pallas")
    assert pallas.seconds["attention"] == pytest.approx(attn_fwd * 3.5 / 191e12, rel=1e-12)
    xla = model.measured_compute(cfg, shape, hw, "xla")
    assert xla.seconds["attention"] == pytest.approx(attn_fwd * (3.5 / 31.6e12 + 1 / 26.5e12), rel=1e-12)


def test_unmeasured_rates_fall_back_to_the_datasheet_times_efficiency_and_say_so():
    cfg, shape = _one_gpu_1b()
    hw = load_hardware("h200-8x")
    fp8 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8="tensorwise"))
    rates = measured_lib.measured_rates(fp8, hw, "cudnn")
    assert rates["matmul_fp8"] == (1978.9e12 * 0.5, "datasheet x efficiency 0.5")
    assert rates["matmul"] == (605e12, "measured")
    # the 1B's projections in float8 (6 x 16 x 60.8M FLOPs a token), the tied output projection in bf16
    tokens = 4 * 4096
    proj = 6 * 16 * (2048 * 64 * 80 + 3 * 2048 * 8192) * tokens
    parts = model.measured_compute(fp8, shape, hw, "cudnn")
    assert parts.flops["matmul_fp8"] == pytest.approx(proj, rel=1e-12)
    assert parts.flops["matmul"] == pytest.approx(6 * 2048 * 128256 * tokens, rel=1e-12)
    odd = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, head_dim=96))  # no attention measured at 96
    assert measured_lib.measured_rates(odd, hw, "cudnn")["attention_fwd_bwd"] == (989.4e12 * 0.5,
                                                                                  "datasheet x efficiency 0.5")
    from jaxtrain.planner.search.target import measured_notes

    (note,) = measured_notes(fp8, hw, "cudnn", None)
    assert "measured on one NVIDIA H200" in note and "matmul fp8 989 TFLOP/s (datasheet x efficiency 0.5)" in note
    assert measured_notes(cfg, hw, "cudnn", 0.4)[0].endswith("--efficiency 0.4 applies to the datasheet figures only")


def test_hardware_without_measured_rates_or_recalibrated_keeps_the_single_efficiency():
    cfg, shape = _one_gpu_1b()
    h100 = load_hardware("h100-8x")
    assert measured_lib.for_hardware(h100) is None and model.measured_compute(cfg, shape, h100, "cudnn") is None
    # a calibration (check's, on those devices) replaced the matmul rate: its figures win, the file's do not apply
    calibrated = dataclasses.replace(load_hardware("h200-8x"), peak_flops=700e12)
    assert measured_lib.for_hardware(calibrated) is None


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("rate: 605.0e+12", "rate: -1"), "matmul.bfloat16.rate=-1 must be a rate > 0"),
    (lambda t: t.replace("hbm_bandwidth: null", "hbm_bandwidth: fast"), "hbm_bandwidth='fast' must be a rate > 0"),
    (lambda t: t.replace('date: "2026-12-04"\n', ""), "lacks date (each figure needs its machine, date and source)"),
    (lambda t: t + "peak: 1\n", "has unknown keys: peak; valid: hardware, machine"),
    (lambda t: t.replace("  float8: null", "  float16: null"), "matmul must map compute dtypes (bfloat16, float8)"),
    (lambda t: t.replace("fwd: 268.0e+12, ", ""), "attention[0] must have exactly the keys impl, head_dim"),
])
def test_a_bad_measured_file_is_one_line_naming_the_key(tmp_path, edit, message):
    with open(os.path.join(measured_lib.MEASURED_DIR, "h200-8x.yaml")) as f:
        text = f.read()
    path = tmp_path / "h200-8x.yaml"
    path.write_text(edit(text))
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        measured_lib.parse(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


@pytest.mark.slow
def test_plan_for_the_h200_prices_cudnn_at_its_measured_rates_not_the_cpu_stand_in(tmp_path):
    """`plan --hardware h200-8x` compiles the Pallas kernel in cuDNN's place on CPU; the step time still takes
    cuDNN's measured rate (307 TFLOP/s forward + backward, not Pallas's 191). A 2-layer 1B at 1024 tokens, 1 row a
    GPU."""
    import json

    from jaxtrain_testing import run_cli

    proc = run_cli("plan", "--config", "1b", "--hardware", "h200-8x", "mesh.ici.fsdp=8", "train.global_batch=8",
                   "model.n_layers=2", "data.seq_len=1024", f"run.dir={tmp_path}", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    (row,) = doc["candidates"]
    tokens = 1024  # per GPU
    weights = 2 * (2048 * 64 * 80 + 3 * 2048 * 8192) + 2048 * 128256
    attn_fwd = 2 * 2 * 2 * 1024 * 32 * 64 / 2 * tokens
    hand = 6 * weights * tokens / 605e12 + attn_fwd * 3.5 / 307e12
    assert row["time"]["compute"] == pytest.approx(hand, rel=1e-9)
    assert any("planned with pallas" in n for n in doc["notes"])
    assert any("attention fwd bwd 307 TFLOP/s (measured: cudnn, head dim 64)" in n for n in doc["notes"])
