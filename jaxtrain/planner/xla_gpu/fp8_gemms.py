"""Which GEMMs of a compiled program multiply in float8: the check that ``model.fp8`` survived the compiler.

Read from ``Compiled.as_text()`` (post-optimisation HLO, :mod:`jaxtrain.planner.cost.hlo`'s parser). XLA:GPU turns a dot
of float8 operands into a cuBLASLt FP8 call (``custom_call_target="__cublas$lt$matmul$f8"``: operands lhs, rhs,
then the scales; bf16, f16 or f32 out) or a Triton GEMM fusion (``"kind":"__triton_gemm"`` or
``"__triton_nested_gemm_fusion"``) whose computation holds the float8 dot, the scales fused into its epilogue as
scalar parameters. A program that lost FP8 somewhere has 16-bit GEMMs where the projections were, or a convert of
float8 data to a wider type feeding a GEMM (XLA:CPU does exactly that: it has no float8 dot; so does XLA:GPU when the
target lacks FP8 support or the quantise-dequantise form is simplified away). Pure text in, data out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from jaxtrain.planner.cost.hlo import ARRAY_RE, HloModule, Instr, fused_computation, parse_hlo

F8 = ("f8e4m3fn", "f8e5m2")
_CUBLAS_F8 = "__cublas$lt$matmul$f8"
_TRITON_KINDS = ('"kind":"__triton_gemm"', '"kind":"__triton_nested_gemm_fusion"')
# ops through which a dot's operand still is the value it came from (layout, and the dequantising multiply)
_PASS_THROUGH = {"bitcast", "transpose", "copy", "reshape", "broadcast", "slice", "dynamic-slice", "multiply",
                 "divide", "get-tuple-element"}


@dataclass(frozen=True)
class Gemm:
    """One matrix multiplication of a compiled program."""

    name: str  # the dot, or the cuBLAS custom call
    engine: str  # "cublas-f8" (cuBLASLt FP8), "cublas", "triton" (a Triton GEMM fusion's dot), "dot" (any other)
    lhs: str  # element types of the operands and the result
    rhs: str
    out: str
    dims: tuple[tuple[int, ...], ...]  # lhs, rhs and result dimension sizes
    batched: bool  # batch dimensions (attention's [batch, heads] matmuls), not a weight's GEMM
    scales: int  # cuBLASLt FP8: scale operands other than the constant 1; Triton: its fusion's scalar parameters
    upcast: bool  # an operand is float8 data converted to a wider type: the float8 GEMM did not happen

    @property
    def fp8(self) -> bool:
        return self.lhs in F8 and self.rhs in F8


def _elem(shape: str) -> str:
    m = ARRAY_RE.search(shape)
    return m.group(1) if m else shape


def _dims(shape: str) -> tuple[int, ...]:
    m = ARRAY_RE.search(shape)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


def _from_f8(module: HloModule, name: str, depth: int = 0) -> bool:
    """Whether value ``name`` is float8 data converted to a wider type (through layout ops, the dequantising
    multiply, fusion boundaries)."""
    ins = module.by_name.get(name)
    if ins is None or depth > 32:
        return False
    if ins.opcode == "convert":
        src = module.by_name.get(ins.operands[0]) if ins.operands else None
        return src is not None and _elem(src.shape) in F8 and _elem(ins.shape) not in F8
    if ins.opcode in _PASS_THROUGH:
        return any(_from_f8(module, op, depth + 1) for op in ins.operands)
    if ins.opcode == "parameter":  # inside a fusion: what the fusion was given
        caller = module.fusion_caller(ins.comp)
        index = int(ins.operands_text) if ins.operands_text.isdigit() else -1
        return caller is not None and 0 <= index < len(caller.operands) and _from_f8(
            module, caller.operands[index], depth + 1)
    if ins.opcode == "fusion":  # what the fusion computes: its root
        root = module.root(fused_computation(ins) or "")
        return root is not None and _from_f8(module, root.name, depth + 1)
    return False


def _is_unit_constant(module: HloModule, name: str) -> bool:
    ins = module.by_name.get(name)
    return ins is not None and ins.opcode == "constant" and ins.operands_text in ("1", "1.0")


def _gemm(module: HloModule, ins: Instr, engine: str, scales: int) -> Gemm:
    lhs, rhs = (module.by_name[op] for op in ins.operands[:2])
    batched = "lhs_batch_dims=" in ins.attrs or '"lhs_batch_dimensions":["' in ins.attrs
    return Gemm(ins.name, engine, _elem(lhs.shape), _elem(rhs.shape), _elem(ins.shape),
                (_dims(lhs.shape), _dims(rhs.shape), _dims(ins.shape)), batched, scales,
                any(_from_f8(module, op) for op in ins.operands[:2]))


def find_gemms(text: str) -> list[Gemm]:
    """Every GEMM of a compiled HLO module: cuBLAS(Lt) custom calls and dots (in Triton GEMM fusions or not)."""
    module = parse_hlo(text)
    triton = {}  # computation -> its number of scalar parameters (the fused scales)
    for ins in module.by_name.values():
        if ins.opcode == "fusion" and any(k in ins.attrs for k in _TRITON_KINDS):
            comp = fused_computation(ins) or ""
            triton[comp] = sum(1 for p in module.comps.get(comp, []) if p.opcode == "parameter"
                               and _dims(p.shape) == () and "[]" in p.shape)
    out = []
    for ins in module.by_name.values():
        if ins.opcode == "custom-call" and "__cublas$" in ins.attrs:
            f8 = _CUBLAS_F8 in ins.attrs
            scales = sum(1 for op in ins.operands[2:] if not _is_unit_constant(module, op)) if f8 else 0
            out.append(_gemm(module, ins, "cublas-f8" if f8 else "cublas", scales))
        elif ins.opcode == "dot":
            in_triton = ins.comp in triton
            out.append(_gemm(module, ins, "triton" if in_triton else "dot", triton.get(ins.comp, 0)))
    return out


def summary(gemms: list[Gemm]) -> dict[str, int]:
    """GEMMs counted by engine and operand types, e.g. ``{"triton f8e4m3fn x f8e4m3fn -> bf16": 7, ...}``."""
    return dict(Counter(f"{g.engine} {g.lhs} x {g.rhs} -> {g.out}" for g in gemms))


def fp8_problems(gemms: list[Gemm], may_stay_wide: Callable[[Gemm], bool]) -> list[str]:
    """What says a float8 program did not multiply in float8 (empty: it did): no float8 GEMM of one of the three
    kinds (e4m3 x e4m3 forward, e5m2 with e4m3 for the gradients), a wide GEMM that ``may_stay_wide`` does not
    excuse (e.g. one over the vocabulary: the output projection; attention's batched ones), or an upcast operand."""
    problems = []
    kinds = {(g.lhs, g.rhs) for g in gemms if g.fp8}
    if ("f8e4m3fn", "f8e4m3fn") not in kinds:
        problems.append("no e4m3 x e4m3 GEMM (the forward)")
    if not kinds & {("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}:
        problems.append("no GEMM of e5m2 gradients")
    for g in gemms:
        if g.upcast:
            problems.append(f"{g.name}: float8 operand converted to {g.lhs}/{g.rhs} before the GEMM")
        elif not g.fp8 and not may_stay_wide(g):
            problems.append(f"{g.name}: {g.lhs} x {g.rhs} GEMM {g.dims[0]} x {g.dims[1]} ({g.engine})")
    return problems
