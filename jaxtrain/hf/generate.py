"""KV-cached generation: prefill the prompts once, then one jitted step per token.

The model is the training model (``model.Transformer``), called with explicit positions and a KV cache: same
blocks, same parameters. Prompts of different lengths share one batch: they are right-padded, each row's next token
goes to its own position, and a query only attends to cache slots at or before its position, so the padding slots a
row has not yet overwritten are never read. The cache [layers, batch, max_len, kv_heads, head_dim] is sharded by the
same logical-axis rules as training's activations (batch over data/fsdp, kv heads over tensor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.errors import ConfigError
from jaxtrain.parallel.layout import Layout


@dataclass
class Result:
    new_ids: list[list[int]]  # per prompt, the generated ids (ending with the eos id where one was produced)
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    compile_seconds: float


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Next ids int32 [batch] from float32 logits [batch, vocab]: argmax at temperature 0, else a draw from the
    temperature-scaled distribution restricted to the smallest set of tokens whose probability reaches ``top_p``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token if the probability mass before it is below top_p (the most likely token always stays).
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _spec(names: tuple, rules) -> PartitionSpec:
    """The mesh PartitionSpec of logical axis ``names`` under ``rules``."""
    spec = nn_partitioning.logical_to_mesh_axes(names, rules)
    assert spec is not None  # rules are given, so the names always map
    return spec


def generate(model, layout: Layout, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_ids: tuple[int, ...] = ()) -> Result:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens, stopping a row at an id in
    ``eos_ids``; all rows decode together. ``model`` lives on ``layout``'s mesh (``convert.load_model``); the batch
    is padded to a multiple of its data-parallel size."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    vocab = model.cfg.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} must be >= 1")
    n = len(prompts)
    mesh, rules = layout.mesh, layout.rules
    batch = -(-n // layout.dims.data_parallel) * layout.dims.data_parallel
    longest = max(len(p) for p in prompts)
    max_len = longest + max_new_tokens
    tokens = np.zeros((batch, longest), np.int32)
    lengths = np.ones(batch, np.int32)  # padding rows: a one-token prompt, discarded
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], lengths[i] = p, len(p)

    graphdef, params = nnx.split(model)
    shapes = model.cache_shapes(batch, max_len)  # MLA's is its compressed latents (models/mla.py)
    cache_sharding = {k: NamedSharding(mesh, _spec(axes, rules)) for k, (_, axes) in shapes.items()}
    row_sharding = NamedSharding(mesh, PartitionSpec(_spec(("batch",), rules)[0]))
    tok_sharding = NamedSharding(mesh, PartitionSpec(row_sharding.spec[0], None))

    def prefill(params, tokens, lengths, key):
        m = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, cache = m(tokens, positions=positions, cache=m.init_cache(tokens.shape[0], max_len))
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return sample(last, jax.random.fold_in(key, 0), temperature, top_p), cache

    def step(params, cache, tok, pos, key, i):
        m = nnx.merge(graphdef, params)
        logits, cache = m(tok[:, None], positions=pos[:, None], cache=cache)
        return sample(logits[:, 0], jax.random.fold_in(key, i), temperature, top_p), cache

    key = jax.random.key(seed)
    t0 = time.perf_counter()
    with layout.scope():
        tokens_d = jax.device_put(tokens, tok_sharding)
        lengths_d = jax.device_put(lengths, row_sharding)
        prefill_c = jax.jit(prefill, out_shardings=(row_sharding, cache_sharding)).lower(
            params, tokens_d, lengths_d, key).compile()
        cache_abstract = {k: jax.ShapeDtypeStruct(shapes[k][0], model.embed.dtype, sharding=s)
                          for k, s in cache_sharding.items()}
        row_abstract = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=row_sharding)
        step_c = jax.jit(step, out_shardings=(row_sharding, cache_sharding), donate_argnums=1).lower(
            params, cache_abstract, row_abstract, row_abstract, key, 0).compile()
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    nxt, cache = prefill_c(params, tokens_d, lengths_d, key)
    nxt = np.asarray(nxt)
    prefill_s = time.perf_counter() - t0

    out: list[list[int]] = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    eos = set(eos_ids)
    pos = lengths.copy()
    decode_tokens = 0
    t0 = time.perf_counter()
    for i in range(max_new_tokens):
        for r in np.flatnonzero(~done):
            out[r].append(int(nxt[r]))
            done[r] = int(nxt[r]) in eos
        if done.all() or i == max_new_tokens - 1:
            break
        nxt, cache = step_c(params, cache, jax.device_put(nxt, row_sharding), jax.device_put(pos, row_sharding),
                            key, i + 1)
        nxt = np.asarray(nxt)  # the host needs the ids to stop at eos; this also times the step honestly
        decode_tokens += int((~done).sum())
        pos += 1
    decode_s = time.perf_counter() - t0
    return Result(out, int(sum(len(p) for p in prompts)), prefill_s, decode_tokens, decode_s, compile_s)


# ---------------------------------------------------------------------------------------------------------------
# Text in and out


class ByteTokenizer:
    """Byte-level text, as the embedded corpus and ``prepare`` without ``--tokenizer`` write it."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` package)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("this checkpoint's tokenizer needs the 'tokenizers' package: "
                              "pip install tokenizers") from None
        self.tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
