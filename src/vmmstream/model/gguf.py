"""A GGUF file (llama.cpp's format) read as a ``Checkpoint``: config from its metadata, its tensors under the
Hugging Face names, each converted as it is read.

The metadata is parsed with the ``gguf`` package's ``GGUFReader`` (once per file, cached); weight bytes are read
later, tensor by tensor, by ``GGUFSource.read`` (``gguf_quants`` decodes the block types to fp32; types it does
not know are decoded by ``gguf.quants.dequantize``). No GGML block type is the int4 layout the kernels read
(``gguf_quants`` says why), so every quantized tensor is stored as bf16 on the device; ``model.conversion``
reports the error of each format (bf16 rounding of the decoded values). A BF16 tensor loads as stored.

Names: ``token_embd`` -> ``model.embed_tokens``, ``output_norm`` -> ``model.norm``, ``output`` -> ``lm_head``
(absent: tied embeddings), ``blk.N.attn_q|k|v|output`` -> ``model.layers.N.self_attn.q|k|v|o_proj``,
``attn_q_norm`` / ``attn_k_norm`` -> ``q_norm`` / ``k_norm``, ``attn_norm`` -> ``input_layernorm``, ``ffn_norm``
-> ``post_attention_layernorm``, ``ffn_gate|up|down`` -> ``mlp.gate|up|down_proj``. For the ``llama``
architecture llama.cpp's converter reorders the rows of q and k within each head (the two halves RoPE rotates
together become interleaved pairs); ``GGUFSource`` puts them back.

Architectures: llama (Llama, Mistral, SmolLM), qwen2, qwen3. The tokenizer, end-of-sequence ids and chat
template come from the metadata too (``gguf_tokenizer``).
"""

from __future__ import annotations

import functools
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

from . import gguf_quants
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    _open_regular,
    read_span,
    validate_tensors,
)
from .config import ModelConfig, UnsupportedModelError

MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_gguf(path) -> bool:
    """A regular file named ``*.gguf`` or starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class GGUFFile:
    """What is parsed once per file: metadata (key -> Python value) and tensors (name, type, shape, offset,
    bytes), shapes in NumPy order (GGUF lists the innermost dimension first)."""

    def __init__(self, path: str):
        from gguf import GGUFReader
        with _open_regular(path):           # a regular file (not a pipe or device) before the reader maps it
            pass
        self.path, self.size = path, os.stat(path).st_size
        try:
            reader = GGUFReader(path, "r")
            self.meta = {k: f.contents() for k, f in reader.fields.items()}
            self.tensors = [(t.name, t.tensor_type.name, tuple(int(s) for s in reversed(t.shape.tolist())),
                             int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
        except (ValueError, KeyError, IndexError, OverflowError, TypeError) as exc:
            raise CheckpointError(f"{path} is not a GGUF file this reads ({type(exc).__name__}: {exc})") from None
        del reader                           # its memory map: weights are read later, by offset
        for name, kind, shape, off, n in self.tensors:
            if off + n > self.size:
                raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {off + n} of {self.size}")

    def get(self, key, default=None):
        return self.meta.get(key, default)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def parse(path) -> GGUFFile:
    """The file's metadata and tensor table (cached while the file is unchanged)."""
    p = str(Path(path).resolve())
    try:
        st = os.stat(p)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror}") from None
    return _parsed(p, st.st_mtime_ns, st.st_size)


class GGUFSource:
    """Reads one GGUF tensor and decodes it to fp32 in the Hugging Face layout (``read()``)."""

    def __init__(self, file: str, offset: int, nbytes: int, kind: str, shape: tuple, heads: int | None = None):
        self.file, self.offset, self.nbytes, self.kind, self.shape, self.heads = file, offset, nbytes, kind, shape, heads
        self.format = f"GGUF {kind}"
        self.exact = kind == "BF16"

    def read(self) -> np.ndarray:
        raw = read_span(self.file, self.offset, self.nbytes, f"GGUF tensor at {self.offset}")
        if self.kind in gguf_quants.BLOCKS:
            w = gguf_quants.dequantize(raw, self.kind, self.shape)
        else:
            import gguf
            qtype = gguf.GGMLQuantizationType[self.kind]
            w = gguf.quants.dequantize(raw.reshape(self.shape[:-1] + (-1,)), qtype).reshape(self.shape)
        return unpermute_rows(w, self.heads) if self.heads else w


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: in each head, Hugging Face row ``j * half + i`` (half ``j`` of the rotated
    pair) is GGUF row ``2 i + j``."""
    rows = w.shape[0]
    half = rows // heads // 2
    order = np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(-1)
    return w[order]


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (unknown names stay as they are)."""
    base, _, kind = name.rpartition(".")
    if base in _TOP and kind in ("weight", "bias"):
        return f"{_TOP[base]}.{kind}"
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return name


def config_dict(g: GGUFFile) -> dict:
    """A ``config.json``-like dict from the metadata (``ModelConfig.from_dict`` checks it)."""
    arch = g.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{g.path}: GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(ARCHITECTURES)}")
    names = {t[0] for t in g.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{g.path}: per-dimension RoPE frequency factors (rope_freqs.weight, as in Llama "
                                    "3.1 GGUF files) are not supported yet")
    scaling = g.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"{g.path}: RoPE scaling {scaling!r} in a GGUF file is not supported yet")

    def key(k, default=None):
        v = g.get(f"{arch}.{k}", default)
        if isinstance(v, list):
            if not v or not all(isinstance(x, (int, float)) for x in v):
                raise CheckpointError(f"{g.path}: metadata {arch}.{k} is {v!r:.80}, not a number per layer")
            if len(set(v)) != 1:
                raise UnsupportedModelError(f"{g.path}: {arch}.{k} differs between layers ({v[:8]}...); layers of "
                                            "one shape are supported")
            v = v[0]
        return v

    heads = key("attention.head_count")
    embd = next((t for t in g.tensors if t[0] == "token_embd.weight"), None)
    d = {"architectures": [ARCHITECTURES[arch]], "hidden_act": "silu", "torch_dtype": "bfloat16",
         "vocab_size": embd[2][0] if embd is not None and len(embd[2]) == 2 else key("vocab_size"),
         "hidden_size": key("embedding_length"), "intermediate_size": key("feed_forward_length"),
         "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
         "num_key_value_heads": key("attention.head_count_kv", heads),
         "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5), "rope_theta": key("rope.freq_base", 10000.0),
         "max_position_embeddings": key("context_length"), "tie_word_embeddings": "output.weight" not in names}
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch == "llama" else None)
    if head_dim:
        d["head_dim"] = head_dim
    return d


@functools.lru_cache(maxsize=None)
def _decodable(kind: str) -> bool:
    """Whether ``gguf.quants.dequantize`` decodes GGML type ``kind`` (tried on one zero block, at open, so a file
    of a type it cannot decode is refused before anything is allocated)."""
    import gguf
    t = gguf.GGMLQuantizationType[kind]
    per, block = gguf.GGML_QUANT_SIZES[t]
    try:
        gguf.quants.dequantize(np.zeros((1, block), np.uint8), t)
    except Exception:
        return False
    return True


def open_gguf(path, *, validate: bool = True) -> Checkpoint:
    """A GGUF file as a ``Checkpoint`` (metadata and tensor table only; no weight bytes are read)."""
    g = parse(path)
    config = ModelConfig.from_dict(config_dict(g))
    permute = g.get("general.architecture") == "llama"
    tensors, kinds = {}, Counter()
    for name, kind, shape, off, n in g.tensors:
        hf = hf_name(name)
        if hf in tensors:
            raise CheckpointError(f"{g.path}: two tensors are named {name}")
        if kind not in gguf_quants.BLOCKS:
            import gguf
            if kind not in gguf.GGMLQuantizationType.__members__ or gguf.GGMLQuantizationType[kind] \
                    not in gguf.GGML_QUANT_SIZES:
                raise CheckpointError(f"{g.path}: tensor {name} has GGML type {kind}, which this does not read")
            per, block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            if not _decodable(kind):
                raise CheckpointError(f"{g.path}: tensor {name} has GGML type {kind}, which the gguf package "
                                      "cannot decode")
        else:
            per, block = gguf_quants.BLOCKS[kind]
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if not shape or shape[-1] % per or n != rows * (shape[-1] // per) * block:
            raise CheckpointError(f"{g.path}: tensor {name} {kind}{list(shape)} does not match its {n} bytes")
        heads = None
        if permute and len(shape) == 2 and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = config.num_attention_heads if ".q_proj." in hf else config.num_key_value_heads
        src = None if kind == "BF16" and heads is None else GGUFSource(g.path, off, n, kind, shape, heads)
        tensors[hf] = TensorInfo(hf, kind, shape, n, g.path, off, src)
        if src is not None:
            kinds[kind] += 1
    if validate:
        tensors = validate_tensors(config, tensors)
    notes = ()
    if kinds:
        listed = ", ".join(f"{k} x{c}" for k, c in sorted(kinds.items()))
        notes = (f"GGUF: {listed} tensors decoded and stored as bf16 (no GGML block type is the int4 layout of "
                 "groups of 128 with integer zero points, so none stays 4-bit); model.conversion gives the error of "
                 "each format against the stored values"),
    return Checkpoint(Path(g.path), config, tensors, (g.path,), "gguf", None, notes)


# -- what the file says besides its weights (vmmstream.model.companions asks for these) --

def tokenizer(path):
    from .gguf_tokenizer import build_tokenizer
    return build_tokenizer(parse(path))


def eos_token_ids(path, vocab_size=None) -> tuple[int, ...]:
    from .gguf_tokenizer import eos_ids
    return eos_ids(parse(path), vocab_size)


def tokenizer_config(path) -> dict:
    from .gguf_tokenizer import tokenizer_config as tc
    return tc(parse(path))


def chat_template(path):
    from .gguf_tokenizer import chat_template as ct
    return ct(parse(path))
