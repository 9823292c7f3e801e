"""The offline sm_90a compile check (python tools/compile_check.py).

The check needs Python 3.12 with the `compile-check` extra (jax 0.11.2, triton 3.6, jax-triton 0.3.1), which is
not the test environment's Python: the tests that compile run it in the interpreter named by
JAXTRAIN_COMPILE_CHECK_PYTHON (.ci/run builds that environment) and skip when it is not set. The argument and
toolchain errors are checked here, in any environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLCHAIN = os.environ.get("JAXTRAIN_COMPILE_CHECK_PYTHON")
needs_toolchain = pytest.mark.skipif(
    not TOOLCHAIN or not os.path.exists(TOOLCHAIN),
    reason="JAXTRAIN_COMPILE_CHECK_PYTHON does not name a Python 3.12 with `pip install -e '.[compile-check]'`")


def run_check(python, *args, timeout=900):
    env = dict(os.environ, TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", "/tmp/jaxtrain-triton-cache"))
    return subprocess.run([python, os.path.join("tools", "compile_check.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args,message", [
    (["--subset", "most"], "--subset 'most' is not valid"),
    (["--impl", "cuda"], "--impl 'cuda' is not valid"),
    (["--cases", "triton:bfloat16:96:causal:seg"], "case 'triton:bfloat16:96:causal:seg' is not valid"),
    (["--blocks", "block_q=big"], "--blocks 'block_q=big' is not valid"),
    (["--jobs", "0"], "--jobs 0 is not valid"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    proc = run_check(sys.executable, *args, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_missing_toolchain_is_a_one_line_error():
    """This test environment (jax 0.10.2 on Python 3.11, or no triton) cannot compile for an abstract H200."""
    import jax

    if jax.__version__.split(".")[:2] >= ["0", "11"] and TOOLCHAIN == sys.executable:
        pytest.skip("this interpreter has the compile-check toolchain")
    proc = run_check(sys.executable, "--cases", "pallas:bfloat16:64:causal:seg", timeout=120)
    assert proc.returncode == 2
    assert "pip install -e '.[compile-check]'" in proc.stderr and "Traceback" not in proc.stderr


@needs_toolchain
def test_sixteen_bit_kernels_of_both_impls_pass():
    proc = run_check(TOOLCHAIN, "--json", "--jobs", "2", "--cases",
                     "pallas:bfloat16:128:causal:seg,triton:float16:64:full:noseg")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert sorted((r["impl"], r["kernel"]) for r in rows) == [
        ("pallas", "dkdv"), ("pallas", "dq"), ("pallas", "fwd"), ("triton", "dkdv"), ("triton", "dq"),
        ("triton", "fwd")]
    for r in rows:
        assert not r["problems"], r
        assert r["wgmma"] > 0 and r["spill_bytes"] == 0 and 0 < r["smem"] <= 227 * 1024, r
        assert r["registers"] and r["registers"] <= 255, r


@needs_toolchain
def test_shared_memory_over_the_limit_fails_the_check():
    """128x128 bfloat16 tiles at head dim 128 with 4 stages need more than Hopper's 227 KiB: the check must say so
    and exit 1 (it would fail to launch on the GPU)."""
    proc = run_check(TOOLCHAIN, "--json", "--jobs", "1", "--cases", "pallas:bfloat16:128:full:noseg",
                     "--blocks", "block_q=128,block_k=128,num_stages=4")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    fwd = [r for r in rows if r["kernel"] == "fwd"][0]
    assert fwd["smem"] > 227 * 1024
    assert any("shared memory" in p for p in fwd["problems"]), fwd
