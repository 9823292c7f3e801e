"""Start-up: what the train command imports, the XLA flags it sets, and JAX's persistent compile cache
(runtime.compile_cache).

How long start-up takes is a benchmark figure (benchmarks/startup.py), not asserted here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxtrain.cluster import process as runtime
from jaxtrain.config import ConfigError, load_config
from jaxtrain_testing import REPO, logged_losses, run_cli

HEAVY = ("torch", "tensorboardX", "transformers")


def test_train_command_imports_no_torch_tensorboardx_or_transformers():
    """The CLI and the train command's whole import closure (the loop and everything it imports) leave out the
    heavy optional packages, which cost seconds of start-up where installed (torch alone ~1.5 s here)."""
    code = ("import sys, jaxtrain.cli, jaxtrain.commands.train, jaxtrain.train.loop\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""


def test_grain_and_orbax_are_imported_while_the_step_compiles():
    """Grain and Orbax (Grain imports Orbax) are not in the train command's import closure: the loop imports them
    on another thread while XLA compiles the train step (jaxtrain/train/loop.py), not before it."""
    code = ("import sys, jaxtrain.cli, jaxtrain.commands.train, jaxtrain.train.loop\n"
            "print(' '.join(m for m in ('grain', 'orbax.checkpoint') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""


def test_compile_cache_setting(monkeypatch, tmp_path):
    # JAX's own variable first (the launchers set it in the run directory), then the XDG cache home, then ~/.cache
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    assert runtime.compile_cache_dir("auto") == str(tmp_path / "jax-cache")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime.compile_cache_dir("auto") == os.path.join(str(tmp_path), "jaxtrain", "compile")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert runtime.compile_cache_dir("auto") == os.path.join(os.path.expanduser("~"), ".cache", "jaxtrain", "compile")
    assert runtime.compile_cache_dir("none") is None
    assert runtime.compile_cache_dir("rel/dir") == os.path.abspath("rel/dir")
    assert load_config(None, []).runtime.compile_cache == "auto"
    with pytest.raises(ConfigError, match="runtime.compile_cache is empty: use auto, a directory or none"):
        load_config(None, ["runtime.compile_cache=''"])


@pytest.mark.slow
def test_rerun_loads_every_program_from_the_compile_cache(tmp_path):
    """The first run fills the cache with its programs (train and eval steps among them); the rerun of the same
    config in a new run.dir finds every one of them there: it adds no entry."""
    cache = tmp_path / "cache"
    args = ["train", "train.steps=2", "runtime.cpu_devices=1", f"runtime.compile_cache={cache}"]
    first = run_cli(*args, f"run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-2000:]
    entries = set(os.listdir(cache))
    assert any(e.startswith("jit_train_step-") for e in entries) and any(e.startswith("jit_eval_step-")
                                                                          for e in entries)
    second = run_cli(*args, f"run.dir={tmp_path / 'b'}")
    assert second.returncode == 0, second.stderr[-2000:]
    assert set(os.listdir(cache)) == entries
    off = run_cli("train", "train.steps=1", "runtime.cpu_devices=1", "runtime.compile_cache=none",
                  f"run.dir={tmp_path / 'c'}", env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / "xdg").exists()  # none: nothing written anywhere, not even the default location


def _startup_benchmark():
    spec = importlib.util.spec_from_file_location("startup_bench", os.path.join(REPO, "benchmarks", "startup.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_maxtext_job_has_the_configs_shapes():
    """The MaxText run the start-up ratio is taken against trains the same shapes as jaxtrain's job (read off the
    config with its overrides), on synthetic data, with no checkpointing and the given compile cache."""
    args = _startup_benchmark().maxtext_args("base.yml", ["runtime.cpu_devices=2", "model.d_model=64",
                                                          "train.global_batch=8", "model.tie_embeddings=false"],
                                             "/c", "/o")
    assert args[:2] == ["maxtext.trainers.pre_train.train", "base.yml"]
    kv = dict(a.split("=", 1) for a in args[2:])
    assert {k: kv[k] for k in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim", "base_mlp_dim",
                               "base_num_decoder_layers", "vocab_size", "max_target_length", "per_device_batch_size",
                               "logits_via_embedding", "jax_cache_dir", "dataset_type", "enable_checkpointing")} == {
        "base_emb_dim": "64", "base_num_query_heads": "8", "base_num_kv_heads": "4", "head_dim": "8",
        "base_mlp_dim": "384", "base_num_decoder_layers": "4", "vocab_size": "256", "max_target_length": "128",
        "per_device_batch_size": "4", "logits_via_embedding": "false", "jax_cache_dir": "/c",
        "dataset_type": "synthetic", "enable_checkpointing": "false"}


@pytest.mark.skipif(importlib.util.find_spec("IPython") is None, reason="IPython is not installed")
def test_commands_skip_flaxs_ipython_probe():
    """While a command runs, Flax's import does not import IPython (seconds of start-up where installed); after it,
    IPython imports as usual, and inside an IPython session nothing is changed."""
    code = ("import sys, importlib.util\nfrom jaxtrain import cli\n"
            "with cli.ipython_probe_skipped():\n    import flax.nnx\n    inside = 'IPython' in sys.modules and "
            "sys.modules['IPython'] is not None\n"
            "print(inside, 'IPython' in sys.modules, importlib.util.find_spec('IPython') is not None)\n"
            "import IPython\nwith cli.ipython_probe_skipped():\n    print(sys.modules['IPython'] is IPython)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True", "True"]


def test_xla_flags_are_added_once_and_disabled_passes_merge(monkeypatch):
    """XLA keeps only the last of a repeated flag, so a second list of passes to skip must join the first, not
    follow it (the plan's compiles skip constant folding on top of the train command's SKIPPED_PASSES); and what
    was added can be taken out again, leaving the user's own flags (the planner's XLA:GPU compiles)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_disable_hlo_passes=foo")
    monkeypatch.setattr(runtime, "ADDED_XLA_FLAGS", set())
    monkeypatch.setattr(runtime, "ADDED_PASSES", set())
    runtime.skip_aborting_passes()
    runtime.add_xla_flags("--xla_backend_optimization_level=0")
    runtime.add_xla_flags("--xla_disable_hlo_passes=constant_folding,all-reduce-promotion",
                          "--xla_backend_optimization_level=0")
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=4",
        "--xla_disable_hlo_passes=foo,all-reduce-promotion,constant_folding",
        "--xla_backend_optimization_level=0"]
    assert runtime.user_xla_flags() == ["--xla_force_host_platform_device_count=4", "--xla_disable_hlo_passes=foo"]


@pytest.mark.slow
def test_bfloat16_moe_under_fsdp_trains_on_cpu(tmp_path):
    """An MoE model in bfloat16 under fsdp: shard_map's transpose sums the experts' bfloat16 weight gradients in a
    psum that aborted XLA:CPU's AllReducePromotion pass (the process died in a check failure); the train command
    skips the pass. Its losses equal one device's within bfloat16 rounding."""
    common = ["train", "--config", "tiny-deepseek-moe", "model.dtype=bfloat16", "train.steps=2",
              "train.eval_batches=1", "mesh.ici.expert=1"]
    for name, devices in (("sharded", 2), ("one", 1)):
        out = run_cli(*common, f"runtime.cpu_devices={devices}", f"mesh.ici.fsdp={devices}",
                      f"run.dir={tmp_path / name}")
        assert out.returncode == 0, out.stderr[-3000:]
    sharded, one = logged_losses(tmp_path / "sharded"), logged_losses(tmp_path / "one")
    assert sorted(sharded) == sorted(one) == [1, 2]
    for step in one:  # bfloat16 keeps 8 bits: 2 steps stay well inside 1 %
        assert sharded[step] == pytest.approx(one[step], rel=1e-2)
