"""The documentation: the README as an entry point, the generated configuration reference, links that resolve.

Fast (no JAX computation): regenerates docs/configuration-reference.md in memory and reads the Markdown files.
"""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

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


def test_configuration_reference_refuses_two_descriptions_for_one_key(tmp_path, monkeypatch):
    """A comment above a field and another beside it used to be joined into one garbled description (mesh.auto
    carried two texts run together): the generator names the field instead of printing that."""
    (tmp_path / "two_comments.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Section:\n"
        "    # the long description\n    key: int = 1  # a second, shorter one\n"
        "    # one text only\n    other: int = 2\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    section = importlib.import_module("two_comments").Section
    generator = _generator()
    with pytest.raises(ValueError, match=r"two_comments\.py:7: Section\.key has a comment above it and one beside"):
        generator._fields_in_source(section)


def test_what_the_hugging_face_examples_write_in_the_checkout_is_git_ignored():
    """docs/huggingface.md's examples, run from the checkout as shown, write model directories there (hf-small/,
    hf-moe/, imports/, exports/, data.bin): git must not offer them for a commit."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    blocks = re.findall(r"```bash\n(.*?)```", (DOCS / "huggingface.md").read_text(encoding="utf-8"), flags=re.S)
    written = set()
    for block in blocks:
        written |= set(re.findall(r"--out ([\w./-]+)", block))
        written |= set(re.findall(r"""(?:save_pretrained|pathlib\.Path)\(['"]([\w./-]+)['"]\)""", block))
    written = {w for w in written if not w.startswith(("/", "~")) and w != "DIR"}
    assert {"hf-small", "hf-moe", "imports/moe", "exports/moe-ft", "data.bin"} <= written, written
    for path in sorted(written):
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", f"{path}/x"], cwd=ROOT)
        assert proc.returncode == 0, f"{path} (written by an example of docs/huggingface.md) is not git-ignored"
