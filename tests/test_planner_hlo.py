"""The planner's HLO reading (jaxtrain.planner.cost.hlo and .passes), on HLO text stored in tests/golden/: no compiling.

The CPU goldens are the tiny model's real train step compiled by XLA:CPU on 8 emulated devices (regenerate with
``python tests/golden/generate.py``); their collective bytes are checked against closed forms from the config.
``async-gpu.handwritten.hlo.txt`` is written by hand in XLA:GPU's asynchronous forms (see tests/golden/README.md).
"""

import json
import os

import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.models.flops import count_params
from jaxtrain.parallel.dims import MESH_AXES
from jaxtrain.planner.cost import collectives, hlo, passes

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
with open(os.path.join(GOLDEN, "goldens.json")) as _f:
    INDEX = json.load(_f)
GOLDEN_AXES = ("data", "stage", "fsdp", "tensor")  # the mesh the goldens were compiled on (before `context`)


def mesh(sizes):
    """Golden mesh sizes (GOLDEN_AXES order) as the sizes of today's MESH_AXES: an axis the goldens lack has size 1,
    which leaves every logical device id as it was."""
    named = dict(zip(GOLDEN_AXES, sizes))
    return tuple(named.get(ax, 1) for ax in MESH_AXES)


def golden(name):
    """(config, stated collectives, collectives after the GPU passes, unknown loops) of a CPU golden."""
    entry = INDEX[name]
    with open(os.path.join(GOLDEN, f"{name}.hlo.txt")) as f:
        text = f.read()
    sizes, axes = tuple(entry["mesh_sizes"]), frozenset(entry["param_axes"])
    stated = collectives.stated_collectives(hlo.parse_hlo(text), int(np.prod(sizes)))
    colls, unknown = passes.collectives(text, mesh(sizes), axes)
    return load_config(None, entry["overrides"]), stated, colls, unknown


def by_kind(colls):
    out = {k: 0 for k in collectives.KINDS}
    for c in colls:
        out[c.kind] += c.total_bytes
    return out


def grad_bytes(cfg):
    return count_params(cfg.model)["total"] * 4  # float32 parameters, so float32 gradients


def test_golden_data_parallel_all_reduces_gradients_once_per_layer():
    cfg, _, colls, unknown = golden("data8")
    kinds = by_kind(colls)
    assert kinds["all-reduce"] == pytest.approx(grad_bytes(cfg), rel=0.10)
    assert kinds["all-gather"] == kinds["reduce-scatter"] == 0
    assert {c.count for c in colls} == {1, cfg.model.n_layers}  # the scanned layers' trip count
    assert unknown == []


def test_golden_fsdp_reduce_scatter_creator():
    """XLA:CPU leaves FSDP's gradient reduction an all-reduce followed by a dynamic-slice of the device's shard;
    ReduceScatterCreator (GPU) makes it a reduce-scatter."""
    cfg, stated, colls, _ = golden("fsdp8")
    assert not any(c.kind == "reduce-scatter" for c in stated.others)
    assert sum(hlo.array_bytes(e.shape) * e.count for e in stated.all_reduces) > 0.9 * grad_bytes(cfg)
    kinds = by_kind(colls)
    assert kinds["all-gather"] == pytest.approx(2 * grad_bytes(cfg), rel=0.10)  # forward and backward
    assert kinds["reduce-scatter"] == pytest.approx(grad_bytes(cfg), rel=0.10)
    assert kinds["all-reduce"] < 0.01 * grad_bytes(cfg)
    assert all(c.groups.shape == (1, 8) for c in colls if c.kind == "reduce-scatter")


def test_golden_tensor_parallel_all_reduce_reassociate():
    """Per layer: attention and MLP outputs forward; backward, the input gradients of q,k,v merged into one
    all-reduce and those of gate,up into another (AllReduceReassociate); plus the final norm's input gradient."""
    cfg, stated, colls, _ = golden("tensor8")
    m = cfg.model
    activation = cfg.train.global_batch * cfg.data.seq_len * m.d_model * 4
    assert by_kind(colls)["all-reduce"] == pytest.approx((4 * m.n_layers + 1) * activation, rel=0.10)
    layer = [c for c in colls if c.kind == "all-reduce" and c.count == m.n_layers]
    assert len(layer) == 4 and all(c.bytes == activation for c in layer)
    stated_layer = [e for e in stated.all_reduces if e.count == m.n_layers and hlo.array_bytes(e.shape) == activation]
    assert len(stated_layer) > len(layer)  # before reassociation: one per q, k, v and gate, up input gradient


def test_golden_hybrid_all_reduce_splitter():
    """data 2 x fsdp 4: each gradient is reduce-scattered over the 4 fsdp devices, and the 1/4 shard all-reduced
    over the 2 data replicas (AllReduceSplitter)."""
    cfg, _, colls, _ = golden("data2fsdp4")
    grads = grad_bytes(cfg)
    rs = [c for c in colls if c.kind == "reduce-scatter"]
    assert sum(c.total_bytes for c in rs) == pytest.approx(grads, rel=0.10)
    assert {c.groups.shape for c in rs} == {(2, 4)}
    shard_ars = [c for c in colls if c.kind == "all-reduce" and c.groups.shape == (4, 2)]
    assert sum(c.total_bytes for c in shard_ars) == pytest.approx(grads / 4, rel=0.10)
    # Every fsdp-sharded gradient is split, the embedding's included: only the unsharded norm scales (d_model
    # float32) are all-reduced over all 8 devices.
    assert {c.bytes for c in colls if c.kind == "all-reduce" and c.groups.shape == (1, 8)} <= {4, cfg.model.d_model * 4}
    # Logical ids are row-major (data, stage, fsdp, tensor): the fsdp groups are consecutive ids, the data pairs 4
    # apart.
    assert rs[0].groups.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(shard_ars[0].groups.tolist()) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_golden_microbatches_reduce_once_per_step():
    """train.accumulate=unreduced: 8 microbatches reduce-scatter the gradients once per step, as 1 microbatch does,
    and gather the parameters once (kept for the forward and backward of every microbatch, where 1 microbatch
    gathers them in the forward and again in the backward); sharded: both run once per microbatch."""
    cfg, _, one, _ = golden("fsdp8-b64-mb1")
    _, _, unreduced, _ = golden("fsdp8-b64-mb8-unreduced")
    _, _, sharded, _ = golden("fsdp8-b64-mb8-sharded")
    base, acc, old = by_kind(one), by_kind(unreduced), by_kind(sharded)
    grads = grad_bytes(cfg)
    assert base["reduce-scatter"] == pytest.approx(grads, rel=0.05)
    assert acc["reduce-scatter"] == pytest.approx(base["reduce-scatter"], rel=0.05)
    assert base["all-gather"] == pytest.approx(2 * grads, rel=0.05)
    assert acc["all-gather"] == pytest.approx(grads, rel=0.05)
    assert old["reduce-scatter"] == pytest.approx(8 * base["reduce-scatter"], rel=0.10)
    assert old["all-gather"] == pytest.approx(8 * base["all-gather"], rel=0.10)
    assert max(acc["all-reduce"], base["all-reduce"]) < 0.01 * grads


def test_golden_bf16_collectives_count_16_bits():
    """XLA:CPU widens bfloat16 collectives to f32 between converts it inserts (no op_name); XLA:GPU moves them in 16
    bits. The tensor-parallel activation all-reduces of a bfloat16 model count 2 bytes per element, half of what
    the CPU program states, and the same number of collectives as the float32 model's."""
    cfg, stated, colls, _ = golden("tensor8-bf16")
    _, _, f32, _ = golden("tensor8")
    m = cfg.model
    activation = cfg.train.global_batch * cfg.data.seq_len * m.d_model * 2  # [batch, seq, embed] bfloat16
    layer = [c for c in colls if c.kind == "all-reduce" and c.count == m.n_layers]
    assert len(layer) == 4 and all(c.bytes == activation for c in layer)
    assert by_kind(colls)["all-reduce"] == pytest.approx((4 * m.n_layers + 1) * activation, rel=0.10)
    assert by_kind(f32)["all-reduce"] == pytest.approx(2 * by_kind(colls)["all-reduce"], rel=0.01)
    widened = [e for e in stated.all_reduces if e.widened]
    assert widened and all(e.shape.startswith("f32[") and e.bytes * 2 == hlo.array_bytes(e.shape) for e in widened)
    # The float32 program's casts are its own (op_name metadata) or absent: nothing is halved there.
    assert not any(e.widened for e in golden("tensor8")[1].all_reduces)


def test_golden_pipeline_ring_permutes_per_iteration():
    """Stage 2 x fsdp 4, 4 microbatches: the ring permute runs in the forward loop and in its transpose, each of
    M + S - 1 = 5 iterations, moving one microbatch's bfloat16 activations per device between the stages; the
    all-to-all that hands out the outputs runs once each way, along the stage axis too."""
    cfg, _, colls, unknown = golden("stage2fsdp4-mb4-bf16")
    t, m = cfg.train, cfg.model
    iterations = t.microbatches * t.virtual_stages + 2 - 1
    microbatch = t.global_batch // t.microbatches // 4 * cfg.data.seq_len * m.d_model * 2
    permutes = [c for c in colls if c.kind == "collective-permute"]
    assert [(c.bytes, c.count) for c in permutes] == [(microbatch, iterations)] * 2
    sizes = tuple(INDEX["stage2fsdp4-mb4-bf16"]["mesh_sizes"])
    assert sizes == (1, 2, 4, 1)
    for c in permutes:  # each pair: the same data and fsdp coordinates, stages 0 -> 1 and 1 -> 0
        src, dst = np.unravel_index(c.groups[:, 0], sizes), np.unravel_index(c.groups[:, 1], sizes)
        assert (src[0] == dst[0]).all() and (src[2] == dst[2]).all() and (src[1] != dst[1]).all()
        assert len(c.groups) == 8
    a2a = [c for c in colls if c.kind == "all-to-all"]
    assert [c.count for c in a2a] == [1, 1] and all(c.groups.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
                                                    for c in a2a)
    assert unknown == []


def test_golden_1f1b_rings_both_ways_in_one_loop():
    """Stage 4 x fsdp 2, 8 microbatches, train.pipeline_schedule=1f1b: both rings run in the one loop of
    M + 2 S - 2 = 14 iterations (no transposed loop), the activations one stage on and their cotangents one stage
    back, each one microbatch's bfloat16 [rows, seq, embed] per device; along the stage axis only, nothing else
    permuted, and no all-to-all (the last stage computes the loss inside the loop)."""
    name = "stage4fsdp2-mb8-1f1b-bf16"
    cfg, _, colls, unknown = golden(name)
    t, m = cfg.train, cfg.model
    iterations = t.microbatches + 2 * 4 - 2
    microbatch = t.global_batch // t.microbatches // 2 * cfg.data.seq_len * m.d_model * 2
    permutes = [c for c in colls if c.kind == "collective-permute"]
    assert [(c.bytes, c.count) for c in permutes] == [(microbatch, iterations)] * 2
    sizes = tuple(INDEX[name]["mesh_sizes"])
    assert sizes == (1, 4, 2, 1)
    shifts = set()
    for c in permutes:  # each pair: the same data and fsdp coordinates, the stage one on (+1) or one back (-1)
        src, dst = np.unravel_index(c.groups[:, 0], sizes), np.unravel_index(c.groups[:, 1], sizes)
        assert (src[0] == dst[0]).all() and (src[2] == dst[2]).all() and len(c.groups) == 8
        shift = set(((dst[1] - src[1]) % 4).tolist())
        assert len(shift) == 1
        shifts |= shift
    assert shifts == {1, 3}  # one ring each way
    assert not [c for c in colls if c.kind == "all-to-all"]
    assert unknown == []


def test_mesh_sizes_name_every_axis():
    with pytest.raises(ValueError, match="must give the size of each of"):
        passes.collectives(LOOP_HLO, (2, 1, 1))


def test_handwritten_gpu_async_forms():
    """-start/-done pairs count once (at the start), a collective wrapped in async-start/async-done once, loops
    multiply, and an all-reduce-start whose done is sliced 1/8 becomes a reduce-scatter."""
    with open(os.path.join(GOLDEN, "async-gpu.handwritten.hlo.txt")) as f:
        text = f.read()
    colls, unknown = passes.collectives(text, mesh((1, 1, 8, 1)))
    got = sorted((c.kind, c.bytes, c.count, c.groups.shape) for c in colls)
    assert got == [("all-gather", 512, 4, (1, 8)),  # f32[16] gathered over 8, in a loop of 4
                   ("all-reduce", 128, 1, (2, 4)),  # the tuple all-reduce's two elements, used whole
                   ("all-reduce", 512, 1, (2, 4)),
                   ("collective-permute", 256, 1, (2, 2)),
                   ("reduce-scatter", 512, 1, (1, 8)),  # all-reduce-start -> done -> dynamic-slice of 1/8
                   ("reduce-scatter", 1024, 1, (1, 8)),  # reduce-scatter-start / -done
                   ("reduce-scatter", 1024, 1, (1, 8))]  # async-start wrapping a reduce-scatter
    assert unknown == []


@pytest.mark.parametrize("text, expected", [
    ("replica_groups={{0,2},{1,3}}, x", [[0, 2], [1, 3]]),
    ("replica_groups={}, x", [[0, 1, 2, 3]]),
    ("replica_groups=[2,2]<=[4], x", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0), x", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}, x", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}, x", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=4] {'a':(2)2}, x", [[0, 1], [2, 3]]),
])
def test_replica_group_forms(text, expected):
    assert collectives.replica_groups(text, 4).tolist() == expected


LOOP_HLO = """HloModule m, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%p), index=1
  %ar = f32[16]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %ar)
}

%cond (p.1: (s32[], f32[16])) -> pred[] {
  %p.1 = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[16]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[16]{0}) tuple(%z, %a)
  %w = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %g = f32[32]{0} all-gather(%a), channel_id=2, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true
  ROOT %r = f32[16]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_parser_counts_loop_trips():
    colls, unknown = passes.collectives(LOOP_HLO, mesh((2, 1, 1, 1)))
    assert unknown == []
    got = sorted((c.kind, c.bytes, c.count) for c in colls)
    assert got == [("all-gather", 128, 1), ("all-reduce", 64, 6)]


def test_single_device_groups_move_nothing():
    """An all-reduce whose replica groups each hold one device (a psum over a mesh axis of size 1) is no collective."""
    text = LOOP_HLO.replace("%ar = f32[16]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}",
                            "%ar = f32[16]{0} all-reduce(%v), channel_id=1, replica_groups={{0},{1}}")
    assert text != LOOP_HLO
    colls, _ = passes.collectives(text, mesh((2, 1, 1, 1)))
    assert [c.kind for c in colls] == ["all-gather"]


def test_loop_without_trip_count_is_counted_once_and_reported():
    text = LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"6"}}', "")
    colls, unknown = passes.collectives(text, mesh((2, 1, 1, 1)))
    assert sorted((c.kind, c.count) for c in colls) == [("all-gather", 1), ("all-reduce", 1)]
    assert [(u.name, u.holds_collectives) for u in unknown] == [("w", True)]
