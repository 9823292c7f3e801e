"""What do checkpoints cost the training loop? Prints figures; asserts nothing.

    python benchmarks/checkpoint_bench.py [key=value ...]     (default: configs/125m.yaml's train state on CPU)

1. Blocking time of one save of the full train state (parameters + AdamW moments), asynchronous vs synchronous:
   how long `save()` holds the loop, and how long the write takes in all; into the persistent directory (a
   temporary directory under BENCH_DIR, default the system's) and into a host-local RAM disk (LOCAL_DIR, default
   /dev/shm when it exists), the kind of directory a local (emergency) checkpoint uses; and one local checkpoint
   save (jaxtrain/checkpoint/local.py: host copy of this process's shards, the file written in the background; one
   process, so no peer copy) into LOCAL_DIR.
2. End-to-end: the same short run with a checkpoint every N steps versus only at the end; the final save and its
   wait are outside the compared window (the sum of step times). SAVES_ONLY=1 skips this part.
"""

import os
import statistics
import sys
import tempfile
import time

from jaxtrain.config import load_config

REPEATS = 3


def _timed_saves(saver, state) -> tuple[float, float]:
    """(median seconds a save held the caller, median seconds until it was on disk) over REPEATS saves."""
    blocked, total = [], []
    for step in range(1, REPEATS + 1):
        t0 = time.perf_counter()
        blocked.append(saver.save(step, state, {"next_index": step}))
        saver.wait()
        total.append(time.perf_counter() - t0)
    return statistics.median(blocked), statistics.median(total)


def main(argv):
    every, steps = 5, 20
    # The 125M model's state is what is measured; a short sequence and tiny batch keep CPU steps affordable.
    overrides = ["data.seq_len=128", "train.global_batch=2", "model.dtype=float32", "train.eval_every=0",
                 "train.eval_batches=1", "model.remat=none", *argv]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        cfg = load_config("configs/125m.yaml", [f"run.dir={tmp}/x", *overrides])
        from jaxtrain.checkpoint import format as ckpt
        from jaxtrain.cluster import process as runtime
        from jaxtrain.train import loop
        from jaxtrain.train import step as step_lib

        runtime.configure(cfg)
        runtime.quiet_logs()
        import jax

        trainer = step_lib.setup(cfg)
        state = trainer.layout.init_state()
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        rows = []
        local = os.environ.get("LOCAL_DIR", "/dev/shm" if os.path.isdir("/dev/shm") else "")
        places = [("persistent", tmp)] + ([("local", local)] if local else [])
        for where, root in places:
            with tempfile.TemporaryDirectory(dir=root) as into:
                for async_save in (True, False):
                    c = load_config("configs/125m.yaml", [f"run.dir={tmp}/save-{where}-{async_save}", *overrides,
                                                          f"checkpoint.dir={into}/{async_save}",
                                                          f"checkpoint.async_save={str(async_save).lower()}"])
                    saver = ckpt.Checkpointer(c, {"benchmark": True})
                    rows.append((f"{where} ({root})", "async" if async_save else "sync", *_timed_saves(saver, state)))
                    saver.close()
        if local:
            from jaxtrain.checkpoint import local as checkpoint_local

            with tempfile.TemporaryDirectory(dir=local) as into:
                local_saver = checkpoint_local.LocalSaver(into, tmp)
                local_saver.save(0, state, {"next_index": 0})  # derives the layout and fingerprint once per run
                local_saver.wait()
                rows.append((f"local checkpoint ({local})", "checkpoint.local_every",
                             *_timed_saves(local_saver, state)))

        runs = {}
        for label, n in ((f"every {every}", every), ("end only", 0)) if not os.environ.get("SAVES_ONLY") else ():
            c = load_config("configs/125m.yaml", [f"run.dir={tmp}/run-{n}", *overrides, f"train.steps={steps}",
                                                  f"checkpoint.every={n}"])
            result = loop.train(c)
            runs[label] = (sum(result.step_times), statistics.median(result.step_times), result.save_block_seconds)

    print(f"\nmachine: {jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"train state {nbytes / 1e9:.2f} GB (parameters + AdamW moments, float32; configs/125m.yaml"
          " with the overrides given)")
    print(f"| directory | save | loop blocked (median of {REPEATS}) | save complete |")
    print("| --- | --- | --- | --- |")
    for where, kind, blocked, total in rows:
        print(f"| {where} | {kind} | {blocked:.3f} s | {total:.3f} s |")
    if not runs:
        return
    base = runs["end only"][0]
    print(f"\n{steps} steps (sum of step times, steps 2-{steps}):")
    for label, (total, median, blocks) in runs.items():
        saves = ", ".join(f"{b:.2f}" for b in blocks)
        print(f"  checkpoint {label:>8}: {total:.2f} s, median step {median:.3f} s, save() blocked: [{saves}] s, "
              f"slowdown {100 * (total / base - 1):+.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
