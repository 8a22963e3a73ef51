"""What a checkpoint has beside its weights: the tokenizer, the end-of-sequence ids, the tokenizer config (special
tokens) and the chat template. A Hugging Face directory keeps them in files of their own (``tokenizer.json``,
``generation_config.json``, ``tokenizer_config.json``, ``chat_template.jinja``); a GGUF file in its metadata
(``vmmstream.model.gguf``), which each reader here turns to when ``path`` is a ``.gguf`` file.
"""

from __future__ import annotations

import os
import reprlib
from pathlib import Path

from .checkpoint import (
    CONFIG,
    MAX_JSON,
    CheckpointError,
    _is_count,
    _open_regular,
    _read_json,
)


def _gguf(path):
    """The GGUF module when ``path`` is a GGUF file, else None."""
    from . import gguf
    return gguf if gguf.is_gguf(path) else None


def load_tokenizer(path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` if both exist, else None (tokenizers is optional); for a
    GGUF file, the one its metadata describes."""
    if (g := _gguf(path)) is not None:
        return g.tokenizer(path)
    p = Path(path) / "tokenizer.json"
    if not p.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(p))


GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"


def read_eos_token_ids(path, vocab_size: int | None = None) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: ``eos_token_id`` of ``generation_config.json`` where that file has
    it (not null), else of ``config.json``; one id or a list of them; () when neither says. A value that is not
    an id or a list of ids is a ``CheckpointError``; ids outside ``[0, vocab_size)`` are dropped with a warning
    (they could never be produced)."""
    if (g := _gguf(path)) is not None:
        return g.eos_token_ids(path, vocab_size)
    root = Path(path)
    for name in (GENERATION_CONFIG, CONFIG):
        f = root / name
        if not os.path.lexists(f):
            continue
        doc = _read_json(f, name.removesuffix(".json").replace("_", " "))
        value = doc.get("eos_token_id") if isinstance(doc, dict) else None
        if value is None:
            continue
        ids = [value] if not isinstance(value, list) else value
        if not all(_is_count(i) for i in ids):
            raise CheckpointError(f"{f}: eos_token_id is {reprlib.repr(value)}; it must be a token id or a list "
                                  "of token ids (non-negative integers)")
        if vocab_size is not None and any(i >= vocab_size for i in ids):
            import warnings
            warnings.warn(f"{f}: eos_token_id {[i for i in ids if i >= vocab_size]} outside the vocabulary of "
                          f"{vocab_size} ignored", RuntimeWarning, stacklevel=2)
            ids = [i for i in ids if i < vocab_size]
        return tuple(dict.fromkeys(ids))
    return ()


def read_tokenizer_config(path) -> dict:
    """``tokenizer_config.json`` of the checkpoint (special tokens, chat template), or {} when there is none."""
    if (g := _gguf(path)) is not None:
        return g.tokenizer_config(path)
    f = Path(path) / TOKENIZER_CONFIG
    if not os.path.lexists(f):
        return {}
    doc = _read_json(f, "tokenizer config")
    if not isinstance(doc, dict):
        raise CheckpointError(f"{f} is not a JSON object")
    return doc


def read_chat_template(path):
    """The checkpoint's chat template source as transformers finds it: ``chat_template.jinja`` when that file
    exists, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}``
    returned as a dict name -> template); None when there is none."""
    if (g := _gguf(path)) is not None:
        return g.chat_template(path)
    root = Path(path)
    f = root / CHAT_TEMPLATE
    if os.path.lexists(f):
        with _open_regular(f, MAX_JSON, "chat template") as fh:
            raw = fh.read(MAX_JSON + 1)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{f} is not UTF-8 text ({exc})") from None
    value = read_tokenizer_config(root).get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{root / TOKENIZER_CONFIG}: chat_template is {reprlib.repr(value)}; it must be a string "
                          "or a list of {\"name\": ..., \"template\": ...} objects")
