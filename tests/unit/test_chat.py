"""Chat: the checkpoint's chat template rendered exactly as transformers' ``apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)`` renders it (one template string, a list of named templates, a
``chat_template.jinja`` file), a clear error for a template that needs what is not given, ``Model.chat`` and
the ``vmmstream chat`` terminal loop, on the host backend with the checkpoint of ``tests/chat_fixture.py``."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest

from chat_fixture import CHATML, PLAIN, make_chat_checkpoint

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory

pytestmark = pytest.mark.unit

G = 64 << 10
MC = 256

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "You are terse. Answer in one line."},
     {"role": "user", "content": "What is the weather like?"}],
    [{"role": "system", "content": "Sé breve — 世界 😀"},
     {"role": "user", "content": "Hi", "meta": {"note": "<b>&\"é\"</b>", "n": [1, 2.5, True, None]}},
     {"role": "assistant", "content": "Hello! How are you?", "tool_calls": None},
     {"role": "user", "content": "  fine, thanks \n"}],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"))


def load(path):
    return vmmstream.load_model(path, memory=DeviceMemory(HostDriver(total_bytes=1 << 30, granularity=G), 64 << 20),
                                max_context=MC)


def transformers_render(path, messages):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(path))
    return t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------- rendering

@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_chat_template_renders_as_transformers(ckpt, k):
    messages = CONVERSATIONS[k]
    with load(ckpt) as m:
        ours = m.render_chat(messages)
    assert ours == transformers_render(ckpt, messages)
    assert ours.endswith("<|im_start|>assistant\n") and messages[-1]["content"] in ours


def test_named_templates_and_the_jinja_file(ckpt, tmp_path):
    messages = CONVERSATIONS[1]
    listed = make_chat_checkpoint(tmp_path / "listed", template=[{"name": "tool_use", "template": CHATML},
                                                                 {"name": "default", "template": PLAIN}])
    with load(listed) as m:
        ours = m.render_chat(messages)
    assert ours == transformers_render(listed, messages) and ours.startswith("SYSTEM: You are terse")
    # chat_template.jinja next to tokenizer_config.json takes precedence over its chat_template
    filed = shutil.copytree(ckpt, tmp_path / "filed")
    (filed / "chat_template.jinja").write_text(PLAIN)
    with load(filed) as m:
        ours = m.render_chat(messages)
    assert ours == transformers_render(filed, messages) and ours.endswith("ASSISTANT:")


@pytest.mark.parametrize("template, names", [
    ("{{ render_tools(tools) }}{% for m in messages %}{{ m.content }}{% endfor %}", "render_tools"),
    ("{% for m in messages %}{{ m.content | from_json }}{% endfor %}", "from_json"),
    ("{% for m in messages %}{% tool_block %}{{ m.content }}{% endtool_block %}{% endfor %}", "tool_block"),
    ("{% for m in messages %}{{ m.tool_calls[0].function.name }}{% endfor %}", "tool_calls"),
    ("{{ raise_exception('this template needs tools') }}", "needs tools"),
    ("{% set ns = namespace(_secret=1) %}{{ ns }}", "_secret"),
])
def test_a_template_that_needs_what_is_not_given_is_a_clear_error(tmp_path, template, names):
    from vmmstream.chat import ChatTemplateError
    path = make_chat_checkpoint(tmp_path / "bad", template=template)
    with load(path) as m:
        with pytest.raises(ChatTemplateError, match=names) as e:
            m.chat(CONVERSATIONS[0], 4)
        assert "chat template" in str(e.value)
        assert m.engine.counters["generate_calls"] == 0          # refused before any work


def test_no_template_and_bad_messages(tmp_path, ckpt):
    from vmmstream.chat import ChatTemplateError
    path = make_chat_checkpoint(tmp_path / "none", template=None)
    with load(path) as m:
        with pytest.raises(ChatTemplateError, match="no chat template"):
            m.chat(CONVERSATIONS[0], 4)
    with load(ckpt) as m:
        with pytest.raises(TypeError, match="messages"):
            m.chat("Hello", 4)
        with pytest.raises(ValueError, match="empty"):
            m.chat([], 4)
        with pytest.raises(ValueError, match="role"):
            m.chat([{"content": "Hi"}], 4)
        with pytest.raises(TypeError, match="messages\\[0\\]"):
            m.chat([{"role": "user", "content": object()}], 4)
        with pytest.raises(TypeError, match="unexpected keyword"):
            m.chat(CONVERSATIONS[0], 4, temprature=0.5)


# ------------------------------------------------------------------------------------------ Model.chat

def test_chat_answers_with_the_template_and_stops_at_the_end_of_turn(ckpt, tmp_path):
    messages = CONVERSATIONS[1]
    with load(ckpt) as m:
        tok = m.tokenizer
        ids = tok.encode(m.render_chat(messages), add_special_tokens=False).ids
        assert tok.encode(m.render_chat(messages)).ids == ids      # the template holds the special tokens
        full = m.generate(ids, 24, eos_token_id=[])
        assert m.chat(messages, 24, eos_token_id=[]) == tok.decode(full)
        s = m.chat(messages, 24, stream=True, eos_token_id=[])
        pieces = [t.text for t in s]
        assert "".join(pieces) == s.text == tok.decode(full) and s.tokens == full
    # by default an answer ends at the checkpoint's end-of-sequence ids and at tokenizer_config.json's eos_token
    # (the template's end of turn): make a token the model produces each of them
    absent = next(t for t in range(3, 256) if t not in full)
    for eos, end_of_turn in ((full[6], absent), (absent, full[4])):
        path = make_chat_checkpoint(tmp_path / f"eos{eos}", tokenizer_config={
            "eos_token": tok.id_to_token(end_of_turn)})
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        with load(path) as m:
            assert m.eos_token_ids == (eos,)
            first = min(full.index(t) for t in (eos, end_of_turn) if t in full)
            assert m.chat(messages, 24) == tok.decode(full[:first + 1])
            assert m.generate(ids, 24) == (full[:full.index(eos) + 1] if eos in full else full)


# ------------------------------------------------------------------------------------------ the CLI chat

def _answers(ckpt, turns, max_new=8):
    """What the CLI should print: each answer of the conversation, in turn."""
    out, messages = [], []
    with load(ckpt) as m:
        for line in turns:
            messages.append({"role": "user", "content": line})
            a = m.chat(messages, max_new)
            messages.append({"role": "assistant", "content": a})
            out.append(a)
    return out


CHAT = ["--budget", "64MiB", "--backend", "host", "--max-context", str(MC), "--max-new-tokens", "8"]


@pytest.mark.parametrize("ending", ["eof", "/exit"])
def test_cli_chat_streams_answers_and_keeps_the_conversation(ckpt, monkeypatch, capsys, ending):
    from vmmstream.cli import main
    turns = ["Hello there!", "How are you today?"]
    want = _answers(ckpt, turns)
    stdin = "\n".join(turns) + "\n" + ("" if ending == "eof" else "/exit\nnot read\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(["chat", str(ckpt), *CHAT]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(a + "\n" for a in want)
    assert err.count("tokens/s") == 2 and "Traceback" not in err


def test_cli_chat_with_a_system_message_and_reset(ckpt, monkeypatch, capsys):
    from vmmstream.cli import main
    with load(ckpt) as m:
        sys_msg = {"role": "system", "content": "You are terse."}
        first = m.chat([sys_msg, {"role": "user", "content": "Hi"}], 8)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\n/reset\nHi\n"))
    assert main(["chat", str(ckpt), *CHAT, "--system", "You are terse."]) == 0
    out, err = capsys.readouterr()
    assert out == first + "\n" + first + "\n"          # the blank line is skipped; /reset forgets the first turn


def test_cli_chat_without_a_template_is_one_error_line(tmp_path, monkeypatch, capsys):
    from vmmstream.cli import main
    path = make_chat_checkpoint(tmp_path / "none", template=None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", str(path), *CHAT]) == 2
    err = capsys.readouterr().err
    assert "vmmstream: error:" in err and "chat template" in err and "Traceback" not in err


def test_tokenizer_config_special_tokens(ckpt):
    from vmmstream.chat import special_tokens
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert special_tokens(cfg) == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                   "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize("source,variables", [
    ("{{ 1 // 0 }}", {}),                                  # the template's own arithmetic fails
    ("{{ messages[5]['content'] }}", {}),                  # an index past the conversation
    ("{% for m in messages %}{{ m }}{% endfor %}", {"tools": "[]"}),   # a variable the renderer gives itself
])
def test_a_template_that_fails_on_the_messages_is_a_chat_template_error(source, variables):
    from vmmstream.chat import ChatTemplate, ChatTemplateError
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], **variables)
