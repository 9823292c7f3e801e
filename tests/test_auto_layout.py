"""mesh.auto: the candidates it searches, the choice under a memory budget and its margin, the one-line error when
nothing fits, the compile cache, and the calibration that `check` writes and `plan` reads."""

import dataclasses
import json

import jax
import pytest

from jaxtrain.config import load_config
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MESH_AXES
from jaxtrain.planner.auto import choose as auto
from jaxtrain.planner.auto import compile_cache, space, trial
from jaxtrain.planner.auto import report as auto_report
from jaxtrain.planner.cost import calibration, memory
from jaxtrain.planner.cost import model as cost

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
    cands = space.candidates(cfg, 8, 1)
    used = {ax for c in cands for ax, n in c.shape.axis_sizes.items() if n > 1}
    assert used == set(MESH_AXES) - {"expert"}  # context joins when config.MESH_AXES has it; expert: MoE models only
    moe = make_config("model.n_layers=4", "train.global_batch=16", "model.moe.experts=8")
    assert any(c.shape.size("expert") > 1 for c in space.candidates(moe, 8, 1))
    assert {c.remat for c in cands} == set(space.REMATS)
    assert {c.microbatches for c in cands} == {1, 2, 4, 8, 16}
    assert {c.schedule for c in cands if c.stages > 1} == {"gpipe", "1f1b"}
    assert all(c.microbatches % c.stages == 0 for c in cands)  # a pipeline needs a microbatch per stage
    c = next(c for c in cands if c.stages == 2)
    pinned = load_config(None, [f"run.dir={cfg.run.dir}", *c.overrides()])  # reproducible without the planner
    assert (pinned.mesh.auto, pinned.model.remat, pinned.train.microbatches) == (False, c.remat, c.microbatches)
    assert pinned.mesh.ici.stage * pinned.mesh.dcn.stage == 2


def test_chat_data_leaves_pipelines_out_of_the_candidates(make_config):
    """mesh.auto never chooses a layout train refuses: with chat data no candidate has stages, the rest remain."""
    cfg = make_config("model.n_layers=4", "train.global_batch=16")
    chat = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, format="chat"))  # past validation: no files
    tokens, cands = space.candidates(cfg, 8, 1), space.candidates(chat, 8, 1)
    assert any(c.stages > 1 for c in tokens) and all(c.stages == 1 for c in cands)
    assert set(cands) == {c for c in tokens if c.stages == 1}


def test_closed_forms_are_lower_bounds_where_they_claim(make_config):
    cfg = make_config()
    c = next(c for c in space.candidates(cfg, 8, 1) if c.shape.axis_sizes["fsdp"] == 8 and c.remat == "none")
    # Parameters + two AdamW moments in float32, sharded 8 ways: the closed form, not a bound, for a pure fsdp mesh.
    from jaxtrain.models.flops import count_params
    assert memory.state_bytes_lower(cfg, c.shape) == 3 * 4 * count_params(cfg.model)["total"] / 8
    lower, guess = memory.activation_bytes(c.apply(cfg), c.shape)
    assert 0 < lower < guess
    full = dataclasses.replace(c, remat="full")
    assert cost.compute_seconds(full.apply(cfg), c.shape, hw(1e9)) == pytest.approx(
        cost.compute_seconds(c.apply(cfg), c.shape, hw(1e9)) * 4 / 3)


def test_measured_efficiency_inverts_the_compute_estimate_per_remat(make_config):
    """measure.measure_model's timing becomes an efficiency that gives that timing back for its layout, and the
    estimate of another layout scales from it by FLOPs and the matmul rate by rows (no constant efficiency)."""
    cfg = make_config()
    cands = {(c.shape.label, c.remat, c.microbatches): c for c in space.candidates(cfg, 8, 1, microbatches=[1, 2])}
    ref, other = cands["fsdp8", "full", 1], cands["fsdp8", "full", 2]
    sized = dataclasses.replace(hw(1e9), matmul_rows=((64.0, 0.5), (512.0, 1.0)), layer_overhead_s=1e-3)
    eff = cost.measured_efficiency(ref.apply(cfg), ref.shape, sized, 0.25)
    measured = dataclasses.replace(sized, model_efficiency=(("full", 1, eff),))
    assert cost.compute_seconds(ref.apply(cfg), ref.shape, measured) == pytest.approx(0.25)
    assert cost.efficiency(ref.apply(cfg), ref.shape, measured) == eff  # remat full: measured
    none = cands["fsdp8", "none", 1]
    assert cost.efficiency(none.apply(cfg), none.shape, measured) == 0.5  # not measured: the hardware's
    # One microbatch: 2 x 128 = 256 rows a device; two: 128, at a rate 2^(1/3) lower (log-log between 64 and 512
    # rows), the same FLOPs, twice the iterations' fixed cost (5 per microbatch: 4 layers + 1, at 1 ms).
    flops_only = 0.25 - 5e-3
    assert cost.compute_seconds(other.apply(cfg), other.shape, measured) == pytest.approx(
        flops_only * 2 ** (1 / 3) + 10e-3)


def test_efficiency_carries_a_tensor_ratio_measured_without_remat_to_the_other_policies(make_config):
    cfg = make_config()
    cands = {(c.shape.label, c.remat): c for c in space.candidates(cfg, 8, 1, microbatches=[1])}
    table = dataclasses.replace(hw(1e9), model_efficiency=(("none", 1, 0.4), ("full", 1, 0.3), ("none", 2, 0.2)))

    def eff(label, remat):
        c = cands[label, remat]
        return cost.efficiency(c.apply(cfg), c.shape, table)

    assert eff("fsdp8", "none") == 0.4 and eff("fsdp8", "full") == 0.3 and eff("fsdp4 tensor2", "none") == 0.2
    assert eff("fsdp4 tensor2", "full") == pytest.approx(0.3 * 0.2 / 0.4)  # full's own x tensor 2's ratio
    assert eff("fsdp2 tensor4", "full") == 0.3  # tensor 4 not measured: the policy's own
    assert eff("fsdp8", "save_matmuls") == 0.5  # the policy not measured: the hardware's compute_efficiency


def test_model_is_measured_in_rounds_back_and_forth_keeping_each_points_fastest(make_config, monkeypatch):
    """measure.measure_model times its points in MODEL_ROUNDS rounds, every other one reversed, warming up in the
    first only, and turns each point's fastest run (whichever round it fell in) into its efficiency: a slow moment of
    the machine then weighs on every point alike. The real model runs; only the clock is replaced."""
    from jaxtrain.planner.cost import measure
    cfg = make_config(*SMALL, "runtime.cpu_devices=1", "mesh.ici.fsdp=1")
    devices = jax.devices()[:1]
    points = [("none", 1), ("full", 1)]
    seen, fake = [], iter([0.5, 0.2, 0.1, 0.4, 0.3, 0.6])  # per call: point none, full, full, none, none, full

    def best_time(fn, seconds, times=None, at_least=1, warm_up=True):
        fn()  # really runs the model's forward and backward
        seen.append(warm_up)
        return next(fake)

    monkeypatch.setattr(measure, "_best_time", best_time)
    monkeypatch.setattr(measure, "MODEL_ROUNDS", 3)
    effs = measure.measure_model(cfg, devices, hw(1e9), points)
    assert seen == [True, True, False, False, False, False]
    fastest = {"none": 0.3, "full": 0.1}  # none: 0.5, 0.4, 0.3; full: 0.2, 0.1, 0.6
    ref = {r: dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=r)) for r in fastest}
    shape = space.candidates(cfg, 1, 1)[0].shape
    assert [(r, t) for r, t, _ in effs] == points
    for r, _, e in effs:
        assert e == pytest.approx(cost.measured_efficiency(ref[r], shape, hw(1e9), fastest[r]))


def test_a_calibration_files_peak_leaves_the_measured_model_time_as_measured(make_config, monkeypatch, tmp_path):
    """The model's efficiency is a fraction of peak_flops, so it is measured against the peak the estimate uses: a
    calibration file whose matmul rate is a third of the one measured at hand leaves the compute estimate of the
    measured layout at the model's measured time (measured against the other peak, it had tripled). The clock is
    fixed (every timing 50 ms), so both searches measure the same."""
    from jaxtrain.planner.cost import measure
    cfg = make_config(*SMALL, "runtime.cpu_devices=1", "mesh.ici.fsdp=1")
    devices = jax.devices()[:1]
    monkeypatch.setattr(measure, "_best_time", lambda fn, seconds, times=None, at_least=1, warm_up=True: 0.05)
    plain = auto.hardware_for(cfg, devices).hw
    path = calibration.write(str(tmp_path / calibration.FILE), device_kind=devices[0].device_kind, platform="cpu",
                             devices=1, hosts=1, matmul_gflops={"float32": plain.peak_flops / 3e9}, axes={},
                             origin=calibration.origin("cpu", "cpu", processes=1, local_devices=1, host="here"))
    cal = auto.hardware_for(cfg, devices, path)
    assert cal.measured == ("peak_flops",) and cal.hw.peak_flops == pytest.approx(plain.peak_flops / 3)
    ref = next(c for c in space.candidates(cfg, 1, 1, microbatches=[1]) if c.remat == "none")
    for figures in (plain, cal.hw):
        assert cost.compute_seconds(ref.apply(cfg), ref.shape, figures) == pytest.approx(0.05)


def test_a_lighter_remat_dominates_only_at_no_more_compute(make_config):
    """Where the measured efficiencies make recompute cheaper (as on this project's CPUs), the layout with remat
    full is compiled and can be chosen although remat none fits; otherwise the lighter setting dominates."""
    cfg = make_config()
    cands = {(c.shape.label, c.remat): c for c in space.candidates(cfg, 8, 1, microbatches=[1])}
    fixed = hw(1e12)
    rows = {r: space.closed_form(cfg, cands["fsdp8", r], fixed) for r in ("none", "full")}
    assert auto._dominates(rows["none"], rows["full"]) and not auto._dominates(rows["full"], rows["none"])
    fast_full = dataclasses.replace(fixed, model_efficiency=(("none", 1, 0.2), ("full", 1, 0.5)))
    rows = {r: space.closed_form(cfg, cands["fsdp8", r], fast_full) for r in ("none", "full")}
    assert rows["full"].lower_s < rows["none"].lower_s and not auto._dominates(rows["none"], rows["full"])


def test_nothing_fits_is_one_line_saying_what_would(make_config):
    cfg = make_config(*SMALL)
    with pytest.raises(ConfigError) as e:
        auto.search_layout(cfg, jax.devices()[:2], hw(1e3))  # state alone over the budget: nothing compiled
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("mesh.auto: no layout fits")
    assert "remat none to full and microbatches 1 to 4 searched" in msg and "or more devices" in msg


@pytest.mark.parametrize("args", [["model.d_model=65536", "model.n_layers=64"], ["--config", "7b"]],
                         ids=["d_model_65536", "7b"])
def test_a_model_no_layout_holds_is_refused_in_one_line_before_anything_is_measured(tmp_path, args):
    """The issue's first tries: a model no layout of 8 CPU devices can hold (its state alone is 10 GB a device for
    the 7B, over a TB for the other) exits 2 with the search's one line, having measured and allocated nothing
    (before the pre-check: a MemoryError traceback from the calibration's host copy of the weights, and an OOM kill
    with no output)."""
    from jaxtrain_testing import run_cli

    proc = run_cli("train", *args, "mesh.auto=true", "runtime.cpu_devices=8", f"run.dir={tmp_path / 'run'}",
                   timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: mesh.auto: no layout fits") and "parameters, optimizer state" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_model_is_not_timed_where_its_copy_per_device_would_not_fit_the_host(make_config, monkeypatch):
    """The model's timing holds a whole copy of the weights on every CPU device (no sharding): with a vocabulary
    making that copy twice the host's available memory a device (the training state, sharded 8 ways, fits), the
    search takes compute_efficiency instead and says so; the matmul table, small, is still measured."""
    from jaxtrain.planner.cost import measure
    from jaxtrain.train.guards import available_memory

    share = available_memory()[0]
    vocab = int(2 * share / (2 * 4 * 32))  # float32 weights and their gradient, d_model 32: the embedding dominates
    cfg = make_config(*SMALL, f"model.vocab_size={vocab}", "runtime.cpu_devices=8", "mesh.auto=true")
    devices = jax.devices()[:8]
    assert measure.model_bytes(cfg, 8, measure.model_points(cfg, 8, auto.REMATS)) > share

    def must_not_run(*a, **k):
        raise AssertionError("the model was timed")

    monkeypatch.setattr(measure, "model_seconds", must_not_run)
    said: list[str] = []
    hw = auto.hardware_for(cfg, devices, progress=said.append).hw
    assert hw.model_efficiency == () and hw.matmul_rows
    assert any("the model's own step is not timed" in line for line in said), said


def test_mesh_sizes_set_beside_mesh_auto_hold_its_search(make_config):
    """The issue's `mesh.auto=true mesh.ici.data=4 mesh.ici.fsdp=2` trained data 2 x fsdp 4: sizes set on the
    command line (either spelling) are kept, the axes left alone stay free, a -1 keeps nothing, and a config
    file's sizes (tiny.yaml's fsdp -1, data 1) are its own layout, which the search replaces."""
    cfg = make_config("model.n_layers=4", "train.global_batch=16", "mesh.auto=true", "mesh.ici.data=4",
                      "mesh.ici.fsdp=2")
    assert cfg.mesh.auto_keep == ["ici.data", "ici.fsdp"]
    assert {c.shape.label for c in space.candidates(cfg, 8, 1)} == {"data4 fsdp2"}
    free = make_config("model.n_layers=4", "train.global_batch=16", "mesh.auto=true", "mesh.ici={data: 2}")
    assert free.mesh.kept() == {("ici", "data"): 2}
    labels = {c.shape.label for c in space.candidates(free, 8, 1)}
    assert labels and all(c.shape.size("data") == 2 for c in space.candidates(free, 8, 1)) and len(labels) > 1
    assert make_config("mesh.auto=true", "mesh.ici.fsdp=-1").mesh.kept() == {}
    tiny = load_config("tiny", ["mesh.auto=true", "model.n_layers=4", "train.global_batch=16"])
    assert tiny.mesh.auto_keep == [] and len({c.shape.label for c in space.candidates(tiny, 8, 1)}) > 1
    with pytest.raises(ConfigError) as e:
        space.candidates(make_config("train.global_batch=6", "mesh.auto=true", "mesh.ici.data=3"), 8, 1)
    assert str(e.value) == ("mesh.auto: no valid layout over 8 device(s) on 1 node(s) has the sizes given "
                            "(mesh.ici.data=3; mesh.auto keeps the sizes set beside it); valid layouts: "
                            "mesh.ici.data takes 1, 2; change or drop them")
    with pytest.raises(ConfigError, match="mesh.auto_keep names 'ici.foo': each must be one of ici.data"):
        make_config("mesh.auto_keep=[ici.foo]")


def test_a_mesh_size_no_layout_has_is_refused_in_one_line_by_train(tmp_path):
    from jaxtrain_testing import run_cli

    proc = run_cli("train", *SMALL, "train.global_batch=6", "mesh.auto=true", "mesh.ici.data=3",
                   "runtime.cpu_devices=8", f"run.dir={tmp_path / 'run'}", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: mesh.auto: no valid layout over 8 device(s) on 1 node(s) has the sizes given "
                               "(mesh.ici.data=3;"), lines[0]


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
    with pytest.raises(ConfigError, match="does not fit: it measured 'cpu' devices, the plan is for h100"):
        calibration.apply(h100, calibration.read(path), path)
    # A plan finds the run directory's file itself: used for its own devices, left out (and said so) for others;
    # named with --calibration, a file of other devices is an error.
    assert calibration.for_plan(hw(1e9), None, str(tmp_path / "run"), "float32").measured == cal.measured
    other = calibration.for_plan(h100, None, str(tmp_path / "run"), "bfloat16")
    assert other.measured == () and other.hw == h100
    assert other.note("the hardware file h100").endswith(
        f"; {path}: it measured 'cpu' devices, the plan is for h100 ('NVIDIA H100 80GB HBM3'), not used")
    with pytest.raises(ConfigError, match="does not fit: it measured 'cpu' devices, the plan is for h100"):
        calibration.for_plan(h100, path, str(tmp_path / "run"), "bfloat16")
    (tmp_path / "bad.json").write_text(json.dumps({"version": 0}))
    with pytest.raises(ConfigError, match="is not a version-1 calibration"):
        calibration.read(str(tmp_path / "bad.json"))


def _calibration(path, *, kind="cpu", platform="cpu", devices=1, hosts=1, processes=1, local=1, machine=None):
    """A hand-made calibration file: 10 GFLOP/s a device, one axis (2 GB/s, 1 ms), measured on ``machine`` (default:
    this one, as ``check`` records it)."""
    origin = calibration.origin(platform, kind, processes=processes, local_devices=local, host="h0")
    if machine is not None:
        origin["machine"] = machine
    return calibration.write(str(path), device_kind=kind, platform=platform, devices=devices, hosts=hosts,
                             matmul_gflops={"float32": 10.0, "bfloat16": 10.0}, origin=origin,
                             axes={"fsdp": calibration.axis_entry(devices, False, 2.0, 1e-3)})


def test_a_calibration_applies_only_where_it_fits_what_it_is_applied_to(tmp_path):
    """The issue: `check` wrote a calibration from one CPU device and `plan runtime.cpu_devices=8 mesh.ici.fsdp=8`
    took its whole-host matmul rate for each of 8 devices (step 690.6 -> 170.5 ms, measured 378-665 ms). Now: the
    same count: every figure; another count on the same machine: the matmul rate alone, on CPUs scaled to each
    device's share of the cores; another machine, device kind or a file without an origin: nothing, said in one
    line (the run directory's) or refused (--calibration)."""
    here = calibration.Devices("cpu", 8, calibration.machine("cpu", "cpu"), processes=1, local=8)
    same = _calibration(tmp_path / "same.json", devices=8, local=8)
    full = calibration.for_plan(hw(1e9), same, str(tmp_path), "float32", here)
    assert full.measured == ("peak_flops", "intra_node_bandwidth", "collective_latency") and not full.partly
    assert full.hw.peak_flops == 1e10 and full.hw.intra_node_bandwidth == 2e9 and full.hw.collective_latency == 1e-3
    # One device measured, eight planned: the host's rate shared by 8, the links of the hardware at hand.
    one = _calibration(tmp_path / "run" / calibration.FILE, devices=1, local=1)
    body = calibration.read(one)
    assert {"machine", "processes", "local_devices", "host", "jax", "jaxlib", "date", "command"} <= set(body["origin"])
    assert body["origin"]["machine"] == f"{calibration.cpu_model()}, {calibration.cpus()} CPUs"
    for cal in (calibration.for_plan(hw(1e9), None, str(tmp_path / "run"), "float32", here),
                calibration.for_plan(hw(1e9), one, str(tmp_path), "float32", here)):
        assert cal.measured == ("peak_flops",) and cal.hw.peak_flops == pytest.approx(1e10 / 8)
        assert cal.hw.intra_node_bandwidth == hw(1e9).intra_node_bandwidth
        note = cal.note("the devices at hand")
        assert "\n" not in note and note.endswith(
            "; the calibration measured another count of devices (devices: 1 measured, 8 planned; devices per "
            "process: 1 measured, 8 planned): its matmul rate is taken x1/8 (emulated devices share the host's "
            "cores: each device's share), its links and collective latency are not (measured over other devices)")
    # GPUs: the rate per device as measured (no shared cores), the links not; a hardware file's hosts compared.
    h100 = dataclasses.replace(hw(1e9), name="h100-8x", device_kind="NVIDIA H100 80GB HBM3", devices_per_node=8)
    gpu = _calibration(tmp_path / "gpu.json", kind="NVIDIA H100 80GB HBM3", platform="gpu", devices=8, processes=8)
    cal = calibration.for_plan(h100, gpu, str(tmp_path), "bfloat16", calibration.Devices.of_hardware(h100, 2))
    assert cal.measured == ("peak_flops",) and cal.hw.peak_flops == 1e10 and "(per device)" in cal.partly
    assert "devices: 8 measured, 16 planned; hosts: 1 measured, 2 planned" in cal.partly
    assert calibration.for_plan(h100, gpu, str(tmp_path), "bfloat16",
                                calibration.Devices.of_hardware(h100, 1)).measured == full.measured
    # Another machine, or no origin: nothing applies.
    other = _calibration(tmp_path / "run" / calibration.FILE, devices=8, local=8, machine="Some CPU, 64 CPUs")
    left = calibration.for_plan(hw(1e9), None, str(tmp_path / "run"), "float32", here)
    assert left.measured == () and left.hw == hw(1e9)
    assert left.note("the devices at hand").endswith(
        f"; {other}: it was measured on 'Some CPU, 64 CPUs', this machine is {here.machine!r}, not used")
    with pytest.raises(ConfigError, match="does not fit: it was measured on 'Some CPU, 64 CPUs', this machine is"):
        calibration.for_plan(hw(1e9), other, str(tmp_path), "float32", here)
    old = calibration.write(str(tmp_path / "run" / calibration.FILE), device_kind="cpu", platform="cpu", devices=8,
                            hosts=1, matmul_gflops={"float32": 10.0}, axes={})
    left = calibration.for_plan(hw(1e9), None, str(tmp_path / "run"), "float32", here)
    assert left.measured == () and "\n" not in left.note("x")
    assert left.note("x").endswith(f"; {old}: it does not say what it was measured on (written before calibrations "
                                   "recorded their origin); `jaxtrain check run.dir=DIR` on the devices planned for "
                                   "remakes it, not used")
    with pytest.raises(ConfigError, match="does not say what it was measured on"):
        calibration.for_plan(hw(1e9), old, str(tmp_path), "float32", here)


@pytest.fixture(scope="module")
def compiled_small(tmp_path_factory):
    """Every candidate of SMALL on one device (remat none / full, one microbatch) compiled into a cache: the
    independent reference for the budgets below, and the searches then read the cache."""
    tmp = tmp_path_factory.mktemp("auto")
    cfg = load_config(None, [f"run.dir={tmp / 'run'}", *SMALL])
    cache = str(tmp / "cache")
    kw = dict(remats=("none", "full"), microbatches=[1])
    memory = {}
    for c in space.candidates(cfg, 1, 1, **kw):
        comp, _ = compile_cache.compile_cached(c.apply(cfg), c.shape, jax.devices()[:1], cache)
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
    text = auto_report.format_result(tight)
    assert f"auto layout: {smallest}" in text and "from the cache" in text


def test_sized_matmul_rates_and_layer_overhead_change_the_estimate_as_computed_by_hand(make_config, tmp_path):
    """SMALL on one device: a microbatch holds 4 x 16 = 64 rows, halfway (in log) between 16 and 256, so the
    log-log interpolation of (16: 0.25, 256: 1.0) gives 0.5: the FLOPs take twice as long; the fixed cost is
    1 ms x (2 layers + 1) per microbatch."""
    cfg = make_config(*SMALL)
    shape = space.candidates(cfg, 1, 1, remats=("none",), microbatches=[1])[0].shape
    plain = hw(1e9)
    sized = calibration.sized(plain, ((256.0, 1.0), (16.0, 0.25)), 1e-3)
    assert sized.matmul_rows == ((16.0, 0.25), (256.0, 1.0)) and sized.peak_flops == plain.peak_flops
    assert cost.matmul_factor(sized, 64) == pytest.approx(0.5)
    assert cost.matmul_factor(sized, 4) == pytest.approx(0.25) and cost.matmul_factor(sized, 1e4) == 1.0  # clamped
    assert cost.matmul_factor(plain, 64) == 1.0  # no table: the rate alone, as before
    one = cost.compute_seconds(cfg, shape, plain)
    assert cost.compute_seconds(cfg, shape, sized) == pytest.approx(one / 0.5 + 1e-3 * 3)
    # Two microbatches: the same FLOPs on 32 rows (0.25 ** 0.75 of the best rate), the fixed cost twice.
    two = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))
    assert cost.compute_seconds(two, shape, sized) == pytest.approx(one / 0.25 ** 0.75 + 2 * 1e-3 * 3)
    # Tensor parallelism: each device multiplies all 64 rows by half the weight, the work of 32 rows.
    tensor2 = next(c.shape for c in space.candidates(cfg, 2, 1, remats=("none",), microbatches=[1])
                   if c.shape.axis_sizes["tensor"] == 2)
    assert cost.compute_seconds(cfg, tensor2, sized) == pytest.approx(
        cost.compute_seconds(cfg, tensor2, plain) / 0.25 ** 0.75 + 1e-3 * 3)
    # A calibration file may carry them (for the compute dtype).
    path = calibration.write(str(tmp_path / calibration.FILE), device_kind="cpu", platform="cpu", devices=1,
                             hosts=1, matmul_gflops={"float32": 5.0}, axes={})
    body = {**calibration.read(path), "matmul_rows": {"float32": [[16, 0.25], [256, 1.0]]}, "layer_overhead_s": 1e-3}
    got = calibration.apply(plain, body, path, "float32").hw
    assert got.matmul_rows == sized.matmul_rows and got.layer_overhead_s == 1e-3 and got.peak_flops == 5e9


def _row(label: str, est: float) -> space.Row:
    """A compiled, fitting row with estimate ``est`` (what the trial's choice reads)."""
    shape = space.candidates(load_config(None, SMALL), 1, 1, remats=("none",), microbatches=[1])[0].shape
    cand = space.Candidate(shape, label, 1, "gpipe")  # the remat field carries the label: rows must differ
    parts = {"compute": est, "intra_node": 0.0, "inter_node": 0.0, "optimizer": 0.0}
    return space.Row(cand, 0, 0, est, est, result={"est_step_seconds": est, "fits": True, "time": parts,
                                                  "memory_bytes_per_device": 1e6})


def test_trial_chooses_the_measured_fastest_finalist():
    rows = [_row("a", 1.0), _row("b", 1.2), _row("c", 1.4), _row("d", 1.0 * auto.TRIAL_WITHIN + 0.1)]
    res = space.AutoResult(rows[0], rows[1], [], rows, 1e9, 1.0, 4, 0, 0, 0, 0, fitting=list(rows))
    fin = auto.finalists(res)
    assert [r.cand.remat for r in fin] == ["a", "b", "c"]  # d: estimated too far behind
    assert auto.finalists(res, most=2) == fin[:2] and auto.finalists(res, within=1.1) == []  # one alone: no trial
    auto.apply_trial(res, {rows[0].cand: 0.3, rows[1].cand: 0.1, rows[2].cand: 0.2})
    assert res.choice is rows[1] and res.runner_up is rows[2] and res.estimated is rows[0]
    assert [r.measured_s for r in res.trial] == [0.1, 0.2, 0.3]
    text = auto_report.format_result(res)
    assert text.startswith("auto layout: one-device, remat b, microbatches 1: est. step 1200.0 ms, measured "
                           "100.0 ms in the trial")
    assert "the estimate alone picked" in text and auto_report.to_json(res)["choice"]["measured_step_seconds"] == 0.1
    # Ties on the measurement break on the label: the same times give the same choice.
    tie = space.AutoResult(rows[0], None, [], rows, 1e9, 1.0, 4, 0, 0, 0, 0, fitting=list(rows))
    auto.apply_trial(tie, {rows[2].cand: 0.1, rows[1].cand: 0.1})
    assert tie.choice is rows[1]


def test_trial_steps_are_validated(make_config):
    assert make_config().mesh.auto_trial_steps == 6
    with pytest.raises(ConfigError, match=r"mesh.auto_trial_steps=-1 must be >= 0"):
        make_config("mesh.auto_trial_steps=-1")


@pytest.mark.slow
def test_trial_runs_the_finalists_and_takes_the_fastest_measured(compiled_small, monkeypatch):
    """The real trial on one device: both remat policies of SMALL are finalists (a wide window), each runs two
    steps, and the choice is the one measured faster."""
    cfg, cache, kw, _ = compiled_small
    dev = jax.devices()[:1]
    res = auto.search_layout(cfg, dev, hw(1e12), cache_dir=cache, **{**kw, "remats": ("full",)})
    res.fitting += auto.search_layout(cfg, dev, hw(1e12), cache_dir=cache, **{**kw, "remats": ("none",)}).fitting
    fin = auto.finalists(res, within=100.0)
    assert len(fin) == 2
    runs: list = []
    real = trial.step_times

    def counted(c, cand, devices, steps, executable=None):
        runs.append((cand.remat, steps))
        return real(c, cand, devices, steps, executable)

    monkeypatch.setattr(trial, "step_times", counted)
    seconds = trial.measure(cfg, [r.cand for r in fin], dev, 3)
    # Two passes, the second in the reverse order, splitting the 3 steps 2 + 1.
    first, second = fin[0].cand.remat, fin[1].cand.remat
    assert runs == [(first, 2), (second, 2), (second, 1), (first, 1)]
    assert all(0 < t < 60 for t in seconds.values())
    auto.apply_trial(res, seconds)
    assert res.choice.cand == min(seconds, key=lambda c: (seconds[c], c.label))
    assert res.choice.measured_s == seconds[res.choice.cand]


@pytest.mark.slow
def test_a_second_search_in_another_run_directory_compiles_and_times_nothing(tmp_path):
    """train mesh.auto=true twice, each in its own run directory, one user cache: the first says what it does as it
    goes (the candidates, the timings, each compile, the trial) and trains with the search's own compile of its
    choice; the second takes the first's CPU timings, so its search visits the same candidates and finds every
    reading in the cache, compiling none."""
    import os
    import re

    from jaxtrain_testing import run_cli

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    runs = [run_cli("train", f"run.dir={tmp_path / name}", "runtime.cpu_devices=1", "mesh.auto=true", *SMALL,
                    "train.steps=1", "train.eval_every=0", env=env, timeout=900) for name in ("a", "b")]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (p.stderr for p in runs)
    said = [re.search(pattern, first, re.M) for pattern in (
        r"mesh\.auto: \d+ candidate layouts over 1 cpu device", r"mesh\.auto: timing the 1 CPU devices",
        r"mesh\.auto: timing the model's step", r"mesh\.auto: \[1/\d\] .*compiled in", r"auto layout: ",
        r"mesh\.auto: [\d.]+ s in all", r"the train step \(compiled by mesh\.auto's search: reused\)")]
    assert all(said) and [m.start() for m in said] == sorted(m.start() for m in said), first[-3000:]
    compiled = int(re.search(r"the search [\d.]+ s \((\d+) compiled, 0 from the cache\)", first).group(1))
    assert compiled >= 1
    assert "the CPU timings of an earlier search of this model on these devices" in second
    assert re.search(rf"the search [\d.]+ s \(0 compiled, {compiled} from the cache\)", second), second[-3000:]


@pytest.mark.slow
def test_two_processes_trial_process_0s_finalists_and_train_its_fastest(tmp_path):
    """launch/local.sh 2 (one CPU device each): both processes run process 0's finalists in its order (the trial
    is collective) and train the fastest process 0 measured; config.yaml records it with mesh.auto false."""
    import re

    import yaml

    from jaxtrain_testing import launch_local

    proc = launch_local(2, "train", f"run.dir={tmp_path}", "runtime.cpu_devices=1", "mesh.auto=true", *SMALL,
                        "train.steps=1", "observe.prometheus_linger_s=0", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trial = {i: re.findall(rf"^\[{i}\] .*mesh\.auto trial \[\d+/\d+\] (.+): ([\d.]+) ms a step", proc.stdout, re.M)
             for i in (0, 1)}
    assert len(trial[0]) >= 2 and [c for c, _ in trial[0]] == [c for c, _ in trial[1]]
    fastest = min(trial[0], key=lambda ct: (float(ct[1]), ct[0]))[0]
    assert re.search(rf"^\[0\] .*auto layout: {re.escape(fastest)}: est\. step", proc.stdout, re.M)
    with open(tmp_path / "config.yaml") as f:
        saved = yaml.safe_load(f)
    assert saved["mesh"]["auto"] is False and f"remat {saved['model']['remat']}" in fastest
