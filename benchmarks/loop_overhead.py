"""How much does the training loop add on top of the compiled step? Prints figures; asserts nothing.

    python benchmarks/loop_overhead.py [key=value ...]      (default: the tiny config, 100 steps, 1 CPU device)

Measures (1) the compiled train step called back to back on one device-resident batch, no host work in between
(mean over the calls, one block at the end), and (2) the full loop (`jaxtrain.train.loop.train`: Grain batches, host to
device transfer, metrics fetched one step late, jsonl/TensorBoard/progress output): median step time.
"""

import statistics
import sys
import tempfile
import time

from jaxtrain.config import load_config


def bare_step_seconds(trainer, steps: int) -> tuple[float, float]:
    import jax
    import numpy as np

    state = trainer.layout.init_state()
    train_step, _, compile_s = trainer.compile(state)
    cfg = trainer.cfg
    batch = trainer.layout.to_device(np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1), dtype=np.int32))
    for _ in range(3):
        state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = train_step(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t0) / steps, compile_s


def main(argv):
    steps = 100
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"run.dir={tmp}", f"train.steps={steps}", "train.eval_every=0", *argv])
        from jaxtrain.cluster import process as runtime
        from jaxtrain.train import loop
        from jaxtrain.train import step as step_lib

        runtime.configure(cfg)
        trainer = step_lib.setup(cfg)
        bare_a, compile_s = bare_step_seconds(trainer, steps)
        result = loop.train(cfg)
        bare_b, _ = bare_step_seconds(trainer, steps)
    loop_step = statistics.median(result.step_times)
    bare = (bare_a + bare_b) / 2
    import jax

    print(f"\nmachine: {jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"compile (train + eval step): {compile_s:.2f} s (loop run: {result.compile_seconds:.2f} s)")
    print(f"compiled step back to back:  {bare * 1e3:.2f} ms/step (runs: {bare_a * 1e3:.2f}, {bare_b * 1e3:.2f})")
    print(f"full loop, median:           {loop_step * 1e3:.2f} ms/step over {len(result.step_times)} steps")
    print(f"loop overhead:               {100 * (loop_step / bare - 1):+.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
