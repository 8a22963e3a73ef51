"""RoPE frequency tables on the host, computed in fp32 as transformers computes its buffers (arange -> float,
base ** (i / dim)), so the values match them to the last bit or so. Shared by the rope kernel module and the
model configuration (which adds the longrope and partial-rotary choices)."""

from __future__ import annotations

import math

import numpy as np


def base_powers(dim: int, theta: float) -> np.ndarray:
    """``theta ** (2i / dim)`` for i < dim / 2, fp32: the default inverse frequencies are their reciprocals."""
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return np.power(np.float32(theta), exps, dtype=np.float32)


def llama3_scaled(inv: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama 3's rope scaling of the inverse frequencies ``inv`` (transformers' ``_compute_llama3_parameters``)."""
    factor = np.float32(scaling["factor"])
    low_ff = float(scaling["low_freq_factor"])
    high_ff = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low_ff     # wavelengths longer than this: slowed down by ``factor``
    high_wavelen = old_ctx / high_ff   # shorter than this: unchanged; in between: interpolated
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = ((np.float32(old_ctx) / wavelen - np.float32(low_ff)) / np.float32(high_ff - low_ff))
    smoothed = ((np.float32(1.0) - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
