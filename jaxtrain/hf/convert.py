"""``convert from-hf`` / ``convert to-hf``, and reading jaxtrain checkpoints by path for ``generate``.

Import streams: each parameter is built with ``jax.make_array_from_callback``, every device shard reading only its
slice of each layer's tensor from the memory-mapped safetensors files, directly in the shardings of the configured
mesh, and the result is saved as an Orbax checkpoint of the same layout ``train`` writes (items ``state`` =
``{"model": ...}`` and ``meta``), so ``checkpoint.init_from`` takes it. Export restores one parameter at a time
into the mesh's shardings and gathers it one layer at a time into safetensors files of at most ``max_shard_bytes``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxtrain import rundir
from jaxtrain.checkpoint import format as ckpt
from jaxtrain.errors import ConfigError
from jaxtrain.hf import deepseek
from jaxtrain.hf import mapping as hf
from jaxtrain.hf import moe_mapping as moe_hf

# ---------------------------------------------------------------------------------------------------------------
# What a checkpoint says (the format itself, steps and meta, is checkpoint.py's)


def model_overrides(meta: dict) -> list[str]:
    """``model.*=value`` overrides that rebuild the model a checkpoint holds, with the compute dtype and attention
    left to the machine that reads it (the saved ones are what the writer's platform resolved)."""
    model = dict(meta["config"]["model"])
    model.update(dtype="auto", attention="xla")
    out = []
    for key, value in model.items():
        if isinstance(value, dict):
            out += [f"model.{key}.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            out.append(f"model.{key}={json.dumps(value)}")
    return out


def hf_origin(meta: dict, depth: int = 4) -> dict:
    """The Hugging Face facts (token ids, context length, tokenizer directory) of the model a checkpoint descends
    from: its own ``hf`` record if it was imported, else that of its ``checkpoint.init_from`` chain."""
    if "hf" in meta:
        return meta["hf"]
    init = (meta.get("config") or {}).get("checkpoint", {}).get("init_from")
    if init and depth > 0:
        try:
            return hf_origin(ckpt.read_meta(*ckpt.resolve(init)), depth - 1)
        except ConfigError:
            return {}
    return {}


def tokenizer_source(meta: dict) -> str | None:
    """How a checkpoint's text is tokenised: the path of a ``tokenizer.json``, ``"bytes"`` (byte-level: the
    embedded corpus, ``prepare`` without ``--tokenizer``), or None (unknown: synthetic data, an import without one)."""
    if "hf" in meta:  # an import: its own tokenizer files, if it came with any
        tok_dir = meta["hf"].get("tokenizer_dir")
        return os.path.join(tok_dir, "tokenizer.json") if tok_dir else None
    data = (meta.get("config") or {}).get("data", {})
    if data.get("tokenizer"):  # the model's tokenizer, named for chat data or shards (jaxtrain/data)
        tok = data["tokenizer"]
        return os.path.join(tok, "tokenizer.json") if os.path.isdir(tok) else tok
    source = data.get("source", "embedded")
    if source == "embedded":
        return "bytes"
    sidecar = os.path.join(source, "index.json") if os.path.isdir(source) else source + ".json"  # shards / one file
    if source != "synthetic" and os.path.isfile(sidecar):
        with open(sidecar) as f:
            return json.load(f).get("tokenizer", "bytes")
    return None


# ---------------------------------------------------------------------------------------------------------------
# The model on a mesh (Layout.build: the config resolved for the devices, mesh, rules, abstract parameters)


def _leaf_shapes(abstract) -> dict[tuple[str, ...], tuple[int, ...]]:
    import jax

    return {ckpt.leaf_path(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}


# ---------------------------------------------------------------------------------------------------------------
# Import


def _discard(out: str, existed: bool) -> None:
    """After a failed write: remove what was written into ``out`` (leaving it as the empty directory it was)."""
    shutil.rmtree(out, ignore_errors=True)
    if existed:
        os.makedirs(out, exist_ok=True)


def import_run_dir(out: str) -> str:
    """The run.dir an import's config.yaml names: ``<out>/run``, absolute. Unique to the import (``out`` was new or
    empty), and the same wherever ``train --config <out>/config.yaml`` is started; a relative ``runs/<name>`` would be
    the directory of any other job of that name (``runs/tiny`` is the default job's), which training would resume."""
    return os.path.join(os.path.abspath(out), "run")


def hf_import_config(src: str, out: str, overrides: list[str],
                     num_devices: Callable[[Any], int | None] | None = None):
    """(config, Hugging Face config.json, tensors) for importing ``src`` into ``out``, with every check that needs
    no device done: the directory, the architecture, the tensor names and shapes, and that ``out`` is new.
    ``num_devices``: as :func:`jaxtrain.config.load_config` takes it (the command passes train's, so that a bad
    mesh is named by the same first error as ``train`` names it)."""
    from jaxtrain.config import load_config

    hf_cfg = hf.read_hf_config(src)
    fields = moe_hf.model_fields(hf_cfg)
    # DeepSeek's reader leaves out the multi-token-prediction layers' tensors, saying so.
    tensors = deepseek.Tensors(src, hf_cfg) if deepseek.is_deepseek(hf_cfg) else hf.SafetensorsDir(src)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out!r} already exists and is not an empty directory (nothing is overwritten)")
    eos = hf_cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    base = [f"{k}={json.dumps(v)}" for k, v in fields.items()]
    if isinstance(eos, int):
        base.append(f"data.eos_id={eos}")
    base.append(f"run.dir={json.dumps(import_run_dir(out))}")
    cfg = load_config(None, base + list(overrides), num_devices=num_devices)
    return cfg, hf_cfg, tensors


def import_hf(cfg, hf_cfg: dict, tensors: hf.SafetensorsDir, src: str, out: str) -> dict:
    """Write ``out/checkpoints/0`` (Orbax: parameters in the mesh's shardings + meta), ``out/config.yaml`` and the
    tokenizer files. JAX must be configured (devices) for ``cfg`` already. Returns a summary."""
    import jax

    from jaxtrain.config import to_dict
    from jaxtrain.parallel.layout import Layout

    user_cfg = cfg  # config.yaml keeps "auto" choices for the machine that trains
    layout = Layout.build(cfg)
    cfg, abstract = layout.cfg, layout.abstract_params
    interleaved = hf_cfg.get("rope_interleave", True)
    maps = {tm.path: tm for tm in moe_hf.tensor_maps_for(cfg.model, tensors.shapes, interleaved)}
    hf.check_tensors(tensors, list(maps.values()), _leaf_shapes(abstract), cfg.model.tie_embeddings)

    def build(path, leaf):
        tm = maps[ckpt.leaf_path(path)]
        lead, inner = leaf.shape[:tm.lead], leaf.shape[tm.lead:]

        def read(index):
            # The shard's part of the stacked (layer, expert) axes, one Hugging Face tensor per key.
            ranges = [range(*hf._bounds(index[a], n)) for a, n in enumerate(lead)]
            blocks = [tensors.read(tm, tuple(key), inner, index[tm.lead:]).astype(leaf.dtype)
                      for key in itertools.product(*ranges)]
            return np.stack(blocks).reshape(*(len(r) for r in ranges), *blocks[0].shape)

        return jax.make_array_from_callback(leaf.shape, leaf.sharding, read)

    t0 = time.perf_counter()
    existed = os.path.isdir(out)  # and empty: checked before
    try:
        os.makedirs(out, exist_ok=True)
        params = jax.tree_util.tree_map_with_path(build, abstract)
        tokenizer = hf.copy_tokenizer(src, out)
        eos = hf_cfg.get("eos_token_id")
        meta = {**ckpt.describe(to_dict(cfg), layout.shape.label, layout.num_devices),
                "hf": {"source": os.path.abspath(src), "architecture": _architecture(hf_cfg),
                       "bos_token_id": hf_cfg.get("bos_token_id"),
                       "eos_token_id": eos if isinstance(eos, list) else ([eos] if eos is not None else []),
                       "max_position_embeddings": hf_cfg.get("max_position_embeddings"),
                       "output_router_logits": bool(hf_cfg.get("output_router_logits", False)),
                       "tokenizer_dir": os.path.abspath(out) if "tokenizer.json" in tokenizer else None}}
        checkpoints = os.path.abspath(rundir.path(out, rundir.CHECKPOINTS))
        ckpt.write(checkpoints, 0, {"model": params}, meta)
        yaml_cfg = to_dict(user_cfg)
        yaml_cfg["checkpoint"]["init_from"] = checkpoints
        with open(rundir.path(out, rundir.CONFIG), "w") as f:
            f.write(f"# Imported from {os.path.abspath(src)}: train with --config this_file data.source=... "
                    "(parameters from checkpoint.init_from)\n")
            import yaml

            f.write(yaml.safe_dump(yaml_cfg, sort_keys=False))
    except BaseException:
        _discard(out, existed)
        raise
    n_params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(abstract))
    return {"params": n_params, "seconds": time.perf_counter() - t0, "tokenizer": tokenizer}


def _architecture(hf_cfg: dict) -> str | None:
    """The class of an imported config.json that jaxtrain maps (the export writes it again where it can)."""
    known = hf.ARCHITECTURES + hf.MOE_ARCHITECTURES + (deepseek.ARCHITECTURE,)
    return next((a for a in hf_cfg.get("architectures") or [] if a in known), None)


# ---------------------------------------------------------------------------------------------------------------
# Export


def export_hf(cfg, directory: str, step: int, meta: dict, out: str, max_shard_bytes: int = hf.MAX_SHARD_BYTES) -> dict:
    """Write ``out/config.json``, safetensors shards (+ index when more than one) and the tokenizer files for the
    checkpoint ``directory/step`` (whose model ``cfg.model`` describes). JAX must be configured for ``cfg``."""
    import jax
    from safetensors.numpy import save_file

    from jaxtrain.parallel.layout import Layout

    layout = Layout.build(cfg)
    cfg, abstract = layout.cfg, layout.abstract_params
    shapes = _leaf_shapes(abstract)
    dtypes = {ckpt.leaf_path(p): leaf.dtype for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    maps = moe_hf.tensor_maps_for(cfg.model)  # refuses a model no class can hold
    # Parameter by parameter (all layers of q, then of k, ...): each parameter is restored from the checkpoint once.
    # The index maps names to files, so readers do not depend on the order.
    order = [(tm, key) for tm in maps for key in tm.keys(shapes[tm.path])]
    sizes = {tm.name(*key): int(np.prod(tm.hf_shape(shapes[tm.path][tm.lead:]))) * dtypes[tm.path].itemsize
             for tm, key in order}
    shards = hf.shard_plan([(tm.name(*key), sizes[tm.name(*key)]) for tm, key in order], max_shard_bytes)
    by_name = {tm.name(*key): (tm, key) for tm, key in order}

    origin = hf_origin(meta)
    eos = origin.get("eos_token_id") or [cfg.data.eos_id]
    # The class the model was imported from where it still holds the model; refused before anything is written.
    kw = dict(eos_token_id=eos[0] if len(eos) == 1 else eos, bos_token_id=origin.get("bos_token_id"),
              max_position_embeddings=origin.get("max_position_embeddings") or cfg.data.seq_len,
              output_router_logits=bool(origin.get("output_router_logits", False)))
    config = moe_hf.hf_config(cfg.model, architecture=origin.get("architecture"), **kw)
    t0 = time.perf_counter()
    existed = os.path.isdir(out)  # and empty: checked before
    try:
        os.makedirs(out, exist_ok=True)
        cache: dict = {}  # the one parameter currently restored (stacked layers), reused across its layers

        def fetch(tm, key):
            if cache.get("path") != tm.path:
                cache.clear()
                cache.update(path=tm.path, array=ckpt.restore_params(directory, step, abstract, only=tm.path))
            return tm.to_hf(np.asarray(jax.device_get(cache["array"][key])))

        files = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        weight_map = {}
        for fname, names in zip(files, shards):
            tensors = {name: fetch(*by_name[name]) for name in names}
            save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in names})
            del tensors
        cache.clear()
        if len(files) > 1:
            with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        tokenizer = tokenizer_source(meta)
        tokenizer = tokenizer if tokenizer and tokenizer != "bytes" and os.path.isfile(tokenizer) else None
        copied = hf.copy_tokenizer(os.path.dirname(tokenizer), out) if tokenizer else []
        if tokenizer and "tokenizer.json" not in copied:
            shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
            copied.append("tokenizer.json")
    except BaseException:
        _discard(out, existed)
        raise
    return {"files": files, "bytes": sum(sizes.values()), "seconds": time.perf_counter() - t0, "tokenizer": copied}


def load_model(cfg, directory: str, step: int, devices: list | None = None):
    """(model, layout): the parameters of checkpoint ``directory/step`` restored into an NNX model laid out on
    ``devices`` (all by default) as ``cfg`` says; ``layout.cfg`` is ``cfg`` resolved for their platform."""
    from flax import nnx

    from jaxtrain.parallel.layout import Layout

    layout = Layout.build(cfg, devices)
    params = ckpt.restore_params(directory, step, layout.abstract_params)
    return nnx.merge(layout.model_graphdef(), params), layout
