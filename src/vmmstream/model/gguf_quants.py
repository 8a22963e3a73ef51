"""The GGML tensor types a GGUF file stores, decoded to fp32 with NumPy (vectorised over blocks).

Each quantized type cuts a row of K values (the row is GGUF's first dimension, ``ne0``) into blocks; a block is
a fixed number of bytes. Values are computed in fp32 as llama.cpp's reference dequantizers compute them
(``d * q`` or ``d * q + m`` with fp16 ``d``, ``m``), so the result is what llama.cpp and the ``gguf`` package
hand out:

========  ======  =====  =========================================================================================
type      values  bytes  layout of one block
========  ======  =====  =========================================================================================
Q8_0      32      34     fp16 d, 32 int8 q: ``d * q``
Q4_0      32      18     fp16 d, 16 bytes: value j in the low nibble of byte j, j + 16 in its high nibble: ``d * (q - 8)``
Q4_1      32      20     fp16 d, fp16 m, 16 bytes as Q4_0: ``d * q + m``
Q4_K      256     144    fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes:
                         each 32 bytes hold sub-block 2i (low nibbles) and 2i + 1 (high nibbles):
                         ``d * sc * q - dmin * m``
Q6_K      256     210    128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales (sub-blocks of 16), fp16 d:
                         ``d * sc * (q - 32)``
========  ======  =====  =========================================================================================

None of these is the int4 layout of ``kernels/matmul/quant/formats.py`` (groups of 128 along K with one scale and
one integer zero point per group): Q4_0 / Q4_1 / Q4_K have a scale (and min) per 32 values, Q4_1 / Q4_K's
minimum is not an integer multiple of the scale, Q8_0 and Q6_K have more than 4 bits. They are loaded as bf16.
"""

from __future__ import annotations

import numpy as np

# type name -> (values per block, bytes per block); F32 / F16 / BF16 are "blocks" of one value
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
          "Q4_K": (256, 144), "Q6_K": (256, 210)}


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of ``k`` values (``k`` a multiple of the block)."""
    per, nbytes = BLOCKS[kind]
    return k // per * nbytes


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] -> fp32 [...] (little-endian fp16)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32] codes: the low nibbles (values 0..15), then the high ones (16..31)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _q8_0(b):
    return _f16(b[:, 0:2])[:, None] * b[:, 2:34].view(np.int8).astype(np.float32)


def _q4_0(b):
    return _f16(b[:, 0:2])[:, None] * (_nibbles(b[:, 2:18]).astype(np.float32) - 8.0)


def _q4_1(b):
    return _f16(b[:, 0:2])[:, None] * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b[:, 2:4])[:, None]


def _q4_k_scales(s: np.ndarray):
    """[B, 12] -> (scales, mins) [B, 8] of 6 bits: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and
    4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the top bits of 0-7."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _q4_k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)   # sub-blocks in order
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 16)
    d = _f16(b[:, 208:210])[:, None]
    # per half of 128 values: four runs of 32, run r from the low (r even) or high (r odd) nibbles of ql bytes
    # 0-31 (r < 2) or 32-63 and from bits 2r, 2r + 1 of qh
    lo = np.stack([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((lo | (hi << 4)).astype(np.float32) - 32.0).reshape(n, 16, 16)    # 16 sub-blocks of 16, in order
    return ((d * sc)[:, :, None] * q).reshape(n, 256)


_DECODE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def dequantize(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    """The bytes of a tensor of GGML type ``kind`` -> fp32 of ``shape`` (rows of the last dim)."""
    shape = tuple(int(s) for s in shape)
    raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    if kind == "F32":
        return raw.view("<f4").astype(np.float32).reshape(shape)
    if kind == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if kind == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    nbytes = BLOCKS[kind][1]
    if raw.size % nbytes:
        raise ValueError(f"{kind}: {raw.size} bytes are not whole blocks of {nbytes}")
    return _DECODE[kind](raw.reshape(-1, nbytes)).reshape(shape)
