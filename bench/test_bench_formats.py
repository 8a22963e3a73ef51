"""GGUF files on the device: decode tokens/s and the streaming bound, resident and under a budget that streams,
beside the same file quantized to int4 at load (``quantize="int4"``).

Files are written here with the ``gguf`` writer from random valid blocks (the GPU machine has no network, so the
real SmolLM2 file cannot reach it): a Llama-3B-shaped model as llama.cpp's Q4_K_M mixes it (Q4_K layers, Q6_K
output and embedding) and a SmolLM2-135M-shaped one as its Q4_1 release (Q4_1 layers, Q8_0 tied embedding).
Every GGML block type is decoded to bf16 at load, so the streamed bytes are the bf16 ones; ``quantize="int4"``
quantizes the decoded values and streams 4-bit codes. ``test_formats_bench_smoke_on_the_host_backend`` runs the
same helpers on a tiny shape on the host backend (CI).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from test_bench_user import h2d_gbps  # noqa: F401  (the pinned host-to-device fixture, shared)

import vmmstream

GiB, MiB = 1 << 30, 1 << 20
PROMPT, NEW = 16, 64

SHAPES = {   # name: (config, layer type, output / embedding type, tied, a budget that streams)
    "llama-3b-q4km": (dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                           num_attention_heads=24, num_key_value_heads=8), "Q4_K", "Q6_K", False, 2 * GiB),
    "smollm2-135m-q4_1": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3), "Q4_1", "Q8_0", True, 160 * MiB),
}


def _blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """Valid random blocks of ``qtype`` for an [n, k] weight, values about 0.02 in size: random codes, fp16
    scales set to match."""
    import gguf
    T = gguf.GGMLQuantizationType
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)

    def half(col, v):
        b[:, col:col + 2] = np.full(len(b), v, np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == T.Q4_K:             # d * sc * q - dmin * m, sc / m / q up to 63 / 63 / 15
        half(0, 0.02 / 63 / 7.5 * 2)
        half(2, 0.02 / 63)
    elif qtype == T.Q6_K:           # d * sc * (q - 32), int8 sub-block scales
        b[:, 192:208] = rng.integers(-40, 40, (len(b), 16)).astype(np.int8).view(np.uint8)
        half(208, 0.02 / 40 / 16)
    elif qtype == T.Q4_1:           # d * q + m
        half(0, 0.04 / 15)
        half(2, -0.02)
    elif qtype == T.Q8_0:           # d * q, int8
        half(0, 0.02 / 127)
    else:
        raise ValueError(f"no random blocks for {qtype!r}")
    return b.reshape(n, -1)


def write_gguf(path, cfg: dict, layer_type: str, edge_type: str, tied: bool, seed: int = 0) -> str:
    """A llama-architecture GGUF of random valid blocks: norms F32, every linear weight ``layer_type``, the
    embedding (and the output head unless ``tied``) ``edge_type``."""
    import gguf
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    h, inter, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    d = h // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(d)

    def put(name, n, k, qtype):
        w.add_tensor(name, _blocks(qtype, n, k, rng), raw_dtype=qtype)
    lt, et = T[layer_type], T[edge_type]
    put("token_embd.weight", cfg["vocab_size"], h, et)
    if not tied:
        put("output.weight", cfg["vocab_size"], h, et)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(cfg["num_hidden_layers"]):
        for g, n, k in (("attn_q", heads * d, h), ("attn_k", kv * d, h), ("attn_v", kv * d, h),
                        ("attn_output", h, heads * d), ("ffn_gate", inter, h), ("ffn_up", inter, h),
                        ("ffn_down", h, inter)):
            put(f"blk.{i}.{g}.weight", n, k, lt)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def decode_case(path, budget, backend: str, quantize=None, gbps=None, new: int = NEW) -> dict:
    """Load, one warm-up answer, then ``generate(PROMPT tokens, new)``: device decode tokens/s, wall tokens/s, the
    plan's streamed bytes per step and the bound they give at ``gbps`` (pinned host-to-device GB/s)."""
    t0 = time.perf_counter()
    with vmmstream.load_model(path, budget=budget, backend=backend, max_context=256, quantize=quantize,
                              progress=False) as m:
        load_s = time.perf_counter() - t0
        ids = np.random.default_rng(1).integers(3, m.config.vocab_size, PROMPT).tolist()
        m.generate(ids, 4, eos_token_id=[])
        before = m.stats()
        t1 = time.perf_counter()
        got = m.generate(ids, new, eos_token_id=[])
        wall = time.perf_counter() - t1
        s = m.stats()
        plan = m.plan
        conv = m.conversion
    assert len(got) == new
    dev_ms = s["decode_device_ms"] - before["decode_device_ms"]
    dev_tok = s["decode_timed_tokens"] - before["decode_timed_tokens"]
    out = {"strategy": plan.strategy, "quantize": quantize, "load_s": load_s, "wall_tok_s": new / wall,
           "device_tok_s": dev_tok / (dev_ms / 1e3) if dev_ms > 0 else float("nan"),
           "streamed_bytes_per_step": plan.streamed_bytes_per_token,
           "formats": sorted(conv["formats"]) if isinstance(conv, dict) and "formats" in conv else None}
    if gbps and plan.streamed_bytes_per_token:
        out["bound_tok_s"] = gbps * 1e9 / plan.streamed_bytes_per_token
        out["ratio_to_bound"] = out["device_tok_s"] / out["bound_tok_s"]
    return out


# ------------------------------------------------------------------------------------------------ GPU

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return {}


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("where", ["resident", "streams"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bench_gguf_decode(benchmark, files, tmp_path_factory, h2d_gbps, shape, where, quantize):
    cfg, lt, et, tied, small = SHAPES[shape]
    if shape not in files:
        t0 = time.perf_counter()
        files[shape] = write_gguf(tmp_path_factory.mktemp(shape) / f"{shape}.gguf", cfg, lt, et, tied)
        print(f"\nwrote {shape} ({os.path.getsize(files[shape]) / GiB:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
    budget = "80%" if where == "resident" else small
    out = benchmark.pedantic(lambda: decode_case(files[shape], budget, "cuda", quantize, h2d_gbps), rounds=1,
                             iterations=1)
    benchmark.extra_info.update(shape=shape, where=where, file_bytes=os.path.getsize(files[shape]),
                                pinned_h2d_GBps=h2d_gbps, **out)
    print(f"\n{shape} {where} quantize={quantize}: {json.dumps(out, default=str)}")
    assert out["strategy"] == ("resident" if where == "resident" else "streamed")


def test_formats_bench_smoke_on_the_host_backend(tmp_path):
    cfg = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
    path = write_gguf(tmp_path / "t.gguf", cfg, "Q4_K", "Q6_K", False)
    resident = decode_case(path, 64 * MiB, "host", new=4)
    streams = decode_case(path, 16 * MiB, "host", quantize="int4", gbps=50.0, new=4)
    assert resident["strategy"] == "resident" and streams["strategy"] == "streamed"
    assert streams["bound_tok_s"] == 50e9 / streams["streamed_bytes_per_step"]
