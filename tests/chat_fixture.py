"""A chat checkpoint for the host tests, made offline: the ``tiny`` preset's random weights, a real byte-level
BPE tokenizer trained here on a small corpus (256 ids, the preset's vocabulary, so every id the model draws is
a token), and a ChatML chat template in ``tokenizer_config.json``.

Ids 0, 1, 2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``: the preset's ``config.json`` says
``eos_token_id`` 2, which is the template's end of turn, as in SmolLM2 / Qwen2 checkpoints. The corpus has
accented letters, CJK and emoji that appear too rarely to be merged, so their UTF-8 bytes stay split across
tokens (``"naïve"`` is ``"naÃ"`` + ``"¯ve"``).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "Hello there! How are you today? I am fine, thank you.",
          "User: what is the weather like?\nAssistant: It is sunny and warm.\n\n",
          "Numbers 0123456789 and symbols ()[]{}<>+-*/=_,.;:!?'\"@#$%^&|~`\\",
          "naïve café résumé über — “quotes” ‘single’",
          "日本語のテキスト 世界 你好 😀 🚀 👍🏽 ✨"] * 20

# ChatML as SmolLM2 / Qwen2 write it: whitespace control with '-' in most tags, plain block tags on their own
# lines (trim_blocks / lstrip_blocks decide what they leave), a tools branch, namespace, loop controls, tojson
# on non-ASCII and HTML characters, raise_exception, bos_token / eos_token from tokenizer_config.json.
CHATML = """{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {%- for tool in tools %}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a small test model.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message.role == 'system' and loop.first %}
        {% continue %}
    {% endif %}
    {% if message.role not in ['user', 'assistant'] %}
        {{ raise_exception('Only user and assistant roles follow the system message, not ' + message.role) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{{ message.content }}{% if message.meta is defined %} {{ message.meta | tojson }}{% endif %}
<|im_end|>
    {% if message.role == 'assistant' %}{{ eos_token }}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# a second, simpler template for the list-of-named-templates form
PLAIN = ("{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == 256 and [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    return tok


def make_chat_checkpoint(path, *, template=CHATML, tokenizer_config=None) -> Path:
    """``make_checkpoint("tiny", path)`` plus ``tokenizer.json`` and ``tokenizer_config.json`` (``template``:
    a string, a list of ``{name, template}``, or None for no chat template)."""
    from vmmstream.model import make_checkpoint
    path = Path(path)
    make_checkpoint("tiny", path, seed=0)
    train_tokenizer().save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
           "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
           "pad_token": "<|endoftext|>", "model_max_length": 256}
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(tokenizer_config or {})
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return path


def set_eos(path, eos) -> None:
    """Write ``generation_config.json`` with ``eos_token_id`` = ``eos`` (None: remove the file)."""
    f = Path(path) / "generation_config.json"
    if eos is None:
        f.unlink(missing_ok=True)
    else:
        f.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
