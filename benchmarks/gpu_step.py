"""Time jaxtrain's compiled train step: ``python benchmarks/gpu_step.py [--config 1b] [--steps 10]
[--rows-per-device 4] [key=value ...]``.

Builds the layout and step of the config on every visible device (``jaxtrain.train.step.setup``), creates the state in
its shards, compiles the train step ahead of time, runs it on random tokens and prints one JSON line: the resolved
attention and dtype, compile seconds, median / min step milliseconds after one warm-up step, tokens per second and
MFU (``model.train_flops_per_token`` over the device kind's peak from ``jaxtrain/configs/hardware``; None for a
kind no hardware file lists), the first and last loss. No data pipeline, no evaluation, no checkpoint: it measures
the step alone (what ``benchmarks/gpu_check.sh`` needs from its first GPU minutes; a 1B state would take ~15 GB
to checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Run as a script, Python puts benchmarks/ first on sys.path: put the checkout's root there, so that its jaxtrain
# is the one measured (the GPU machine has no installed copy).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="1b", help="a shipped config name or a YAML path (default 1b)")
    p.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step")
    p.add_argument("--rows-per-device", type=int, default=4, help="sequences per device and step (global batch = "
                   "this x devices)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rows_per_device < 1:
        p.exit(2, f"gpu_step: --steps {args.steps} and --rows-per-device {args.rows_per_device} must be >= 1\n")

    import jax
    import numpy as np

    from jaxtrain.config import hardware, load_config
    from jaxtrain.errors import ConfigError
    from jaxtrain.models.flops import train_flops_per_token
    from jaxtrain.train.step import setup

    n = jax.device_count()
    try:
        cfg = load_config(args.config, [f"train.global_batch={args.rows_per_device * n}", "train.microbatches=1",
                                        *args.overrides])
        step = setup(cfg)
    except ConfigError as e:
        print(f"gpu_step: {e}", file=sys.stderr)
        return 2
    lay = step.layout
    train, _, compile_s = step.compile(with_eval=False)
    state = lay.init_state()
    tokens = np.random.default_rng(0).integers(0, lay.cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)
    batch = jax.device_put(tokens, lay.batch_sharding)
    losses, times = [], []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        state, metrics = train(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        if i:  # the first call warms up (allocations, autotuning)
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    seq = lay.cfg.data.seq_len
    step_s = statistics.median(times)
    tokens_per_s = lay.batch_shape[0] * seq / step_s
    kind = jax.devices()[0].device_kind
    peak = hardware.peak_flops(kind)
    mfu = train_flops_per_token(lay.cfg.model, seq) * tokens_per_s / (peak * n) if peak else None
    print(json.dumps(dict(config=args.config, attention=lay.cfg.model.attention, dtype=lay.cfg.model.dtype,
                          remat=lay.cfg.model.remat, devices=n, device_kind=kind, global_batch=lay.batch_shape[0],
                          seq=seq, compile_s=round(compile_s, 1), step_ms=round(1e3 * step_s, 2),
                          step_ms_min=round(1e3 * min(times), 2), tokens_per_s=round(tokens_per_s),
                          mfu=None if mfu is None else round(mfu, 4), loss_first=losses[0], loss_last=losses[-1])),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
