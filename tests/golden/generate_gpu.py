"""Regenerate the XLA:GPU golden HLO files: ``JAXTRAIN_GPU_COMPILER=PYTHON python tests/golden/generate_gpu.py
[NAME ...]``, PYTHON a Python with a CUDA jax plugin (``jax[cuda12]``) and jaxtrain's dependencies (a few minutes).

Each golden is the train step of the tiny model (bfloat16, a few settings per file) compiled by XLA:GPU for 8 H100s
without a GPU (``jaxtrain.planner.xla_gpu.deviceless``: a deviceless compile), trimmed as ``generate.py`` trims
XLA:CPU's (``trim.py``) while what ``tests/test_gpu_program.py`` reads stays exactly that of the untrimmed text: the
planner's reading of the collectives (as XLA:GPU states them), the attention calls, the S x S score matmuls and the
float32 GEMMs. ``goldens_gpu.json`` records each file's overrides, mesh sizes, sequence per device, head dim and
versions.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

from trim import trim_keeping  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.parallel.dims import MeshShape  # noqa: E402
from jaxtrain.planner.cost import hlo  # noqa: E402
from jaxtrain.planner.cost.passes import collectives  # noqa: E402
from jaxtrain.planner.xla_gpu import deviceless as xla_gpu  # noqa: E402
from jaxtrain.planner.xla_gpu import program as gpu_program  # noqa: E402

BASE = ["model.dtype=bfloat16", "model.head_dim=32", "model.remat=full", "data.threads=0"]
GOLDENS = {
    # cuDNN attention, FSDP: the async all-gather / reduce-scatter / all-reduce starts, ((operands), results) shapes.
    "gpu-fsdp8-cudnn": ["mesh.ici.fsdp=8", "model.attention=cudnn"],
    # The XLA reference attention: the S x S score matmuls, and float32 GEMMs in its backward.
    "gpu-fsdp8-xla": ["mesh.ici.fsdp=8", "model.attention=xla"],
    # jaxtrain's Pallas kernel (a Triton custom call) in the 1F1B pipeline beside tensor parallelism.
    "gpu-stage2-fsdp2-tensor2-1f1b-pallas": ["mesh.ici.stage=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2",
                                             "train.microbatches=4", "train.pipeline_schedule=1f1b",
                                             "model.attention=pallas"],
    # Ring attention over context 4 on the Pallas kernel (the K/V permutes).
    "gpu-data2-context4-pallas": ["mesh.ici.fsdp=1", "mesh.ici.data=2", "mesh.ici.context=4",
                                  "train.global_batch=2", "model.attention=pallas"],
}


def reading(text: str, sizes: tuple[int, ...], seqs: set[int], head_dim: int):
    """What the tests read from ``text``: the comparison key for trimming (the batched dots too, split-K's among
    them, which the S x S check must tell from attention's)."""
    colls, unknown = collectives(text, sizes, frozenset(), compiled_for_cpu=False)
    module = hlo.parse_hlo(text)
    batched = sorted(f"{i.name} {re.sub(r'{[^}]*}', '', i.shape)} {re.findall(r'[lr]hs_batch_dims={[^}]*}', i.attrs)}"
                     for i in module.by_name.values() if i.opcode == "dot" and "lhs_batch_dims" in i.attrs)
    return (sorted((c.kind, c.bytes, c.count, repr(c.groups.tolist())) for c in colls),
            sorted((u.name, u.holds_collectives) for u in unknown), sorted(gpu_program.attention_calls(text).items()),
            gpu_program.score_dots(module, seqs, head_dim), gpu_program.float32_gemms(module), batched)


def main(names: list[str]) -> None:
    compiler, why = xla_gpu.find_compiler()
    if compiler is None:
        sys.exit(f"no GPU compiler: {why}")
    index_path = os.path.join(HERE, "goldens_gpu.json")
    index = {}
    if names and os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
    for name in names or GOLDENS:
        cfg = load_config(None, [*BASE, *GOLDENS[name]])
        shape = MeshShape.resolve(cfg.mesh, 8)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "hlo.txt")
            res = xla_gpu.compile_layout(compiler, shape.apply(cfg), "h100", 1, 8, hlo_path=path)
            with open(path) as f:
                full = f.read()
        context = shape.axis_sizes["context"]
        seq_local = cfg.data.seq_len // context
        seqs = {seq_local} | ({seq_local // 2} if context > 1 else set())
        sizes = tuple(shape.axis_sizes.values())
        head_dim = cfg.model.resolved_head_dim
        text = trim_keeping(full, lambda t, sizes=sizes, seqs=seqs, head_dim=head_dim: reading(t, sizes, seqs,
                                                                                                head_dim))
        with open(os.path.join(HERE, f"{name}.hlo.txt"), "w") as f:
            f.write(text)
        index[name] = {"overrides": [*BASE, *GOLDENS[name]], "mesh_sizes": list(sizes), "seq_local": seq_local,
                       "context": context, "head_dim": cfg.model.resolved_head_dim, "attention": res.attention,
                       "device_kind": res.device_kind, "compiler": compiler.label, "backend": "gpu (deviceless)"}
        print(f"{name}: {len(full):,} -> {len(text):,} characters; violations as compiled: {res.violations}",
              flush=True)
    with open(index_path, "w") as f:
        json.dump({k: index[k] for k in GOLDENS if k in index}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
