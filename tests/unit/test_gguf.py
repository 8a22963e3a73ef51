"""GGUF files loaded by ``load_model("x.gguf")`` on the host backend, written here with the ``gguf`` package's
``GGUFWriter``.

A tiny random Llama (and Qwen2: q/k/v biases, no row reordering) whose tensors are stored in every GGML type read
here: Q8_0, Q4_0, Q4_1 (quantized by ``gguf.quants.quantize`` from the transformers weights, q and k rows put in
llama.cpp's order by this test's own permutation), Q4_K and Q6_K (``gguf`` cannot quantize these: random valid
blocks), F16, BF16 and F32. Reference values: ``gguf.quants.dequantize`` of the stored bytes, rows put back in
order. The loaded model's weights must be those values rounded to bf16, bit for bit; its greedy tokens and logits
those of transformers on the same weights (the oracle of ``test_oracle.py``), resident and streamed; the
conversion report names every type with its error. A byte-level BPE tokenizer and a chat template stored in the
metadata come back equal to the originals.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import check_against_reference
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.unit

G = 64 << 10
NEW = 16
PROMPT = [1, 5, 9, 33, 7, 2]
MC = 64
COMMON = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2}
# GGML type per tensor (per layer for blk.N): every type in some linear weight, q and k in several
TYPES = {"token_embd": T.Q6_K, "output": T.Q8_0,
         0: {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.F16, "attn_output": T.BF16, "ffn_gate": T.Q4_K,
             "ffn_up": T.Q6_K, "ffn_down": T.Q8_0},
         1: {"attn_q": T.Q4_K, "attn_k": T.BF16, "attn_v": T.Q6_K, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
             "ffn_up": T.F16, "ffn_down": T.Q4_K}}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order of q / k rows: per head, rows i and half + i become rows 2i and 2i + 1."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def hf_order(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """Valid Q4_K / Q6_K bytes [n, row bytes]: random codes and scales, fp16 super-block scales sized so the values
    are about as large as the model's weights."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    half = lambda v: np.full(len(b), v, np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == T.Q4_K:                       # d * sc * q - dmin * m: sc, m, q up to 63, 63, 15
        b[:, 0:2], b[:, 2:4] = half(0.02 / 63 / 7.5 * 2), half(0.02 / 63)
    else:                                     # Q6_K: d * sc * (q - 32), int8 scales
        b[:, 192:208] = rng.integers(-40, 40, (len(b), 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = half(0.02 / 40 / 16)
    return b.reshape(n, -1)


def store(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(bytes as written, the values they hold) for ``w`` [N, K] in ``qtype``."""
    if qtype == T.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    data = random_blocks(qtype, *w.shape, rng) if qtype in (T.Q4_K, T.Q6_K) else gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def write_gguf(arch: str, path, seed: int = 0, tokenizer=None):
    """A GGUF file of a tiny random ``arch`` model; returns (transformers fp32 model on the stored values rounded
    to bf16, {hf name: stored values fp32})."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**COMMON, tie_word_embeddings=False)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    c = COMMON
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c["head_dim"])
    if tokenizer is not None:
        tokenizer(w)
    stored = {}

    def put(gname: str, hname: str, qtype, heads=None):
        v = sd[hname]
        if heads and arch == "llama":
            v = llama_cpp_order(v, heads)
        data, vals = store(v, qtype, rng)
        w.add_tensor(gname, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        stored[hname] = hf_order(vals, heads) if heads and arch == "llama" else vals

    put("token_embd.weight", "model.embed_tokens.weight", TYPES["token_embd"])
    put("output.weight", "lm_head.weight", TYPES["output"])
    put("output_norm.weight", "model.norm.weight", T.F32)
    heads = {"attn_q": c["num_attention_heads"], "attn_k": c["num_key_value_heads"]}
    for i in range(c["num_hidden_layers"]):
        for g, qtype in list(TYPES[i].items()) + [("attn_norm", T.F32), ("ffn_norm", T.F32)]:
            put(f"blk.{i}.{g}.weight", f"model.layers.{i}.{HF[g]}.weight", qtype, heads.get(g))
        if arch == "qwen2":
            for g in ("attn_q", "attn_k", "attn_v"):
                sd[f"model.layers.{i}.{HF[g]}.bias"] = rng.normal(0, 0.1, sd[f"model.layers.{i}.{HF[g]}.bias"].shape)
                put(f"blk.{i}.{g}.bias", f"model.layers.{i}.{HF[g]}.bias", T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():          # transformers computes with what the device holds: the stored values in bf16
        model.load_state_dict({k: torch.from_numpy(bf16_to_f32(f32_to_bf16(v))).reshape(sd[k].shape)
                               for k, v in stored.items()}, strict=False)
    return model, stored


@pytest.fixture(scope="module", params=[("llama", 1), ("qwen2", 2)], ids=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    arch, seed = request.param            # seeds whose greedy margins are well above rounding
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    model, stored = write_gguf(arch, path, seed)
    ids, logits = list(PROMPT), []
    with torch.no_grad():
        for _ in range(NEW):
            lg = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            logits.append(lg)
            ids.append(int(lg.argmax()))
    return arch, path, stored, ids[len(PROMPT):], np.stack(logits)


def _load(path, budget, quantize=None):
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)
    return mem, vmmstream.load_model(path, memory=mem, max_context=MC, quantize=quantize)


@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_gguf_tensors_are_their_stored_values_in_bf16_and_run_as_transformers(tiny, where):
    arch, path, stored, hf_tokens, hf_logits = tiny
    from vmmstream.model import open_checkpoint
    ck = open_checkpoint(path)
    assert ck.format == "gguf" and ck.config.architecture == ("LlamaForCausalLM" if arch == "llama"
                                                              else "Qwen2ForCausalLM")
    budget = 1 << 30
    if where == "streamed":
        mem, m = _load(path, budget)
        budget = m.plan.floor + m.plan.weight_bytes // 2
        m.close()
        mem.close()
        mem.driver.close()
    mem, m = _load(path, budget)
    try:
        assert m.plan.strategy == where
        if where == "resident":
            for name, t in m.weights.tensors.items():
                got = m.weights.embedding_table if name == "model.embed_tokens.weight" else t.array
                np.testing.assert_array_equal(got, f32_to_bf16(stored[name]).reshape(got.shape), err_msg=name)
        conv = m.conversion
        kinds = {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "F32"}
        if arch == "llama":        # blk.1.attn_k, rows reordered; other BF16 tensors load as stored
            kinds.add("BF16")
            assert conv["GGUF BF16"]["exact"] and conv["GGUF BF16"]["tensors"] == 1
        assert set(conv) == {f"GGUF {k}" for k in kinds}
        q = stored["model.layers.0.mlp.gate_proj.weight"]                           # the only Q4_K of layer 0
        want = np.linalg.norm(bf16_to_f32(f32_to_bf16(q)) - q) / np.linalg.norm(q)
        assert 0 < conv["GGUF Q4_K"]["worst_rel_rms_error"] < 2 ** -8
        assert conv["GGUF Q4_K"]["worst_rel_rms_error"] >= want * (1 - 1e-3)
        assert any("GGUF: " in n and "stored as bf16" in n for n in m.plan.notes)
        tokens, logits = m.generate(PROMPT, NEW, return_logits=True, eos_token_id=[])
        check_against_reference(f"gguf {arch}/{where}", tokens, logits, hf_tokens, hf_logits, 0.02)
    finally:
        m.close()
        mem.close()
        mem.driver.close()


def test_gguf_with_quantize_int4_quantizes_the_decoded_values(tiny):
    path = tiny[1]
    mem, m = _load(path, 1 << 30, quantize="int4")
    try:
        q, conv = m.quantization, m.conversion
        assert q["tensors"] == 14 and q["repacked"] == 0 and 0 < q["rel_rms_error"] < 0.15
        assert conv["GGUF Q4_K"]["stored_as"] == "int4" and conv["GGUF F32"]["stored_as"] == "bf16"
        assert conv["GGUF Q4_K"]["rel_rms_error"] > 2 ** -8               # int4 error, not bf16 rounding
        assert len(m.generate(PROMPT, 4, eos_token_id=[])) == 4
    finally:
        m.close()
        mem.close()
        mem.driver.close()


def test_gguf_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    """A byte-level BPE tokenizer (the chat fixture's) written as ``tokenizer.ggml.*``: the one read back encodes and
    decodes as the original, keeps the control tokens whole, and the chat template and end of sequence are the
    file's."""
    import json

    from chat_fixture import CHATML, CORPUS, train_tokenizer

    from vmmstream.model.companions import (
        load_tokenizer,
        read_chat_template,
        read_eos_token_ids,
        read_tokenizer_config,
    )
    tok = train_tokenizer()
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]

    def add(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_chat_template(CHATML)

    path = tmp_path / "tok.gguf"
    write_gguf("llama", path, tokenizer=add)
    got = load_tokenizer(path)
    for text in CORPUS[:6] + ["<|im_start|>user\nhi there<|im_end|>\n", "  two  spaces\n\n\ttab"]:
        want = tok.encode(text, add_special_tokens=False).ids
        assert got.encode(text, add_special_tokens=False).ids == want, text
        assert got.decode(want, skip_special_tokens=False) == tok.decode(want, skip_special_tokens=False)
    assert got.encode("<|im_end|>", add_special_tokens=False).ids == [2]
    assert read_chat_template(path) == CHATML and read_eos_token_ids(path, 256) == (2,)
    assert read_tokenizer_config(path)["eos_token"] == "<|im_end|>"
    mem, m = _load(path, 1 << 30)
    try:
        text = m.render_chat([{"role": "user", "content": "hello"}])
        assert text.startswith("<|endoftext|><|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert m.eos_token_ids == (2,)
    finally:
        m.close()
        mem.close()
        mem.driver.close()


def test_gguf_architectures_and_features_not_read_are_refused_by_name(tmp_path):
    from vmmstream.model import UnsupportedModelError, open_checkpoint
    w = gguf.GGUFWriter(str(tmp_path / "phi2.gguf"), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'phi2' is not supported"):
        open_checkpoint(tmp_path / "phi2.gguf")


def test_a_gguf_type_the_reader_cannot_decode_is_refused_at_open(tmp_path):
    """Q8_1 (an intermediate type llama.cpp never stores) is a known GGML type the gguf package cannot decode:
    refused when the file is opened, before anything is allocated."""
    from vmmstream.model import CheckpointError, open_checkpoint
    path = tmp_path / "q8_1.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 32),
                   (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):
        add(v)
    per, size = gguf.GGML_QUANT_SIZES[T.Q8_1]
    w.add_tensor("token_embd.weight", np.zeros((16, 32 // per * size), np.uint8), raw_dtype=T.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="Q8_1, which the gguf package cannot decode"):
        open_checkpoint(path, validate=False)


@pytest.mark.parametrize("bad,match", [({"merges": ["a b", "nospace"]}, "merge 'nospace'"),
                                       ({"bos": 1.5}, "bos_token_id is 1.5")])
def test_malformed_tokenizer_metadata_is_a_checkpoint_error(tmp_path, bad, match):
    from vmmstream.model import CheckpointError
    from vmmstream.model.companions import load_tokenizer

    def add(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "ab"])
        w.add_token_types([1, 1, 1])
        w.add_token_merges(bad.get("merges", ["a b"]))
        w.add_uint32("tokenizer.ggml.bos_token_id", 0) if "bos" not in bad else \
            w.add_float32("tokenizer.ggml.bos_token_id", bad["bos"])
    path = tmp_path / "bad.gguf"
    write_gguf("llama", path, tokenizer=add)
    with pytest.raises(CheckpointError, match=match):
        load_tokenizer(path)
