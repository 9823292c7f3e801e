"""``python -m jaxtrain convert from-hf SRC --out DIR [key=value ...]`` and ``convert to-hf CHECKPOINT --out DIR``."""

import re

FAMILIES = "Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3"


def add_arguments(p):
    p.description = (f"Convert Hugging Face {FAMILIES.replace(' or ', ' and ')} checkpoints (safetensors + "
                     "config.json) to and from jaxtrain's.")
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", parser_class=type(p))
    sub.required = True
    a = sub.add_parser("from-hf", help="import a local Hugging Face model directory as a jaxtrain checkpoint",
                       description=f"Import a local Hugging Face {FAMILIES} directory (config.json + "
                       "*.safetensors, nothing is downloaded): writes DIR/config.yaml, an Orbax checkpoint "
                       "DIR/checkpoints/0 (usable as checkpoint.init_from or generate --checkpoint DIR) and the "
                       "tokenizer files. Overrides (key=value) set the mesh the parameters are sharded for, e.g. "
                       "runtime.cpu_devices=8 mesh.ici.fsdp=8, or model.param_dtype=float32.")
    a.add_argument("src", help="Hugging Face model directory")
    a.add_argument("--out", required=True, help="new output directory")
    a.add_argument("overrides", nargs="*", metavar="key=value")
    b = sub.add_parser("to-hf", help=f"export a jaxtrain checkpoint as a Hugging Face {FAMILIES} directory",
                       description="Export a checkpoint (a run directory, its checkpoints directory, one step, or "
                       "a convert from-hf output) as config.json + safetensors shards (+ index) + tokenizer files, "
                       "loadable with transformers' AutoModelForCausalLM.from_pretrained.")
    b.add_argument("checkpoint", help="run directory, checkpoints directory, step directory or import directory")
    b.add_argument("--out", required=True, help="new output directory")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    b.add_argument("overrides", nargs="*", metavar="key=value", help="mesh to restore on, e.g. runtime.cpu_devices=8")


def _size(text: str) -> int:
    from jaxtrain.errors import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size={text!r} must be a positive size such as 5GB or 500MB")
    units = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    return int(float(m.group(1)) * units[(m.group(2) or "B").lower()])


def _start(cfg):
    from jaxtrain.cluster import process as runtime

    runtime.quiet_logs()
    runtime.configure(cfg)


def run(args) -> int:
    import os

    from jaxtrain.cluster.distributed import cpu_device_count  # the device count train checks the mesh against
    from jaxtrain.hf import convert

    if args.direction == "from-hf":
        cfg, hf_cfg, tensors = convert.hf_import_config(args.src, args.out, args.overrides, cpu_device_count)
        _start(cfg)
        s = convert.import_hf(cfg, hf_cfg, tensors, args.src, args.out)
        print(f"imported {s['params'] / 1e6:.2f}M parameters in {s['seconds']:.1f} s to {os.path.abspath(args.out)} "
              f"(config.yaml, checkpoints/0{', ' + ', '.join(s['tokenizer']) if s['tokenizer'] else ''})")
        return 0
    from jaxtrain.checkpoint import format as ckpt
    from jaxtrain.config import load_config
    from jaxtrain.errors import ConfigError

    max_bytes = _size(args.max_shard_size)
    directory, step = ckpt.resolve(args.checkpoint)
    meta = ckpt.read_meta(directory, step)
    data = meta["config"].get("data", {})
    shape = convert.model_overrides(meta) + [f"data.eos_id={data.get('eos_id', 0)}",
                                             f"data.seq_len={data.get('seq_len', 128)}"]
    cfg = load_config(None, shape + list(args.overrides), num_devices=cpu_device_count)
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise ConfigError(f"--out {args.out!r} already exists and is not an empty directory (nothing is overwritten)")
    _start(cfg)
    s = convert.export_hf(cfg, directory, step, meta, args.out, max_bytes)
    print(f"exported {directory}/{step} ({s['bytes'] / 1e6:.1f} MB in {len(s['files'])} file(s)) in "
          f"{s['seconds']:.1f} s to {os.path.abspath(args.out)}"
          f"{' with ' + ', '.join(s['tokenizer']) if s['tokenizer'] else ''}")
    return 0
