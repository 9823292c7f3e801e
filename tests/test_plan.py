"""The planner: collective bytes read from the compiled HLO against closed forms, memory, the cost model, the CLI.
(The HLO reading alone, on stored HLO text, is tested in test_planner_hlo.py.)

Compiles use the tiny model on the 8 emulated CPU devices that conftest sets up (a few seconds each); each mesh is
compiled once per module.
"""

import dataclasses
import json
import math
import os

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, hardware, load_config
from jaxtrain.models import flops as model
from jaxtrain.models.flops import count_params
from jaxtrain.parallel.dims import MESH_AXES, MeshShape
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.planner.cost import collectives
from jaxtrain.planner.cost import model as cost
from jaxtrain.planner.search import meshes as search
from jaxtrain.planner.search import report
from jaxtrain_testing import FAST, run_cli

MESHES = {
    "data8": ["mesh.ici.data=8", "mesh.ici.fsdp=1"],
    "fsdp8": ["mesh.ici.fsdp=8"],
    # tensor=8 needs 8 kv heads (the tiny model has 4)
    "tensor8": ["mesh.ici.tensor=8", "mesh.ici.fsdp=1", "model.n_kv_heads=8"],
    "data2fsdp4": ["mesh.ici.data=2", "mesh.ici.fsdp=4"],
}


def tiny(*overrides):
    return load_config(None, ["runtime.cpu_devices=8", *FAST, *overrides])


@pytest.fixture(scope="module")
def compiled():
    """name -> (config, shape, search.Compiled), compiled on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cfg = tiny(*MESHES[name])
            shape = MeshShape.resolve(cfg.mesh, 8)
            cache[name] = (cfg, shape, search.compile_step(cfg, shape, jax.devices()[:8]))
        return cache[name]

    return get


def by_kind(comp):
    out = {k: 0 for k in collectives.KINDS}
    for c in comp.collectives:
        out[c.kind] += c.total_bytes
    return out


def grad_bytes(cfg):
    return count_params(cfg.model)["total"] * 4  # float32 parameters, so float32 gradients


def test_data_parallel_all_reduces_the_gradients_once(compiled):
    cfg, _, comp = compiled("data8")
    kinds = by_kind(comp)
    assert kinds["all-reduce"] == pytest.approx(grad_bytes(cfg), rel=0.10)
    assert kinds["all-gather"] == kinds["reduce-scatter"] == 0
    # The per-layer gradients are reduced inside the scanned layer loop: counted once per layer.
    assert {c.count for c in comp.collectives} == {1, cfg.model.n_layers}


def test_fsdp_gathers_parameters_twice_and_reduce_scatters_gradients(compiled):
    cfg, _, comp = compiled("fsdp8")
    kinds = by_kind(comp)
    # Forward and again in the backward pass (no remat, yet XLA re-gathers rather than keep whole weights).
    assert kinds["all-gather"] == pytest.approx(2 * grad_bytes(cfg), rel=0.10)
    assert kinds["reduce-scatter"] == pytest.approx(grad_bytes(cfg), rel=0.10)
    assert kinds["all-reduce"] < 0.01 * grad_bytes(cfg)  # only the replicated norm scales and scalars


def test_tensor_parallel_all_reduces_activations_per_layer(compiled):
    cfg, _, comp = compiled("tensor8")
    m, t = cfg.model, cfg.train
    activation = t.global_batch * cfg.data.seq_len * m.d_model * 4  # [batch, seq, embed] float32
    # Per layer: forward, the attention and MLP outputs (partial sums over heads / d_ff); backward, the input
    # gradients of q,k,v (one all-reduce once reassociated) and of gate,up. Plus one: the gradient into the final
    # norm through the vocab-sharded tied output projection.
    expected = (4 * m.n_layers + 1) * activation
    assert by_kind(comp)["all-reduce"] == pytest.approx(expected, rel=0.10)
    layer_ars = [c for c in comp.collectives if c.kind == "all-reduce" and c.count == m.n_layers]
    assert len(layer_ars) == 4 and all(c.bytes == activation for c in layer_ars)


def test_fsdp_state_is_an_eighth_of_data_parallel(compiled):
    _, _, data = compiled("data8")
    _, _, fsdp = compiled("fsdp8")
    assert fsdp.params_bytes + fsdp.opt_bytes == pytest.approx((data.params_bytes + data.opt_bytes) / 8, rel=0.05)
    assert data.opt_bytes == pytest.approx(2 * data.params_bytes, rel=0.01)  # AdamW: two moments
    assert 0 < fsdp.temp_bytes and fsdp.memory_bytes >= fsdp.params_bytes + fsdp.opt_bytes + fsdp.temp_bytes


def test_one_compile_serves_every_ici_dcn_split(compiled):
    """The program depends on the axis sizes only; the ici/dcn split only renames devices (why plan() compiles once
    per sizes)."""
    _, _, a = compiled("data2fsdp4")
    b = search.compile_step(tiny(), _mesh((1, 1, 4, 1), (2, 1, 1, 1)), jax.devices()[:8])

    def key(comp):
        return sorted((c.kind, c.bytes, c.count, c.groups.tolist().__repr__()) for c in comp.collectives)

    assert key(a) == key(b) and a.memory_bytes == b.memory_bytes


def test_node_coordinates_match_build_mesh():
    """The planner's logical id -> node mapping (MeshShape.node_of) is the one build_mesh lays out (contiguous
    devices play a host)."""
    for ici, dcn in [((1, 1, 4, 1), (2, 1, 1, 1)), ((2, 1, 2, 1), (1, 1, 2, 1)), ((1, 1, 2, 2), (2, 1, 1, 1)),
                     ((1, 1, 4, 1), (1, 2, 1, 1)), ((1, 2, 2, 1), (1, 1, 2, 1)), ((1, 2, 1, 2), (2, 1, 1, 1))]:
        shape = _mesh(ici, dcn)
        mesh, built = build_mesh(shape.apply(tiny("train.microbatches=4", "train.global_batch=64")), jax.devices()[:8])
        assert built == shape
        per_host = 8 // math.prod(dcn)
        ids = np.arange(8)
        node = shape.node_of(ids)
        host_of = [d.id // per_host for d in mesh.devices.flat]
        for n in set(node.tolist()):
            members = [i for i in ids if node[i] == n]
            assert len({host_of[i] for i in members}) == 1  # one node = one host's devices
        assert len(set(node.tolist())) == math.prod(dcn)


def test_group_span_and_hierarchical_link_bytes():
    shape = _mesh((1, 1, 4, 1), (2, 1, 1, 1))  # fsdp within a node, data across 2 nodes
    over_data = np.array([[0, 4], [1, 5], [2, 6], [3, 7]])
    over_fsdp = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert cost.group_span(shape, over_data) == (1, 2, ["data(dcn)"])
    assert cost.group_span(shape, over_fsdp) == (4, 1, ["fsdp"])
    assert cost.group_span(shape, np.arange(8)[None]) == (4, 2, ["data(dcn)", "fsdp"])
    # Ring all-reduce of S over n devices sends 2 S (n-1)/n per device; hierarchically, the network carries only
    # the 1/a shard each device holds after the in-node reduce-scatter.
    assert cost.link_bytes("all-reduce", 800, 8, 1, False) == (1400, 0)
    assert cost.link_bytes("all-reduce", 800, 1, 8, True) == (0, 1400)
    assert cost.link_bytes("all-reduce", 800, 8, 8, True) == (1400, 175)
    assert cost.link_bytes("all-gather", 800, 4, 2, True) == (600, 100)
    assert cost.link_bytes("collective-permute", 800, 1, 2, True) == (0, 800)


def small_hardware(usable_bytes):
    return hardware.Hardware(name="test", device="test", peak_flops=1e12, hbm_bytes=usable_bytes, hbm_bandwidth=1e11,
                         devices_per_node=8, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10,
                         compute_efficiency=0.5)


def test_plan_prunes_what_cannot_fit_and_marks_what_does_not(compiled):
    cfg, fsdp_shape, fsdp = compiled("fsdp8")
    _, _, data = compiled("data8")
    # Less than data parallelism's parameters + optimizer state: data8 is pruned without compiling; fsdp8's state
    # fits but not its whole step (temporaries included), so it is compiled and marked.
    hw = small_hardware(data.params_bytes + data.opt_bytes - 1)
    assert fsdp.params_bytes + fsdp.opt_bytes < hw.usable_bytes < fsdp.memory_bytes
    shapes = [MeshShape.resolve(tiny(*MESHES[n]).mesh, 8) for n in ("data8", "fsdp8")]
    result = search.plan(tiny(), shapes, hw, jax.devices()[:8])
    assert [p["label"] for p in result["pruned"]] == ["data8"]
    (cand,) = result["candidates"]
    assert cand["label"] == "fsdp8" and cand["mesh"]["fsdp"] == 8 and not cand["fits"]
    assert cand["memory_bytes_per_device"] == fsdp.memory_bytes
    for wide in (False, True):
        text = report.format_report(tiny(), hw, 8, 1, result, wide=wide)
        assert "fsdp8" in text and " NO " in text and "pruned" in text
        assert max(map(len, text.splitlines())) <= (200 if wide else report.WIDTH)
    assert search.candidate_result(cfg, fsdp_shape, small_hardware(fsdp.memory_bytes), fsdp)["fits"]


def test_hybrid_sharding_within_nodes_crosses_nodes_less(compiled):
    """data=2 x fsdp=4 on 2 nodes of 4: sharding within a node and replicating across (ici fsdp 4, dcn data 2) sends
    far fewer bytes between nodes than replicating within and sharding across (ici data 2 fsdp 2, dcn fsdp 2)."""
    hw = small_hardware(1e12)
    cfg, _, prog = compiled("data2fsdp4")

    def est(shape):
        return cost.estimate(cfg, shape, hw, prog.collectives, prog.params_bytes, prog.opt_bytes)[0]

    hsdp = est(_mesh((1, 1, 4, 1), (2, 1, 1, 1)))
    reverse = est(_mesh((2, 1, 2, 1), (1, 1, 2, 1)))
    single = est(_mesh((2, 1, 4, 1), (1, 1, 1, 1)))
    grads = grad_bytes(cfg)
    # HSDP: only the all-reduce of each device's 1/4 gradient shard crosses: 2 x G/4 x 1/2 = G/4. Reverse: fsdp
    # spans 2 devices x 2 nodes, so its gathers (forward, backward) and reduce-scatter each cross with
    # (G/2) x 1/2 = G/4: 3G/4 in all.
    assert hsdp.dcn_bytes == pytest.approx(grads / 4, rel=0.15)
    assert reverse.dcn_bytes == pytest.approx(0.75 * grads, rel=0.15)
    assert single.dcn_bytes == 0 and single.serial_s < hsdp.serial_s < reverse.serial_s
    assert single.overlap_s < single.serial_s


# -- the command line ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_json_two_devices():
    proc = run_cli("plan", "runtime.cpu_devices=2", *FAST, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    cands = {(c["mesh"]["data"], c["mesh"]["fsdp"], c["mesh"]["tensor"]): c for c in result["candidates"]}
    assert set(cands) == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}  # stage 2 needs train.microbatches >= 2: the note says
    assert any("train.microbatches=1 must be a multiple of the 2 pipeline stages" in n for n in result["notes"])
    data, fsdp = cands[(2, 1, 1)], cands[(1, 2, 1)]
    for c in result["candidates"]:
        assert set(c["collective_bytes"]) == set(collectives.KINDS)
        assert c["mesh"]["dcn"] == {ax: 1 for ax in MESH_AXES} and c["mesh"]["stage"] == 1
        assert c["est_step_seconds"] > 0 and isinstance(c["fits"], bool) and c["bubble_fraction"] == 0
    assert fsdp["memory"]["params"] + fsdp["memory"]["optimizer"] < 0.6 * (data["memory"]["params"] +
                                                                            data["memory"]["optimizer"])
    assert data["collective_bytes"]["all-reduce"] > 0 and fsdp["collective_bytes"]["all-gather"] > 0
    order = [(not c["fits"], c["est_step_seconds"]) for c in result["candidates"]]
    assert order == sorted(order)  # meshes that fit first, then by estimated step time


@pytest.mark.slow
def test_plan_auto_writes_its_cache_into_no_run_directory(tmp_path):
    """`plan mesh.auto=true` without run.dir used to leave a plan-cache/ in runs/tiny, the default job's directory:
    its readings go into the user's cache ($XDG_CACHE_HOME/jaxtrain/plan), nothing into the working directory."""
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    small = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
             "model.vocab_size=64", "data.seq_len=16", "train.global_batch=4", "data.source=synthetic"]
    proc = run_cli("plan", "runtime.cpu_devices=1", "mesh.auto=true", *small, cwd=work,
                   env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "auto layout: one-device" in proc.stdout
    assert os.listdir(work) == []
    entries = os.listdir(cache / "jaxtrain" / "plan")
    assert entries and all(e.endswith(".json") for e in entries)


@pytest.mark.slow
def test_cli_plans_a_bfloat16_pipeline_on_the_devices_at_hand():
    """XLA:CPU aborts in AllReducePromotion on the pipeline's bfloat16 psum over the stage axis; the plan skips the
    pass and reads the ring's permutes at 2 bytes an element (one microbatch, 4 sequences over fsdp 4, per device)."""
    proc = run_cli("plan", "runtime.cpu_devices=8", "model.dtype=bfloat16", "mesh.ici.stage=2", "mesh.ici.fsdp=4",
                   "train.microbatches=4", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (cand,) = json.loads(proc.stdout)["candidates"]
    assert cand["bubble_fraction"] == pytest.approx(1 / 5) and cand["pipeline"]["iterations"] == 5
    cfg = tiny()
    microbatch = 16 // 4 // 4 * cfg.data.seq_len * cfg.model.d_model * 2
    assert cand["collective_bytes"]["collective-permute"] == 2 * 5 * microbatch


@pytest.mark.parametrize("args, expected", [
    (["--hardware", "h999-8x"],
     "hardware 'h999-8x' is neither a file nor a shipped name; shipped: a100-8x, b200-8x, h100-8x, h200-8x"),
    (["runtime.cpu_devices=7"], "no valid mesh over 7 device(s) on 1 node(s): "),
    (["runtime.cpu_devices=8", "--nodes", "3"], "8 device(s) cannot be split evenly into 3 node(s)"),
    (["--hardware", "h100-8x", "--nodes", "2", "mesh.ici.fsdp=4", "mesh.dcn.data=2"],
     "has 8 devices but 16 are available"),
    (["--hardware", "h100-8x", "mesh.ici.fsdp=3"], "the mesh (ici.fsdp=3) has 3 devices but 8 are available"),
    (["runtime.cpu_devices=8", "mesh.ici.fsdp=3"], "the mesh (ici.fsdp=3) has 3 devices but 8 are available"),
    (["--hardware", "h100-8x", "--nodes", "0"], "argument --nodes: '0': node counts must be >= 1"),
    (["--nodes", "4,x", "--tokens", "2e12"], "argument --nodes: '4,x': expected node counts"),
    (["--tokens", "0"], "argument --tokens: '0': expected a finite number > 0"),
    (["--tokens", "2e12", "--gpu-hour-cost", "-1"], "argument --gpu-hour-cost: '-1': expected a finite number >= 0"),
    (["--gpu-hour-cost", "2.5"], "--gpu-hour-cost needs --tokens"),
    (["--nodes", "4,8"], "--nodes 4,8: several node counts need --tokens"),
])
def test_cli_bad_input_exits_2_with_one_line(args, expected):
    proc = run_cli("plan", *args, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # the CPU's device count is known
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert expected in lines[0]


def test_impossible_device_count_says_why():
    with pytest.raises(ConfigError, match=r"no valid mesh over 7 device\(s\).*not divisible by the "):
        search.enumerate_shapes(tiny(), 7, 1)
    shapes = search.enumerate_shapes(tiny(), 64, 8)
    tensor = MESH_AXES.index("tensor")
    assert all(s.dcn[tensor] == 1 and math.prod(s.dcn) == 8 and math.prod(s.ici) == 8 for s in shapes)
    assert all(tiny().model.n_kv_heads % s.axis_sizes["tensor"] == 0 for s in shapes)


def test_enumeration_covers_stages_when_microbatches_allow():
    """The stage axis is enumerated within and across nodes; one microbatch rules every pipeline out, and the note
    says what to set."""
    shapes, rejected = search.search_shapes(tiny(), 64, 8)
    assert all(s.axis_sizes["stage"] == 1 for s in shapes)
    note = search.pipeline_note(tiny(), rejected, shapes)
    assert note is not None and "train.microbatches=1 must be a multiple of the 2 pipeline stages" in note
    assert "Set train.microbatches to a multiple of the stages (4 covers 2, 4)" in note  # 4 layers: 2 or 4 stages
    cfg = tiny("train.microbatches=4", "train.global_batch=64")
    shapes, rejected = search.search_shapes(cfg, 64, 8)
    assert search.pipeline_note(cfg, rejected, shapes) is None
    staged = [s for s in shapes if s.axis_sizes["stage"] > 1]
    assert {s.ici[1] for s in staged} == {1, 2, 4} and {s.dcn[1] for s in staged} == {1, 2, 4}
    # 8 stages: 4 layers do not split
    assert all(s.axis_sizes["stage"] in (2, 4) and s.dcn[MESH_AXES.index("tensor")] == 1 for s in staged)
    # Each shape once; stage x data x fsdp x tensor covers every factorisation the checks allow.
    assert len({(s.ici, s.dcn) for s in shapes}) == len(shapes)


def test_chat_data_plans_no_pipeline_and_says_why():
    """data.format=chat cannot run with stages (ParallelDims.check): the search rejects every stage > 1 mesh it
    would otherwise plan, the note names that reason (no microbatch hint: more microbatches do not help), and a given
    stage > 1 mesh is refused in one line."""
    tokens = tiny("train.microbatches=4", "train.global_batch=64")
    # format set past validation (a chat config needs a tokenizer and a chat file; the search reads the format only)
    chat = dataclasses.replace(tokens, data=dataclasses.replace(tokens.data, format="chat"))
    shapes, _ = search.search_shapes(tokens, 64, 8)
    assert any(s.axis_sizes["stage"] > 1 for s in shapes)
    shapes, rejected = search.search_shapes(chat, 64, 8)
    assert shapes and all(s.axis_sizes["stage"] == 1 for s in shapes)
    assert {(s.ici, s.dcn) for s in shapes} == {(s.ici, s.dcn) for s in search.search_shapes(tokens, 64, 8)[0]
                                                if s.axis_sizes["stage"] == 1}
    note = search.pipeline_note(chat, rejected, shapes)
    assert note is not None and "data.format=chat (a per-token loss mask) is not yet supported" in note
    assert "Set train.microbatches" not in note
    staged = dataclasses.replace(chat, mesh=dataclasses.replace(
        chat.mesh, ici=dataclasses.replace(chat.mesh.ici, stage=2, fsdp=4)))
    with pytest.raises(ConfigError, match=r"data.format=chat .* \(mesh stage=2\)"):
        search.given_shape(staged, 8, 1)


def test_hardware_files_are_complete():
    for name in hardware.known_hardware():
        hw = hardware.load_hardware(name)
        assert hw.devices_per_node == 8 and hw.inter_node_bandwidth < hw.intra_node_bandwidth
    assert hardware.load_hardware("h100-8x").inter_node_bandwidth == 50e9  # 400 Gb/s per GPU
    assert hardware.load_hardware("a100-8x").inter_node_bandwidth == 25e9  # 200 Gb/s per GPU
    assert dataclasses.replace(hardware.load_hardware("h200-8x"), mem_fraction=0.5).usable_bytes == 70.5e9


# -- pipeline parallelism -----------------------------------------------------------------------------------------

PIPELINE = ["mesh.ici.stage=2", "mesh.ici.fsdp=4", "train.microbatches=4", "train.virtual_stages=2"]


@pytest.fixture(scope="module")
def pipelined():
    """(config, search.Compiled) of stage 2 x fsdp 4, 4 microbatches, 2 virtual stages (one layer per chunk)."""
    cfg = tiny(*PIPELINE)
    return cfg, search.compile_step(cfg, MeshShape.resolve(cfg.mesh, 8), jax.devices()[:8])


def test_pipeline_bubble_and_permutes_against_closed_forms(pipelined):
    """The ring's permutes run once per iteration of the forward loop and of its transpose, each moving one
    microbatch's activations per device; interleaving adds one permute per moved chunk of layer weights (forward)
    and of their gradients (backward). All of them run along the stage axis only, within a node on one node and
    across nodes when the stages are split over nodes."""
    cfg, comp = pipelined
    m, t = cfg.model, cfg.train
    s_n, m_n, v_n, fsdp = 2, t.microbatches, t.virtual_stages, 4
    iterations = m_n * v_n + s_n - 1
    assert iterations == 9
    microbatch = t.global_batch // m_n // fsdp * cfg.data.seq_len * m.d_model * 4  # float32, per device
    ring = 2 * iterations * microbatch
    # One chunk (n_layers / (stages x virtual) = 1 layer) of weights as a device holds it: matrices split over fsdp
    # (their embed dimension), the two norm scales whole.
    hd = m.resolved_head_dim
    layer = 4 * (2 * m.d_model * m.n_heads * hd + 2 * m.d_model * m.n_kv_heads * hd + 3 * m.d_model * m.d_ff) // fsdp \
        + 4 * 2 * m.d_model
    chunk = m.n_layers // (s_n * v_n) * layer
    # Stage d stores chunks d V .. d V + V - 1 and runs chunk c on stage c % S: the ones it stores and does not run
    # leave it, once forward and once backward (their gradients).
    moved = sum(c // v_n != c % s_n for c in range(s_n * v_n)) // s_n
    exchange = 2 * moved * chunk
    permutes = [c for c in comp.collectives if c.kind == "collective-permute"]
    assert sum(c.total_bytes for c in permutes) == ring + exchange
    ring_ops = [c for c in permutes if c.count > 1]
    assert [c.count for c in ring_ops] == [iterations, iterations] and all(c.bytes == microbatch for c in ring_ops)

    hw = small_hardware(1e12)
    one_node = MeshShape.resolve(cfg.mesh, 8)
    two_nodes = _mesh((1, 1, 4, 1), (1, 2, 1, 1))  # the same sizes, stages on different nodes
    for shape, stage_axis in ((one_node, "stage"), (two_nodes, "stage(dcn)")):
        assert {tuple(cost.group_span(shape, c.groups)[2]) for c in permutes} == {(stage_axis,)}
        r = search.candidate_result(cfg, shape, hw, comp)
        assert r["bubble_fraction"] == pytest.approx((s_n - 1) / (m_n * v_n + s_n - 1))
        assert (r["microbatches"], r["virtual_stages"], r["pipeline"]["stages"]) == (m_n, v_n, s_n)
        assert r["pipeline"]["iterations"] == iterations
        permute_bytes = r["pipeline"]["permute_bytes_per_device"]
        crosses = shape is two_nodes
        assert permute_bytes == {"intra_node": 0 if crosses else ring + exchange, "inter_node": ring + exchange
                                 if crosses else 0}
        assert r["pipeline"]["temp_bytes_per_stage"] == comp.temp_bytes * 4
        tokens = t.global_batch * cfg.data.seq_len
        flops = model.train_flops_per_token(m, cfg.data.seq_len) * tokens / 8
        assert r["time"]["compute"] == pytest.approx(flops / (hw.peak_flops * hw.compute_efficiency) * 9 / 8)
    text = report.format_report(cfg, hw, 8, 2, {"candidates": [search.candidate_result(cfg, two_nodes, hw, comp)],
                                                "pruned": []})
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("#  mesh"))
    assert "bubble" in lines[at].split() and "11.1%" in lines[at + 2].split()


def test_table_fits_120_columns_with_the_longest_mesh_label(pipelined):
    """A pipeline plan over 8 nodes can name all three dcn axes and three ici axes; the table still fits, the labels
    then shortened to the axes' initials (and the note says so)."""
    cfg, comp = pipelined
    hw = small_hardware(1e12)
    shapes = search.enumerate_shapes(tiny("train.microbatches=8", "train.global_batch=64"), 64, 8)
    longest = max(shapes, key=lambda s: len(s.label)).label
    row = search.candidate_result(cfg, MeshShape.resolve(cfg.mesh, 8), hw, comp)
    text = report.format_report(cfg, hw, 64, 8, {"candidates": [dict(row, label=longest), row], "pruned": []})
    assert max(map(len, text.splitlines())) <= report.WIDTH
    short = " ".join(w[0] + w.lstrip("abcdefghijklmnopqrstuvwxyz") if w[0].isalpha() and w != "dcn" else w
                     for w in longest.split())
    assert f"1  {short} " in text or f"2  {short} " in text
    assert report.SHORT_LABELS in text


def test_1f1b_rows_add_one_forward_and_keep_the_bubble(pipelined):
    """The cost model of train.pipeline_schedule=1f1b on the same compile: compute x (1 + 1/3) for the forward each
    backward recomputes (remat none), GPipe's bubble, the 1F1B loop's iterations, the row marked as 1F1B."""
    from jaxtrain.parallel import pipeline_1f1b

    cfg, comp = pipelined
    one_f_one_b = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pipeline_schedule="1f1b"))
    shape, hw = MeshShape.resolve(cfg.mesh, 8), small_hardware(1e12)
    gpipe, row = search.candidate_result(cfg, shape, hw, comp), search.candidate_result(one_f_one_b, shape, hw, comp)
    assert row["time"]["compute"] == pytest.approx(gpipe["time"]["compute"] * 4 / 3)
    assert row["bubble_fraction"] == gpipe["bubble_fraction"] == pytest.approx(1 / 9)
    assert row["pipeline"]["iterations"] == pipeline_1f1b.iterations(2, 4, 2) == 8 + 3 * 2 - 2
    assert (row["schedule"], gpipe["schedule"]) == ("1f1b", "gpipe") and row["label"] == gpipe["label"] + " 1f1b"
    assert cost.pipeline_recompute(one_f_one_b, MeshShape.resolve(tiny().mesh, 8)) == 0.0  # no stages: no pipeline


@pytest.mark.slow
def test_plan_adds_1f1b_where_gpipe_does_not_fit():
    """Stage 4 x fsdp 2, 16 microbatches of one sequence per device: GPipe's compiled step needs more than the
    hardware's memory, so the plan compiles the 1F1B schedule too, which fits and ranks first."""
    cfg = tiny("mesh.ici.stage=4", "mesh.ici.fsdp=2", "train.microbatches=16", "train.global_batch=32",
               "data.seq_len=64")
    shape = MeshShape.resolve(cfg.mesh, 8)
    result = search.plan(cfg, [shape], small_hardware(12e6), jax.devices()[:8])
    rows = result["candidates"]
    assert [r["schedule"] for r in rows] == ["1f1b", "gpipe"]
    assert rows[0]["fits"] and not rows[1]["fits"]
    assert rows[0]["memory"]["temp"] < rows[1]["memory"]["temp"] / 4


# -- time and money: plan --tokens ----------------------------------------------------------------------------------


def test_training_budget_against_a_hand_computation():
    """2e12 tokens in steps of 512 x 4096 tokens at 3.93 s on 64 devices, 2.5 a device-hour."""
    got = report.training_budget(2e12, 512 * 4096, 3.93, 64, 2.5)
    steps = 953_675  # 2e12 / 2,097,152 = 953,674.3: the last step is whole
    seconds = steps * 3.93  # 3,747,942.75 s
    assert got["steps"] == steps
    assert got["days"] == pytest.approx(seconds / 86400)  # 43.38 days
    assert got["gpu_hours"] == pytest.approx(seconds / 3600 * 64)  # 66,630 device-hours
    assert got["cost"] == pytest.approx(seconds / 3600 * 64 * 2.5)  # 166,575
    assert report.training_budget(2e12, 512 * 4096, 3.93, 64)["cost"] is None
    # Twice the devices at 2.1 s instead of 3.93 s: 3.93 x 64 / (2.1 x 128) = 93.6% of linear scaling.
    assert report.scaling_efficiency(3.93, 64, 2.1, 128) == pytest.approx(0.93571, abs=1e-5)
    assert report.scaling_efficiency(2.0, 8, 1.0, 16) == 1.0


def _sizes(four):
    return tuple(dict(zip(("data", "stage", "fsdp", "tensor"), four)).get(ax, 1) for ax in MESH_AXES)


def _mesh(ici, dcn) -> MeshShape:
    """A mesh from (data, stage, fsdp, tensor) sizes for ici and dcn; the other mesh axes (context) 1."""
    return MeshShape(_sizes(ici), _sizes(dcn))


def _candidate(ici, dcn, step):
    """A plan row with (data, stage, fsdp, tensor) sizes; the other mesh axes 1."""
    shape = _mesh(ici, dcn)
    return {"mesh": shape.as_dict(), "label": shape.label, "fits": True, "memory_bytes_per_device": 1,
            "est_step_seconds": step, "est_step_seconds_overlap": step / 2}


def test_budget_rows_compare_each_layout_with_itself_at_the_previous_node_count():
    one = {"candidates": [_candidate((1, 1, 8, 1), (1, 1, 1, 1), 4.0)]}
    two = {"candidates": [_candidate((1, 1, 8, 1), (2, 1, 1, 1), 2.5),  # HSDP: against fsdp8 on one node
                          _candidate((1, 1, 8, 1), (1, 1, 2, 1), 2.2)]}  # FSDP over both nodes: the same
    four = {"candidates": [_candidate((1, 1, 8, 1), (4, 1, 1, 1), 1.25),  # against HSDP on two nodes
                           _candidate((1, 1, 4, 2), (1, 1, 4, 1), 1.0)]}  # no such layout before
    rows = report.budget_rows([(1, 8, one), (2, 16, two), (4, 32, four)], 1e9, 1000, 2.0)
    assert [(r["nodes"], r["mesh"]) for r in rows] == [(1, "fsdp8"), (2, "fsdp8 | dcn data2"), (2, "fsdp8 | dcn fsdp2"),
                                                       (4, "fsdp8 | dcn data4"), (4, "fsdp4 tensor2 | dcn fsdp4")]
    eff = [r["scaling_efficiency"] for r in rows]
    assert eff[0] is None and eff[4] is None
    assert eff[1] == pytest.approx(4.0 * 8 / (2.5 * 16)) and eff[2] == pytest.approx(4.0 * 8 / (2.2 * 16))
    assert eff[3] == pytest.approx(2.5 * 16 / (1.25 * 32))  # linear: 1.0
    assert rows[3]["cost"] == pytest.approx(1e6 * 1.25 / 3600 * 32 * 2.0)
    assert rows[3]["days_overlapped"] == pytest.approx(rows[3]["days"] / 2)


@pytest.mark.slow
def test_cli_budget_one_row_per_candidate_and_node_count():
    """``plan --tokens --gpu-hour-cost --nodes 1,2`` on h100-8x nodes (8 and 16 emulated devices), HSDP given."""
    proc = run_cli("plan", "--hardware", "h100-8x", "--nodes", "2,1", "--tokens", "1e9", "--gpu-hour-cost", "2.5",
                   "mesh.ici.fsdp=8", "mesh.dcn.data=-1", "train.global_batch=32", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert [p["nodes"] for p in out["plans"]] == [1, 2]  # ascending, whatever the order given
    rows = out["budget"]
    assert [(r["nodes"], r["devices"], r["mesh"]) for r in rows] == [(1, 8, "fsdp8"), (2, 16, "fsdp8 | dcn data2")]
    for r, plan in zip(rows, out["plans"]):
        step = plan["candidates"][0]["est_step_seconds"]
        assert r["est_step_seconds"] == step
        assert r["cost"] == pytest.approx(math.ceil(1e9 / (32 * 128)) * step / 3600 * r["devices"] * 2.5)
    assert rows[1]["scaling_efficiency"] == pytest.approx(rows[0]["est_step_seconds"] * 8
                                                          / (rows[1]["est_step_seconds"] * 16))
    table = run_cli("plan", "--hardware", "h100-8x", "--nodes", "1,2", "--tokens", "1e9", "--gpu-hour-cost", "2.5",
                    "mesh.ici.fsdp=8", "mesh.dcn.data=-1", "train.global_batch=32")
    assert table.returncode == 0, table.stderr[-2000:]
    lines = table.stdout.splitlines()
    assert sum(line.split()[:2] in (["1", "8"], ["2", "16"]) for line in lines) == 2  # one line each
