"""XLA:GPU's own programs, read without compiling: the planner's reading of their collectives and the checks of
``jaxtrain.planner.xla_gpu.program`` (attention kernel, no S x S scores on a flash path, no float32 GEMM in 16-bit runs,
the collectives the cost model expects), on the tiny model's train steps compiled by XLA:GPU for 8 H100s without a
GPU and trimmed (``tests/golden/gpu-*.hlo.txt``, ``python tests/golden/generate_gpu.py``; tests/golden/README.md).
"""

import json
import os
import re

import pytest

from jaxtrain.config import load_config
from jaxtrain.models.flops import count_params
from jaxtrain.parallel.dims import MESH_AXES, MeshShape
from jaxtrain.planner.cost import collectives, hlo, passes
from jaxtrain.planner.xla_gpu import program as gpu_program

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
with open(os.path.join(GOLDEN, "goldens_gpu.json")) as _f:
    INDEX = json.load(_f)


def golden(name):
    """(config, its text, mesh shape, the collectives as XLA:GPU states them, expected as compiled)."""
    entry = INDEX[name]
    with open(os.path.join(GOLDEN, f"{name}.hlo.txt")) as f:
        text = f.read()
    shape = MeshShape(ici=tuple(entry["mesh_sizes"]), dcn=(1,) * len(MESH_AXES))
    colls, _ = passes.collectives(text, tuple(entry["mesh_sizes"]), compiled_for_cpu=False)
    cfg = load_config(None, entry["overrides"])
    expected = gpu_program.Expected(entry["attention"], entry["seq_local"], entry["context"], entry["head_dim"],
                                    cfg.model.dtype)
    return cfg, text, shape, colls, expected


def by_kind(colls):
    out = {k: 0 for k in collectives.KINDS}
    for c in colls:
        out[c.kind] += c.total_bytes
    return out


def test_fsdp_collectives_as_xla_gpu_states_them():
    """FSDP on XLA:GPU in bfloat16: the parameters, cast to 16 bits, gathered twice (forward, and again in the
    rematerialised backward), the 16-bit gradients reduce-scattered once (XLA:GPU made the reduce-scatters itself),
    little else."""
    cfg, _, shape, colls, _ = golden("gpu-fsdp8-cudnn")
    params = count_params(cfg.model)["total"] * 2
    kinds = by_kind(colls)
    assert kinds["all-gather"] == pytest.approx(2 * params, rel=0.10)
    assert kinds["reduce-scatter"] == pytest.approx(params, rel=0.10)
    assert kinds["all-reduce"] < 0.01 * params
    assert gpu_program.collective_axes(colls, shape).keys() == {("gather", "fsdp"), ("reduce", "fsdp")}


def test_async_all_reduce_counts_once():
    """XLA:GPU prints an asynchronous all-reduce as ((operands), results): each array once, not twice."""
    _, text, _, _, _ = golden("gpu-fsdp8-cudnn")
    starts = re.findall(r"= (\(\(.*?\), [^ ]+\)) all-reduce-start\(", text)
    assert starts, "the golden holds XLA:GPU's tuple-shaped all-reduce-start"
    stated = collectives.stated_collectives(hlo.parse_hlo(text), 8, cpu=False)
    one_each = sum(hlo.array_bytes(s.split("), ")[0]) for s in starts)
    assert sum(hlo.array_bytes(e.shape) for e in stated.all_reduces if e.ins.opcode == "all-reduce-start") == one_each
    line = ("  %all-reduce-start = ((bf16[14024704]{0}), bf16[14024704]{0}) all-reduce-start(%p), channel_id=16, "
            "replica_groups=mesh['axis_0'=8,'axis_1'=8] {'axis_0'}, use_global_device_ids=true, to_apply=%add")
    module = ("HloModule m\n\n%add (x: bf16[], y: bf16[]) -> bf16[] {\n  %x = bf16[] parameter(0)\n  %y = bf16[] "
              "parameter(1)\n  ROOT %s = bf16[] add(%x, %y)\n}\n\nENTRY %main (p: bf16[14024704]) -> bf16[14024704] "
              f"{{\n  %p = bf16[14024704]{{0}} parameter(0)\n{line}\n  ROOT %d = bf16[14024704]{{0}} "
              "all-reduce-done(%all-reduce-start)\n}\n")  # a line of the 7B HSDP step as XLA:GPU compiled it
    colls, _ = passes.collectives(module, MeshShape.of({"data": 8, "fsdp": 8}).ici, compiled_for_cpu=False)
    assert [(c.kind, c.bytes, c.groups.shape) for c in colls] == [("all-reduce", 14024704 * 2, (8, 8))]


def test_gpu_programs_are_read_as_stated():
    """The GPU passes the planner re-creates for XLA:CPU's programs have run in XLA:GPU's: not applied again."""
    _, text, _, colls, _ = golden("gpu-stage2-fsdp2-tensor2-1f1b-pallas")
    stated = collectives.stated_collectives(hlo.parse_hlo(text), 8, cpu=False)
    assert sorted((c.kind, c.total_bytes) for c in colls) == sorted(
        [(c.kind, c.total_bytes) for c in stated.others if c.kind == "collective-permute" or c.groups.shape[1] > 1]
        + [("all-reduce", e.bytes * e.count) for e in stated.all_reduces
           if collectives.replica_groups(e.ins.attrs, 8).shape[1] > 1])


@pytest.mark.parametrize("name, calls", [
    ("gpu-fsdp8-cudnn", {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}),
    ("gpu-fsdp8-xla", set()),
    ("gpu-stage2-fsdp2-tensor2-1f1b-pallas", {"__gpu$xla.gpu.triton"}),
    ("gpu-data2-context4-pallas", {"__gpu$xla.gpu.triton"}),
])
def test_each_program_is_what_it_was_configured_to_be(name, calls):
    _, text, shape, colls, expected = golden(name)
    assert set(gpu_program.attention_calls(text)) == calls
    entry = INDEX[name]
    batch = ("data", "fsdp")
    params = frozenset(a for a in ("fsdp", "tensor", "stage") if shape.axis_sizes[a] > 1)
    expected = gpu_program.Expected(**{**expected.__dict__,
                                       "collectives": gpu_program.expected_collectives(shape, batch, params)})
    found = gpu_program.violations(text, expected, colls, shape)
    if entry["attention"] == "xla":  # the reference's backward multiplies float32 cotangents
        assert len(found) == 1 and found[0].startswith("precision: 4 float32 GEMM(s) where model.dtype=bfloat16")
    else:
        assert found == []


def test_the_xla_reference_shows_as_s_by_s_scores_where_a_flash_kernel_was_configured():
    _, text, shape, colls, expected = golden("gpu-fsdp8-xla")
    for flash, target in [("cudnn", "__cudnn$fmha"), ("pallas", "__gpu$xla.gpu.triton")]:
        found = gpu_program.violations(text, gpu_program.Expected(**{**expected.__dict__, "attention": flash}),
                                       colls, shape)
        assert [f.split(":")[0] for f in found] == ["attention", "attention", "precision"]
        assert target in found[0]
        assert re.search(r"\d+ S x S score matmul\(s\) .* e\.g\. %dot\.\d+ = f32\[8,128,256\]", found[1])


def test_score_matmuls_are_q_by_k_not_split_k_weight_gradients():
    """The tiny model's d_model (128) equals its sequence, and XLA:GPU's split-K cuts the tokens of weight
    gradients into chunks of 32 = its head dim: batched dots whose batch dimension is not leading (split-K's) are
    not attention; the reference attention's Q K^T (contracting over the head dim, [queries x groups, keys]) is."""
    _, text, _, _, expected = golden("gpu-fsdp8-cudnn")
    module = hlo.parse_hlo(text)
    split_k = [i for i in module.by_name.values() if i.opcode == "dot" and "lhs_batch_dims={1}" in i.attrs]
    assert split_k, "the golden holds XLA:GPU's split-K weight-gradient dots"
    assert gpu_program.score_dots(module, {expected.seq_local}, expected.head_dim) == []
    xla_module = hlo.parse_hlo(golden("gpu-fsdp8-xla")[1])
    assert gpu_program.score_dots(xla_module, {128}, 32)
    assert gpu_program.score_dots(xla_module, {128}, 64) == []  # another head dim: not these


def test_missing_collectives_are_named_per_axis():
    _, text, shape, colls, expected = golden("gpu-data2-context4-pallas")
    assert ("permute", "context") in gpu_program.collective_axes(colls, shape)
    want = gpu_program.Expected(**{**expected.__dict__, "collectives": frozenset(
        {(frozenset({"permute", "gather"}), "context"), (frozenset({"gather"}), "tensor")})})
    assert gpu_program.violations(text, want, colls, shape) == [
        "collectives: no all-gather over mesh axis tensor, which the plan expects"]


def test_expected_collectives_from_the_layout():
    fsdp = MeshShape.of({"fsdp": 8})
    assert gpu_program.expected_collectives(fsdp, ("data", "fsdp"), frozenset({"fsdp"})) == {
        (frozenset({"reduce"}), "fsdp"), (frozenset({"gather"}), "fsdp")}
    pipeline = MeshShape.of({"fsdp": 2, "tensor": 4}, {"stage": 8})
    assert gpu_program.expected_collectives(pipeline, ("data", "fsdp"), frozenset({"fsdp", "tensor", "stage"})) == {
        (frozenset({"reduce"}), "fsdp"), (frozenset({"gather"}), "fsdp"), (frozenset({"reduce"}), "tensor"),
        (frozenset({"permute"}), "stage")}
    ring = MeshShape.of({"data": 2, "context": 4})
    assert (frozenset({"permute", "gather"}), "context") in gpu_program.expected_collectives(
        ring, ("data", "fsdp"), frozenset())
