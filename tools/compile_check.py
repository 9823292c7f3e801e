"""Offline compile check of the flash kernels for Hopper (sm_90a), on a machine without a GPU.

``python tools/compile_check.py [--json] [--subset full|ci] [--impl pallas,triton] [--jobs N]`` (from the repository
root or anywhere: it imports ``jaxtrain.kernels`` and ``jaxtrain.config`` from the checkout it sits in)

Needs the ``compile-check`` extra on Python 3.12 (``pip install -e '.[compile-check]'``: jax 0.11.2, triton 3.6,
jax-triton 0.3.1, the GPU machine's versions; the ``gpu`` extras pin the same triton). Two kinds of configuration:

* the shipped models' training calls (``config_cases``: 125m, 1b, 7b, 70b read with ``jaxtrain.config``): their
  head dim, query and kv heads (GQA group 1, 4 or 8), bfloat16, causal, segments only with document masking, the
  rows per device of one 8-GPU node (so the dk/dv launch is the unsplit one real batches get), at their
  ``data.seq_len`` (a multiple of every tile: the ``EVEN`` / unpadded path) and, in the full set, 3 tokens less;
* the generic matrix (impl x dtype x head_dim 32..256 x causal x segments) on q [2, 4093, 16, d] with 4 kv heads:
  masked loads (4093 is no tile multiple) and a dk/dv launch split over the GQA group (2 x 4 x 32 programs < 264).

For each it traces ``jax.grad`` of a loss through ``jaxtrain.kernels.flash_attention`` and lowers it
for an abstract NVIDIA H200 with ``lowering_platforms=("cuda",)``, which is what XLA does on the GPU machine up to
the launch:

* ``impl="pallas"``: Pallas lowers each kernel to Triton IR; the IR is captured at
  ``lower_jaxpr_to_triton_module`` and compiled with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` using the
  num_warps / num_stages that the lowering put into the custom call.
* ``impl="triton"``: jax-triton's own lowering compiles the Triton-language kernels to PTX (the real code path).
  Its launch objects (``jaxlib.gpu_triton``: TritonKernel, TritonKernelCall, ...) are C++ classes that need a
  GPU, so this process replaces that module with recording stubs; nothing is launched. The stubs exist only in
  this process (``python tools/compile_check.py``), never when the kernels are used.

Each kernel's PTX then goes through the ``ptxas`` bundled in the Triton wheel (``-arch=sm_90a -v``). One row per
kernel: tiles, warps, stages, registers, spill bytes, shared memory, number of ``wgmma.mma_async``, ``mma.sync``,
``cp.async`` and TMA (``cp.async.bulk.tensor``) instructions in the PTX, ptxas warnings (C7515 "wgmma serialized"
in particular) and compile seconds.

Exit status: 0 when every kernel passes; 1 when any kernel has a compile error, shared memory over the sm_90 limit
(227 KiB per block), spills in a 16-bit kernel, a 16-bit kernel without ``wgmma``, or a TF32 dot in a float32
kernel; 2 for bad arguments or a missing toolchain.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings

# Run as a script, Python puts tools/ first on sys.path, not the repository root: put the root there so that
# `jaxtrain` is this checkout's (the spawned worker processes inherit sys.path), not another installed copy.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SMEM_LIMIT = 227 * 1024  # sm_90 maximum dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (32, 64, 128, 256)
IMPLS = ("pallas", "triton")
# Shape of the generic matrix's calls. seq 4093 (not a multiple of any tile) makes the kernels compile their
# masked-load path, heads 16 / kv heads 4 makes them GQA kernels, and batch 2 splits the dk/dv launch.
BATCH, SEQ, HEADS, KV_HEADS = 2, 4093, 16, 4
# Ring-attention block calls (context parallelism): a query block of 2c tokens against a key block of c (zigzag's
# load-balanced chunks), through flash_attention_fwd (float32 out) and flash_attention_bwd (float32 grads) with
# traced offsets; odd lengths in the matrix (masked path), tile multiples in the CI's first ring case.
RING_BATCH, RING_SEQ, RING_KV_SEQ = 1, 4093, 2045
SHIPPED_CONFIGS = ("125m", "1b", "7b", "70b")
CI_CONFIGS = ("1b", "7b", "70b")  # the training shapes the CI subset must compile
GPUS_PER_NODE = 8  # the per-device shapes of config_cases are those of one 8-GPU node
TOOLCHAIN_HINT = ("the compile check needs Python 3.12 with jax 0.11.2, triton 3.6 and jax-triton 0.3.1: "
                  "pip install -e '.[compile-check]' in a Python 3.12 environment")


@dataclasses.dataclass(frozen=True)
class Case:
    impl: str
    dtype: str
    head_dim: int
    causal: bool
    segments: bool
    block_sizes: tuple = ()  # ((name, value), ...) overrides passed to flash_attention; () for the defaults
    batch: int = BATCH
    seq: int = SEQ
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    source: str = "matrix"  # "matrix", "ring", or the shipped config the shape comes from
    kv_seq: int = 0  # > 0: a ring block call (queries [batch, seq], keys [batch, kv_seq], traced offsets)
    window: int = 0  # > 0: a causal sliding window of this many keys (model.sliding_window; the Pallas kernels)

    @property
    def shape(self) -> str:
        kv = f"/{self.kv_seq}" if self.kv_seq else ""
        return f"b{self.batch} s{self.seq}{kv} h{self.heads}/{self.kv_heads}"

    @property
    def label(self) -> str:
        return (f"{self.impl} {self.dtype} d{self.head_dim} {'causal' if self.causal else 'full'}"
                f"{f' window {self.window}' if self.window else ''}{' seg' if self.segments else ''} {self.shape} "
                f"({self.source})")


def config_cases(impls=IMPLS, names=SHIPPED_CONFIGS, odd_seq: bool = True) -> list[Case]:
    """The attention call each shipped config's training step makes on one device of an 8-GPU node, read from the
    config (``jaxtrain.config.load_config``): dtype ("auto" is bfloat16 on GPU), head dim, query and kv heads per
    device (divided by the tensor axis), rows per device and microbatch, causal, segments when the config masks
    documents, at ``data.seq_len`` and (``odd_seq``) 3 tokens less."""
    from jaxtrain.config import load_config
    from jaxtrain.parallel.dims import ParallelDims

    cases = []
    for name in names:
        cfg = load_config(name, [])
        m = cfg.model
        dims = ParallelDims.of(cfg, num_devices=GPUS_PER_NODE)
        rows = dims.rows_per_group
        dtype = "bfloat16" if m.dtype == "auto" else m.dtype
        seqs = (cfg.data.seq_len, cfg.data.seq_len - 3) if odd_seq else (cfg.data.seq_len,)
        for impl in impls:
            for seq in seqs:
                cases.append(Case(impl, dtype, m.resolved_head_dim, True, cfg.data.document_mask, (), max(1, rows),
                                  seq, m.n_heads // dims.tensor, m.n_kv_heads // dims.tensor, name))
    return cases


def ring_case(impl, dtype, head_dim, causal=True, segments=True, seq=RING_SEQ, kv_seq=RING_KV_SEQ) -> Case:
    """A ring-attention block call: fwd + bwd entries, traced q/kv offsets, separate key segment ids."""
    return Case(impl, dtype, head_dim, causal, segments, batch=RING_BATCH, seq=seq, kv_seq=kv_seq, source="ring")


# Grouped matmul (mixture-of-experts) calls: lhs [m, k] x rhs [groups, k, n], forward and both gradients. The
# Mixtral-sized pair: 8 experts, top 2, 4 x 4096 tokens per device (m = 32768 rows), d_model 4096, d_ff 14336.
GMM_SHAPES = {
    "mixtral-up": (32768, 4096, 14336, 8),  # the gate / up projection [m, 4096] x [8, 4096, 14336]
    "mixtral-down": (32768, 14336, 4096, 8),  # the down projection [m, 14336] x [8, 14336, 4096]
    "uneven": (4093, 1000, 1500, 8),  # no dimension a tile multiple: every masked path
}
GMM_CI = ("mixtral-up", "mixtral-down")
GMM_KINDS = ("fwd", "dlhs", "drhs")  # the kernels of a call, in launch order


@dataclasses.dataclass(frozen=True)
class GmmCase:
    """A differentiable grouped matmul call (``jaxtrain.kernels.grouped_matmul``) of shape ``GMM_SHAPES[source]``."""

    impl: str
    dtype: str
    source: str  # a GMM_SHAPES name
    block_sizes: tuple = ()  # ((name, value), ...) tile overrides passed to grouped_matmul

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return GMM_SHAPES[self.source]

    @property
    def shape(self) -> str:
        m, k, n, groups = self.dims
        return f"m{m} k{k} n{n} experts {groups}"

    @property
    def label(self) -> str:
        return f"{self.impl} {self.dtype} grouped matmul {self.shape} (gmm {self.source})"


def gmm_cases(impls=IMPLS, subset: str = "full") -> list[GmmCase]:
    """CI: the Mixtral-sized pair in bfloat16, and the uneven shape (every masked path) in bfloat16 and float32 (no
    TF32). Full: also float16 in both shapes."""
    uneven = ("bfloat16", "float32") if subset == "ci" else DTYPES
    mixtral = ("bfloat16",) if subset == "ci" else ("bfloat16", "float16")
    return ([GmmCase(i, d, name) for i in impls for name in GMM_CI for d in mixtral]
            + [GmmCase(i, d, "uneven") for i in impls for d in uneven])


def window_cases(impls=IMPLS) -> list[Case]:
    """Sliding-window calls (Pallas only: the Triton-language kernels have no window mask): Mistral 7B's layer on one
    device (32 heads over 8 kv heads, d128, window 4096 over 8192 tokens: whole key tiles skipped) on the EVEN
    path, and a generic d64 call with segments on the masked path (window 1000 over 4093 tokens)."""
    if "pallas" not in impls:
        return []
    return [Case("pallas", "bfloat16", 128, True, False, batch=1, seq=8192, heads=32, kv_heads=8, source="window",
                 window=4096),
            Case("pallas", "bfloat16", 64, True, True, source="window", window=1000)]


def full_matrix(impls=IMPLS) -> list[Case]:
    """The shipped configs' calls (both sequence lengths), the whole generic matrix and the ring block calls
    (every dtype and head dim, causal, with segments, odd lengths)."""
    return (config_cases(impls) + [Case(i, d, h, c, s) for i, d, h, c, s in
                                   itertools.product(impls, DTYPES, HEAD_DIMS, (True, False), (True, False))]
            + [ring_case(i, d, h) for i, d, h in itertools.product(impls, DTYPES, HEAD_DIMS)] + window_cases(impls))


def ci_subset(impls=IMPLS) -> list[Case]:
    """The 1B, 7B and 70B training calls (GQA groups 4, 1, 8; head dims 64 and 128; the EVEN path; unsplit dk/dv)
    and generic cases that cover every dtype, head dim, mask kind, the masked path and the split dk/dv once, for
    both impls (the whole set takes over an hour on 2 cores: float32 kernels compile slowly)."""
    picks = [("bfloat16", 128, True, True), ("bfloat16", 32, False, False), ("float16", 256, True, False),
             ("float32", 64, True, True)]
    # Ring block calls: traced offsets, sq = 2 skv, the fwd / bwd entries; tile multiples with separate segments
    # (a split dk/dv launch: 1 x 4 kv heads x 16 kv tiles), then the masked path without segments.
    rings = [dict(dtype="bfloat16", head_dim=128, seq=4096, kv_seq=2048),
             dict(dtype="bfloat16", head_dim=64, segments=False)]
    return (config_cases(impls, CI_CONFIGS, odd_seq=False) + [Case(i, *p) for i in impls for p in picks]
            + [ring_case(i, **r) for i in impls for r in rings] + window_cases(impls))


# ----------------------------------------------------------------------------------------------------------------
# Toolchain
# ----------------------------------------------------------------------------------------------------------------


def toolchain_error(impls) -> str | None:
    """Why the check cannot run here, or None."""
    try:
        import jax
        import triton
    except ImportError as e:
        return f"{e}; {TOOLCHAIN_HINT}"
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        return f"jax {jax.__version__} is too old to name an abstract H200; {TOOLCHAIN_HINT}"
    if not os.path.exists(ptxas_path()):
        return f"triton {triton.__version__} has no bundled ptxas at {ptxas_path()}; {TOOLCHAIN_HINT}"
    if "triton" in impls:
        import importlib.util

        if importlib.util.find_spec("jax_triton") is None:
            return f"jax_triton is not installed; {TOOLCHAIN_HINT}"
    return None


def ptxas_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


class _Recorder:
    """Collects the kernels jax-triton compiles while lowering (see the module docstring)."""

    kernels: list = []
    calls: list = []


def install_launch_stubs():
    """Replace ``jaxlib.gpu_triton`` (GPU-only launch objects) with recording stubs before jax_triton is imported."""
    stub = types.ModuleType("jaxlib.gpu_triton")

    class TritonKernel:
        def __init__(self, name, num_warps, num_ctas, shared, ptx, ttir, compute_capability):
            self.name, self.num_warps, self.shared, self.ptx, self.ttir = name, num_warps, shared, ptx, ttir
            _Recorder.kernels.append(self)

    class TritonKernelCall:
        def __init__(self, kernel, grid_x, grid_y, grid_z, params):
            self.kernel, self.grid = kernel, (grid_x, grid_y, grid_z)
            _Recorder.calls.append(self)

        def to_proto(self, name, metadata):
            return b"compile-check stub: not launchable"

    stub.TritonKernel = TritonKernel
    stub.TritonKernelCall = TritonKernelCall
    stub.TritonAutotunedKernelCall = None
    stub.create_array_parameter = lambda zeroed, alignment: ("array", zeroed, alignment)
    stub.create_scalar_parameter = lambda value, dtype: ("scalar", value, dtype)
    stub.get_compute_capability = lambda device: 90
    stub.get_serialized_metadata = lambda *args: b""
    import jax._src.lib as jax_lib

    sys.modules["jaxlib.gpu_triton"] = stub
    jax_lib.gpu_triton = stub


# ----------------------------------------------------------------------------------------------------------------
# Lowering
# ----------------------------------------------------------------------------------------------------------------


def _abstract_h200_mesh():
    import jax
    from jax._src.mesh import AbstractDevice

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def _lower_gmm(case: GmmCase) -> str:
    """StableHLO text lowered for CUDA of a grouped matmul's value and its vjp (d_lhs, d_rhs): all three kernels
    (``jax.grad`` alone would leave the forward's output dead and its kernel unlowered)."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.kernels import grouped_matmul

    m, k, n, groups = case.dims
    dtype = jnp.dtype(case.dtype)
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((groups, k, n), dtype),
            jax.ShapeDtypeStruct((groups,), jnp.int32), jax.ShapeDtypeStruct((m, n), dtype))

    def value_and_vjp(lhs, rhs, group_sizes, d_out):
        out, pull = jax.vjp(lambda a, b: grouped_matmul(a, b, group_sizes, impl=case.impl, **dict(case.block_sizes)),
                            lhs, rhs)
        return out, pull(d_out)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jax 0.11 deprecation warning of the Pallas Triton backend
        with jax.sharding.use_abstract_mesh(_abstract_h200_mesh()):
            return jax.jit(value_and_vjp).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _lower_grad(case) -> str:
    """StableHLO text lowered for CUDA of grad(sum(flash_attention)), or for a ring block call (``kv_seq``) of
    flash_attention_fwd then flash_attention_bwd with traced offsets and separate key segment ids (a grouped matmul
    case: ``_lower_gmm``)."""
    if isinstance(case, GmmCase):
        return _lower_gmm(case)
    import jax
    import jax.numpy as jnp

    from jaxtrain.kernels import flash_attention, flash_attention_bwd, flash_attention_fwd

    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((case.batch, case.seq, case.heads, case.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((case.batch, case.kv_seq or case.seq, case.kv_heads, case.head_dim), dtype)
    seg = jax.ShapeDtypeStruct((case.batch, case.seq), jnp.int32) if case.segments else None
    kv_seg = jax.ShapeDtypeStruct((case.batch, case.kv_seq), jnp.int32) if case.segments and case.kv_seq else None

    def loss(q, k, v, seg):
        window = {"window": case.window} if case.window else {}
        out = flash_attention(q, k, v, causal=case.causal, segment_ids=seg, impl=case.impl, **window,
                              **dict(case.block_sizes))
        return jnp.sum(out.astype(jnp.float32))

    def ring_block(q, k, v, do, seg, kv_seg, offsets):
        kw = dict(causal=case.causal, segment_ids=seg, kv_segment_ids=kv_seg, q_offset=offsets[0],
                  kv_offset=offsets[1], impl=case.impl, **dict(case.block_sizes))
        out, lse = flash_attention_fwd(q, k, v, out_dtype=jnp.float32, **kw)
        return out, lse, flash_attention_bwd(q, k, v, out, lse, do, grad_dtype=jnp.float32, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jax 0.11 deprecation warning of the Pallas Triton backend
        with jax.sharding.use_abstract_mesh(_abstract_h200_mesh()):
            if case.kv_seq:
                offsets = jax.ShapeDtypeStruct((2,), jnp.int32)
                lowered = jax.jit(ring_block).trace(q, kv, kv, q, seg, kv_seg, offsets)
            else:
                lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg)
            return lowered.lower(lowering_platforms=("cuda",)).as_text()


# jax_triton 0.3.1 sets TRITON_CACHE_DIR="" when it is imported (by a triton case in the same process), after which
# triton.compile finds no cache directory ("Could not create or locate cache dir"): Pallas cases put back the value
# the process started with.
_START_CACHE_DIR = os.environ.get("TRITON_CACHE_DIR")


def _pallas_kernels(case, workdir: str) -> list[dict]:
    import triton

    if os.environ.get("TRITON_CACHE_DIR") == "":
        if _START_CACHE_DIR:
            os.environ["TRITON_CACHE_DIR"] = _START_CACHE_DIR
        else:
            del os.environ["TRITON_CACHE_DIR"]
    from jax._src.pallas.triton import pallas_call_registration as registration
    from triton.backends.compiler import GPUTarget

    captured = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, platform, cc, mlir_ctx):
        result = original(jaxpr, grid_mapping, platform, cc, mlir_ctx=mlir_ctx)
        captured.append((jaxpr.debug_info.func_name, result.module.operation.get_asm(enable_debug_info=False)))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        text = _lower_grad(case)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    # The custom call's backend_config carries each kernel's launch parameters next to its name.
    launch = {m.group(1): (int(m.group(3)), int(m.group(2))) for m in re.finditer(
        r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    kernels = []
    for name, ttir in captured:
        warps, stages = launch[name]
        path = os.path.join(workdir, f"{name}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        start = time.perf_counter()
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        kernels.append(dict(name=name, ttir=ttir, ptx=compiled.asm["ptx"], shared=compiled.metadata.shared,
                            warps=warps, stages=stages, seconds=time.perf_counter() - start))
    return kernels


def _triton_kernels(case) -> list[dict]:
    from jaxtrain.kernels.flash import triton as flash_triton

    _Recorder.kernels.clear()
    _Recorder.calls.clear()
    original = flash_triton.availability_error
    flash_triton.availability_error = lambda: None  # the check compiles; it never launches
    start = time.perf_counter()
    try:
        _lower_grad(case)
    finally:
        flash_triton.availability_error = original
    seconds = (time.perf_counter() - start) / max(1, len(_Recorder.calls))
    # The num_stages a kernel was compiled with is not kept on TritonKernel: take it from the kernels' launch settings.
    stages = _launch_settings(case)
    kernels = []
    dkdv_calls = [c for c in _Recorder.calls if _kind(c.kernel.name) == "dkdv"]
    # A grouped matmul's forward and d_lhs are one Triton kernel with other constexprs: name them by launch order.
    gmm_kinds = iter(GMM_KINDS) if isinstance(case, GmmCase) and len(_Recorder.calls) == len(GMM_KINDS) else None
    for call in _Recorder.calls:
        k = call.kernel
        name = k.name
        if len(dkdv_calls) == 2 and call in dkdv_calls:  # two passes, dv then dk (flash_triton.run_backward)
            name = f"{name}:{'dv' if call is dkdv_calls[0] else 'dk'}"
        kind = _kind(k.name)
        if gmm_kinds is not None:
            kind = next(gmm_kinds)
            name = f"{name}:grouped_matmul_{kind}"
        kernels.append(dict(name=name, ttir=k.ttir, ptx=k.ptx, shared=k.shared, warps=k.num_warps,
                            stages=stages.get(kind, {}).get("num_stages", "?"), seconds=seconds,
                            grid=call.grid))
    return kernels


def _kind(name: str) -> str:
    """Kernel role from its name: fwd, dq, dkdv (or dk / dv for the passes of a two-pass dk/dv); a grouped matmul's
    fwd, dlhs, drhs."""
    for kind in ("dlhs", "drhs", "dkdv", "dq", "fwd", "dk", "dv"):
        if kind in name.split(":")[-1]:
            return kind
    return name


def _gmm_settings(case: GmmCase) -> dict:
    """{kind: {tiles, even, num_warps, num_stages}} of a grouped matmul's kernels as its plan sets them; tiles:
    output rows x output columns / contraction step."""
    from jaxtrain.kernels.gmm.api import plan_for

    m, k, n, groups = case.dims
    plan = plan_for((m, k), (groups, k, n), case.dtype, impl=case.impl, **dict(case.block_sizes))
    geos = {kind: plan.geometry(kind) for kind in GMM_KINDS}
    return {kind: dict(tiles=g.tiles, even=g.even, num_warps=g.num_warps, num_stages=g.num_stages)
            for kind, g in geos.items()}


def _launch_settings(case) -> dict:
    """{kind: {block_q, block_k, num_warps, num_stages}} as the kernels set them, or {} where not available (a
    grouped matmul case: ``_gmm_settings``)."""
    if isinstance(case, GmmCase):
        return _gmm_settings(case)
    try:
        from jaxtrain.kernels.flash import api

        return api.launch_settings((case.batch, case.seq, case.heads, case.head_dim), case.kv_heads, case.dtype,
                                   causal=case.causal, has_segments=case.segments, impl=case.impl,
                                   seq_k=case.kv_seq or None, traced_offsets=bool(case.kv_seq),
                                   **dict(case.block_sizes))
    except (ImportError, AttributeError):
        return {}


# ----------------------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------------------


def run_ptxas(ptx: str, workdir: str, name: str) -> dict:
    path = os.path.join(workdir, f"{name}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    proc = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True,
                          text=True)
    out = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    codes = set(re.findall(r"\((C\d{4})\)", out))  # C7515 "wgmma serialized" and friends come as info lines
    codes |= {line.split("warning", 1)[1].strip(" :")[:80] for line in out.splitlines()
              if "warning" in line and not re.search(r"\(C\d{4}\)", line)}
    return dict(
        ptxas_rc=proc.returncode,
        registers=int(regs.group(1)) if regs else None,
        spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None,
        warnings=sorted(codes),
        ptxas_error=None if proc.returncode == 0 else out.strip().splitlines()[-1][:300],
    )


def analyse(case, kernel: dict, workdir: str, settings: dict) -> dict:
    ptx, ttir = kernel["ptx"], kernel["ttir"]
    kind = _kind(kernel["name"])
    row = _case_fields(case) | dict(kernel=kind, name=kernel["name"])
    tiles = settings.get("dkdv" if kind in ("dk", "dv") else kind, {})
    row["tiles"] = f"{tiles['block_q']}x{tiles['block_k']}" if "block_q" in tiles else tiles.get("tiles", "?")
    if "even" in tiles:  # a grouped matmul's kernel
        row["even"] = tiles["even"]
    elif "block_q" in tiles:
        row["even"] = case.seq % tiles["block_q"] == 0 and (case.kv_seq or case.seq) % tiles["block_k"] == 0
        if kind in ("dkdv", "dk", "dv"):
            row["splits"] = _dkdv_splits(case, tiles["block_k"])
    row.update(warps=kernel["warps"], stages=kernel["stages"])
    row.update(run_ptxas(ptx, workdir, f"{case.impl}_{kernel['name'].replace(':', '_')}"))
    row.update(
        smem=kernel["shared"],
        wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        cp_async=len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)),
        tma=len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx)),
        tf32=bool(re.search(r"inputPrecision\s*=\s*tf32", ttir)) or bool(re.search(r"\.tf32\b", ptx)),
        seconds=round(kernel["seconds"], 1),
    )
    problems = []
    if row["ptxas_error"]:
        problems.append(f"ptxas: {row['ptxas_error']}")
    if row["smem"] > SMEM_LIMIT:
        problems.append(f"shared memory {row['smem']} B > {SMEM_LIMIT} B")
    sixteen_bit = case.dtype in ("bfloat16", "float16")
    if sixteen_bit and row["spill_bytes"]:
        problems.append(f"{row['spill_bytes']} B of spills in a 16-bit kernel")
    if sixteen_bit and not row["wgmma"]:
        problems.append("16-bit kernel without wgmma")
    if case.dtype == "float32" and row["tf32"]:
        problems.append("TF32 dot in a float32 kernel")
    row["problems"] = problems
    return row


def _case_fields(case) -> dict:
    if isinstance(case, GmmCase):
        return dict(case=f"gmm {case.source}", impl=case.impl, dtype=case.dtype, head_dim=None, group=None,
                    shape=case.shape, causal=None, segments=None)
    return dict(case=case.source, impl=case.impl, dtype=case.dtype, head_dim=case.head_dim,
                group=case.heads // case.kv_heads, shape=case.shape, causal=case.causal, segments=case.segments)


def _dkdv_splits(case: Case, block_k: int) -> int:
    """Programs per GQA group of the dk/dv launch (1: the unsplit launch), as the kernels choose it."""
    from jaxtrain.kernels.flash import tiling

    forced = dict(case.block_sizes).get("dkdv_splits")
    group = case.heads // case.kv_heads
    return forced or tiling.choose_splits(case.batch, case.kv_seq or case.seq, case.kv_heads, group, block_k)


def check_case(case) -> list[dict]:
    """Lower and compile one configuration; one row per kernel (a compile error gives one failing row)."""
    with tempfile.TemporaryDirectory(prefix="compile_check_") as workdir:
        try:
            kernels = _pallas_kernels(case, workdir) if case.impl == "pallas" else _triton_kernels(case)
            if not kernels:
                raise RuntimeError("no kernel was lowered")
        except Exception as e:  # noqa: BLE001 - a compile error is a result to report, not a crash
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:400]
            return [_case_fields(case) | dict(kernel="-", name="-", problems=[f"compile error: {msg}"])]
        settings = _launch_settings(case)
        return [analyse(case, k, workdir, settings) for k in kernels]


def _worker_init():
    warnings.simplefilter("ignore")
    install_launch_stubs()


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------

COLUMNS = ("case", "impl", "dtype", "head_dim", "group", "shape", "causal", "segments", "kernel", "tiles", "even",
           "splits", "warps", "stages", "registers", "spill_bytes", "smem", "wgmma", "mma_sync", "cp_async", "tma",
           "warnings", "seconds", "status")


def _cell(row, col):
    if col == "status":
        return "ok" if not row["problems"] else "FAIL: " + "; ".join(row["problems"])
    value = row.get(col, "")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(value) or "-"
    return "" if value is None else str(value)


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python tools/compile_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--subset", default="full", help="full (every configuration) or ci (a covering subset)")
    parser.add_argument("--impl", default=",".join(IMPLS), help="comma-separated: pallas, triton")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel processes")
    parser.add_argument("--cases", default="", help="only these configurations, comma-separated "
                        "IMPL:DTYPE:HEAD_DIM:causal|full:seg|noseg[:ring] (e.g. triton:bfloat16:128:causal:seg; "
                        f":ring: a ring block call, q [{RING_BATCH}, {RING_SEQ}] against kv [{RING_BATCH}, "
                        f"{RING_KV_SEQ}], fwd + bwd entries, traced offsets) or "
                        f"IMPL:CONFIG with CONFIG in {','.join(SHIPPED_CONFIGS)} (its training call at data.seq_len)")
    parser.add_argument("--list", action="store_true", help="print the configurations (JSON with --json) and exit "
                        "without compiling (needs no GPU toolchain)")
    parser.add_argument("--blocks", default="", help="block-size overrides for every case, NAME=VALUE,... "
                        "(the keywords of jaxtrain.kernels.flash_attention for the impl)")
    args = parser.parse_args(argv)
    if args.subset not in ("full", "ci"):
        parser.exit(2, f"compile_check: --subset {args.subset!r} is not valid; use full or ci\n")
    impls = tuple(x for x in args.impl.split(",") if x)
    bad = [x for x in impls if x not in IMPLS]
    if bad or not impls:
        parser.exit(2, f"compile_check: --impl {args.impl!r} is not valid; use a comma-separated subset of "
                       f"{','.join(IMPLS)}\n")
    if args.jobs < 1:
        parser.exit(2, f"compile_check: --jobs {args.jobs} is not valid; use a positive integer\n")
    try:
        args.blocks = tuple((k, int(v)) for k, v in (kv.split("=") for kv in args.blocks.split(",") if kv))
    except ValueError:
        parser.exit(2, f"compile_check: --blocks {args.blocks!r} is not valid; use NAME=INT,...\n")
    args.case_list = [_parse_case(spec, parser, args.blocks) for spec in args.cases.split(",") if spec]
    return args, impls


def _parse_case(spec: str, parser, blocks):
    parts = spec.split(":")
    if (len(parts) in (3, 4) and parts[0] in IMPLS and parts[1] == "gmm" and parts[2] in GMM_SHAPES
            and (len(parts) == 3 or parts[3] in DTYPES)):
        return _with_blocks(GmmCase(parts[0], parts[3] if len(parts) == 4 else "bfloat16", parts[2]), blocks)
    if len(parts) == 2 and parts[0] in IMPLS and parts[1] in SHIPPED_CONFIGS:
        return dataclasses.replace(config_cases((parts[0],), (parts[1],), odd_seq=False)[0], block_sizes=blocks)
    ring = len(parts) == 6 and parts[5] == "ring"
    ok = ((len(parts) == 5 or ring) and parts[0] in IMPLS and parts[1] in DTYPES and parts[2].isdigit()
          and int(parts[2]) in HEAD_DIMS and parts[3] in ("causal", "full") and parts[4] in ("seg", "noseg"))
    if not ok:
        parser.exit(2, f"compile_check: case {spec!r} is not valid; use IMPL:DTYPE:HEAD_DIM:causal|full:seg|noseg"
                       "[:ring] "
                       f"with IMPL in {IMPLS}, DTYPE in {DTYPES}, HEAD_DIM in {HEAD_DIMS}, or IMPL:CONFIG with "
                       f"CONFIG in {SHIPPED_CONFIGS}, or IMPL:gmm:SHAPE[:DTYPE] with SHAPE in {tuple(GMM_SHAPES)}\n")
    if ring:
        return _with_blocks(ring_case(parts[0], parts[1], int(parts[2]), parts[3] == "causal", parts[4] == "seg"),
                            blocks)
    return _with_blocks(Case(parts[0], parts[1], int(parts[2]), parts[3] == "causal", parts[4] == "seg"), blocks)


def _with_blocks(case, blocks):
    """The case with the --blocks overrides its kind takes: the grouped matmul's tile names
    (``jaxtrain.kernels.gmm.plan``) for grouped matmul cases, every other name for attention cases (names both
    take, such as num_warps, go to both)."""
    from jaxtrain.kernels.flash.tiling import BlockSizes
    from jaxtrain.kernels.gmm.plan import FIELDS, KINDS

    if isinstance(case, GmmCase):
        names = set(FIELDS) | {f"{f}_{k}" for f in FIELDS for k in KINDS}
        mine = tuple((k, v) for k, v in blocks if k in names)
    else:
        flash_names = {f.name for f in dataclasses.fields(BlockSizes)}
        gmm_only = (set(FIELDS) | {f"{f}_{k}" for f in FIELDS for k in KINDS}) - flash_names
        mine = tuple((k, v) for k, v in blocks if k not in gmm_only)
    return dataclasses.replace(case, block_sizes=mine)


def main(argv=None) -> int:
    args, impls = _parse_args(argv)
    if args.case_list:
        cases = args.case_list
    else:
        cases = full_matrix(impls) if args.subset == "full" else ci_subset(impls)
        cases = [_with_blocks(c, args.blocks) for c in cases + gmm_cases(impls, args.subset)]
    if args.list:
        if args.json:
            print(json.dumps([dataclasses.asdict(c) | dict(label=c.label) for c in cases], indent=1))
        else:
            print("\n".join(c.label for c in cases))
        return 0
    reason = toolchain_error({c.impl for c in cases})
    if reason:
        print(f"compile_check: {reason}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = []
    if args.jobs == 1:
        _worker_init()
        for case in cases:
            rows += check_case(case)
            if not args.json:
                print(f"  {case.label}: done ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    else:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_worker_init) as pool:
            for case, case_rows in zip(cases, pool.map(check_case, cases)):
                rows += case_rows
                if not args.json:
                    print(f"  {case.label}: done ({time.perf_counter() - start:.0f} s)", file=sys.stderr,
                          flush=True)
    failed = [r for r in rows if r["problems"]]
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(dict(rows=rows, failed=len(failed), seconds=round(elapsed, 1)), indent=1))
    else:
        import jax
        import triton

        print(f"sm_90a compile check: jax {jax.__version__}, triton {triton.__version__}, abstract NVIDIA H200, "
              f"smem limit {SMEM_LIMIT} B; shape: q [batch, seq, heads, d] / kv heads (matrix cases: "
              f"b{BATCH} s{SEQ} h{HEADS}/{KV_HEADS}; config cases: one device of an 8-GPU node; ring cases: "
              "q seq / kv seq, fwd + bwd entries with traced offsets)")
        if any(isinstance(c, GmmCase) for c in cases):
            print("grouped matmul (gmm) cases: lhs [m, k] x rhs [experts, k, n] and both gradients; tiles: output "
                  "rows x columns / contraction step (fwd: m x n / k, dlhs: m x k / n, drhs: k x n / m)")
        print(markdown_table(rows))
        print(f"{len(rows)} kernels in {len(cases)} configurations, {len(failed)} failing, {elapsed:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
