"""One XLA:GPU compile of a train step for a GPU topology, without a GPU: the process ``planner/xla_gpu/deviceless.py``
starts (``python -m jaxtrain.planner.xla_gpu.child REQUEST.json``, with ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
JAX_PLATFORMS=cpu``). It prints one ``RESULT {json}`` line: the planner's reading of the compiled step (memory,
collectives as XLA:GPU states them), the attention it runs and the checks of ``planner/xla_gpu/program.py``; or an
``ERROR`` line and exit status 1.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def topology_devices(gpu_target: str, nodes: int, per_node: int) -> list:
    """The devices of ``nodes`` hosts of ``per_node`` GPUs described by the shipped target config ``gpu_target``:
    ids host-major, ``process_index`` = host, as on a real cluster (``jax.experimental.topologies``)."""
    from jax.experimental import topologies

    from jaxtrain.config.hardware import gpu_target_device_kind, gpu_targets

    with open(gpu_targets()[gpu_target]) as f:
        text = f.read()
    topo = topologies.get_topology_desc(gpu_target, "cuda", target_config=text, topology=f"1x{nodes}x{per_node}")
    devices: list = list(topo.devices)
    kind = gpu_target_device_kind(gpu_target)
    # get_topology_desc accepts a config it did not understand (an empty one gives other devices): check.
    if len(devices) != nodes * per_node or devices[0].device_kind != kind or devices[0].platform != "gpu":
        raise RuntimeError(f"the topology of {gpu_target} gave {len(devices)} {devices[0].platform} device(s) of "
                           f"kind {devices[0].device_kind!r}, expected {nodes * per_node} gpu devices of kind {kind!r}")
    return devices


def as_compiled(cfg, num_devices: int):
    """``cfg`` resolved for GPUs on ``num_devices`` devices as a deviceless compile can build it, and what stands
    in for what: jax-triton's kernels compile only on a GPU (the launcher asks the local device for its compute
    capability), so jaxtrain's Pallas kernel, the same tiles, is compiled in their place."""
    from jaxtrain.parallel.layout import resolve_auto

    notes = []
    if cfg.model.moe.gemm == "triton":  # before resolving, which asks for jax-triton
        moe = dataclasses.replace(cfg.model.moe, gemm="pallas")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))
        notes.append("model.moe.gemm=triton compiled as pallas: Triton kernels compile only on a GPU")
    cfg = resolve_auto(cfg, "gpu", num_devices)
    if cfg.model.attention == "triton":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="pallas"))
        notes.append("model.attention=triton compiled as pallas: Triton kernels compile only on a GPU; the Pallas "
                     "kernel has the same tiles (docs/kernels.md)")
    return cfg, "; ".join(notes)


def main(request_path: str) -> dict:
    """The compile ``request_path`` asks for: {config (a YAML path), gpu_target, nodes, per_node, hlo (a path or
    null)}; returns the result JSON."""
    import jax

    from jaxtrain.config import load_config
    from jaxtrain.planner.search import meshes as search
    from jaxtrain.planner.xla_gpu import program as gpu_program
    from jaxtrain.planner.xla_gpu.deviceless import reading_json
    from jaxtrain.train.step import setup

    with open(request_path) as f:
        req = json.load(f)
    devices = topology_devices(req["gpu_target"], req["nodes"], req["per_node"])
    cfg, stand_in = as_compiled(load_config(req["config"]), len(devices))
    step = setup(cfg, devices)
    train, seconds = search.compile_train_step(step)
    comp = search.reading(step, train, seconds)
    text, lay = train.as_text(), step.layout
    if req.get("hlo"):
        with open(req["hlo"], "w") as f:
            f.write(text)
    m = lay.cfg.model
    expected = gpu_program.Expected(m.attention, lay.dims.local_seq, lay.dims.context, m.resolved_head_dim, m.dtype,
                                    gpu_program.expected_collectives(lay.shape, lay.dims.batch_axes, lay.param_axes))
    return {**reading_json(comp), "device_kind": devices[0].device_kind, "jax": jax.__version__,
            "topology": f"1x{req['nodes']}x{req['per_node']}", "attention": m.attention, "stand_in": stand_in,
            "attention_calls": dict(gpu_program.attention_calls(text)),
            "violations": gpu_program.violations(text, expected, comp.collectives, lay.shape)}


if __name__ == "__main__":
    try:
        result = main(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - the parent reports it in one line
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        # jax's custom_partitioner wraps the Python exception raised inside it: the last such line says why.
        cause = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception"))]
        print(f"ERROR {type(e).__name__}: {(cause or lines or [''])[-1]}", file=sys.stderr, flush=True)
        sys.exit(1)
    print("RESULT " + json.dumps(result), flush=True)
