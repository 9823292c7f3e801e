"""What XLA makes of ``jax.lax.ragged_dot`` (the MoE layers' grouped matmul, jaxtrain/models/experts.py): the dots of
the optimized HLO and their FLOPs against the grouped matmul's real work. Asserts nothing.

    python benchmarks/ragged_dot_hlo.py [--rows M] [--experts E] [--d-model D] [--d-ff F]
    # XLA:GPU without a GPU (Python 3.12 venv with jax[cuda12]==0.11.2; docs/moe.md):
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_autotune_level=0 \
        python benchmarks/ragged_dot_hlo.py --gpu-target h100_min.txtpb

Default shape: one Mixtral 8x7B expert projection on 8192 token assignments, bf16 (float32 on CPU, which has no
bf16 dot): lhs [M, D], rhs [E, D, F], group sizes [E]. The real work is 2 M D F FLOPs whatever the groups are.
"""

import argparse
import re
import sys

import jax
import jax.numpy as jnp


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=14336)
    p.add_argument("--gpu-target", help="a GPU target config (protobuf text): compile with XLA:GPU for one H100")
    a = p.parse_args(argv)
    m, e, d, f = a.rows, a.experts, a.d_model, a.d_ff
    if a.gpu_target:
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        topo = topologies.get_topology_desc("h100", "cuda", target_config=open(a.gpu_target).read(),
                                            topology="1x1x1")
        sharding, dtype = NamedSharding(Mesh(topo.devices, ("x",)), PartitionSpec()), jnp.bfloat16
    else:
        sharding, dtype = None, jnp.float32
    args = (jax.ShapeDtypeStruct((m, d), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((e, d, f), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((e,), jnp.int32, sharding=sharding))
    compiled = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32)
                       ).trace(*args).lower().compile()
    text = compiled.as_text()
    print(f"jax {jax.__version__}, {'XLA:GPU for ' + topo.devices[0].device_kind if a.gpu_target else 'XLA:CPU'}; "
          f"ragged_dot({dtype.__name__}[{m},{d}], [{e},{d},{f}])")
    shapes = dict(re.findall(r"(%[\w.-]+) = (\w+\[[\d,]*\])", text))
    for _, shape, lhs, rhs in re.findall(r"(%[\w.-]+) = (\w+\[[\d,]*\])\S* dot\((%[\w.-]+), (%[\w.-]+)\)", text):
        print(f"  dot {shapes.get(lhs)} x {shapes.get(rhs)} -> {shape}")
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = (cost or {}).get("flops")
    real = 2 * m * d * f
    print(f"real work 2 M D F = {real / 1e9:.1f} GFLOP; XLA's count: "
          f"{'not given' if flops is None else f'{flops / 1e9:.1f} GFLOP ({flops / real:.2f}x)'}")
    mem = compiled.memory_analysis()
    if mem is not None:
        print(f"temporaries {mem.temp_size_in_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
