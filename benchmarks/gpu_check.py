"""The first minutes on a GPU machine, in one call: what ``benchmarks/gpu_check.sh`` runs (standard library only, so
that it runs before anything is installed). ``--help`` lists the arguments; ``--plan`` prints what a run would do.

A run is a list of sections in order of value, each a child process under its own cap: wall-clock seconds, its kill
grace included (SIGTERM GRACE_S before the cap, SIGKILL at it). The plan keeps, in order, the sections whose caps fit
the budget beside OVERHEAD_S for this script's own work, and names those it leaves out: a run never outlasts its
budget. Quick mode (the headline: kernel correctness, attention TFLOP/s, a 1B step's MFU, a checkpoint save) must fit
QUICK_MAX_S by its caps; ``check_tables`` proves it when this module loads.

Reports, in --out: ``results.jsonl`` (one line per section, the moment it ends), ``results.json`` (the plan, every
section's record with its figures, the headline table; rewritten after each section, so a run cut short keeps what it
measured), ``results.md`` (the headline and each section's status as markdown tables, rewritten with it) and
``gpu_check.log`` (everything printed). Bulky things (installed wheels, each section's log, the attention benchmark's
tables, training runs, checkpoints (deleted once timed), JAX's compile cache) go to --work (default: --out).

``--issue41``: what issue 41 has not measured yet, most valuable first, within ISSUE41_MAX_S (9 minutes) by the caps:
FP8 against BF16 on the 1B step with the compiled program's figures, the grouped GEMM table ``model.moe.gemm=auto``
chooses from (down projection and skewed routing too), flash attention's backward against cuDNN at head dims 64 and
128, the kernel tests (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), the planner's rates (``gpu_rates.py``), the Llama 3.1
8B shape's MFU on as many layers as fit, the remat and XLA-flag choices, the MoE step with ``gemm=auto``. The plan
names what the budget leaves out and the second call that runs it. Everything is written under --out: --work must be
inside it, and the children's temporary files, caches and configuration (TMPDIR, Triton's, CUDA's, XDG's, matplotlib's,
JAX's) go to the work directory, without bytecode files.

To add a check (FP8, MoE, ...): append a Section to SECTIONS, with its group ("quick" only if the headline needs it),
GPU and --smoke caps, title and commands (argv lists run in turn; a string instead says why it is skipped); its rows
are the JSON-object lines it prints unless ``rows`` reads them elsewhere; ``headline`` gives its lines of the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_run as run  # noqa: E402 - beside this file; benchmarks/ is no package

QUICK_MAX_S = 300  # quick mode: at most 5 minutes, so that a failed first try leaves time for a second
ISSUE41_MAX_S = 540  # --issue41: at most 9 minutes of wall time on a bare machine, set-up included
DEFAULT_BUDGET_S = {"quick": 300, "rest": 520, "full": 520, "issue41": ISSUE41_MAX_S}  # rest/full: one 10-minute
# device call, with slack
SMOKE_BUDGET_S = 7200  # --smoke on a shared 2-core CPU machine: a ceiling, not a plan
OVERHEAD_S = 5  # this script's own work between sections (reports), outside every cap

# What the sections run, in one place.
KERNEL_BENCH = "jaxtrain.kernels.bench.flash"
GMM_BENCH = "jaxtrain.kernels.bench.gmm"
KERNEL_TESTS = "tests/test_flash_attention.py"
QUICK_TESTS = "test_gpu_values_and_grads and bfloat16"
MORE_TESTS = "(test_gpu_values_and_grads and float32) or test_document_mask_skips or test_remat_policy"
GPU_SETUP = "benchmarks/gpu_setup.py"
GPU_STEP = "benchmarks/gpu_step.py"
STEP_1B = ["--config", "1b", "--rows-per-device", "4"]
STEP_SMOKE = ["--config", "tiny", "--steps", "2", "--rows-per-device", "2", "model.head_dim=32"]  # flash: d >= 32
GPU_RATES = "benchmarks/gpu_rates.py"
# Llama 3.1 8B's layer (its config.json) over the 7b config, 2 sequences of 8192 a device as torchtitan's table; the
# layer counts tried, smallest first: the whole 8B's state (128 GB of float32 parameters and AdamW moments) does not
# fit one H200, so its MFU is measured on as many of its layers as fit.
STEP_8B = ["--config", "7b", "--rows-per-device", "2", "--steps", "5", "model.vocab_size=128256", "model.n_kv_heads=8",
           "model.d_ff=14336", "model.rope_theta=500000", "data.seq_len=8192", "model.remat=save_matmuls"]
LAYERS_8B = (8, 16)


@dataclasses.dataclass
class Ctx:
    """What the commands depend on: the interpreter, --smoke, the work directory, the wheels, the devices."""

    py: str
    smoke: bool
    work: str
    wheels: str | None = None
    devices: int = 1  # learnt from the set-up's row
    contained: bool = False  # --issue41: caches and temporary files under the work directory (inside --out) too

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)


Commands = Callable[[Ctx, str], "list[list[str]] | str"]


@dataclasses.dataclass(frozen=True)
class Section:
    name: str  # results key and file names
    group: str  # "setup" (always first), "quick" (the headline) or "rest"
    cap_s: int  # on a GPU: wall-clock seconds, kill grace included (estimates until measured: results.json has each)
    smoke_cap_s: int  # with --smoke on a CPU
    title: str
    commands: Commands  # (ctx, name) -> argv lists run in turn, or why the section is skipped
    rows: Callable[[Ctx, str, list[str]], list[dict]] = run.json_rows  # (ctx, name, output lines) -> figures
    headline: Callable[[Section, list[dict]], list[dict]] | None = None  # -> [{"what", "result", "figures"}]
    cleanup: Callable[[Ctx, str], list[str]] | None = None  # paths deleted after it ran
    env: tuple[tuple[str, str], ...] = ()  # environment variables of its commands, beside the run's

    def cap(self, smoke: bool) -> int:
        return self.smoke_cap_s if smoke else self.cap_s


# ---- the sections' commands -----------------------------------------------------------------------------------------

def _setup(ctx: Ctx, name: str) -> list[list[str]]:
    pip = [ctx.py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", ctx.path("site")]
    install = [pip + run.wheel_files(ctx.wheels)] if ctx.wheels else []
    return install + [[ctx.py, GPU_SETUP, *(["--smoke"] if ctx.smoke else [])]]


def _kernel_tests(select: str) -> Commands:
    def commands(ctx: Ctx, name: str) -> list[list[str]]:
        return [[ctx.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", KERNEL_TESTS, "-k", select,
                 f"--junitxml={ctx.path(name + '.xml')}"]]
    return commands


def _bench(*sweeps: dict, smoke: dict) -> Commands:
    """The attention benchmark over ``sweeps`` (kernels.bench arguments; --smoke: ``smoke``), each into its own
    directory, the section's cap shared between them."""
    def commands(ctx: Ctx, name: str) -> list[list[str]]:
        chosen = [smoke] if ctx.smoke else list(sweeps)
        cap = SECTIONS_BY_NAME[name].cap(ctx.smoke)
        argvs = []
        for i, sweep in enumerate(chosen):
            out = ctx.path(name) if len(chosen) == 1 else ctx.path(name, str(i))
            common = ["--impls", "cudnn,xla,triton,pallas", "--out", out]
            if ctx.smoke:
                common += ["--smoke"]
            else:  # stop starting rows early enough for the last to end (a row: compiles + timing, ~20 s)
                budget = max(10, cap // len(chosen) - 35)
                common += ["--seq-lens", "4096", "--iters", "5", "--grad-check-max-seq", "0", "--time-budget",
                           str(budget)]
            argvs.append([ctx.py, "-m", KERNEL_BENCH, *common, *(f"--{k.replace('_', '-')}={v}"
                                                                  for k, v in sweep.items())])
        return argvs
    return commands


def _gmm_bench(ctx: Ctx, name: str) -> list[list[str]]:
    """The grouped GEMM benchmark (Mixtral-sized, balanced then skewed routing), rows not started past the cap
    skipped; --smoke: one tiny shape, interpreted."""
    if ctx.smoke:
        return [[ctx.py, "-m", GMM_BENCH, "--smoke", "--routing", "balanced", "--projections", "up"]]
    budget = max(10, SECTIONS_BY_NAME[name].cap(ctx.smoke) - 45)  # a row: compiles + timing, ~20-40 s
    # 8192 tokens, no dense one-hot: on the H200 three impls of one shape took about 100 s (ragged_dot's backward
    # 0.6 s an iteration), where the 16384-token default with the one-hot finished no shape in 150 s.
    return [[ctx.py, "-m", GMM_BENCH, "--tokens", "8192", "--impls", "pallas,triton,xla", "--iters", "5",
             "--time-budget", str(budget)]]


def _step(impl: str, steps: int, checkpoint: bool = False, smoke_skip: str = "") -> Commands:
    def commands(ctx: Ctx, name: str) -> list[list[str]] | str:
        if ctx.smoke and smoke_skip:
            return f"in --smoke, {smoke_skip}"
        args = STEP_SMOKE if ctx.smoke else STEP_1B + ["--steps", str(steps)]
        saves = ["--checkpoint-dir", ctx.path("checkpoint")] if checkpoint else []
        return [[ctx.py, GPU_STEP, *args, *saves, f"model.attention={impl}"]]
    return commands


def _fp8_steps(*recipes: str) -> Commands:
    """The 1B step (--smoke: the tiny one) with each ``model.fp8`` recipe, "none" first: BF16 against FP8 under the
    same attention and rows."""
    def commands(ctx: Ctx, name: str) -> list[list[str]]:
        args = STEP_SMOKE if ctx.smoke else STEP_1B + ["--steps", "10"]
        return [[ctx.py, GPU_STEP, *args, "model.attention=auto", f"model.fp8={r}"] for r in recipes]
    return commands


# The 1B with every MLP replaced by 8 experts of half its width, top 2: a token multiplies the dense 1B's weights
# (same model FLOPs a token), the model holds 3.7B parameters. --smoke: tiny-moe.
MOE_1B = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.d_ff=4096"]


def _moe_steps(*gemms: str) -> Commands:
    """The 1B MoE step (attention auto) with each ``model.moe.gemm`` named; "" for the config's default."""
    def commands(ctx: Ctx, name: str) -> list[list[str]]:
        if ctx.smoke:
            return [[ctx.py, GPU_STEP, "--config", "tiny-moe", "--steps", "2", "--rows-per-device", "2"]]
        return [[ctx.py, GPU_STEP, *STEP_1B, "--steps", "5", "model.attention=auto", *MOE_1B,
                 *([f"model.moe.gemm={g}"] if g else [])] for g in gemms]
    return commands


def _train(impl: str, smoke_skip: str = "") -> Commands:
    def commands(ctx: Ctx, name: str) -> list[list[str]] | str:
        if ctx.smoke and smoke_skip:
            return f"in --smoke, {smoke_skip}"
        if ctx.smoke:  # the built-in tiny config
            config = ["train.steps=3", "train.log_every=1", "model.head_dim=32"]
        else:
            config = ["--config", "configs/125m.yaml", "train.steps=10", "train.log_every=5",
                      f"train.global_batch={8 * ctx.devices}"]
        return [[ctx.py, "-m", "jaxtrain", "train", *config, "train.eval_every=0", "train.eval_batches=1",
                 "checkpoint.resume=never", "checkpoint.every=0", f"model.attention={impl}",
                 f"run.dir={ctx.path(name)}"]]
    return commands


def _train_checkpoints(ctx: Ctx, name: str) -> list[str]:
    return [ctx.path(name, "checkpoints")]  # its end-of-run checkpoint: not what is measured


def _fp8_program(*recipes: str) -> Commands:
    """The 1B step with each ``model.fp8`` recipe and the compiled program's figures (gpu_step --program)."""
    def commands(ctx: Ctx, name: str) -> list[list[str]]:
        args = STEP_SMOKE if ctx.smoke else STEP_1B + ["--steps", "10"]
        return [[ctx.py, GPU_STEP, *args, "--program", "model.attention=auto", f"model.fp8={r}"] for r in recipes]
    return commands


def _gmm_table(ctx: Ctx, name: str) -> list[list[str]]:
    """The grouped GEMM table ``model.moe.gemm=auto`` chooses from: the Pallas and Triton kernels on Mixtral's gate/up
    and down projections, balanced and skewed routing (XLA's ragged_dot, 54-64x slower, measured already)."""
    if ctx.smoke:
        return [[ctx.py, "-m", GMM_BENCH, "--smoke", "--impls", "pallas", "--routing", "balanced,skewed",
                 "--projections", "up,down"]]
    budget = max(10, SECTIONS_BY_NAME[name].cap(ctx.smoke) - 35)
    return [[ctx.py, "-m", GMM_BENCH, "--tokens", "8192", "--impls", "pallas,triton", "--projections", "up,down",
             "--routing", "balanced,skewed", "--iters", "5", "--time-budget", str(budget)]]


def _rates(ctx: Ctx, name: str) -> list[list[str]]:
    return [[ctx.py, GPU_RATES, *(["--smoke", "--iters", "2"] if ctx.smoke else ["--iters", "10"])]]


def _steps_8b(ctx: Ctx, name: str) -> list[list[str]]:
    """The Llama 3.1 8B shape's step on as many layers as fit (LAYERS_8B in turn; --smoke: the tiny one)."""
    if ctx.smoke:
        return [[ctx.py, GPU_STEP, *STEP_SMOKE, "model.remat=save_matmuls"]]
    return [[ctx.py, GPU_STEP, *STEP_8B, "model.attention=auto", f"model.n_layers={n}"] for n in LAYERS_8B]


# The settings an engineer tuning the 1B's step tries first (the default, save_matmuls with XLA's Triton GEMMs, is
# the fp8 section's BF16 row): no remat, full remat, and cuBLAS in place of XLA's Triton GEMM fusions.
REMAT_CHOICES = (["model.remat=none"], ["model.remat=full"],
                 ["model.remat=save_matmuls", "--xla-flags=--xla_gpu_enable_triton_gemm=false"])


def _remat_choices(ctx: Ctx, name: str) -> list[list[str]]:
    args = STEP_SMOKE if ctx.smoke else STEP_1B + ["--steps", "10"]
    return [[ctx.py, GPU_STEP, *args, "model.attention=auto", *choice] for choice in REMAT_CHOICES]


# ---- the headline ---------------------------------------------------------------------------------------------------

def _machine(sec: Section, rows: list[dict]) -> list[dict]:
    r = next((r for r in rows if r.get("kind") == "setup"), None)
    if r is None:
        return []
    v = r.get("versions", {})
    driver = f"driver {r.get('driver_release') or '-'} (CUDA {r.get('driver_cuda') or '-'})"
    return [dict(what="machine", figures=r, result=f"{r['devices']} x {r['device_kind']}, jax {v.get('jax')}, "
                 f"triton {v.get('triton')}, {driver}")]


def _tests(sec: Section, rows: list[dict]) -> list[dict]:
    tests = [r for r in rows if r.get("kind") == "test"]
    if not tests:
        return []
    counts = Counter(r["outcome"] for r in tests)
    failed = [r["test"] for r in tests if r["outcome"] in ("failed", "error")]
    kinds = ("passed", "failed", "error", "skipped")
    result = ", ".join(f"{counts[k]} {k}" for k in kinds if counts[k] or k == "failed")
    return [dict(what=f"kernels vs float64 ({sec.name}: {len(tests)} tests)", figures=dict(counts, failed=failed),
                 result=result + (f": {', '.join(failed)}" if failed else ""))]


def _attention(sec: Section, rows: list[dict]) -> list[dict]:
    shapes: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("kind") == "attention":
            mask = "doc" if r.get("doc_mask") else "causal" if r.get("causal") else "full"
            key = (r["head_dim"], r["heads"] // r["kv_heads"], mask, r["seq"], r["batch"])
            shapes.setdefault(key, {})[r["impl"]] = r
    out = []
    for (d, group, mask, seq, batch), by_impl in shapes.items():
        ok = {impl: r["fwdbwd_tflops"] for impl, r in by_impl.items() if r.get("status") == "ok"}
        parts, figures = [], {}
        for impl, r in by_impl.items():
            t = ok.get(impl)
            vs = {f"vs_{base}": round(t / ok[base], 3)
                  for base in ("cudnn", "xla") if t and ok.get(base) and base != impl}
            figures[impl] = dict(status=r.get("status"), fwd_tflops=r.get("fwd_tflops"), fwdbwd_tflops=t, **vs)
            ratios = ", ".join(f"{x:.2f}x {k[3:]}" for k, x in vs.items())
            parts.append(f"{impl} {t:.3g}" + (f" ({ratios})" if ratios else "") if t is not None
                         else f"{impl} {str(r.get('status'))[:60]}")
        out.append(dict(what=f"attention d{d} GQA {group} {mask} b{batch} s{seq}, fwd+bwd TFLOP/s",
                        result="; ".join(parts), figures=figures))
    return out


def _grouped_gemm(sec: Section, rows: list[dict]) -> list[dict]:
    shapes: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("kind") == "gmm":
            shapes.setdefault((r["projection"], r["routing"], r["m"], r["k"], r["n"], r["experts"]), []).append(r)
    out = []
    for (proj, routing, m, k, n, experts), mine in shapes.items():
        base = next((r for r in mine if r["impl"] == "xla" and r["status"] == "ok"), None)
        parts = [f"{r['impl']} {r['fwdbwd_tflops']:.3g}" + (f" ({r['fwdbwd_tflops'] / base['fwdbwd_tflops']:.2f}x xla)"
                 if base and r["impl"] != "xla" else "") if r["status"] == "ok" else
            f"{r['impl']} {str(r['status'])[:60]}" for r in mine]
        out.append(dict(what=f"grouped GEMM {proj} [{m}, {k}] x [{experts}, {k}, {n}] {routing}, fwd+bwd TFLOP/s",
                        result="; ".join(parts), figures={r["impl"]: r for r in mine}))
    return out


def _step_and_save(sec: Section, rows: list[dict]) -> list[dict]:
    out = []
    for r in (r for r in rows if r.get("kind") == "step"):
        mfu = f"MFU {100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "MFU - (no peak for this device kind)"
        where = f"{r['devices']} x {r['device_kind']}"
        out.append(dict(what=f"{r['config']} train step, attention {r['attention']}, {where}",
                        result=f"{mfu}, {r['step_ms']:.0f} ms/step, {r['tokens_per_s']:,} tokens/s, compile "
                               f"{r['compile_s']} s", figures=r))
    saves = {r.get("save", "-"): r for r in rows if r.get("kind") == "checkpoint"}
    if saves:
        r = saves.get("later") or next(iter(saves.values()))
        what = f"checkpoint save, train state {r['state_gb']:.2f} GB into {r.get('fstype', '?')} {r.get('dir')}"
        if r["status"] != "ok":
            result = r["status"]
        else:
            during = (f"{r['steps_during_write']} step(s) during the write at {r['step_ms_during_write']} ms vs "
                      f"{r['step_ms_before']} ms" if r["steps_during_write"] else "no step during the write")
            result = (f"loop blocked {r['blocked_s']:.2f} s, on disk after {r['written_s']:.1f} s "
                      f"({r['gb_per_s']:.2f} GB/s), {during}")
            if "first" in saves and saves["first"] is not r:
                f = saves["first"]
                result += f"; first save: blocked {f['blocked_s']:.2f} s, on disk after {f['written_s']:.1f} s"
        out.append(dict(what=what, result=result, figures=saves))
    return out


def _moe(sec: Section, rows: list[dict]) -> list[dict]:
    out = []
    for r in (r for r in rows if r.get("kind") == "step"):
        mfu = f"MFU {100 * r['mfu']:.1f} % (active FLOPs)" if r.get("mfu") is not None else "MFU -"
        out.append(dict(what=f"{r['config']} MoE train step ({r['moe_experts']} experts, top {r['moe_top_k']}), "
                             f"experts' GEMM {r.get('moe_gemm')}, {r['devices']} x {r['device_kind']}",
                        result=f"{mfu}, {r['step_ms']:.0f} ms/step, {r['tokens_per_s']:,} tokens/s, peak "
                               f"{r.get('peak_gb')} GB, compile {r['compile_s']} s", figures=r))
    return out


def _train_run(sec: Section, rows: list[dict]) -> list[dict]:
    r = next((r for r in rows if r.get("kind") == "train"), None)
    if r is None:
        return []
    mfu = f", MFU {100 * r['mfu']:.1f} %" if r.get("mfu") is not None else ""
    return [dict(what=f"jaxtrain train end to end, attention {r['attention']}", figures=r,
                 result=f"compile {r['compile_seconds']:.1f} s, {1e3 * r['step_seconds']['median']:.1f} ms/step, "
                        f"{r['tokens_per_second']:,.0f} tokens/s{mfu}")]


def _fp8(sec: Section, rows: list[dict]) -> list[dict]:
    steps = [r for r in rows if r.get("kind") == "step"]
    base = next((r for r in steps if r.get("fp8") == "none"), None)
    out = []
    for r in steps:
        if r.get("fp8") in (None, "none"):
            continue
        mfu = (f"MFU {100 * r['mfu']:.1f} % of the BF16 peak ({r['peak_tflops']:.0f} TFLOP/s), "
               f"{100 * r['mfu_fp8_peak']:.1f} % of the FP8 peak ({r['fp8_peak_tflops']:.0f})"
               if r.get("mfu") is not None and r.get("mfu_fp8_peak") is not None else "MFU - (no peaks for this kind)")
        base_mfu = f", MFU {100 * base['mfu']:.1f} %" if base and base.get("mfu") is not None else ""
        speed = (f"{base['step_ms'] / r['step_ms']:.2f}x BF16's speed ({base['step_ms']:.0f} ms{base_mfu})"
                 if base else "no BF16 step to compare")
        out.append(dict(what=f"{r['config']} train step, model.fp8={r['fp8']}, attention {r['attention']}",
                        result=f"{r['step_ms']:.0f} ms/step: {speed}; {mfu}", figures=dict(fp8=r, bf16=base)))
    return out


def _fp8_and_program(sec: Section, rows: list[dict]) -> list[dict]:
    """The FP8 line(s), and each step's program figures beside its time."""
    out = _fp8(sec, rows)
    for r in (r for r in rows if r.get("kind") == "step" and r.get("program")):
        p = r["program"]
        gb = f"{p['bytes_accessed'] / 1e9:.1f} GB accessed, " if p.get("bytes_accessed") else ""
        calls = ", ".join(f"{k} {v}" for k, v in sorted(p.get("custom_calls", {}).items()))
        out.append(dict(what=f"{r['config']} program, model.fp8={r.get('fp8')}", figures=p,
                        result=f"{r['step_ms']:.0f} ms; {gb}{p['fusions']} fusions, {p['reduces']} reduces, "
                               f"{p['f8_converts']} float8 converts, {p['triton_gemm_fusions']} Triton GEMMs"
                               + (f"; calls: {calls}" if calls else "")))
    return out


def _rates_headline(sec: Section, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r.get("kind") == "rate" and r.get("what") == "gemm":
            both = f", fwd+bwd {r['fwdbwd_tflops']:.4g}" if r.get("fwdbwd_tflops") is not None else ""
            if "f8_gemm" in r:  # whether XLA kept it in float8: an upcast GEMM's rate is not the FP8 rate
                both += " (a float8 GEMM)" if r["f8_gemm"] else " (XLA upcast it: not the FP8 rate)"
            out.append(dict(what=f"GEMM {r['shape']} [{r['m']}, {r['k']}] x [{r['k']}, {r['n']}] {r['dtype']}, "
                                 "TFLOP/s", result=f"fwd {r['fwd_tflops']:.4g}{both}", figures=r))
        elif r.get("kind") == "rate" and r.get("what") == "hbm":
            out.append(dict(what=f"HBM, y = x * c over {r['bytes'] / 2**30:.3g} GiB",
                            result=f"{r['gb_per_s']:.4g} GB/s", figures=r))
    return out


def _choices(sec: Section, rows: list[dict]) -> list[dict]:
    out = []
    for r in (r for r in rows if r.get("kind") == "step"):
        mfu = f"MFU {100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "MFU -"
        flags = f", XLA flags {r['xla_flags']}" if r.get("xla_flags") else ""
        out.append(dict(what=f"{r['config']} step ({r.get('n_layers', '')}{' layers, ' if r.get('n_layers') else ''}"
                             f"seq {r['seq']}, {r['global_batch']} rows), remat {r['remat']}{flags}",
                        result=f"{mfu}, {r['step_ms']:.0f} ms/step, {r['tokens_per_s']:,} tokens/s, peak "
                               f"{r.get('peak_gb')} GB, compile {r['compile_s']} s", figures=r))
    return out


# ---- the table ------------------------------------------------------------------------------------------------------

def _train_section(impl: str, cap: int, smoke_skip: str = "") -> Section:
    return Section(f"train-{impl}", "rest", cap, 900,
                   f"training steps end to end: jaxtrain train, model.attention={impl}", _train(impl, smoke_skip),
                   rows=run.train_rows, headline=_train_run, cleanup=_train_checkpoints)


SECTIONS = [
    Section("setup", "setup", 25, 300, "set-up: wheels, imports, versions and devices (driver/plugin verdict)",
            _setup, headline=_machine),
    Section("kernel-tests", "quick", 130, 300, "kernel tests on the device: values and gradients vs float64 (bfloat16)",
            _kernel_tests(QUICK_TESTS), rows=run.junit_rows, headline=_tests),
    Section("bench", "quick", 60, 900, "attention TFLOP/s vs cuDNN and XLA: the 1B's and 7B's head dim and GQA group",
            _bench(dict(head_dims="64,128", groups="4,1", masks="causal"), smoke=dict(masks="causal", groups=2)),
            rows=run.bench_rows, headline=_attention),
    Section("step-auto", "quick", 80, 600, "1B train step (attention auto = cuDNN): MFU; then the checkpoint save",
            _step("auto", 5, checkpoint=True), headline=_step_and_save),
    Section("step-triton", "rest", 75, 60, "1B train step with the Triton flash kernel", _step(
        "triton", 10, smoke_skip="model.attention=triton needs a GPU"), headline=_step_and_save),
    Section("step-pallas", "rest", 75, 60, "1B train step with the Pallas flash kernel", _step(
        "pallas", 10, smoke_skip="interpreted on CPU; train-pallas runs it"), headline=_step_and_save),
    Section("step-fp8", "rest", 120, 600, "1B train step, BF16 against FP8 (tensorwise): step time, MFU against both "
            "peaks", _fp8_steps("none", "tensorwise"), headline=_fp8),
    Section("step-moe", "rest", 100, 300, "1B MoE train step (8 experts of half the MLP, top 2): the experts' "
            "grouped GEMM by XLA (ragged_dot) and by the Pallas kernel", _moe_steps("xla", "pallas"), headline=_moe),
    Section("kernel-tests-more", "rest", 110, 900, "kernel tests: float32 values and gradients, document masks, remat",
            _kernel_tests(MORE_TESTS), rows=run.junit_rows, headline=_tests),
    Section("bench-more", "rest", 120, 900,
            "attention TFLOP/s: the 7B's and 70B's GQA (1, 8), causal and document masks",
            _bench(dict(head_dims="128", groups="1,8", masks="causal,doc"),
                   dict(head_dims="64", groups="4", masks="doc"), smoke=dict(masks="doc", groups=2)),
            rows=run.bench_rows, headline=_attention),
    Section("bench-gmm", "rest", 150, 300, "grouped GEMM (MoE experts) TFLOP/s vs ragged_dot and a dense one-hot "
            "einsum: Mixtral-sized, bfloat16", _gmm_bench, headline=_grouped_gemm),
    _train_section("auto", 60, smoke_skip="auto is xla on CPU; train-xla runs it"),
    Section("step-xla", "rest", 70, 60, "1B train step with XLA's attention", _step(
        "xla", 10, smoke_skip="step-auto is XLA on CPU"), headline=_step_and_save),
    _train_section("xla", 60),
    _train_section("pallas", 60),
    _train_section("triton", 60, smoke_skip="model.attention=triton needs a GPU"),
    Section("step-fp8-more", "rest", 160, 600, "1B train step, BF16 against FP8 (delayed, rowwise)",
            _fp8_steps("none", "delayed", "rowwise"), headline=_fp8),
    # --issue41: what issue 41 has not measured yet, most valuable first (docs/results.md says what each answers)
    Section("i41-fp8", "issue41", 120, 300, "1B step BF16 against FP8 (tensorwise) with the compiled program's "
            "figures (cost analysis, fusions, float8 converts, reductions)", _fp8_program("none", "tensorwise"),
            headline=_fp8_and_program),
    Section("i41-gmm", "issue41", 100, 600, "grouped GEMM table for model.moe.gemm=auto: Pallas and Triton, gate/up "
            "and down projections, balanced and skewed routing", _gmm_table, headline=_grouped_gemm),
    Section("i41-flash", "issue41", 90, 900, "flash attention forward + backward against cuDNN at head dims 64 and "
            "128", _bench(dict(head_dims="64", groups="4"), dict(head_dims="128", groups="1"),
                          smoke=dict(masks="causal", groups=2)), rows=run.bench_rows, headline=_attention),
    Section("i41-kernel-tests", "issue41", 130, 300, "kernel tests on the device: values and gradients vs float64 "
            "(bfloat16), no preallocation", _kernel_tests(QUICK_TESTS), rows=run.junit_rows, headline=_tests,
            env=(("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),)),
    Section("i41-rates", "issue41", 50, 120, "the planner's rates: dense GEMM TFLOP/s (bf16, fp8) at the 1B's and "
            "8B's shapes, HBM GB/s", _rates, headline=_rates_headline),
    Section("i41-8b", "issue41", 120, 300, "Llama 3.1 8B's shape, seq 8192, 2 rows: MFU on as many layers as fit",
            _steps_8b, headline=_choices, env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),)),
    Section("i41-remat", "issue41", 100, 300, "1B step: remat none and full, cuBLAS instead of Triton GEMMs",
            _remat_choices, headline=_choices),
    Section("i41-moe", "issue41", 70, 300, "1B MoE step with model.moe.gemm=auto (the kernel the table chooses)",
            _moe_steps(""), headline=_moe),
]
SECTIONS_BY_NAME = {s.name: s for s in SECTIONS}
MODES = {"quick": ("setup", "quick"), "rest": ("setup", "rest"), "full": ("setup", "quick", "rest"),
         "issue41": ("setup", "issue41")}


def check_tables(sections: list[Section] = SECTIONS) -> None:
    """ValueError unless the table is sound: unique names, set-up first, known groups, and quick mode's caps (with
    OVERHEAD_S) within QUICK_MAX_S."""
    names = [s.name for s in sections]
    if len(set(names)) != len(names) or sections[0].group != "setup" or names.count("setup") != 1:
        raise ValueError(f"gpu_check: sections need unique names and the set-up first: {names}")
    unknown = {s.group for s in sections} - {"setup", "quick", "rest", "issue41"}
    if unknown:
        raise ValueError(f"gpu_check: unknown section group(s) {sorted(unknown)}")
    quick = sum(s.cap_s for s in sections if s.group in MODES["quick"]) + OVERHEAD_S
    if quick > QUICK_MAX_S:
        raise ValueError(f"gpu_check: quick mode's caps add up to {quick} s with the {OVERHEAD_S} s overhead, over "
                         f"its {QUICK_MAX_S} s; lower a cap or move a section to the rest")


check_tables()


# ---- the command line -----------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        if message.startswith("unrecognized arguments: "):
            given = message.split(": ", 1)[1].split()[0]
            message = f"unknown argument '{given}'; valid: {', '.join(self._option_string_actions)}"
        self.exit(2, f"gpu_check.sh: {message}\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments, checked: a bad one exits 2 with one line naming it and what would be valid."""
    p = _Parser(prog="benchmarks/gpu_check.sh", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"the headline only, at most {QUICK_MAX_S} s")
    mode.add_argument("--rest", action="store_true", help="the sections quick mode leaves out (after a quick run)")
    mode.add_argument("--issue41", action="store_true", help="what issue 41 has not measured yet, most valuable first, "
                      f"at most {ISSUE41_MAX_S} s; everything it writes (work, caches, temporary files) under --out")
    p.add_argument("--plan", action="store_true", help="print the sections, their caps and the total; run nothing")
    p.add_argument("--smoke", action="store_true", help="on a CPU: the same sections at toy sizes (the numbers mean "
                   "nothing): checks the script end to end")
    p.add_argument("--sections", default="", help="comma-separated: only these (and the set-up)")
    p.add_argument("--budget", default=None, help="seconds for the whole run, set-up included (default: quick "
                   f"{DEFAULT_BUDGET_S['quick']}, rest and full {DEFAULT_BUDGET_S['full']}, --smoke {SMOKE_BUDGET_S})")
    p.add_argument("--out", default=None, help="where the reports go (default: a new temporary directory); must not "
                   "hold an earlier run's results.json")
    p.add_argument("--work", default=None, help="where bulky things go: wheels' site, logs, tables, runs, compile "
                   "cache (default: --out)")
    p.add_argument("--wheels", default=None, help="wheels to install first (pip --no-index --no-deps into WORK/site)")
    p.add_argument("--fetch-wheels", default=None, metavar="DIR", help="on a machine with a package registry: "
                   "download the wheels the GPU image lacks into DIR and exit")
    args = p.parse_args(argv)
    args.mode = "quick" if args.quick else "rest" if args.rest else "issue41" if args.issue41 else "full"
    if args.budget is None:
        args.budget = str(SMOKE_BUDGET_S if args.smoke else DEFAULT_BUDGET_S[args.mode])
    if not args.budget.isdigit():
        p.error(f"--budget '{args.budget}' must be whole seconds")
    args.budget = int(args.budget)
    if args.mode == "quick" and not args.smoke and args.budget > QUICK_MAX_S:
        p.error(f"--budget {args.budget} is over quick mode's {QUICK_MAX_S} s; leave out --quick for a longer run")
    if args.mode == "issue41" and not args.smoke and args.budget > ISSUE41_MAX_S:
        p.error(f"--budget {args.budget} is over --issue41's {ISSUE41_MAX_S} s; a second call with --sections runs "
                "what the first left out")
    if args.mode == "issue41" and args.work and args.out and not _inside(args.work, args.out):
        p.error(f"--work '{args.work}' is outside --out '{args.out}': --issue41 writes nothing outside --out")
    least = SECTIONS[0].cap(args.smoke) + OVERHEAD_S
    if args.budget < least:
        p.error(f"--budget {args.budget} is below the set-up's {least} s (its cap and {OVERHEAD_S} s for reports)")
    args.only = [s for s in args.sections.split(",") if s]
    unknown = [s for s in args.only if s not in SECTIONS_BY_NAME]
    if unknown:
        p.error(f"--sections: unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS_BY_NAME)}")
    elsewhere = [s for s in args.only if SECTIONS_BY_NAME[s].group not in MODES[args.mode]]
    if elsewhere:
        p.error(f"--sections: {', '.join(elsewhere)} not in {args.mode} mode; leave out --{args.mode}")
    if args.wheels and not os.path.isdir(args.wheels):
        p.error(f"--wheels '{args.wheels}' is not a directory")
    if args.wheels and not run.wheel_files(args.wheels):
        p.error(f"--wheels '{args.wheels}' holds no .whl file (fetch them with --fetch-wheels DIR)")
    if args.out and os.path.exists(os.path.join(args.out, "results.json")):
        p.error(f"--out '{args.out}' already holds an earlier run's results.json; name a new directory")
    return args


def _inside(path: str, root: str) -> bool:
    path, root = os.path.abspath(path), os.path.abspath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def fetch_wheels(directory: str, py: str) -> int:
    """Download the wheels the GPU image lacks, for Python 3.12 / manylinux x86_64, into ``directory``."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        print(f"gpu_check.sh: cannot create --fetch-wheels '{directory}': {e.strerror}", file=sys.stderr)
        return 2
    platforms = [arg for p in run.MANYLINUX for arg in ("--platform", p)]
    proc = subprocess.run([py, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", directory,
                           *run.GPU_WHEELS])
    if proc.returncode:
        print("gpu_check.sh: pip download failed", file=sys.stderr)
        return 1
    files = run.wheel_files(directory)
    for path in files:
        print(f"{os.path.getsize(path):>10}  {path}")
    print(f"{len(files)} wheels, {sum(map(os.path.getsize, files)) / 2**20:.1f} MiB")
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    py = os.environ.get("PYTHON") or sys.executable
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels, py)
    ctx = Ctx(py=py, smoke=args.smoke, work="", wheels=args.wheels and os.path.abspath(args.wheels),
              contained=args.mode == "issue41")
    plan = run.make_plan(sys.modules[__name__], ctx, args.mode, args.budget, args.only)
    if args.plan:
        print("\n".join(run.plan_lines(plan)))
        return 0
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="gpu_check."))
    ctx.work = os.path.abspath(args.work or out)
    for what, path in (("--out", out), ("--work", ctx.work)):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            print(f"gpu_check.sh: cannot create {what} '{path}': {e.strerror}", file=sys.stderr)
            return 2
    console = run.Console(os.path.join(out, "gpu_check.log"))
    try:
        return run.run_plan(plan, ctx, out, console, argv)
    finally:
        console.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
