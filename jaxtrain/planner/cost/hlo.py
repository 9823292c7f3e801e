"""HLO text -> data: instructions, the computations that call each other, shapes, loop trip counts. Pure text in,
data out: no JAX, no mesh, no cost model. The text is ``Compiled.as_text()`` (post-optimisation HLO);
``tests/golden/`` holds the HLO this is tested against. :mod:`jaxtrain.planner.cost.collectives` reads the collectives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
ARRAY_RE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_CALLED_RE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass
class Instr:
    """One HLO instruction: ``[ROOT] %name = shape opcode(operands), attrs``."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    comp: str  # the computation it belongs to
    operands_text: str = ""  # the raw operand list; for parameter(N) it is N
    is_root: bool = False


@dataclass
class HloModule:
    comps: dict[str, list[Instr]]
    entry: str
    by_name: dict[str, Instr]
    users: dict[str, list[Instr]]
    callers: dict[str, list[Instr]]  # computation -> instructions that call it

    def root(self, comp: str) -> Instr | None:
        return next((i for i in self.comps.get(comp, []) if i.is_root), None)

    def fusion_caller(self, comp: str) -> Instr | None:
        """The fusion instruction that calls ``comp``, when exactly one does."""
        calls = [c for c in self.callers.get(comp, []) if c.opcode == "fusion"]
        return calls[0] if len(calls) == 1 else None

    def param(self, comp: str, index: int) -> Instr | None:
        for ins in self.comps.get(comp, []):
            if ins.opcode == "parameter" and ins.operands_text == str(index):
                return ins
        return None


def balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _parse_instr(line: str, comp: str) -> Instr | None:
    body = line.strip()
    is_root = body.startswith("ROOT ")
    if is_root:
        body = body[5:]
    name, sep, rest = body.partition(" = ")
    if not sep or not name.startswith("%"):
        return None
    end = balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = balanced(rest, paren)
    operands_text = rest[paren + 1:close - 1]
    return Instr(name[1:], shape, opcode, re.findall(r"%([\w.\-]+)", operands_text), rest[close:], comp,
                 operands_text.strip(), is_root)


def parse_hlo(text: str) -> HloModule:
    """Computations and instructions of an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line[0].isspace():
            if line.rstrip().endswith("{"):
                header = line.split()
                is_entry = header[0] == "ENTRY"
                current = header[1 if is_entry else 0].lstrip("%")
                comps[current] = []
                if is_entry:
                    entry = current
            else:
                current = None  # the closing brace
            continue
        if current is not None:
            ins = _parse_instr(line, current)
            if ins is not None:
                comps[current].append(ins)
    by_name = {i.name: i for instrs in comps.values() for i in instrs}
    users: dict[str, list[Instr]] = {}
    callers: dict[str, list[Instr]] = {}
    for ins in by_name.values():
        for op in ins.operands:
            users.setdefault(op, []).append(ins)
        for callee in called(ins):
            callers.setdefault(callee, []).append(ins)
    return HloModule(comps, entry, by_name, users, callers)


def called(ins: Instr) -> list[str]:
    """The computations an instruction calls (fusion bodies, loop body and condition, reducers, branches)."""
    names = [m.group(2) for m in _CALLED_RE.finditer(ins.attrs)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    if branches:
        names += re.findall(r"%([\w.\-]+)", branches.group(1))
    return names


def fused_computation(ins: Instr) -> str | None:
    m = re.search(r"\bcalls=%([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


# -- shapes ------------------------------------------------------------------------------------------------------


def array_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple counts all its elements)."""
    total = 0
    for dtype, dims in ARRAY_RE.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def elements(shape: str) -> int:
    """Number of elements of an HLO shape string (a tuple counts all its elements)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in ARRAY_RE.findall(shape))


def element_shape(ins: Instr, idx: int) -> str:
    """The ``idx``-th array of a tuple-shaped instruction (the instruction's shape when it is not a tuple)."""
    if not ins.shape.startswith("("):
        return ins.shape
    return [f"{d}[{s}]" for d, s in ARRAY_RE.findall(ins.shape)][idx]


# -- loops ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnknownLoop:
    """A while loop whose trip count the compiler did not state: its body is counted once per enclosing run."""

    name: str
    op_name: str  # the JAX operation it came from (metadata op_name), e.g. "jit(train_step)/while"
    computations: frozenset[str] = frozenset()  # its body and everything the body calls
    holds_collectives: bool = False  # whether any collective runs inside (only then does the count matter)


def multiplicities(module: HloModule) -> tuple[dict[str, int], list[UnknownLoop]]:
    """How many times each computation runs per call of the entry, from the while loops' known trip counts.

    Returns the counts and the loops whose trip count XLA did not know (counted once: a lower bound).
    """
    counts: dict[str, int] = {}
    unknown: list[tuple[Instr, set[str]]] = []

    def visit(comp: str, times: int, inside: tuple[set[str], ...]) -> None:
        counts[comp] = counts.get(comp, 0) + times
        for enclosing in inside:
            enclosing.add(comp)
        for ins in module.comps.get(comp, []):
            if ins.opcode == "while":
                trip = _TRIP_RE.search(ins.attrs)
                n, nested = (int(trip.group(1)), inside) if trip else (1, inside + (set(),))
                if trip is None:
                    unknown.append((ins, nested[-1]))
                body = re.search(r"\bbody=%([\w.\-]+)", ins.attrs)
                if body:
                    visit(body.group(1), times * n, nested)
            elif ins.opcode == "call":  # a call's body is its to_apply
                for callee in called(ins):
                    visit(callee, times, inside)
            elif ins.opcode in ("async-update", "async-done") or (ins.opcode.endswith("-start")
                                                                   and ins.opcode != "async-start"):
                # The computation an async op runs is counted once, at its async-start (a sugared
                # "reduce-scatter-start" is itself the collective).
                continue
            elif ins.opcode != "fusion":  # fusions hold no collectives; skip their (many) bodies
                for callee in called(ins):  # async wrappers, conditional branches (each counted: an upper bound)
                    if not re.search(rf"\b(to_apply|condition)=%{re.escape(callee)}\b", ins.attrs):
                        visit(callee, times, inside)  # to_apply of a reduce or collective is its reduction function

    visit(module.entry, 1, ())
    return counts, [UnknownLoop(ins.name, op_name(ins), frozenset(comps)) for ins, comps in unknown]


def op_name(ins: Instr) -> str:
    """The JAX operation an instruction came from (``metadata={op_name="..."}``), or ""."""
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


