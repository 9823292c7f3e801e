"""Trimming compiled HLO text to what a reader of it needs (the goldens' generators: generate.py for XLA:CPU,
generate_gpu.py for XLA:GPU): attributes the planner does not read dropped, then whole computations and instruction
lines removed for as long as a given reading of the text stays what it was. Pure text; no JAX."""

from __future__ import annotations

import re
from collections.abc import Callable


def strip_attributes(text: str) -> str:
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?\n\n", "", text, flags=re.M | re.S)
    header, _, rest = text.partition("\n")
    parts = re.search(r"num_partitions=\d+", header)
    text = f"HloModule {header.split()[1].rstrip(',')}" + (f", {parts.group(0)}" if parts else "") + "\n" + rest
    def metadata(m: re.Match) -> str:
        name = re.search(r'op_name="[^"]*"', m.group(0))
        return f", metadata={{{name.group(0)}}}" if name else ""

    text = re.sub(r", metadata=\{[^}]*\}", metadata, text)
    text = re.sub(r', backend_config=(\{.*?\})(?=,|$)',
                  lambda m: m.group(0) if "known_trip_count" in m.group(1) else "", text, flags=re.M)
    text = re.sub(r"\]\{[\d,]*\}", "]", text)  # layouts
    return re.sub(r"/\*index=\d+\*/", "", text)


def _computations(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line index of each non-entry computation."""
    spans, start = [], None
    for i, line in enumerate(lines):
        if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("ENTRY"):
            start = i
        elif line.startswith("}") and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _drop(lines: list[str], keep_fn, candidates: list[list[int]]) -> list[str]:
    """Remove groups of line indices (halving the batch on failure) while ``keep_fn(lines)`` holds."""
    removed: set[int] = set()
    batch = max(1, len(candidates) // 4)
    while candidates:
        chunk, rest = candidates[:batch], candidates[batch:]
        trial = removed | {i for group in chunk for i in group}
        if keep_fn([ln for i, ln in enumerate(lines) if i not in trial]):
            removed, candidates = trial, rest
        elif batch > 1:
            batch //= 2
            continue
        else:
            candidates = rest
        batch = max(1, min(batch * 2, len(candidates) // 4 or 1))
    return [ln for i, ln in enumerate(lines) if i not in removed]


def trim_keeping(text: str, reading: Callable[[str], object]) -> str:
    """``text`` with attributes stripped and computations, then instruction lines, removed while ``reading(text)``
    (which may raise on a text it cannot read: not a valid trim) stays equal to the untrimmed text's."""
    want = reading(text)
    text = strip_attributes(text)
    assert reading(text) == want, "attribute stripping changed the reading"

    def same(lines: list[str]) -> bool:
        try:
            return reading("\n".join(lines)) == want
        except Exception:  # a removal that breaks the parse is not a valid trim
            return False

    lines = text.splitlines()
    lines = _drop(lines, same, [list(range(a, b + 1)) for a, b in _computations(lines)])
    # Instruction lines (not headers, closing braces or ROOTs), in chunks of neighbours.
    body = [i for i, ln in enumerate(lines) if ln.startswith("  ") and not ln.lstrip().startswith("ROOT")]
    lines = _drop(lines, same, [[i] for i in body])
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)) + "\n"
    assert reading(out) == want
    return out
