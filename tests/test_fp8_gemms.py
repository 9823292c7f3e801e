"""jaxtrain.planner.xla_gpu.fp8_gemms on stored compiled programs (tests/golden/fp8-*.hlo.txt, excerpts of what XLA
printed; tests/golden/README.md says how they were made): the 1B train step compiled with XLA:GPU for H100 with and
without model.fp8, and an FP8 matmul compiled by XLA:CPU, which converts float8 to float32 before its dots."""

import os

import pytest

from jaxtrain.planner.xla_gpu import fp8_gemms

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
VOCAB_1B = 128256


def _gemms(name):
    with open(os.path.join(GOLDEN, name)) as f:
        return fp8_gemms.find_gemms(f.read())


def _output_projection_or_attention(g):
    return g.batched or VOCAB_1B in sum(g.dims, ())


def _kinds(gemms):
    out = {}
    for g in gemms:
        if g.fp8:
            out[(g.lhs, g.rhs)] = out.get((g.lhs, g.rhs), 0) + 1
    return out


@pytest.mark.parametrize("name", ["fp8-1b-tensorwise-triton.hlo.txt", "fp8-1b-tensorwise-cublas.hlo.txt"])
def test_every_projection_gemm_of_the_fp8_1b_step_is_float8(name):
    """16 layers scanned: one body with the 7 projections' forward (e4m3 x e4m3), input-gradient (e5m2 x e4m3) and
    weight-gradient (e4m3 x e5m2) GEMMs; only the tied output projection's three GEMMs (over the 128,256-token
    vocabulary) stay bfloat16; every float8 GEMM carries its scales (fused scalars or cuBLASLt scale operands)."""
    gemms = _gemms(name)
    assert _kinds(gemms) == {("f8e4m3fn", "f8e4m3fn"): 7, ("f8e5m2", "f8e4m3fn"): 7, ("f8e4m3fn", "f8e5m2"): 7}
    wide = [g for g in gemms if not g.fp8]
    assert len(wide) == 3 and all(VOCAB_1B in sum(g.dims, ()) for g in wide) and all(g.lhs == "bf16" for g in wide)
    assert not any(g.upcast for g in gemms)
    assert fp8_gemms.fp8_problems(gemms, _output_projection_or_attention) == []
    engines = {g.engine for g in gemms if g.fp8}
    assert engines == ({"triton"} if "triton" in name else {"cublas-f8"})
    assert any(g.scales for g in gemms if g.fp8)


def test_a_step_without_fp8_is_reported_as_sixteen_bit_projections():
    gemms = _gemms("fp8-1b-none-triton.hlo.txt")
    problems = fp8_gemms.fp8_problems(gemms, _output_projection_or_attention)
    assert problems[:2] == ["no e4m3 x e4m3 GEMM (the forward)", "no GEMM of e5m2 gradients"]
    projections = [g for g in gemms if not _output_projection_or_attention(g)]
    assert projections and len(problems) == 2 + len(projections)
    assert all("bf16 x bf16 GEMM" in p for p in problems[2:])


def test_xla_cpu_converts_float8_before_its_dots():
    """The same FP8 matmul's forward and gradients as XLA:CPU compiles them: float32 dots on float8 data converted
    to float32 (why the tests read the lowered program on CPU): every GEMM is an upcast."""
    gemms = _gemms("fp8-cpu-tensorwise.hlo.txt")
    assert len(gemms) == 3 and all(g.upcast and g.lhs == g.rhs == "f32" for g in gemms)
    problems = fp8_gemms.fp8_problems(gemms, lambda g: False)
    assert sum("float8 operand converted" in p for p in problems) == 3


def test_summary_counts_gemms_by_engine_and_types():
    summary = fp8_gemms.summary(_gemms("fp8-1b-tensorwise-triton.hlo.txt"))
    assert summary["triton f8e4m3fn x f8e4m3fn -> bf16"] == 7
    assert sum(n for k, n in summary.items() if k.startswith("triton bf16 x bf16")) == 3
