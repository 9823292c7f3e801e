"""Regenerate the golden HLO files: ``python tests/golden/generate.py [NAME ...]`` (all: about 5 minutes on 2 cores).

Each golden is the post-optimisation HLO (``Compiled.as_text()``) of the real train step of the tiny model
(tests/jaxtrain_testing.py's FAST settings) compiled by XLA:CPU on 8 emulated devices, trimmed to what the planner
reads:

1. the module header reduced to its name and partition count, the stack-frame tables dropped, metadata reduced
   to op_name; backend_config kept only where it states a loop trip count; layouts and
   ``/*index=N*/`` comments dropped;
2. fused computations, then instruction lines, removed while the planner's reading of the file (every
   collective's kind, bytes, count and replica groups, after the GPU passes, and the loops of unknown trip count)
   stays exactly what it is for the untrimmed text.

So a golden is no longer valid HLO for XLA, but every line in it is a line XLA printed (less the dropped
attributes), and the planner reads it exactly as it reads the full program. ``goldens.json`` records, per file,
the config overrides, the mesh sizes and the parameter-sharded axes the analysis needs. The hand-written goldens
(``*.handwritten.hlo.txt``) are not touched.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (helpers's FAST) and the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

# As the planner compiles (jaxtrain/planner/search/target.py: AllReducePromotion off, which aborts XLA:CPU on some
# bfloat16 psums); the bf16 normalisation widens 16-bit all-reduces to f32 without it all the same.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=all-reduce-promotion").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from trim import trim_keeping  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.parallel.dims import MeshShape  # noqa: E402
from jaxtrain.planner.cost.passes import collectives  # noqa: E402
from jaxtrain.planner.search import meshes as search  # noqa: E402
from jaxtrain_testing import FAST  # noqa: E402

# name -> overrides on top of FAST and 8 devices. What each exercises is in tests/golden/README.md.
GOLDENS = {
    "data8": ["mesh.ici.data=8", "mesh.ici.fsdp=1"],
    "fsdp8": ["mesh.ici.fsdp=8"],
    "tensor8": ["mesh.ici.tensor=8", "mesh.ici.fsdp=1", "model.n_kv_heads=8"],
    "data2fsdp4": ["mesh.ici.data=2", "mesh.ici.fsdp=4"],
    # Gradient accumulation: 8 microbatches of 8 sequences (one per device) against 1 of 64.
    "fsdp8-b64-mb1": ["mesh.ici.fsdp=8", "train.global_batch=64"],
    "fsdp8-b64-mb8-unreduced": ["mesh.ici.fsdp=8", "train.global_batch=64", "train.microbatches=8",
                                "train.accumulate=unreduced"],
    "fsdp8-b64-mb8-sharded": ["mesh.ici.fsdp=8", "train.global_batch=64", "train.microbatches=8",
                              "train.accumulate=sharded"],
    # bfloat16 compute: XLA:CPU widens the 16-bit collectives to f32 (collectives.widened_by_cpu).
    "tensor8-bf16": ["mesh.ici.tensor=8", "mesh.ici.fsdp=1", "model.n_kv_heads=8", "model.dtype=bfloat16"],
    # Pipeline: 2 stages x fsdp 4, 4 microbatches (5 iterations), bfloat16 activations round the ring.
    "stage2fsdp4-mb4-bf16": ["mesh.ici.stage=2", "mesh.ici.fsdp=4", "train.microbatches=4", "model.dtype=bfloat16"],
    # The 1F1B schedule: 4 stages x fsdp 2, 8 microbatches (8 + 2 * 4 - 2 = 14 iterations), both rings in one loop.
    "stage4fsdp2-mb8-1f1b-bf16": ["mesh.ici.stage=4", "mesh.ici.fsdp=2", "train.microbatches=8",
                                  "model.dtype=bfloat16", "train.pipeline_schedule=1f1b"],
}


def reading(text: str, sizes: tuple[int, ...], axes: frozenset[str]):
    """What the planner reads from ``text``: the comparison key for trimming."""
    colls, unknown = collectives(text, sizes, axes)
    return (sorted((c.kind, c.bytes, c.count, repr(c.groups.tolist())) for c in colls),
            sorted((u.name, u.holds_collectives) for u in unknown))


def trim(text: str, sizes: tuple[int, ...], axes: frozenset[str]) -> str:
    return trim_keeping(text, lambda t: reading(t, sizes, axes))


def main(names: list[str]) -> None:
    index_path = os.path.join(HERE, "goldens.json")
    index = {}
    if names and os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
    for name in names or GOLDENS:
        overrides = GOLDENS[name]
        full = ["runtime.cpu_devices=8", *FAST, *overrides]
        cfg = load_config(None, full)
        shape = MeshShape.resolve(cfg.mesh, 8)
        step = search._step(cfg, shape, jax.devices())
        compiled, _ = search.compile_train_step(step)
        sizes, axes = tuple(shape.axis_sizes.values()), step.layout.param_axes
        text = trim(compiled.as_text(), sizes, axes)
        path = os.path.join(HERE, f"{name}.hlo.txt")
        with open(path, "w") as f:
            f.write(text)
        index[name] = {"overrides": full, "mesh_sizes": list(sizes), "param_axes": sorted(axes),
                       "jax": jax.__version__, "backend": "cpu"}
        print(f"{name}: {len(compiled.as_text()):,} -> {len(text):,} characters", flush=True)
    with open(index_path, "w") as f:
        json.dump({k: index[k] for k in GOLDENS if k in index}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
