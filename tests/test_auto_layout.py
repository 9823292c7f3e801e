"""mesh.auto: the candidates it searches, the choice under a memory budget and its margin, the one-line error when
nothing fits, the compile cache, and the calibration that `check` writes and `plan` reads."""

import dataclasses
import json

import jax
import pytest

from jaxtrain.config import MESH_AXES, load_config
from jaxtrain.errors import ConfigError
from jaxtrain.hardware import Hardware
from jaxtrain.planner import auto, calibration, cost

# One device: the candidates differ in remat only (one microbatch), so the slow test compiles two small steps.
SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
         "model.vocab_size=64", "data.seq_len=16", "train.global_batch=4", "data.source=synthetic"]


def hw(usable: float, **kw) -> Hardware:
    """Fixed figures (nothing measured: the choice must not depend on the machine's load)."""
    return Hardware(peak_flops=1e10, hbm_bytes=usable, hbm_bandwidth=1e10, devices_per_node=8,
                    intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, compute_efficiency=0.5, name="fixed",
                    device_kind="cpu", collective_latency=1e-5, **kw)


def test_candidates_cover_every_axis_remat_microbatches_and_schedules(make_config):
    cfg = make_config("model.n_layers=4", "train.global_batch=16")
    cands = auto.candidates(cfg, 8, 1)
    used = {ax for c in cands for ax, n in c.shape.axis_sizes.items() if n > 1}
    assert used == set(MESH_AXES)  # context joins when config.MESH_AXES has it
    assert {c.remat for c in cands} == set(auto.REMATS)
    assert {c.microbatches for c in cands} == {1, 2, 4, 8, 16}
    assert {c.schedule for c in cands if c.stages > 1} == {"gpipe", "1f1b"}
    assert all(c.microbatches % c.stages == 0 for c in cands)  # a pipeline needs a microbatch per stage
    c = next(c for c in cands if c.stages == 2)
    pinned = load_config(None, [f"run.dir={cfg.run.dir}", *c.overrides()])  # reproducible without the planner
    assert (pinned.mesh.auto, pinned.model.remat, pinned.train.microbatches) == (False, c.remat, c.microbatches)
    assert pinned.mesh.ici.stage * pinned.mesh.dcn.stage == 2


def test_closed_forms_are_lower_bounds_where_they_claim(make_config):
    cfg = make_config()
    c = next(c for c in auto.candidates(cfg, 8, 1) if c.shape.axis_sizes["fsdp"] == 8 and c.remat == "none")
    # Parameters + two AdamW moments in float32, sharded 8 ways: the closed form, not a bound, for a pure fsdp mesh.
    from jaxtrain.model import count_params
    assert cost.state_bytes_lower(cfg, c.shape) == 3 * 4 * count_params(cfg.model)["total"] / 8
    lower, guess = cost.activation_bytes(c.apply(cfg), c.shape)
    assert 0 < lower < guess
    full = dataclasses.replace(c, remat="full")
    assert cost.compute_seconds(full.apply(cfg), c.shape, hw(1e9)) == pytest.approx(
        cost.compute_seconds(c.apply(cfg), c.shape, hw(1e9)) * 4 / 3)


def test_nothing_fits_is_one_line_saying_what_would(make_config):
    cfg = make_config(*SMALL)
    with pytest.raises(ConfigError) as e:
        auto.search_layout(cfg, jax.devices()[:2], hw(1e3))  # state alone over the budget: nothing compiled
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("mesh.auto: no layout fits")
    assert "remat none to full and microbatches 1 to 4 searched" in msg and "or more devices" in msg


def test_margin_is_validated_once(make_config):
    with pytest.raises(ConfigError, match=r"mesh.auto_memory_margin=1.0 must be in \[0, 1\)"):
        make_config("mesh.auto_memory_margin=1.0")


def test_calibration_round_trip_flags_measured_figures(tmp_path):
    latency, rate = calibration.latency_and_rate([(1000, 2e-6 + 1000 / 1e9), (10 ** 6, 2e-6 + 10 ** 6 / 1e9)])
    assert latency == pytest.approx(2e-6) and rate == pytest.approx(1e9)
    assert calibration.latency_and_rate([(4096, 1e-3)]) == (None, 4096 / 1e-3)  # one size: no latency
    path = calibration.write(str(tmp_path / "run" / calibration.FILE), device_kind="cpu", platform="cpu", devices=8,
                             hosts=1, matmul_gflops={"float32": 5.0}, axes={
                                 "fsdp": calibration.axis_entry(4, False, 2.0, 1e-4),
                                 "data": calibration.axis_entry(2, False, 3.0, 3e-4)})
    assert calibration.in_run_dir(str(tmp_path / "run")) == path
    cal = calibration.apply(hw(1e9), calibration.read(path), path, "float32")
    assert cal.hw.peak_flops == 5e9 and cal.hw.intra_node_bandwidth == 2e9  # the slowest axis of the class
    assert cal.hw.collective_latency == 3e-4 and cal.hw.inter_node_bandwidth == 1e9  # no crossing axis: the file's
    assert cal.measured == ("peak_flops", "intra_node_bandwidth", "collective_latency")
    note = cal.note("the hardware file fixed")
    assert note.startswith(f"figures: measured by check ({path}): peak_flops, intra_node_bandwidth")
    assert note.endswith("; from the hardware file fixed: inter_node_bandwidth")
    assert calibration.apply(hw(1e9), calibration.read(path), path, "bfloat16").hw.peak_flops == 1e10  # other dtype
    h100 = dataclasses.replace(hw(1e9), name="h100", device_kind="NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError, match="measured 'cpu' devices but the plan is for h100"):
        calibration.apply(h100, calibration.read(path), path)
    # A plan finds the run directory's file itself: used for its own devices, left out (and said so) for others;
    # named with --calibration, a file of other devices is an error.
    assert calibration.for_plan(hw(1e9), None, str(tmp_path / "run"), "float32").measured == cal.measured
    other = calibration.for_plan(h100, None, str(tmp_path / "run"), "bfloat16")
    assert other.measured == () and other.hw == h100
    assert other.note("the hardware file h100").endswith(f"; {path} measured 'cpu' devices, not used")
    with pytest.raises(ConfigError, match="measured 'cpu' devices but the plan is for h100"):
        calibration.for_plan(h100, path, str(tmp_path / "run"), "bfloat16")
    (tmp_path / "bad.json").write_text(json.dumps({"version": 0}))
    with pytest.raises(ConfigError, match="is not a version-1 calibration"):
        calibration.read(str(tmp_path / "bad.json"))


@pytest.fixture(scope="module")
def compiled_small(tmp_path_factory):
    """Every candidate of SMALL on one device (remat none / full, one microbatch) compiled into a cache: the
    independent reference for the budgets below, and the searches then read the cache."""
    tmp = tmp_path_factory.mktemp("auto")
    cfg = load_config(None, [f"run.dir={tmp / 'run'}", *SMALL])
    cache = str(tmp / "cache")
    kw = dict(remats=("none", "full"), microbatches=[1])
    memory = {}
    for c in auto.candidates(cfg, 1, 1, **kw):
        comp, _ = auto.compile_cached(c.apply(cfg), c.shape, jax.devices()[:1], cache)
        memory[c.label] = comp.memory_bytes
    return cfg, cache, kw, memory


@pytest.mark.slow
def test_choice_is_deterministic_cached_and_respects_the_margin(compiled_small):
    cfg, cache, kw, memory = compiled_small
    dev = jax.devices()[:1]
    ample = auto.search_layout(cfg, dev, hw(1e12), cache_dir=cache, **kw)
    assert ample.compiles == 0 and ample.cache_hits == 1  # the fixture compiled them all
    again = auto.search_layout(cfg, dev, hw(1e12), cache_dir=cache, **kw)
    assert again.choice.cand == ample.choice.cand and again.choice.est == ample.choice.est
    assert ample.choice.cand.remat == "none"  # with room, no recompute: fastest under the cost model
    assert ample.bounded == 1 and ample.runner_up is None  # remat full of a layout that fits without: not compiled
    # A budget where exactly one candidate fits once the margin is taken off: it is chosen.
    smallest = min(memory, key=memory.get)
    second = sorted(memory.values())[1]
    assert second > memory[smallest]
    margin = cfg.mesh.auto_memory_margin
    usable = (memory[smallest] + second) / 2 / (1 - margin)
    tight = auto.search_layout(cfg, dev, hw(usable), cache_dir=cache, **kw)
    assert tight.choice.cand.label == smallest and tight.runner_up is None
    assert any("over the memory budget" in w for w in tight.why)
    # The margin is kept: the smallest fits the usable memory, but not usable x (1 - margin).
    with pytest.raises(ConfigError, match="no layout fits"):
        auto.search_layout(cfg, dev, hw(memory[smallest] * (1 + margin / 2)), cache_dir=cache, **kw)
    text = auto.format_result(tight)
    assert f"auto layout: {smallest}" in text and "from the cache" in text
