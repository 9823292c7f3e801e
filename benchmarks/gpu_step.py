"""Time jaxtrain's compiled train step, and optionally a checkpoint save of its train state:
``python benchmarks/gpu_step.py [--config 1b] [--steps 10] [--rows-per-device 4] [--checkpoint-dir DIR]
[key=value ...]``.

Builds the layout and step of the config on every visible device (``setup`` of jaxtrain's step module), creates the
state in its shards, compiles the train step ahead of time, runs it on random tokens and prints one JSON line
(``"kind": "step"``): the resolved attention and dtype, compile seconds, median / min step milliseconds after one
warm-up step, tokens per second and MFU (``models.flops.train_flops_per_token`` over the device kind's peak from
``jaxtrain/configs/hardware``; None for a kind no hardware file lists) and, for ``model.fp8``, the same over the dense
FP8 peak (``mfu_fp8_peak``), the first and last loss, an MoE model's experts, and memory: the device's peak bytes in
use (``memory_stats``, where the backend keeps it) beside what the compiled program says it needs (arguments,
outputs less aliased, temporaries: XLA's ``memory_analysis``, the planner's reading). No data pipeline, no evaluation.

``--checkpoint-dir DIR`` then saves the trained state twice through jaxtrain's own ``Checkpointer`` (Orbax, async,
as the training loop saves: parameters, AdamW moments and step, with the fingerprint and JSON metadata), each time
running train steps while the write goes on in the background, as the loop does, and prints one JSON line per save
(``"kind": "checkpoint"``): the state's bytes, how long ``save()`` held the loop (the first save also pays Orbax's
import, its manager and the fingerprint's compile; the second is what every later save costs), how long until the
step was on disk, GB/s, and the steps that ran during the write against the steps before it. Each save goes into
its own directory under DIR, deleted once measured (a 1B state is about 15 GB); DIR's filesystem is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import threading
import time

# Run as a script, Python puts benchmarks/ first on sys.path: put the checkout's root there, so that its jaxtrain
# is the one measured (the GPU machine has no installed copy).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MAX_STEPS_DURING_SAVE = 100  # bounds the steps run while a write goes on (a stuck write ends at the section's cap)


def _args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="1b", help="a shipped config name or a YAML path (default 1b)")
    p.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step")
    p.add_argument("--rows-per-device", type=int, default=4, help="sequences per device and step (global batch = "
                   "this x devices)")
    p.add_argument("--checkpoint-dir", default=None, help="after the timed steps, save the state twice into "
                   "directories made (and deleted) under DIR, and time the saves")
    p.add_argument("--program", action="store_true", help="add the compiled program's figures (program: XLA's "
                   "cost analysis, fusions, GEMM and attention calls, float8 converts and reductions)")
    p.add_argument("--xla-flags", default="", help="XLA flags added to XLA_FLAGS for this step (e.g. "
                   "--xla_gpu_enable_triton_gemm=false), reported as xla_flags")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_intermixed_args(argv)  # key=value overrides before and after the options
    if args.steps < 1 or args.rows_per_device < 1:
        p.exit(2, f"gpu_step: --steps {args.steps} and --rows-per-device {args.rows_per_device} must be >= 1\n")
    return args


def main(argv=None) -> int:
    args = _args(argv)
    if args.xla_flags:  # read once, when JAX starts its backend: set before importing it
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), args.xla_flags]))
    import jax
    import numpy as np

    from jaxtrain.checkpoint.format import Checkpointer
    from jaxtrain.config import hardware, load_config
    from jaxtrain.errors import ConfigError
    from jaxtrain.models.flops import train_flops_per_token
    from jaxtrain.train.step import setup

    n = jax.device_count()
    try:
        cfg = load_config(args.config, [f"train.global_batch={args.rows_per_device * n}", "train.microbatches=1",
                                        "checkpoint.async_save=true", *args.overrides])
        step = setup(cfg)
    except ConfigError as e:
        print(f"gpu_step: {e}", file=sys.stderr)
        return 2
    lay = step.layout
    train, _, compile_s = step.compile(with_eval=False)
    state = lay.init_state()
    tokens = np.random.default_rng(0).integers(0, lay.cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)
    batch = jax.device_put(tokens, lay.batch_sharding)
    state, times, losses = _run_steps(train, state, batch, args.steps + 1)
    times = times[1:]  # the first call warms up (allocations, autotuning)
    seq = lay.cfg.data.seq_len
    step_s = statistics.median(times)
    tokens_per_s = lay.batch_shape[0] * seq / step_s
    kind = jax.devices()[0].device_kind
    peak = hardware.peak_flops(kind)
    mfu = train_flops_per_token(lay.cfg.model, seq) * tokens_per_s / (peak * n) if peak else None
    # model.fp8: the same model FLOPs over the dense FP8 peak too (every FLOP at the FP8 rate: a lower bound)
    hw = hardware.for_device_kind(kind)
    fp8_peak = hw.fp8_peak_flops if hw and hw.fp8_peak_flops > 0 else None
    mfu_fp8 = mfu * peak / fp8_peak if mfu is not None and fp8_peak else None
    print(json.dumps(dict(kind="step", config=args.config, attention=lay.cfg.model.attention,
                          dtype=lay.cfg.model.dtype, remat=lay.cfg.model.remat, devices=n, device_kind=kind,
                          global_batch=lay.batch_shape[0], seq=seq, compile_s=round(compile_s, 1),
                          step_ms=round(1e3 * step_s, 2), step_ms_min=round(1e3 * min(times), 2),
                          tokens_per_s=round(tokens_per_s), mfu=None if mfu is None else round(mfu, 4),
                          fp8=lay.cfg.model.fp8, peak_tflops=peak and peak / 1e12,
                          fp8_peak_tflops=fp8_peak and fp8_peak / 1e12,
                          mfu_fp8_peak=None if mfu_fp8 is None else round(mfu_fp8, 4),
                          loss_first=losses[0], loss_last=losses[-1], moe_experts=lay.cfg.model.moe.experts,
                          moe_top_k=lay.cfg.model.moe.top_k if lay.cfg.model.moe.experts else None,
                          moe_gemm=lay.cfg.model.moe.gemm if lay.cfg.model.moe.experts else None,
                          xla_flags=args.xla_flags or None, n_layers=lay.cfg.model.n_layers,
                          **_memory(train), **({"program": program_figures(train)} if args.program else {}))),
          flush=True)
    if args.checkpoint_dir:
        return _time_saves(Checkpointer, lay.cfg, args.checkpoint_dir, train, state, batch, step_s)
    return 0


def _memory(train) -> dict:
    """GB: the first device's peak bytes in use so far (None where the backend keeps no statistics) and the compiled
    step's own account of one device's need."""
    import jax

    from jaxtrain.parallel.layout import compiled_need

    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    need = compiled_need(train)  # the planner's reading of the same program
    return dict(peak_gb=None if peak is None else round(peak / 1e9, 2),
                compiled_gb=None if need is None else round(need.total / 1e9, 2))


def program_figures(train) -> dict:
    """What the compiled step's program holds: XLA's cost analysis (FLOPs, bytes accessed: where a GPU gives one;
    a deviceless compile does not), and counted off its optimized HLO: fusions, custom calls by target (cuBLAS GEMMs,
    cuDNN attention), Triton GEMM fusions, float8 converts and reductions (amax passes) outside and inside fusions."""
    import collections
    import re

    cost = train.cost_analysis()
    cost = cost[0] if isinstance(cost, list) and cost else cost
    text = train.as_text() or ""
    ops = collections.Counter(m.group(1) for m in re.finditer(r"=\s*\S+\s+([a-z][\w-]*)\(", text))
    calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    f8_converts = len(re.findall(r"=\s*f8e\w+\[[^\]]*\][^=]*\sconvert\(", text))
    return dict(flops=cost and cost.get("flops"), bytes_accessed=cost and cost.get("bytes accessed"),
                fusions=ops["fusion"], reduces=ops["reduce"], custom_calls=dict(calls),
                triton_gemm_fusions=len(re.findall(r'"kind":"__triton_gemm"', text)), f8_converts=f8_converts,
                hlo_chars=len(text))


def _run_steps(train, state, batch, count: int, until=None):
    """Run ``count`` steps (or, with ``until``, steps while ``until()`` holds, at most ``count``), each timed to its
    loss on the host: (state, seconds per step, losses)."""
    times: list[float] = []
    losses: list[float] = []
    while len(times) < count and (until is None or until()):
        t0 = time.perf_counter()
        state, metrics = train(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - t0)
    return state, times, losses


def _time_saves(checkpointer_cls, cfg, root: str, train, state, batch, step_s: float) -> int:
    """Two timed saves (the first, then a later one) of ``state`` under ``root``; one JSON line each. 1 when ``root``
    cannot take the state."""
    import jax

    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    os.makedirs(root, exist_ok=True)
    free = shutil.disk_usage(root).free
    where = dict(dir=os.path.abspath(root), **_filesystem(root), free_gb=round(free / 1e9, 1))
    if free < 1.1 * nbytes:
        print(json.dumps(dict(kind="checkpoint", status=f"skipped: {root} has {free / 1e9:.1f} GB free, the state "
                              f"needs {nbytes / 1e9:.1f} GB", state_gb=round(nbytes / 1e9, 3), **where)), flush=True)
        return 1
    for i, which in enumerate(("first", "later")):
        directory = os.path.join(root, f"save-{os.getpid()}-{i}")
        c = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=directory))
        try:
            state, figures = _one_save(checkpointer_cls(c, {"benchmark": "gpu_step"}), 1 + i, train, state, batch)
            figures["on_disk_gb"] = round(_disk_bytes(directory) / 1e9, 3)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        written = figures["written_s"]
        during = figures.pop("during")
        print(json.dumps(dict(
            kind="checkpoint", save=which, status="ok", state_bytes=nbytes, state_gb=round(nbytes / 1e9, 3),
            gb_per_s=round(nbytes / 1e9 / written, 3), **figures, steps_during_write=len(during),
            step_ms_during_write=round(1e3 * statistics.median(during), 2) if during else None,
            step_ms_before=round(1e3 * step_s, 2),
            # What the loop lost to this save: the blocking part, plus what the write added to the steps beside it.
            loop_lost_s=round(figures["blocked_s"] + sum(max(0.0, t - step_s) for t in during), 3), **where)),
            flush=True)
    try:
        os.rmdir(root)  # made here and now empty; left alone if it holds anything else
    except OSError:
        pass
    return 0


def _one_save(saver, step: int, train, state, batch):
    """One save through ``saver`` (a jaxtrain Checkpointer), train steps running until its write ends, as the loop's
    steps do: (state, figures). A thread waits for the write to learn when it ended; the steps stop then."""
    t0 = time.perf_counter()
    blocked = saver.save(step, state, {"next_index": step})
    returned = time.perf_counter()
    done: dict[str, float] = {}

    def wait():
        saver.wait()
        done["at"] = time.perf_counter()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    state, during, _ = _run_steps(train, state, batch, MAX_STEPS_DURING_SAVE, until=waiter.is_alive)
    waiter.join()
    saver.close()  # re-raises a failed write
    if "at" not in done:
        raise RuntimeError("the checkpoint write did not finish")
    figures = dict(blocked_s=round(blocked, 3), save_call_s=round(returned - t0, 3),
                   background_s=round(done["at"] - returned, 3), written_s=round(done["at"] - t0, 3), during=during)
    return state, figures


def _filesystem(path: str) -> dict:
    """The filesystem type and mount point holding ``path`` (from /proc/mounts; empty where there is none)."""
    path, best = os.path.realpath(path), ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                    best = (mount, fstype)
    except OSError:
        return {}
    return dict(mount=best[0], fstype=best[1])


def _disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


if __name__ == "__main__":
    sys.exit(main())
