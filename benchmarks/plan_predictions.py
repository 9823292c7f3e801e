"""The planner's predictions beside measured and published figures (docs/planning.md, "Predicted throughput"):
``python benchmarks/plan_predictions.py [--skip-published]``. Runs on a CPU.

1. The 1B step on one H200 (``configs/1b.yaml``, 4 x 4096 tokens, remat save_matmuls, cuDNN attention), BF16 and
   ``model.fp8=tensorwise``: the planner's estimate (``cost.estimate`` on one device: no collectives, nothing to
   compile) with the measured rates of ``jaxtrain/configs/hardware/measured/h200-8x.yaml``, against the step times
   docs/results.md records ("The first GPU run: one H200", read from there).
2. The published Llama 3.1 8B workloads on 8 x H100: each a ``python -m jaxtrain plan --hardware h100-8x ... --json``
   (printed, run in a process of its own: it compiles the step on 8 emulated CPU devices for the collectives and
   memory), giving tokens/s per GPU from its estimated step (no overlap), and the same step with its compute priced at
   the H200's measured rates (same GH100 compute: 132 SMs, 989 TFLOP/s dense BF16 on both datasheets; the H100's
   links and HBM kept). Predictions, not measurements.

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Llama 3.1 8B's shapes (its config.json) over the 7b config; seq 8192 as both published runs.
LLAMA31_8B = ["model.vocab_size=128256", "model.n_kv_heads=8", "model.d_ff=14336", "model.rope_theta=500000",
              "data.seq_len=8192"]
# (workload, jaxtrain's settings, {recipe: published tokens/s/GPU}); each planned with both remat policies that
# save memory: save_matmuls (the nearest to torchtitan's selective AC) and full.
PUBLISHED = [
    ("torchtitan Llama 3.1 8B, 8 x H100, FSDP 8, local batch 2 (selective AC)",
     ["mesh.ici.fsdp=8", "train.global_batch=16"], {"none": 6667, "tensorwise": 8532}),
    ("NeMo 24.09 Llama 3.1 8B, 8 x H100, global batch 128 (TP1 PP1 CP2, no AC)",
     ["mesh.ici.fsdp=8", "train.global_batch=128", "train.microbatches=8", "train.accumulate=sharded"],
     {"none": round(128 * 8192 / 12.91 / 8), "tensorwise": round(128 * 8192 / 9.67 / 8)}),
]
REMATS = ("save_matmuls", "full")


def measured_1b_ms() -> dict[str, float]:
    """The 1B step times docs/results.md records for the one H200 (ms): {"none": BF16, "tensorwise": FP8}."""
    with open(os.path.join(REPO, "docs", "results.md")) as f:
        text = f.read()
    section = text[text.index("## The first GPU run: one H200"):]
    bf16 = re.search(r"^\| BF16 \| ([\d.]+) \|", section, re.M)
    fp8 = re.search(r"^\| `model\.fp8=tensorwise` \| ([\d.]+) \|", section, re.M)
    assert bf16 and fp8, "docs/results.md's H200 table has changed"
    return {"none": float(bf16.group(1)), "tensorwise": float(fp8.group(1))}


def one_h200_rows() -> list[str]:
    """Section 1: the 1B on one H200, predicted against measured."""
    from jaxtrain.config import load_config
    from jaxtrain.config.hardware import load_hardware
    from jaxtrain.models.flops import count_params
    from jaxtrain.parallel.dims import MeshShape
    from jaxtrain.parallel.layout import resolve_auto
    from jaxtrain.planner.cost import model
    from jaxtrain.planner.cost.measured import for_hardware

    hw = load_hardware("h200-8x")
    measured = measured_1b_ms()
    rows = ["| 1B on one H200, 4 x 4096 tokens | predicted ms (matmul / attention / optimizer) | measured ms "
            "(results.md) | predicted / measured | single efficiency 0.5, ms |", "| --- | ---: | ---: | ---: | ---: |"]
    for recipe in ("none", "tensorwise"):
        cfg = resolve_auto(load_config("1b", ["train.global_batch=4", "mesh.ici.fsdp=1", f"model.fp8={recipe}"],
                                       num_devices=lambda c: 1), "gpu")
        shape = MeshShape.resolve(cfg.mesh, 1)
        n = count_params(cfg.model)["total"]
        est, _ = model.estimate(cfg, shape, hw, [], 4 * n, 8 * n, attention=cfg.model.attention)
        parts = model.measured_compute(cfg, shape, hw, cfg.model.attention)
        assert parts is not None and for_hardware(hw) is not None
        matmul = parts.seconds.get("matmul", 0) + parts.seconds.get("matmul_fp8", 0)
        plain = dataclasses.replace(hw, name="")  # the hardware file alone: peak x compute_efficiency
        single, _ = model.estimate(cfg, shape, plain, [], 4 * n, 8 * n)
        label = "BF16" if recipe == "none" else f"model.fp8={recipe}"
        rows.append(f"| {label} | {est.serial_s * 1e3:.1f} ({matmul * 1e3:.1f} / {parts.seconds['attention'] * 1e3:.1f}"
                    f" / {est.optimizer_s * 1e3:.1f}) | {measured[recipe]:.1f} | "
                    f"{est.serial_s * 1e3 / measured[recipe]:.3f} | {single.serial_s * 1e3:.1f} |")
    return rows


def plan_command(settings: list[str], recipe: str) -> list[str]:
    return [sys.executable, "-m", "jaxtrain", "plan", "--config", "7b", "--hardware", "h100-8x", *LLAMA31_8B,
            *settings, f"model.fp8={recipe}", "--json"]


def published_rows() -> list[str]:
    """Section 2: each published workload planned on 8 x H100."""
    from jaxtrain.config import load_config
    from jaxtrain.config.hardware import load_hardware
    from jaxtrain.parallel.dims import MeshShape
    from jaxtrain.parallel.layout import resolve_auto
    from jaxtrain.planner.cost import model

    h200 = load_hardware("h200-8x")
    rows = ["| workload | recipe | remat | published tok/s/GPU | predicted tok/s/GPU: h100-8x file (peak x 0.5) | "
            "predicted, compute at the H200's measured rates | predicted step s (compute / NVLink / optimizer) | fits "
            "(CPU-derived GB of 60 usable) |", "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for workload, base, published_by_recipe, recipe, remat in [(w, b, p, r, m) for w, b, p in PUBLISHED
                                                                for r in ("none", "tensorwise") for m in REMATS]:
        settings, published = [*base, f"model.remat={remat}"], published_by_recipe[recipe]
        argv = plan_command(settings, recipe)
        print("$ python " + " ".join(argv[1:]), file=sys.stderr, flush=True)
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"plan failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        c = json.loads(proc.stdout)["candidates"][0]
        cfg = resolve_auto(load_config("7b", [*LLAMA31_8B, *settings, f"model.fp8={recipe}"],
                                       num_devices=lambda c: 8), "gpu")
        shape = MeshShape.resolve(cfg.mesh, 8)
        tokens = cfg.train.global_batch * cfg.data.seq_len / 8
        t = c["time"]
        parts = model.measured_compute(cfg, shape, h200, cfg.model.attention)
        assert parts is not None
        compute = sum(parts.seconds.values())
        at_h200 = compute + t["intra_node"] + t["inter_node"] + t["optimizer"]
        rows.append(f"| {workload} | {'BF16' if recipe == 'none' else 'FP8 ' + recipe} | {remat} | {published:,} | "
                    f"{tokens / c['est_step_seconds']:,.0f} | {tokens / at_h200:,.0f} | {c['est_step_seconds']:.2f} "
                    f"({t['compute']:.2f} / {t['intra_node']:.3f} / {t['optimizer']:.3f}); at H200 rates {at_h200:.2f}"
                    f" | {'yes' if c['fits'] else 'no'} ({c['memory_bytes_per_device'] / 1e9:.1f}) |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/plan_predictions.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-published", action="store_true", help="the 1B on one H200 only (no compiles)")
    args = p.parse_args(argv)
    print("\n".join(one_h200_rows()), flush=True)
    if not args.skip_published:
        print()
        print("\n".join(published_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
