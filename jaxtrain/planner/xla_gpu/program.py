"""What must be in XLA:GPU's program of a train step, checked on its compiled HLO text (``Compiled.as_text()``):
pure text in, findings out, like :mod:`jaxtrain.planner.cost.hlo` which it reads with.

:func:`violations` lists, one line each, where the program is not what the config asked for:

- **attention**: the kernel configured runs: cuDNN's fused attention (``custom_call_target="__cudnn$fmha..."``, a
  forward and a ``...Backward`` call), jaxtrain's Pallas flash kernel (``__gpu$xla.gpu.triton``, Pallas' Triton
  lowering) or its jax-triton kernel (``triton_kernel_call``);
- **no S x S scores** where a flash path (cuDNN, Pallas, Triton) was configured: no batched matrix multiply of
  queries by keys (over the head dim, giving [queries, keys] blocks of the local sequence or, with context
  parallelism, of a zigzag chunk of it), which is what attention without a flash kernel computes;
- **no float32 GEMM** where 16-bit compute was configured: every ``dot`` (fused or not) and cuBLAS call takes 16-bit
  operands;
- **the collectives the planner expects**: each (kind, mesh axis) the expectation names appears, kinds grouped as
  gathers, reductions (all-reduce or reduce-scatter: XLA:GPU picks between them), permutes and all-to-alls.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from jaxtrain.models.routing import ROUTER_SCOPE
from jaxtrain.parallel.dims import Axis, MeshShape
from jaxtrain.planner.cost.collectives import Collective
from jaxtrain.planner.cost.hlo import ARRAY_RE, HloModule, op_name, parse_hlo
from jaxtrain.planner.cost.model import group_span

CUDNN_ATTENTION = re.compile(r'custom_call_target="(__cudnn\$fmha[A-Za-z0-9]*)"')
# The custom-call target of each flash kernel: Pallas' Triton lowering, jax-triton's launcher.
FLASH_TARGETS = {"pallas": "__gpu$xla.gpu.triton", "triton": "triton_kernel_call"}
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CUBLAS_GEMM = re.compile(r'custom_call_target="(__cublas\$gemm|__cublas\$lt\$matmul[^"]*)"')
_16_BIT = {"bfloat16": "bf16", "float16": "f16"}
# Collective kinds grouped as the expectation names them.
FAMILY = {"all-gather": "gather", "all-reduce": "reduce", "reduce-scatter": "reduce",
          "collective-permute": "permute", "all-to-all": "all-to-all"}


@dataclass(frozen=True)
class Expected:
    """What the program must hold: ``attention`` the resolved ``model.attention`` it was compiled with, ``seq_local``
    the tokens of a sequence one device holds (``ParallelDims.local_seq``), ``context`` the context-parallel size,
    ``head_dim`` the model's, ``dtype`` the compute dtype, ``collectives`` (families, mesh axis) pairs: on that
    axis, a collective of one of those families."""

    attention: str
    seq_local: int
    context: int
    head_dim: int
    dtype: str
    collectives: frozenset[tuple[frozenset[str], str]] = frozenset()


def attention_calls(text: str) -> Counter:
    """Custom-call targets of attention kernels in ``text``: cuDNN's and the flash kernels', with their counts."""
    flash = set(FLASH_TARGETS.values())
    return Counter(t for t in _CUSTOM_CALL_TARGET.findall(text) if t.startswith("__cudnn$fmha") or t in flash)


def _dims(shape: str) -> list[int]:
    """The dimensions of an array shape string (the first array of a tuple)."""
    found = ARRAY_RE.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _dot_dims(attrs: str, name: str) -> list[int]:
    found = re.search(rf"\b{name}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def score_dots(module: HloModule, seqs: set[int], head_dim: int) -> list[str]:
    """Attention scores computed as matrices: batched ``dot`` instructions (fused or not) that contract over the
    head dim alone and give two non-batch dimensions that are multiples of a sequence length in ``seqs`` (Q K^T,
    [batch..., queries, keys], the query groups of GQA possibly folded in). Weight matmuls have no batch
    dimensions (but for split-K's, below); a flash kernel's are inside its custom call. ``"%name = dtype[dims]"``
    each."""
    found = []
    for ins in module.by_name.values():
        batch = _dot_dims(ins.attrs, "lhs_batch_dims")
        leading = list(range(len(batch)))
        # XLA canonicalises batched dots to leading batch dimensions on both operands; a batch dimension elsewhere
        # is one XLA:GPU's split-K rewrite inserted into a weight matmul (its contracting tokens cut in chunks,
        # which may happen to be head_dim long): not attention.
        if ins.opcode != "dot" or not batch or batch != leading or _dot_dims(ins.attrs, "rhs_batch_dims") != leading \
                or not ins.operands or ins.operands[0] not in module.by_name:
            continue
        lhs = _dims(module.by_name[ins.operands[0]].shape)
        contracting = [lhs[i] for i in _dot_dims(ins.attrs, "lhs_contracting_dims") if i < len(lhs)]
        if math.prod(contracting) != head_dim:
            continue
        out = _dims(ins.shape)[len(batch):]
        if sum(any(d % s == 0 for s in seqs) for d in out) >= 2:
            found.append(f"%{ins.name} = {ins.shape.split('{')[0]}")
    return found


def float32_gemms(module: HloModule) -> list[str]:
    """Matrix multiplies (``dot``, fused or not, and cuBLAS calls) with a float32 operand: ``"%name: dtype[..] x
    dtype[..]"`` each. The MoE router's logits are float32 by design (``routing.route``, under the name scope
    ``routing.ROUTER_SCOPE``; tokens x experts, a sliver of the step's FLOPs): not counted."""
    found = []
    for ins in module.by_name.values():
        if ins.opcode != "dot" and not (ins.opcode == "custom-call" and _CUBLAS_GEMM.search(ins.attrs)):
            continue
        if f"/{ROUTER_SCOPE}/" in op_name(ins):
            continue
        operands = [module.by_name[o].shape for o in ins.operands[:2] if o in module.by_name]
        if any(shape.startswith("f32[") for shape in operands):
            found.append(f"%{ins.name}: " + " x ".join(re.sub(r"\{[^}]*\}", "", s) for s in operands))
    return found


def collective_axes(colls: list[Collective], shape: MeshShape) -> dict[tuple[str, str], int]:
    """{(family, mesh axis): bytes per device and step} of ``colls`` on ``shape``: each collective counted on every
    axis its groups span (``cost.group_span``; ici and dcn parts of an axis are one axis here)."""
    out: dict[tuple[str, str], int] = {}
    for c in colls:
        for axis in group_span(shape, c.groups)[2]:
            key = (FAMILY[c.kind], axis.split("(")[0])
            out[key] = out.get(key, 0) + c.total_bytes
    return out


def expected_collectives(shape: MeshShape, batch_axes: tuple[str, ...], param_axes: frozenset[str]
                         ) -> frozenset[tuple[frozenset[str], str]]:
    """What the planner's cost model expects on each mesh axis > 1: gradients reduced over the batch axes; the
    parameters sharded over a batch axis (fsdp) gathered over it; those sharded over another axis (tensor)
    reduced there (activations); the pipeline's ring permuted along stage; the K/V ring along context (permutes,
    or an all-gather for a ring of 2)."""
    sizes = shape.axis_sizes
    out: set[tuple[frozenset[str], str]] = set()
    for axis in batch_axes:
        if sizes[axis] > 1:
            out.add((frozenset({"reduce"}), axis))
    for axis in param_axes:
        if sizes[axis] > 1 and axis != Axis.STAGE:
            out.add((frozenset({"gather" if axis in batch_axes else "reduce"}), axis))
    if sizes[Axis.STAGE] > 1:
        out.add((frozenset({"permute"}), Axis.STAGE.value))
    if sizes[Axis.CONTEXT] > 1:
        out.add((frozenset({"permute", "gather"}), Axis.CONTEXT.value))
    return frozenset(out)


def violations(text: str, expected: Expected, colls: list[Collective], shape: MeshShape) -> list[str]:
    """One line per way the program ``text`` (with its collectives ``colls`` on ``shape``) is not ``expected``."""
    module = parse_hlo(text)
    out = []
    calls = attention_calls(text)
    if expected.attention == "cudnn":
        fwd = sum(n for t, n in calls.items() if t.startswith("__cudnn$fmha") and not t.endswith("Backward"))
        bwd = sum(n for t, n in calls.items() if t.startswith("__cudnn$fmha") and t.endswith("Backward"))
        if not fwd or not bwd:
            out.append(f"attention: model.attention=cudnn but the program has {fwd} cuDNN forward and {bwd} backward "
                       "call(s) (custom_call_target __cudnn$fmha...)")
    elif expected.attention in FLASH_TARGETS and not calls[FLASH_TARGETS[expected.attention]]:
        out.append(f"attention: model.attention={expected.attention} but the program has no flash kernel call "
                   f"(custom_call_target {FLASH_TARGETS[expected.attention]})")
    if expected.attention != "xla":
        seqs = {expected.seq_local} | ({expected.seq_local // 2} if expected.context > 1 else set())
        scores = score_dots(module, seqs, expected.head_dim)
        if scores:
            out.append(f"attention: {len(scores)} S x S score matmul(s) where model.attention={expected.attention} "
                       f"should compute none, e.g. {scores[0]}")
    if expected.dtype in _16_BIT:
        gemms = float32_gemms(module)
        if gemms:
            out.append(f"precision: {len(gemms)} float32 GEMM(s) where model.dtype={expected.dtype}, e.g. {gemms[0]}")
    found = collective_axes(colls, shape)
    for families, axis in sorted(expected.collectives, key=lambda e: (e[1], sorted(e[0]))):
        if not any(found.get((f, axis)) for f in families):
            kinds = " or ".join(sorted(k for k, f in FAMILY.items() if f in families))
            out.append(f"collectives: no {kinds} over mesh axis {axis}, which the plan expects")
    return out
