"""Named model shapes, and random-weight checkpoints of them in real Hugging Face layout.

``make_checkpoint`` writes ``config.json`` + ``model.safetensors`` (or shards + ``model.safetensors.index.json``)
that transformers loads as-is. Weights are N(0, 0.02²) in bf16, norms are ones. The safetensors format
is written here directly (header JSON + raw bytes) because ``safetensors.numpy`` has no bf16 dtype;
each tensor is generated in chunks on a few threads and written as it comes, so a 3B model needs a
few hundred MB of RAM, not 2x its size.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .checkpoint import INDEX, SINGLE, CheckpointError
from .config import ModelConfig, UnsupportedModelError

INIT_STD = 0.02
_CHUNK_ELEMS = 8 << 20          # elements generated per step: bounds memory, keeps the RNG vectorised
_WORKERS = max(1, min(16, os.cpu_count() or 1))


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    description: str

    @property
    def weight_bytes(self) -> int:
        return 2 * self.config.n_params()


def _llama(**kw) -> ModelConfig:
    kw.setdefault("architecture", "LlamaForCausalLM")
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return ModelConfig(**kw)


def _longrope(n: int, original: int) -> dict:
    """A longrope rope_scaling with ``n`` factors per list: short ones near 1, long ones growing to ~8 (the shape
    of Phi-3's)."""
    return {"rope_type": "longrope", "short_factor": [round(1.0 + 0.05 * i, 4) for i in range(n)],
            "long_factor": [round(1.0 + 7.0 * i / max(1, n - 1), 4) for i in range(n)],
            "original_max_position_embeddings": original}


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", _llama(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          rms_norm_eps=1e-5),
           "Llama-shaped, ~0.1 M parameters: CPU tests"),
    Preset("qwen2-tiny", _llama(architecture="Qwen2ForCausalLM", vocab_size=256, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                tie_word_embeddings=True, attention_bias=True, rope_theta=1000000.0),
           "Qwen2-shaped, q/k/v biases, tied embeddings: CPU tests"),
    Preset("qwen3-tiny", _llama(architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                                tie_word_embeddings=True, rope_theta=1000000.0),
           "Qwen3-shaped, q/k RMSNorm per head, head_dim 32 (hidden 64, 4 heads), tied embeddings: CPU tests"),
    Preset("phi3-tiny", _llama(architecture="Phi3ForCausalLM", vocab_size=256, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                               rope_scaling=_longrope(8, original=64), sliding_window=2047),
           "Phi-3-shaped: fused qkv_proj / gate_up_proj, longrope (original context 64 of 256), sliding window "
           "2047: CPU tests"),
    Preset("phi4-mini-tiny", _llama(architecture="Phi3ForCausalLM", vocab_size=256, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                                    rms_norm_eps=1e-5, tie_word_embeddings=True, partial_rotary_factor=0.75,
                                    rope_scaling=_longrope(12, original=64)),
           "Phi-4-mini-shaped: fused projections, RoPE on 24 of head_dim 32 (partial_rotary_factor 0.75), "
           "longrope, tied embeddings: CPU tests"),
    Preset("small", _llama(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                           max_position_embeddings=2048, rms_norm_eps=1e-5),
           "Llama-shaped, ~16 M parameters, fused-attention head_dim 64: quick GPU checks"),
    Preset("llama-3b", _llama(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                              num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=4096, rms_norm_eps=1e-5),
           "Llama-shaped 3.0B (5.62 GiB bf16), the GPU.md benchmark model"),
    Preset("qwen2-7b-12l", _llama(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                                  intermediate_size=18944, num_hidden_layers=12, num_attention_heads=28,
                                  num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                                  rms_norm_eps=1e-6, attention_bias=True, rope_theta=1000000.0),
           "Qwen2-7B's layer shape with 12 of its 28 layers (3.9B, 7.24 GiB bf16; vocab 152,064 untied, "
           "GQA 7): the second benchmark model"),
    Preset("mixtral-tiny", _llama(architecture="MixtralForCausalLM", vocab_size=256, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                  rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=128, norm_topk_prob=True),
           "Mixtral-shaped, 4 experts top-2, ~0.2 M parameters: CPU tests"),
    Preset("mixtral-4.7b", _llama(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=2048,
                                  intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                                  num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                                  rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=5632, norm_topk_prob=True),
           "Mixtral-shaped 4.7B (8.81 GiB bf16; 8 experts top-2, expert MLP 5632), the GPU.md MoE benchmark model"),
)}


def get_preset(name) -> Preset:
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise UnsupportedModelError(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def make_checkpoint(preset, out_dir, seed: int = 0, shard_bytes: int | None = None, *,
                    overwrite: bool = False, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a random-weight bf16 checkpoint of ``preset`` (a name, a ``Preset`` or a ``ModelConfig``).

    ``shard_bytes``: split into ``model-0000i-of-0000n.safetensors`` files of at most that many data
    bytes (a tensor larger than it gets a shard of its own) plus an index; None: one file.
    Values depend only on (seed, tensor name), not on sharding. ``progress(done_bytes, total_bytes)``.
    """
    config = preset if isinstance(preset, ModelConfig) else get_preset(preset).config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = [p for p in out.iterdir() if p.name in (SINGLE, INDEX) or
                (p.name.startswith("model-") and p.name.endswith(".safetensors"))]
    if existing and not overwrite:
        raise CheckpointError(f"{out} already holds a checkpoint ({existing[0].name}); choose an empty directory "
                              "or pass overwrite=True")
    for p in existing:
        p.unlink()

    shapes = config.checkpoint_shapes()        # as stored: Phi-3's fused qkv_proj / gate_up_proj whole
    shards = _split(shapes, shard_bytes)
    total = sum(2 * _numel(s) for s in shapes.values())
    done = [0]

    def tick(n):
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    names = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, members in zip(names, shards):
        _write_safetensors(out / fname, {n: shapes[n] for n in members}, seed, tick)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: fname for fname, members in zip(names, shards) for n in members}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    hf = config.to_hf_dict()
    hf["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def tensor_values(name: str, shape, seed: int = 0) -> np.ndarray:
    """The bf16 bit patterns ``make_checkpoint`` writes for one tensor (all at once: for tests)."""
    return np.concatenate(list(_chunks(name, tuple(shape), seed)) or [np.empty(0, np.uint16)]).reshape(shape)


def _split(shapes: dict, shard_bytes: int | None) -> list[list[str]]:
    if shard_bytes is None:
        return [list(shapes)]
    if shard_bytes <= 0:
        raise ValueError("shard_bytes must be positive")
    shards, cur, size = [], [], 0
    for name, shape in shapes.items():
        n = 2 * _numel(shape)
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    shards.append(cur)
    return shards


def _chunks(name: str, shape: tuple, seed: int):
    """bf16 chunks of one tensor, in order: ones for norms, N(0, INIT_STD²) otherwise.

    Chunk i comes from its own generator seeded by (seed, name, i), so chunks are made in parallel
    threads (NumPy's RNG and ufuncs release the GIL) and the values survive a change of shard layout.
    """
    n = _numel(shape)
    starts = range(0, n, _CHUNK_ELEMS)
    if name.endswith("norm.weight"):
        for start in starts:
            yield np.full(min(_CHUNK_ELEMS, n - start), 0x3F80, dtype=np.uint16)   # bf16 1.0
        return
    key = zlib.crc32(name.encode())

    def make(i_start):
        i, start = i_start
        x = np.random.default_rng([seed, key, i]).standard_normal(min(_CHUNK_ELEMS, n - start), dtype=np.float32)
        x *= np.float32(INIT_STD)
        return f32_to_bf16_finite(x)

    work = list(enumerate(starts))
    if len(work) == 1:
        yield make(work[0])
        return
    window = 2 * _WORKERS          # chunks in flight: bounds memory to ~window x 32 MB
    with ThreadPoolExecutor(_WORKERS) as pool:
        pending = [pool.submit(make, w) for w in work[:window]]
        for j in range(len(work)):
            chunk = pending[j].result()
            pending[j] = None
            if j + window < len(work):
                pending.append(pool.submit(make, work[j + window]))
            yield chunk


def f32_to_bf16_finite(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 bits, in place in ``x``'s buffer, for finite ``x``.

    Bit-identical to ``vmmstream.kernels.dtypes.f32_to_bf16`` on finite values (a test checks it) but
    ~20x faster: that one widens to uint64 to be safe for NaN, which made writing a 3B checkpoint
    take minutes. Random normal samples are always finite, and uint32 cannot overflow for them.
    """
    u = x.view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (u >> np.uint32(16)).astype(np.uint16)


def _write_safetensors(path: Path, shapes: dict, seed: int, tick) -> None:
    """Header (dtype BF16, shape, contiguous data_offsets, 8-byte padded) then each tensor's bytes."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)        # data starts 8-byte aligned, as the reference writer does
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in shapes.items():
            for chunk in _chunks(name, tuple(shape), seed):
                f.write(chunk)      # contiguous: written from its buffer, no copy
                tick(chunk.nbytes)
    os.replace(tmp, path)      # a crash leaves a .partial file, never a short model file


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
