"""Where can checkpoints go fast? Orbax save and restore bandwidth (GB/s) into a local directory and into an S3
store, through the same code as training (jaxtrain.checkpoint.orbax_io.make_manager: TensorStore's file or s3
driver, Orbax's rename or commit-file protocol). Prints figures; asserts nothing.

    python benchmarks/checkpoint_store.py [--mb 512] [--arrays 16] [--repeats 3] [--local DIR] [--s3 URL]

``--local``: default a temporary directory under $TMPDIR. ``--s3``: an ``s3://bucket/prefix`` reached with the
environment's AWS settings (AWS_ENDPOINT_URL_S3 for MinIO or another S3-compatible server); without it a moto S3
server is started on 127.0.0.1 (moto keeps objects in its own Python process, so its figure measures the client
path and moto's HTTP handling on this machine, not a cloud's bandwidth). Each save is synchronous (the figure is
the write itself, not the loop's blocking time: see checkpoint_bench.py for that) and ends with Orbax's commit.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server process on a free port with bucket ``bench``; (process, s3:// prefix)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL_S3=url)
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="bench")
    return proc, "s3://bench/checkpoints"


def state(mb: int, arrays: int):
    """``arrays`` float32 arrays of random values (incompressible, like trained weights) totalling ``mb`` MiB."""
    import jax
    import numpy as np

    n = mb * (1 << 20) // 4 // arrays
    rng = np.random.default_rng(0)
    return {f"w{i}": jax.device_put(rng.standard_normal(n, dtype=np.float32)) for i in range(arrays)}


def measure(directory: str, tree, repeats: int) -> tuple[float, float]:
    """(best save GB/s, best restore GB/s) over ``repeats`` saves of ``tree`` into ``directory``."""
    import jax

    from jaxtrain.checkpoint.orbax_io import META, STATE, make_manager, ocp

    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    manager = make_manager(directory)
    saves, restores = [], []
    for step in range(1, repeats + 1):
        t = time.perf_counter()
        manager.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(tree),
                                                      META: ocp.args.JsonSave({"step": step})}), force=True)
        manager.wait_until_finished()
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(tree)}))
        jax.block_until_ready(out[STATE])
        restores.append(time.perf_counter() - t)
    manager.close()
    return nbytes / min(saves) / 1e9, nbytes / min(restores) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--arrays", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--local", default=None)
    ap.add_argument("--s3", default=None)
    a = ap.parse_args()
    server = None
    if a.s3 is None:
        server, a.s3 = start_moto()
    tree = state(a.mb, a.arrays)
    try:
        with tempfile.TemporaryDirectory(dir=a.local) as local:
            targets = {f"local disk ({local})": os.path.join(local, "checkpoints"), f"S3 ({a.s3})": a.s3}
            print(f"state: {a.arrays} float32 arrays, {a.mb} MiB; best of {a.repeats}; synchronous saves")
            for name, directory in targets.items():
                save, restore = measure(directory, tree, a.repeats)
                print(f"{name}: save {save:.2f} GB/s, restore {restore:.2f} GB/s")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
