"""The documentation: the README as an entry point, the generated configuration reference, links that resolve.

Fast (no JAX computation): regenerates docs/configuration-reference.md in memory and reads the Markdown files.
"""

import importlib.util
import re
from pathlib import Path

from jaxtrain import config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "configuration-reference.md"
SETUP = [
    "pip install -e . && python -m jaxtrain train",
    "pip install -e '.[test]' && python -m pytest -q -n 2",
]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_config_py():
    """docs/configuration-reference.md is exactly what tools/config_reference.py prints: a key added to (or a
    comment changed in) jaxtrain/config.py without regenerating fails here."""
    generator = _generator()
    assert REFERENCE.read_text(encoding="utf-8") == generator.render(), (
        f"docs/configuration-reference.md is out of date: run `{generator.COMMAND}`"
    )


def test_configuration_reference_names_every_key():
    text = REFERENCE.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w.]+)` \|", text, flags=re.M))
    missing = [k for k in config.all_keys() if k not in listed]
    assert not missing, f"keys missing from docs/configuration-reference.md: {missing}"


def test_readme_is_short_and_starts_with_the_two_setup_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move detail to docs/"
    first = [line for line in lines if line.strip()][:4]
    assert first[0].startswith("# "), first  # the title
    assert first[1].startswith("```"), first
    for expected, line in zip(SETUP, first[2:]):
        assert line.split("#")[0].strip() == expected, (line, expected)


def _markdown_files():
    return [README, *sorted(DOCS.glob("*.md"))]


def test_every_relative_link_points_at_an_existing_file():
    link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
    broken = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
        for target in link.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # https:, mailto:, or an anchor in the same file
            path = target.split("#")[0]
            if not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert len(_markdown_files()) > 5  # the docs/ folder is there
