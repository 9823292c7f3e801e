"""jaxtrain installs beside the Hugging Face stack: no importable name of its own can shadow, or be shadowed by, a
package its users install.

``transformers`` (>= 5.25) depends on Hugging Face's ``kernels``, a top-level package; jaxtrain's kernels are
``jaxtrain.kernels``. With Hugging Face's ``kernels`` installed (the ``hf-parity`` extra brings it), transformers
builds its models from the checkout's root, where the tests run, and ``python -m jaxtrain train`` works from any
directory.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from jaxtrain_testing import REPO, run_cli


def _top_level_names(folder: str) -> set[str]:
    """What ``import NAME`` finds as a regular package or module in ``folder`` when it is on ``sys.path`` (a folder
    without ``__init__.py`` is only a namespace portion: any regular package of that name elsewhere wins)."""
    names = set()
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if entry.endswith(".py"):
            names.add(entry[:-3])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            names.add(entry)
    return names


def test_the_checkout_root_exposes_only_jaxtrain():
    assert _top_level_names(REPO) == {"jaxtrain"}


def test_the_installed_distribution_provides_only_jaxtrain():
    top_level = importlib.metadata.distribution("jaxtrain").read_text("top_level.txt") or ""
    assert top_level.split() == ["jaxtrain"]


def _hf_kernels_installed() -> bool:
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return "huggingface" in (dist.metadata.get("Home-page", "") + str(dist.metadata.get_all("Project-URL"))).lower() \
        or dist.metadata.get("Author", "").lower().startswith("hugging")


needs_hf = pytest.mark.skipif(not _hf_kernels_installed(), reason="Hugging Face's kernels package is not installed "
                              "(the hf-parity extra brings it with transformers >= 5.25)")


@needs_hf
def test_transformers_builds_a_llama_from_the_checkout_root():
    """Where the tests run, ``import kernels`` is Hugging Face's, and transformers builds (and runs) a model."""
    code = ("import kernels, torch, transformers\n"
            "assert 'site-packages' in kernels.__file__, kernels.__file__\n"
            "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
            " num_attention_heads=4, num_key_value_heads=2)\n"
            "model = transformers.LlamaForCausalLM(cfg)\n"
            "print(model(torch.tensor([[1, 2, 3]])).logits.shape)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch.Size([1, 3, 64])" in proc.stdout


@needs_hf
def test_train_runs_from_another_directory_beside_hugging_face_kernels(tmp_path):
    proc = run_cli("train", "train.steps=2", "train.eval_every=0", "train.eval_batches=1", "data.threads=0",
                   f"run.dir={tmp_path / 'run'}", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()
