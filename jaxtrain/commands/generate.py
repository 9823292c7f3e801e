"""``python -m jaxtrain generate --checkpoint PATH (--prompt TEXT | --prompt-ids 1,2,3 | --prompts FILE)``."""


def add_arguments(p):
    p.description = ("Generate from a checkpoint with a KV cache: prefill once, then one jitted step per token. The "
                     "model's shape comes from the checkpoint; overrides (key=value) set the mesh, e.g. "
                     "runtime.cpu_devices=8 mesh.ici.fsdp=8.")
    p.add_argument("--checkpoint", required=True,
                   help="a run directory, its checkpoints directory, one step inside it, or a convert from-hf output")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (through the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated, e.g. 1,2,3")
    src.add_argument("--prompts", metavar="FILE", help="a text file, one prompt per line, generated as one batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: prompt_ids, new_ids, text")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def _tokenizer(meta):
    import os

    from jaxtrain.errors import ConfigError
    from jaxtrain.hf import convert, generate

    path = convert.tokenizer_source(meta)
    if path == "bytes":
        return generate.ByteTokenizer()
    if path is None:
        return None  # token ids only
    if not os.path.isfile(path):
        raise ConfigError(f"this checkpoint's tokenizer {path!r} is gone; use --prompt-ids")
    return generate.HFTokenizer(path)


def run(args) -> int:
    import json
    import os
    import sys

    from jaxtrain.checkpoint import format as ckpt
    from jaxtrain.config import load_config
    from jaxtrain.errors import ConfigError
    from jaxtrain.hf import convert

    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature} must be >= 0")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p} must be in (0, 1]")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    directory, step = ckpt.resolve(args.checkpoint, "--checkpoint")
    meta = ckpt.read_meta(directory, step)
    tok = _tokenizer(meta)
    if args.prompt_ids is not None:
        try:
            prompts = [[int(t) for t in args.prompt_ids.split(",")]]
        except ValueError:
            raise ConfigError(f"--prompt-ids={args.prompt_ids!r} must be comma-separated integers, "
                              "e.g. 1,2,3") from None
    else:
        if args.prompts is not None:
            if not os.path.isfile(args.prompts):
                raise ConfigError(f"--prompts file {args.prompts!r} does not exist")
            texts = [line.rstrip("\n") for line in open(args.prompts, encoding="utf-8") if line.strip()]
            if not texts:
                raise ConfigError(f"--prompts file {args.prompts!r} holds no prompt")
        else:
            texts = [args.prompt]
        if tok is None:
            raise ConfigError(f"checkpoint {directory}/{step} has no known tokenizer; use --prompt-ids")
        prompts = [tok.encode(t) for t in texts]
    origin = convert.hf_origin(meta)
    eos = tuple(origin.get("eos_token_id") or [meta["config"].get("data", {}).get("eos_id", 0)])
    cfg = load_config(None, convert.model_overrides(meta) + list(args.overrides))

    from jaxtrain.cluster import process as runtime
    from jaxtrain.hf import generate

    runtime.quiet_logs()
    runtime.configure(cfg)
    model, layout = convert.load_model(cfg, directory, step)
    res = generate.generate(model, layout, prompts, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_ids=eos)
    for prompt, new in zip(prompts, res.new_ids):
        text = tok.decode(new) if tok is not None else None
        if args.json:
            print(json.dumps({"prompt_ids": prompt, "new_ids": new, "text": text}), flush=True)
        else:
            print((tok.decode(prompt) + text) if tok is not None else ",".join(map(str, prompt + new)), flush=True)
            print("-" * 40)

    def rate(k, s):
        return f"{k / s:,.1f} tokens/s" if s > 0 else "n/a"

    print(f"prefill {res.prefill_tokens} tokens in {res.prefill_seconds * 1e3:.1f} ms "
          f"({rate(res.prefill_tokens, res.prefill_seconds)}); decode {res.decode_tokens} tokens in "
          f"{res.decode_seconds * 1e3:.1f} ms ({rate(res.decode_tokens, res.decode_seconds)}); "
          f"compile {res.compile_seconds:.2f} s", file=sys.stderr if args.json else sys.stdout)
    return 0
