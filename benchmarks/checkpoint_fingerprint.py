"""Cost of the per-save checksum and finiteness pass (jaxtrain.checkpoint.format.fingerprint), which blocks the loop at
each save: configs/125m.yaml's float32 train state (parameters and AdamW moments, 1.48 GB) on one device.

    python benchmarks/checkpoint_fingerprint.py [--config 125m]
"""

import argparse
import statistics
import time

import jax

from jaxtrain.checkpoint import format as ckpt
from jaxtrain.config import load_config
from jaxtrain.train import step as step_lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="125m")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cfg = load_config(args.config, ["runtime.cpu_devices=1", "mesh.ici.fsdp=1", "model.dtype=float32"])
    ts = step_lib.setup(cfg, jax.devices()[:1])
    state = jax.block_until_ready(ts.layout.init_state())
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    t0 = time.perf_counter()
    ckpt.fingerprint(state)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ckpt.fingerprint(state)
        times.append(time.perf_counter() - t0)
    print(f"{jax.devices()[0].device_kind}: state {size / 1e9:.2f} GB; fingerprint first call (with compile) "
          f"{first:.2f} s, then median {statistics.median(times):.3f} s of {args.repeats} "
          f"({size / 1e9 / statistics.median(times):.2f} GB/s)")


if __name__ == "__main__":
    main()
