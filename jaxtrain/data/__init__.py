"""Training data: token sources, shards and mixtures (:mod:`.tokens`), ``prepare`` (:mod:`.corpus`) and chat
data for supervised fine-tuning (:mod:`.chat`). ``from jaxtrain import data`` then ``data.train_batches`` etc.:
the names are loaded on first use, so that importing the package loads neither Grain nor NumPy (the data section's
checks live with the config: ``jaxtrain.config.data_checks``).

May import: errors, log and config; nothing that needs devices or a model.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "tokens": ("EOS", "DOC_START", "NO_LOSS", "PAD", "TOKEN_BITS", "INDEX", "Tokens", "Mixture", "Stream", "Windows",
               "Rows", "embedded_corpus", "synthetic_tokens", "check_token_ids", "load_source", "read_index",
               "tokenizer_json", "file_sha256", "train_batches", "eval_batches"),
    "corpus": ("prepare",),
    "chat": ("ChatTokenizer", "load_chat", "pack", "read_examples"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted([*_HOME, "load_tokens"])


def load_tokens(cfg, vocab_size: int):
    """The data of ``cfg`` (a DataConfig): one source (:class:`Tokens`), a :class:`Mixture` (``data.mixture``), or
    chat rows (``data.format=chat``, :func:`jaxtrain.data.chat.load_chat`); ConfigError if the model's vocabulary
    (``vocab_size``) cannot represent it, or for bad data."""
    from jaxtrain.data import tokens

    if cfg.format == "chat":
        from jaxtrain.data.chat import load_chat

        return load_chat(cfg, vocab_size)
    if cfg.mixture:
        parts = [tokens.load_source(m["source"], cfg, vocab_size, f"data.mixture[{i}].source")
                 for i, m in enumerate(cfg.mixture)]
        return tokens.Mixture(parts, [float(m["weight"]) for m in cfg.mixture], [m["source"] for m in cfg.mixture])
    return tokens.load_source(cfg.source, cfg, vocab_size)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'jaxtrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jaxtrain.data.{_HOME[name]}"), name)
    globals()[name] = value  # later reads (and a test's monkeypatch) see the module attribute
    return value
