"""Compile jaxtrain's real train step with XLA:GPU for a topology of H100s on a machine without a GPU, and print
what the compiled program holds: memory per device, the collectives by kind, the grouped matmuls' GEMMs. Asserts
nothing. Needs a Python 3.12 environment with ``jax[cuda12]==0.11.2`` (and jaxtrain's dependencies):

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_autotune_level=0 \
        python benchmarks/xla_gpu_step.py TARGET.txtpb DEVICES [--config NAME] [key=value ...]

TARGET.txtpb: a GPU target config in protobuf text (../shared/tools/gpu-offline/h100_min.txtpb: the fields jaxlib
0.11.2 accepts, from XLA's H100 SXM spec). DEVICES: GPUs in one topology (one node's worth, e.g. 8).
"""

import argparse
import re
import sys
import time

import jax
from jax.experimental import topologies

from jaxtrain.config import load_config
from jaxtrain.train import step as step_lib

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute", "ragged-all-to-all")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("devices", type=int)
    p.add_argument("--config", default=None)
    p.add_argument("--hlo", help="also write the compiled HLO text here")
    p.add_argument("overrides", nargs="*")
    a = p.parse_intermixed_args(argv)
    topo = topologies.get_topology_desc("h100", "cuda", target_config=open(a.target).read(),
                                        topology=f"1x1x{a.devices}")
    cfg = load_config(a.config, ["run.dir=/tmp/xla-gpu-step", "data.source=synthetic", *a.overrides])
    t0 = time.perf_counter()
    step = step_lib.setup(cfg, list(topo.devices))
    compiled, _, _ = step.compile(with_eval=False)
    seconds = time.perf_counter() - t0
    text, mem = compiled.as_text(), compiled.memory_analysis()
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(text)
    counts = {k: len(re.findall(rf"[ }}]{k}(-start)?\(", text)) for k in KINDS}
    gemms = len(re.findall(r"__triton_gemm|custom_call_target=\"__cublas", text))
    print(f"jax {jax.__version__}; {a.devices} x {topo.devices[0].device_kind}; mesh {step.layout.shape.label}; "
          f"model {step.cfg.model.dtype}, attention {step.cfg.model.attention}; compiled in {seconds:.1f} s")
    print(f"memory per device: arguments {mem.argument_size_in_bytes / 2**30:.2f} GiB, temporaries "
          f"{mem.temp_size_in_bytes / 2**30:.2f} GiB, outputs {mem.output_size_in_bytes / 2**30:.2f} GiB (aliased "
          f"{mem.alias_size_in_bytes / 2**30:.2f})")
    print("collectives in the program (instructions):", {k: v for k, v in counts.items() if v}, "| GEMM calls:", gemms)


if __name__ == "__main__":
    main(sys.argv[1:])
