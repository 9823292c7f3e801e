"""Emulated CPU devices: the same train step with collectives kept in-process (what one jaxtrain process does) and
routed through gloo (what happens once jax.distributed is initialised, which jaxtrain did for one process before).

    python benchmarks/cpu_collectives.py [--steps 8]

Each (mesh, mode) runs in its own process on 8 emulated devices: a 4.3M-parameter float32 model (d_model 256,
4 layers, d_ff 1024, vocab 256) at sequence 256, global batch 16. Prints the median step time of each.
"""

import argparse
import json
import os
import subprocess
import sys

MESHES = {"fsdp=8": ["mesh.ici.fsdp=8"], "data2 x fsdp2 x tensor2": ["mesh.ici.data=2", "mesh.ici.fsdp=2",
                                                                     "mesh.ici.tensor=2"]}
MODEL = ["model.dtype=float32", "model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8",
         "model.d_ff=1024", "data.seq_len=256", "train.global_batch=16", "run.dir=/tmp/jaxtrain-cpu-collectives"]

CHILD = r"""
import json, socket, statistics, sys, time
import jax
import numpy as np
jax.config.update("jax_num_cpu_devices", 8)
mode, steps, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
if mode == "gloo":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
from jaxtrain.config import load_config
from jaxtrain.train import step as step_lib
ts = step_lib.setup(load_config(None, overrides))
state = ts.layout.init_state()
step, _, _ = ts.compile(state)
rng = np.random.default_rng(0)
batch = ts.layout.to_device(rng.integers(0, 256, (16, 257)).astype(np.int32))
state, m = step(state, batch); jax.block_until_ready(m)
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
print(json.dumps({"median": statistics.median(times), "min": min(times)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    print(f"{'mesh':<24} {'in-process':>12} {'gloo':>12} {'gloo / in-process':>18}")
    for name, mesh in MESHES.items():
        medians = {}
        for mode in ("in-process", "gloo"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.steps), json.dumps(MODEL + mesh)],
                                 capture_output=True, text=True, env=env, check=True)
            medians[mode] = json.loads(out.stdout.strip().splitlines()[-1])["median"]
        print(f"{name:<24} {medians['in-process'] * 1e3:>9.0f} ms {medians['gloo'] * 1e3:>9.0f} ms "
              f"{medians['gloo'] / medians['in-process']:>17.2f}x", flush=True)


if __name__ == "__main__":
    main()
