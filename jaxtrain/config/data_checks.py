"""The data section's rules that config validation applies (no JAX, no Grain: usable before the runtime is set)."""

from __future__ import annotations

import glob
import math
import os

from jaxtrain import rundir
from jaxtrain.errors import ConfigError


def check_data_config(cfg) -> None:
    """The data section of a Config: ranges, ``data.mixture`` (a list of {source, weight > 0}, exclusive with
    data.source) and ``data.format=chat``'s needs; ConfigError naming the first bad value."""
    d = cfg.data
    for ok, msg in ((d.seq_len >= 2, f"data.seq_len={d.seq_len} must be >= 2"),
                    (0 < d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction} must be in (0, 1)"),
                    (d.threads >= 0, f"data.threads={d.threads} must be >= 0"),
                    (d.prefetch >= 0, f"data.prefetch={d.prefetch} must be >= 0")):
        if not ok:
            raise ConfigError(msg)
    _check_mixture_and_chat(d)
    check_chat_attention(cfg)


def _check_mixture_and_chat(d) -> None:
    if not isinstance(d.mixture, list):
        raise ConfigError(f"data.mixture={d.mixture!r} must be a list of {{source: PATH, weight: W}}")
    for i, m in enumerate(d.mixture):
        if not isinstance(m, dict) or set(m) != {"source", "weight"} or not isinstance(m["source"], str):
            raise ConfigError(f"data.mixture[{i}]={m!r} must be a mapping {{source: PATH, weight: W}}")
        w = m["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"data.mixture[{i}].weight={w!r} must be a number > 0 (a source's share is its "
                              "weight over the sum of weights)")
    if d.mixture and d.source != "embedded":
        raise ConfigError(f"data.source={d.source!r} and data.mixture are both set; put that source in the mixture")
    if d.format != "chat":
        return
    if d.tokenizer is None:
        raise ConfigError("data.format=chat needs data.tokenizer (the directory of the model's tokenizer.json and "
                          "tokenizer_config.json; a convert from-hf output has both)")
    if d.mixture:
        raise ConfigError("data.mixture is for token sources; data.format=chat takes one data.source (a .jsonl, or "
                          "a glob or directory of them)")
    if d.source in ("embedded", "synthetic"):
        raise ConfigError(f"data.format=chat needs data.source to be a .jsonl of conversations, not {d.source!r}")


def check_chat_attention(cfg) -> None:
    """Packed chat examples are separate documents: an attention that takes no segment ids cannot train them."""
    if cfg.data.format == "chat" and cfg.data.pack and cfg.model.attention == "cudnn":
        raise ConfigError("model.attention=cudnn cannot keep packed chat examples apart (it takes no segment ids); "
                          "use data.pack=false, or model.attention pallas, triton or xla")


def _check_source(spec: str, name: str, chat: bool, existing_file) -> None:
    if rundir.is_remote(spec):
        if chat:
            raise ConfigError(f"{name}={spec!r}: chat data is read from local files; copy the .jsonl here first")
        rundir.check_location(spec, name)  # a prepare output directory; its index.json is read when it is loaded
        return
    if any(ch in spec for ch in "*?[") and not os.path.exists(spec):
        if not any(os.path.isfile(f) for f in glob.glob(spec)):
            raise ConfigError(f"{name}={spec!r} matches no files")
    elif os.path.isdir(spec):
        return  # what it holds is checked when it is read (its index, or its token files)
    elif chat:
        existing_file(spec, f"{name} file")
    elif spec.endswith((".bin", ".npy")):
        existing_file(spec, f"{name} file")
    elif not os.path.exists(spec):
        where = "" if os.path.isabs(spec) else f" in {os.getcwd()}"
        raise ConfigError(f"{name}={spec!r} does not exist (no file or directory of that name{where}); it takes "
                          "'embedded', 'synthetic', a .bin/.npy token file, a directory of shards or a glob")
    else:
        raise ConfigError(f"{name}={spec!r} must be 'embedded', 'synthetic' or a .bin/.npy token file (or a "
                          f"directory of shards, a glob); text, .jsonl or .parquet files become shards with "
                          f"`python -m jaxtrain prepare {spec} --out DIR`")


def check_data_paths(d, existing_file) -> None:
    """The data section's paths exist (read-only checks; ``existing_file(path, what)`` from
    jaxtrain.config.locations)."""
    if d.tokenizer is not None and not os.path.exists(d.tokenizer):
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} does not exist; give the tokenizer.json or its directory")
    for i, m in enumerate(d.mixture):
        _check_source(m["source"], f"data.mixture[{i}].source", False, existing_file)
    if d.source not in ("embedded", "synthetic"):
        _check_source(d.source, "data.source", d.format == "chat", existing_file)
