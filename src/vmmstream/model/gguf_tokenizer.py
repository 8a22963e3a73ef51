"""The tokenizer, special tokens and chat template a GGUF file describes in its ``tokenizer.*`` metadata.

``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE: SmolLM2, Llama 3, Qwen2) becomes a ``tokenizers.Tokenizer``:
the vocabulary ``tokenizer.ggml.tokens`` (ids in order) and ``tokenizer.ggml.merges``, the byte-level
pre-tokenizer (with the split pattern of the ``tokenizer.ggml.pre`` families that have their own; the GPT-2
pattern otherwise) and decoder; tokens typed control (3) are special tokens, user-defined (4) added tokens,
both matched whole. Other tokenizer models (sentencepiece ``llama``, ...) give no tokenizer, with a warning:
the model still runs on token ids.

End of sequence: ``tokenizer.ggml.eos_token_id`` and, where the file has one, ``eot_token_id`` (llama.cpp
stops at either). The chat template is ``tokenizer.chat_template`` (named ones ``tokenizer.chat_template.NAME``).
"""

from __future__ import annotations

import warnings

from .checkpoint import CheckpointError

# split patterns of the byte-level families whose pre-tokenizer is not GPT-2's (by ``tokenizer.ggml.pre``)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "qwen2": _QWEN2,
          "deepseek-r1-qwen": _QWEN2}
CONTROL, USER_DEFINED = 3, 4


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 on, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_tokenizer(g):
    """A ``tokenizers.Tokenizer`` for the file, or None (with a warning) for a tokenizer model not read here."""
    kind = g.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        warnings.warn(f"{g.path}: tokenizer model {kind!r} is not read from GGUF files yet (byte-level BPE 'gpt2' "
                      "is); the model runs on token ids", RuntimeWarning, stacklevel=3)
        return None
    try:
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            pre_tokenizers,
            processors,
        )
    except ImportError:
        return None
    tokens = list(g.get("tokenizer.ggml.tokens") or [])
    types = list(g.get("tokenizer.ggml.token_type") or [])
    alphabet = byte_alphabet()
    chars = set(alphabet.values())

    def spelled(t: str) -> str:        # a token outside the byte alphabet (a control token with a space, say)
        return t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    raw = list(g.get("tokenizer.ggml.merges") or [])
    bad = next((m for m in raw if not isinstance(m, str) or m.count(" ") != 1), None)
    if bad is not None:
        raise CheckpointError(f"{g.path}: tokenizer merge {bad!r:.60} is not two tokens joined by one space")
    merges = [tuple(m.split(" ", 1)) for m in raw]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False))
    split = SPLITS.get(g.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == CONTROL and set(t) <= chars]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
            if k == USER_DEFINED and spelled(t) in vocab]
    if user:
        tok.add_tokens(user)
    bos = g.get("tokenizer.ggml.bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise CheckpointError(f"{g.path}: tokenizer.ggml.bos_token_id is {bos!r:.40}, not a token id")
    if g.get("tokenizer.ggml.add_bos_token") and bos is not None and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                           pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok


def eos_ids(g, vocab_size=None) -> tuple[int, ...]:
    ids = [g.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    ids = [int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    if vocab_size is not None:
        ids = [i for i in ids if i < vocab_size]
    return tuple(dict.fromkeys(ids))


def tokenizer_config(g) -> dict:
    """What ``tokenizer_config.json`` would say: the special tokens' strings, add_bos_token, the chat template."""
    tokens = g.get("tokenizer.ggml.tokens") or []
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        i = g.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokens):
            out[name] = tokens[i]
    if g.get("tokenizer.ggml.add_bos_token") is not None:
        out["add_bos_token"] = bool(g.get("tokenizer.ggml.add_bos_token"))
    template = chat_template(g)
    if template is not None:
        out["chat_template"] = template
    return out


def chat_template(g):
    """``tokenizer.chat_template``, or a dict name -> template when the file has named ones too."""
    default = g.get("tokenizer.chat_template")
    named = {k.removeprefix("tokenizer.chat_template."): v for k, v in g.meta.items()
             if k.startswith("tokenizer.chat_template.") and isinstance(v, str)}
    if not named:
        return default
    if default is not None:
        named["default"] = default
    return named
