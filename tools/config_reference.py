"""Print the configuration reference (Markdown) from the config dataclasses in jaxtrain/config/tree.py.

    python tools/config_reference.py > docs/configuration-reference.md

One row per dotted key of ``jaxtrain.config.all_keys()``, plus a row for each nested section (``mesh.ici``,
``model.rope_scaling``, ...): the key, its type as written in the source, its default (from ``Config()``, so default
factories count) and its description: the comment lines directly above the field (no blank line between) or the
comment at the end of the field's line, never both (two texts for one key read as one garbled description, so the
generator refuses them, naming the field). A field without either gets an empty description; ``--missing`` lists
those keys instead of printing the table. The output depends only on config.py, so tests/test_docs.py can compare it
with the committed file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxtrain import config  # noqa: E402

COMMAND = "python tools/config_reference.py > docs/configuration-reference.md"


@cache
def _source(path: str) -> tuple[ast.Module, str, dict[int, str], set[int]]:
    """The parsed module, its text, each line's comment (without ``#``) and the lines holding only a comment."""
    text = Path(path).read_text(encoding="utf-8")
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    comment_only = {line for line in comments if line not in code_lines}
    return ast.parse(text), text, comments, comment_only


@cache
def _fields_in_source(cls: type) -> dict[str, tuple[str, str]]:
    """``{field name: (annotation as written, description)}`` for the dataclass ``cls``."""
    path = inspect.getsourcefile(cls)
    assert path is not None, cls
    tree, text, comments, comment_only = _source(path)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line in comment_only:
            above.insert(0, comments[line])
            line -= 1
        end = stmt.end_lineno or stmt.lineno
        trailing = [comments[n] for n in range(stmt.lineno, end + 1) if n in comments and n not in comment_only]
        if above and trailing:
            raise ValueError(
                f"{path}:{stmt.lineno}: {cls.__name__}.{stmt.target.id} has a comment above it and one beside it;"
                " keep one, it is the key's whole description"
            )
        annotation = ast.get_source_segment(text, stmt.annotation) or ""
        out[stmt.target.id] = (" ".join(annotation.split()), " ".join(above + trailing))
    return out


def _value(v: Any) -> str:
    """A default as it would be written in YAML (null, true, a list)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def rows(cls: Any = config.Config, default: Any = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(key, type, default, description)`` for every field under ``cls``, sections before their keys."""
    default = cls() if default is None else default
    hints = typing.get_type_hints(cls)
    source = _fields_in_source(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        annotation, description = source.get(f.name, (str(f.type), ""))
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out.append((key, annotation, "(section)", description))
            out += rows(hints[f.name], value, key + ".")
        elif isinstance(value, dict):  # mesh.rules: its entries get their own table
            out.append((key, annotation, "(entries below)", description))
        else:
            out.append((key, annotation, _value(value), description))
    return out


def _cell(s: str, code: bool = False) -> str:
    s = s.replace("|", "\\|")
    return f"`{s}`" if code and s else s


def render() -> str:
    table = rows()
    keys = {r[0] for r in table}
    missing = [k for k in config.all_keys() if k not in keys]
    if missing:  # all_keys and this walk must agree; fail loudly rather than print an incomplete reference
        raise SystemExit(f"config_reference: keys of all_keys() not found in the dataclasses: {missing}")
    lines = [
        f"<!-- Generated by `{COMMAND}`; do not edit by hand. -->",
        "",
        "# Configuration reference",
        "",
        "Every key of the config tree (`jaxtrain/config/tree.py`), its type, its default (the tiny config) and the",
        "comment beside it in the source. Set a key in a YAML file (`--config`) or on the command line (`key=value`,",
        "value in YAML syntax); see [configuration.md](configuration.md).",
        "",
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    for key, annotation, value, description in table:
        shown = value if value in ("(section)", "(entries below)") else _cell(value, code=True)
        lines.append(f"| `{key}` | {_cell(annotation, code=True)} | {shown} | {_cell(description)} |")
    rules = config.Config().mesh.rules
    lines += [
        "",
        "## `mesh.rules` entries",
        "",
        "`mesh.rules` maps each logical axis the model names to a mesh axis, a list of mesh axes, or `null`",
        "(replicated); override one entry at a time, e.g. `mesh.rules.vocab=null`. Defaults:",
        "",
        "| key | default |",
        "| --- | --- |",
    ]
    lines += [f"| `mesh.rules.{name}` | `{_value(v)}` |" for name, v in rules.items()]
    return "\n".join(lines) + "\n"


def undescribed() -> list[str]:
    """Keys of all_keys() whose field has no comment."""
    described = {key for key, _, _, description in rows() if description}
    return [k for k in config.all_keys() if k not in described]


def main(argv: list[str]) -> int:
    if argv == ["--missing"]:
        print("\n".join(undescribed()))
        return 0
    if argv:
        print(__doc__.strip().splitlines()[0] + f"\nusage: {COMMAND}  |  python tools/config_reference.py --missing",
              file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
