"""Chat data for supervised fine-tuning (``data.format=chat``).

Each line of the ``.jsonl`` source is ``{"messages": [{"role": ..., "content": ...}, ...]}``. A conversation is
rendered with the tokenizer's chat template (``chat_template`` of ``tokenizer_config.json`` next to the
``tokenizer.json`` that ``data.tokenizer`` names) in the Jinja environment Hugging Face's ``apply_chat_template``
uses (a sandbox with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, an unescaped
``tojson``, the special tokens as variables), and tokenised without adding special tokens (the template writes
them), as ``apply_chat_template(tokenize=True)`` does.

The loss mask: the text an assistant turn adds is the difference between the conversation rendered up to that turn
and rendered up to the turn before with the generation prompt; tokens starting inside it are trained (content and
the template's end-of-turn marker), every other token is not. Examples are packed whole into rows of
``seq_len + 1`` tokens (``data.pack=true``, each example a document of its own: attention never crosses examples)
or put one per row; the rest of a row is padding, never trained. Rows carry the mask and the document starts in the
high bits of each token word (:data:`jaxtrain.data.tokens.NO_LOSS`, ``DOC_START``, ``PAD``).
"""

from __future__ import annotations

import datetime
import glob
import json
import os

import numpy as np

from jaxtrain import log
from jaxtrain.config import DataConfig
from jaxtrain.data.tokens import DOC_START, NO_LOSS, PAD, Tokens, tokenizer_json
from jaxtrain.errors import ConfigError, one_line

ROLES = ("system", "user", "assistant", "tool")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken mapping with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTokenizer:
    """A tokenizer.json plus the chat template and special tokens of its tokenizer_config.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.file = tokenizer_json(path)
        try:
            self.tokenizer = Tokenizer.from_file(self.file)
        except Exception as e:  # the Rust side raises a plain Exception for any malformed file
            raise ConfigError(f"data.tokenizer {self.file!r} is not a Hugging Face tokenizer.json "
                              f"({one_line(e, 200)})") from None
        config_path = os.path.join(os.path.dirname(self.file), "tokenizer_config.json")
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"data.format=chat needs the chat template of {config_path!r} ({one_line(e, 200)})") \
                from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ConfigError(f"{config_path!r} has no chat_template; data.format=chat renders conversations with it")
        self.special = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                                       "mask_token") if (v := _token_text(config.get(k))) is not None}
        self.template = _compile(template)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64 [n], trained bool [n]) of one conversation; ValueError if the template does not render
        each assistant turn as an extension of the conversation before it."""
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ValueError("the chat template does not render the conversation turn by turn (a prefix of it "
                                 "differs from the whole), so its assistant tokens cannot be told apart")
            spans.append((len(before), len(upto)))
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            trained |= (starts >= lo) & (starts < hi)
        return ids, trained


def _compile(template: str):
    """The template in the environment of transformers' ``_cached_compile_jinja_template`` (5.24): the sandbox, its
    options and extensions, ``tojson``, ``raise_exception`` and ``strftime_now`` (transformers also swaps in
    stricter ``dict``/``namespace`` objects; Jinja's own behave the same for templates that render)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3.x templates call it
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template does not compile ({one_line(e, 200)})") from None


def _files(spec: str) -> list[str]:
    if any(ch in spec for ch in "*?["):
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    elif os.path.isdir(spec):
        files = sorted(glob.glob(os.path.join(spec, "*.jsonl")))
    else:
        files = [spec] if os.path.isfile(spec) else []
    if not files:
        raise ConfigError(f"data.source {spec!r} names no .jsonl file of chat examples (data.format=chat)")
    return files


def _problem(messages) -> str | None:
    """Why an example cannot be trained on, or None."""
    if not isinstance(messages, list) or not messages:
        return "no messages"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return "a message without string content"
        if m.get("role") not in ROLES:
            return f"unknown role {m.get('role')!r}"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


def read_examples(spec: str, chat: ChatTokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every usable conversation of the source, encoded; the unusable ones counted, skipped and reported in one
    warning per reason; ConfigError for a line that is not a JSON object with ``messages``, or when none is left."""
    examples: list[tuple[np.ndarray, np.ndarray]] = []
    skipped: dict[str, list[str]] = {}
    for path in _files(spec):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{path}:{n} is not JSON ({one_line(e, 120)})") from None
                if not isinstance(record, dict) or "messages" not in record:
                    raise ConfigError(f"{path}:{n} has no 'messages' (a chat example is "
                                      '{"messages": [{"role": ..., "content": ...}, ...]})')
                why = _problem(record["messages"])
                if why is None:
                    try:
                        examples.append(chat.encode(record["messages"]))
                        continue
                    except Exception as e:  # the template's raise_exception, or a template that is not turn-wise
                        why = f"the template refused it: {one_line(e, 100)}"
                skipped.setdefault(why, []).append(f"{os.path.basename(path)}:{n}")
    for why, where in skipped.items():
        log.info(f"warning: skipped {len(where)} chat example(s) with {why} (first: {where[0]})")
    if not examples:
        raise ConfigError(f"data.source {spec!r} has no usable chat example ({sum(len(w) for w in skipped.values())} "
                          "skipped: each needs messages with roles in " + "/".join(ROLES) + " and an assistant turn)")
    return examples


def pack(examples: list[tuple[np.ndarray, np.ndarray]], row_len: int, packed: bool) -> tuple[np.ndarray, int]:
    """(rows int32 [n, row_len] of flagged token words, examples truncated). Examples go whole into rows in order
    (a new row when the next does not fit; one per row unless ``packed``), longer ones cut to ``row_len``; the
    rest of a row is padding: token 0, flagged PAD, not trained, a document of its own."""
    rows: list[np.ndarray] = []
    row: list[np.ndarray] = []
    truncated = 0
    pad = np.full(row_len, NO_LOSS | PAD, dtype=np.int64)
    pad[0] |= DOC_START

    def close():
        words = np.concatenate(row) if row else np.zeros(0, np.int64)
        rows.append(np.concatenate([words, pad[: row_len - len(words)]]))

    for ids, trained in examples:
        if len(ids) > row_len:
            ids, trained, truncated = ids[:row_len], trained[:row_len], truncated + 1
        words = ids | np.where(trained, 0, NO_LOSS)
        words[0] |= DOC_START
        if row and (not packed or sum(len(w) for w in row) + len(words) > row_len):
            close()
            row = []
        row.append(words)
    close()
    return np.stack(rows).astype(np.int32), truncated


def load_chat(cfg: DataConfig, vocab_size: int) -> Tokens:
    """The chat source as train and eval rows [n, seq_len + 1]; the last ``data.eval_fraction`` of the examples
    (at least one) are held out."""
    if cfg.tokenizer is None:
        raise ConfigError("data.format=chat needs data.tokenizer: the directory of the model's tokenizer.json and "
                          "tokenizer_config.json (a convert from-hf output has them)")
    chat = ChatTokenizer(cfg.tokenizer)
    examples = read_examples(cfg.source, chat)
    hi = max(int(ids.max()) for ids, _ in examples)
    if hi >= vocab_size:
        raise ConfigError(f"the chat data's token id {hi} does not fit model.vocab_size={vocab_size}; "
                          "data.tokenizer must be the model's own tokenizer")
    n_eval = max(1, int(len(examples) * cfg.eval_fraction))
    if len(examples) - n_eval < 1:
        raise ConfigError(f"data.source {cfg.source!r} has {len(examples)} usable chat example(s): too few to hold "
                          f"out data.eval_fraction={cfg.eval_fraction} for evaluation and train on the rest")
    train, cut = pack(examples[:-n_eval], cfg.seq_len + 1, cfg.pack)
    evals, cut_eval = pack(examples[-n_eval:], cfg.seq_len + 1, cfg.pack)
    if cut + cut_eval:
        log.info(f"warning: {cut + cut_eval} chat example(s) longer than data.seq_len + 1 = {cfg.seq_len + 1} "
                 "tokens were cut to fit")
    trained = int(((train[:, 1:] & NO_LOSS) == 0).sum())
    log.info(f"chat data: {len(examples)} examples in {len(train)} + {len(evals)} rows of {cfg.seq_len + 1} tokens "
             f"({'packed' if cfg.pack else 'one per row'}), {trained:,} trained tokens")
    return Tokens(train=train, eval=evals, vocab_size=hi + 1)
