"""Hugging Face import/export cost at the 1B config's shapes, and KV-cached decode speed.

    python benchmarks/hf_bench.py convert [--dtype bfloat16] [--workdir /tmp/hf_bench]
    python benchmarks/hf_bench.py decode [--configs tiny 125m] [--batch 1] [--new 128]

``convert`` writes random weights with Llama 3.2 1B's shapes (configs/1b.yaml: vocabulary 128,256, d_model 2048,
16 layers, 32/8 heads, d_ff 8192, tied) in the Hugging Face layout (config.json + 1 GB safetensors shards + index),
then runs ``python -m jaxtrain convert from-hf`` and ``convert to-hf`` as subprocesses under ``/usr/bin/time -v`` and
prints wall time and peak resident memory of each. ``decode`` builds each config's model with random parameters on
one device and times prefill and the per-token decode step of ``jaxtrain.hf.generate`` (greedy, no eos stop).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, max_position_embeddings=131072)


def write_random_hf(path: str, dtype: str) -> int:
    """Random Llama weights with ONE_B's shapes in the Hugging Face layout; returns the bytes written."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jaxtrain.config import load_config
    from jaxtrain.hf import mapping as hf

    os.makedirs(path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "dtype": dtype,
              "bos_token_id": 128000, "eos_token_id": 128001, **ONE_B}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in hf.model_fields_from_hf(config).items()])
    m = cfg.model
    hd, d = m.resolved_head_dim, m.d_model
    shapes = {"embed_tokens": (m.vocab_size, d), "q_proj": (m.n_heads * hd, d), "k_proj": (m.n_kv_heads * hd, d),
              "v_proj": (m.n_kv_heads * hd, d), "o_proj": (d, m.n_heads * hd), "gate_proj": (m.d_ff, d),
              "up_proj": (m.d_ff, d), "down_proj": (d, m.d_ff), "lm_head": (m.vocab_size, d)}
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    rng = np.random.default_rng(0)
    order = [(tm, None) for tm in hf.tensor_maps(m) if not tm.layered]
    order += [(tm, i) for i in range(m.n_layers) for tm in hf.tensor_maps(m) if tm.layered]
    files, current, used, weight_map, total = [], {}, 0, {}, 0

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(current, os.path.join(path, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in current})

    for tm, i in order:
        kind = tm.hf.split(".")[-2]
        shape = shapes.get(kind, (d,))  # the rest are norm scales
        x = (rng.standard_normal(shape, dtype=np.float32) * 0.02 + (kind not in shapes)).astype(np_dtype)
        if used + x.nbytes > 1e9 and current:
            flush()
            current, used = {}, 0
        current[tm.name(i)] = x
        used += x.nbytes
        total += x.nbytes
    flush()
    # Rename to Hugging Face's -of-N names now that N is known.
    renamed = {f: f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k, f in enumerate(files)}
    for old, new in renamed.items():
        os.rename(os.path.join(path, old), os.path.join(path, new))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}, f)
    return total


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS GiB, output) of a command run under /usr/bin/time -v."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return wall, rss_kb / 2**20, r.stdout.strip()


def bench_convert(workdir: str, dtype: str) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    src, jt, out = (os.path.join(workdir, n) for n in ("hf", "jt", "out"))
    t0 = time.perf_counter()
    nbytes = write_random_hf(src, dtype)
    print(f"wrote {nbytes / 1e9:.2f} GB of random {dtype} weights (1B shapes) in {time.perf_counter() - t0:.1f} s")
    rows = []
    for name, cmd in [("import (convert from-hf)", ["convert", "from-hf", src, "--out", jt]),
                      ("export (convert to-hf)", ["convert", "to-hf", jt, "--out", out])]:
        wall, rss, text = timed([sys.executable, "-m", "jaxtrain", *cmd])
        rows.append((name, wall, rss))
        print(text)
    print(f"\n| 1B shapes, {dtype} ({nbytes / 1e9:.2f} GB) | wall time | peak RSS |\n| --- | --- | --- |")
    for name, wall, rss in rows:
        print(f"| {name} | {wall:.1f} s | {rss:.2f} GiB |")
    shutil.rmtree(workdir, ignore_errors=True)


def bench_decode(configs: list[str], batch: int, new: int, prompt_len: int) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain.config import load_config
    from jaxtrain.hf import generate
    from jaxtrain.models.llama import Transformer
    from jaxtrain.parallel.layout import Layout

    print("| config | params | batch | prompt | new | prefill tokens/s | decode tokens/s | ms/step | compile |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in configs:
        path = os.path.join(REPO, "configs", f"{name}.yaml")
        layout = Layout.build(load_config(path, ["model.attention=xla", "mesh.ici.fsdp=1"]), jax.devices()[:1])
        cfg = layout.cfg
        with layout.scope():
            model = Transformer(cfg.model, rngs=nnx.Rngs(0))
        prompts = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, prompt_len)).tolist()
        generate.generate(model, layout, prompts, max_new_tokens=4)  # warm caches of the process
        r = generate.generate(model, layout, prompts, max_new_tokens=new)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        print(f"| {name} | {n_params / 1e6:.1f}M | {batch} | {prompt_len} | {new} | "
              f"{r.prefill_tokens / r.prefill_seconds:,.0f} | {r.decode_tokens / r.decode_seconds:,.1f} | "
              f"{r.decode_seconds / max(1, new - 1) * 1e3:.1f} | {r.compile_seconds:.1f} s |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    c.add_argument("--workdir", default="/tmp/hf_bench")
    d = sub.add_parser("decode")
    d.add_argument("--configs", nargs="+", default=["tiny", "125m"])
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--new", type=int, default=128)
    d.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args()
    if args.what == "convert":
        bench_convert(args.workdir, args.dtype)
    else:
        bench_decode(args.configs, args.batch, args.new, args.prompt_len)


if __name__ == "__main__":
    main()
