"""Open a checkpoint, whatever its format: a Hugging Face directory (bf16 / f16 / f32 safetensors, or GPTQ / AWQ
4-bit as its ``quantization_config`` says: ``quantized``) or a GGUF file (``gguf``)."""

from __future__ import annotations

from pathlib import Path

from . import gguf
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    read_config_json,
    read_headers,
    validate_tensors,
)
from .config import ModelConfig
from .quantized import prequantized_tensors


def open_checkpoint(path, *, validate: bool = True) -> Checkpoint:
    """Config + tensor headers of a checkpoint directory (bf16 / f16 / f32, or GPTQ / AWQ 4-bit as its config's
    ``quantization_config`` says) or of a GGUF file; no weight bytes are read."""
    root = Path(path)
    if gguf.is_gguf(root):
        return gguf.open_gguf(root, validate=validate)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; give a Hugging Face checkpoint directory or a .gguf file")
    raw = read_config_json(root)
    config = ModelConfig.from_dict(raw)
    tensors = read_headers(root)
    fmt, quant, notes = "safetensors", None, ()
    if isinstance(raw, dict) and raw.get("quantization_config") is not None:
        fmt, tensors, notes = prequantized_tensors(config, raw["quantization_config"], tensors)
        quant = "int4"
    if validate:
        tensors = validate_tensors(config, tensors)
    files = tuple(dict.fromkeys(t.file for t in tensors.values()))
    return Checkpoint(root, config, tensors, files, fmt, quant, notes)
