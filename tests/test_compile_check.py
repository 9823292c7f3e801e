"""The offline sm_90a compile check (python tools/compile_check.py).

The check needs Python 3.12 with the `compile-check` extra (jax 0.11.2, triton 3.6, jax-triton 0.3.1), which is
not the test environment's Python: the tests that compile run it in the interpreter named by
JAXTRAIN_COMPILE_CHECK_PYTHON (.ci/run builds that environment) and skip when it is not set. The argument and
toolchain errors are checked here, in any environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

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
    (["--cases", "pallas:bfloat16:64:causal:seg:rings"], "case 'pallas:bfloat16:64:causal:seg:rings' is not valid"),
    (["--cases", "pallas:gmm:huge"], "case 'pallas:gmm:huge' is not valid"),
    (["--cases", "triton:gmm:uneven:int8"], "case 'triton:gmm:uneven:int8' is not valid"),
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


def _load_tool():
    spec = importlib.util.spec_from_file_location("compile_check", os.path.join(REPO, "tools", "compile_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compile_check", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _yaml_model(name):
    """The shipped config's model and data sections as the YAML file writes them (an independent reading)."""
    with open(os.path.join(REPO, "jaxtrain", "configs", f"{name}.yaml")) as f:
        doc = yaml.safe_load(f)
    m = doc["model"]
    head_dim = m.get("head_dim") or m["d_model"] // m["n_heads"]
    return head_dim, m["n_heads"], m.get("n_kv_heads", m["n_heads"]), doc["data"]["seq_len"]


def test_cases_come_from_the_shipped_configs():
    """Every shipped model's training call is in the full set at its seq_len (a tile multiple: the EVEN path) and 3
    tokens less, with its head dim and GQA group, bfloat16, causal, no segments, and rows enough for the unsplit
    dk/dv launch; the CI subset has the 1B, 7B and 70B calls; the generic matrix adds head dim 32, the masked path
    and the split dk/dv launch."""
    from jaxtrain.kernels.flash import tiling

    tool = _load_tool()
    full, ci = tool.full_matrix(), tool.ci_subset()
    groups = set()
    for name in ("125m", "1b", "7b", "70b"):
        head_dim, heads, kv_heads, seq = _yaml_model(name)
        mine = [c for c in full if c.source == name]
        assert sorted((c.impl, c.seq) for c in mine) == sorted(
            (impl, s) for impl in ("pallas", "triton") for s in (seq, seq - 3))
        for c in mine:
            assert (c.head_dim, c.heads, c.kv_heads, c.dtype, c.causal, c.segments) == (
                head_dim, heads, kv_heads, "bfloat16", True, False), c
            block_k = tiling.default_launch("dkdv", "bfloat16", head_dim).block_k
            assert tiling.choose_splits(c.batch, c.seq, c.kv_heads, heads // kv_heads, block_k) == 1, c
        launches = [tiling.default_launch(k, "bfloat16", head_dim) for k in tiling.KINDS]
        assert all(seq % t.block_q == 0 and seq % t.block_k == 0 for t in launches)  # the EVEN path
        groups.add(heads // kv_heads)
        in_ci = sorted(c.impl for c in ci if c.source == name)
        assert in_ci == (["pallas", "triton"] if name != "125m" else []), (name, in_ci)
        assert all(c.seq == seq for c in ci if c.source == name)
    assert groups == {1, 4, 8}
    matrix = [c for c in ci if c.source == "matrix"]
    assert {c.head_dim for c in matrix} == {32, 64, 128, 256} and {c.dtype for c in matrix} == set(tool.DTYPES)
    for c in matrix:
        block_k = tiling.default_launch("dkdv", c.dtype, c.head_dim).block_k
        assert c.seq % block_k, c  # the masked path: 4093 is no multiple of any tile
    assert any(tiling.choose_splits(c.batch, c.seq, c.kv_heads, c.heads // c.kv_heads,
                                    tiling.default_launch("dkdv", c.dtype, c.head_dim).block_k) > 1 for c in matrix)


def test_ring_block_calls_are_in_the_ci_subset_and_the_full_matrix():
    """The ring-attention block calls (fwd + bwd entries, traced offsets, sq != skv) are checked in CI for both impls,
    with separate key segments on the tile-multiple path and without segments on the masked path; the full matrix
    has one per impl, dtype and head dim."""
    tool = _load_tool()
    rings = [c for c in tool.ci_subset() if c.source == "ring"]
    assert sorted(c.impl for c in rings) == ["pallas", "pallas", "triton", "triton"]
    for impl in ("pallas", "triton"):
        mine = [c for c in rings if c.impl == impl]
        assert all(c.kv_seq and c.kv_seq != c.seq and c.causal for c in mine)
        assert any(c.segments and c.seq % 128 == 0 and c.kv_seq % 128 == 0 for c in mine)  # the EVEN path
        assert any(not c.segments and c.seq % 16 and c.kv_seq % 16 for c in mine)  # masked loads
    full = {(c.impl, c.dtype, c.head_dim) for c in tool.full_matrix() if c.source == "ring"}
    assert full == {(i, d, h) for i in tool.IMPLS for d in tool.DTYPES for h in tool.HEAD_DIMS}


def test_list_prints_the_cases_without_a_toolchain(capsys):
    assert _load_tool().main(["--list", "--cases", "triton:70b,pallas:bfloat16:32:causal:noseg,"
                                                   "triton:float16:64:causal:seg:ring"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head_dim, heads, kv_heads, seq = _yaml_model("70b")
    assert lines[0].startswith(f"triton bfloat16 d{head_dim} causal ")
    assert lines[0].endswith(f" s{seq} h{heads}/{kv_heads} (70b)")
    assert lines[1] == "pallas bfloat16 d32 causal b2 s4093 h16/4 (matrix)"
    assert lines[2] == "triton float16 d64 causal seg b1 s4093/2045 h16/4 (ring)"


def test_grouped_matmul_cases_are_mixtral_sized_in_the_ci_subset(capsys):
    """CI compiles the grouped matmul of a Mixtral-sized MoE layer (8 experts, top 2, 4 x 4096 tokens per device,
    d_model 4096, d_ff 14336, bfloat16): gate/up [m, 4096] x [8, 4096, 14336] and down [m, 14336] x [8, 14336,
    4096], both impls, and the uneven shape's masked paths in bfloat16 and float32; the full set adds float16."""
    tool = _load_tool()
    ci = tool.gmm_cases(subset="ci")
    mixtral = {(c.impl, c.dims) for c in ci if c.source.startswith("mixtral")}
    m = 4 * 4096 * 2
    assert mixtral == {(i, d) for i in ("pallas", "triton") for d in ((m, 4096, 14336, 8), (m, 14336, 4096, 8))}
    assert all(c.dtype == "bfloat16" for c in ci if c.source.startswith("mixtral"))
    uneven = [c for c in ci if c.source == "uneven"]
    assert {(c.impl, c.dtype) for c in uneven} == {(i, d) for i in tool.IMPLS for d in ("bfloat16", "float32")}
    assert all(x % 16 for x in uneven[0].dims[:3])  # no dimension a tile multiple
    assert {c.dtype for c in tool.gmm_cases()} == set(tool.DTYPES)
    assert tool.main(["--list", "--subset", "ci"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sum("grouped matmul" in line for line in listed) == len(ci)
    assert "pallas bfloat16 grouped matmul m32768 k4096 n14336 experts 8 (gmm mixtral-up)" in listed


def _three_kernels_of_each_impl(cases: str) -> list[dict]:
    """The compile check's rows for ``cases`` (one Pallas and one Triton case), after checking that it passed and
    compiled the forward, dq and dk/dv kernels of each."""
    proc = run_check(TOOLCHAIN, "--json", "--jobs", "2", "--cases", cases)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert sorted((r["impl"], r["kernel"]) for r in rows) == [
        ("pallas", "dkdv"), ("pallas", "dq"), ("pallas", "fwd"), ("triton", "dkdv"), ("triton", "dq"),
        ("triton", "fwd")]
    return rows


@needs_toolchain
def test_the_1b_training_call_compiles_on_the_even_path_with_one_dkdv_program_per_group():
    for r in _three_kernels_of_each_impl("triton:1b,pallas:1b"):
        assert r["case"] == "1b" and r["even"] is True and r["group"] == 4 and not r["problems"], r
        assert r.get("splits", 1) == 1 and r["wgmma"] > 0 and r["spill_bytes"] == 0, r


@needs_toolchain
def test_sixteen_bit_kernels_of_both_impls_pass():
    for r in _three_kernels_of_each_impl("pallas:bfloat16:128:causal:seg,triton:float16:64:full:noseg"):
        assert not r["problems"], r
        assert r["wgmma"] > 0 and r["spill_bytes"] == 0 and 0 < r["smem"] <= 227 * 1024, r
        assert r["registers"] and r["registers"] <= 255, r


@needs_toolchain
def test_ring_block_kernels_of_both_impls_pass():
    """The fwd / bwd entries with traced offsets, sq != skv and separate key segments compile without spills."""
    for r in _three_kernels_of_each_impl("pallas:bfloat16:128:causal:seg:ring,triton:bfloat16:128:causal:seg:ring"):
        assert r["case"] == "ring" and not r["problems"], r
        assert r["wgmma"] > 0 and r["spill_bytes"] == 0, r


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


@needs_toolchain
def test_grouped_matmul_kernels_pass_with_wgmma_and_exact_float32():
    """The Mixtral gate/up call's forward, d_lhs and d_rhs kernels of both impls compile without spills and with
    wgmma; the uneven float32 call's (every masked path) without a TF32 dot."""
    proc = run_check(TOOLCHAIN, "--json", "--jobs", "2", "--cases",
                     "pallas:gmm:mixtral-up,triton:gmm:mixtral-up,triton:gmm:uneven:float32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert sorted((r["impl"], r["dtype"], r["kernel"]) for r in rows) == sorted(
        (impl, dtype, kind) for impl, dtype in (("pallas", "bfloat16"), ("triton", "bfloat16"), ("triton", "float32"))
        for kind in ("fwd", "dlhs", "drhs"))
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["smem"] <= 227 * 1024, r
        assert (r["wgmma"] > 0) == (r["dtype"] == "bfloat16") and not (r["dtype"] == "float32" and r["tf32"]), r


def test_sliding_window_calls_are_in_the_ci_subset_for_pallas():
    """Mistral 7B's windowed layer (the window shorter than the sequence, so whole key tiles are skipped) on the EVEN
    path and a masked-path call with segments, Pallas only (the Triton-language kernels have no window)."""
    tool = _load_tool()
    windows = [c for c in tool.ci_subset() if c.window]
    assert {c.impl for c in windows} == {"pallas"} and len(windows) == 2
    assert all(c.causal and 0 < c.window < c.seq for c in windows)
    assert any(c.seq % 128 == 0 and (c.heads, c.kv_heads, c.head_dim) == (32, 8, 128) for c in windows)
    assert any(c.seq % 16 and c.segments for c in windows)
    assert not [c for c in tool.ci_subset(("triton",)) if c.window]
