"""The offline walkthroughs of docs/huggingface.md (a small random Llama with its own tokenizer and chat template:
import, prepare, fine-tune, export) and docs/data.md (chat fine-tuning of that import), run as the docs show them:
the bash blocks are read from the Markdown and run in order in a scratch directory, without any download."""

import json
import os
import subprocess
import sys

import pytest

from jaxtrain_testing import REPO


def _block(doc: str, first_line: str) -> str:
    """The code block of ``docs/<doc>`` that starts with ``first_line``, up to its closing fence."""
    with open(os.path.join(REPO, "docs", doc), encoding="utf-8") as f:
        text = f.read()
    start = text.index(first_line)
    return text[start:text.index("\n```", start)]


@pytest.mark.slow
def test_offline_hugging_face_and_chat_walkthroughs_run_as_shown(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    install = "pip install -e '.[hf-parity]'\n"
    hf = _block("huggingface.md", install)[len(install):]  # the extra is installed where this test runs
    sft = _block("data.md", "python - <<'EOF'\nimport json, random")
    (tmp_path / "docs").symlink_to(os.path.join(REPO, "docs"))  # `prepare 'docs/*.md'` reads the checkout's docs
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)  # the docs say `python`
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1")
    outputs = []
    for block in (hf, sft):
        proc = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout)
    for export in ("small-ft", "small-sft"):  # transformers loads them, with the tokenizer that came along
        files = set(os.listdir(tmp_path / "exports" / export))
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files, files
    assert "LlamaForCausalLM(" in outputs[0] and "<|im_end|>" in outputs[0]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "runs/small-sft/metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] / 4, losses  # chat fine-tuning of the random import learns the answers' form
    assert "user\nWhat is 3 plus 4?\nassistant\n" in outputs[1]  # the prompt through the import's tokenizer
