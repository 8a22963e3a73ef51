"""Host-side round-to-nearest weight quantizers (NumPy, vectorised) and their exact dequantizers.

Two formats, both grouped along K (the input dim) of a weight ``W[N, K]`` and packed two values per
byte, **low nibble = even k** (byte ``b`` of a row holds k = 2b in bits 0-3 and k = 2b + 1 in bits 4-7;
read as little-endian uint32 words, nibble j of word w is k = 8w + j):

int4, group-wise asymmetric (``quantize_int4``)
    group = 128 consecutive k of one row. Per group ``lo = min(w_min, 0)``, ``hi = max(w_max, 0)``
    (the range always contains 0, as in GPTQ: the zero point is then an integer in [0, 15], exact in
    fp16, and an all-positive group cannot ask for a zero point of -10⁶), ``scale = (hi - lo) / 15``
    rounded *up* to the stored dtype (so no value falls outside the 16 levels), ``zero = round(-lo / scale)``,
    ``q = clamp(round(w / scale) + zero, 0, 15)``; dequantized ``(q - zero) * scale``, |err| <= scale / 2.
    Stored: ``packed uint8 [N, K/2]``, ``scales [N, K/128]`` and ``zeros [N, K/128]``, both fp16 by
    default (half the bytes of fp32: 4 bytes per 64 packed bytes, +6.25 %; fp16 holds every zero point
    exactly and any scale of weights below ~10⁶); ``scale_dtype=np.float32`` stores fp32. An all-zero
    group stores scale 1, zero 0.

MXFP4, OCP Microscaling v1.0 (``quantize_mxfp4``)
    block = 32 consecutive k of one row, one E8M0 shared scale per block (``uint8`` biased exponent e,
    value 2^(e-127); 255 is NaN), elements E2M1 (bit 3 sign, bits 2-1 exponent, bit 0 mantissa;
    magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6). Shared exponent = floor(log2(max|x|)) - 2 (emax of E2M1, the
    spec's suggested method), clamped to [-127, 127]; elements x / 2^shared rounded to nearest, ties to
    even (even mantissa), saturated to ±6. An all-zero block stores e = 127 (scale 1). Stored:
    ``packed uint8 [N, K/2]``, ``scales uint8 [N, K/32]``. The codes are stored as plain nibbles, the OCP
    packing: byte b of a row holds the code of k = 2b in bits 0-3 and of k = 2b + 1 in bits 4-7 (read as a
    little-endian 32-bit word, nibble j of word w is the code of k = 8w + j). The batch-1 GEMV
    (``kernels/matmul/quant/gemv_imma.py``) turns a word into bytes by ``prmt`` table lookups keyed by those nibbles
    (magnitude bits 0-2 as the index, the sign as the lookup's sign-fill bit); the bf16 tensor-core route
    (``kernels/matmul/quant/gemv_mma.py``) shifts each pair of codes k and k + 4 into a bf16 pair; the scalar kernels read
    the nibbles one by one. ``pack_e2m1`` / ``unpack_e2m1`` convert from / to codes, checking the shape.

Both dequantizers return fp32 and are exact (every stored value is representable in fp32). NaN or inf in
a weight raises ``ValueError`` naming the first bad element.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

INT4, MXFP4 = 0, 1     # the format codes the kernels take
INT4_GROUP = 128
MX_BLOCK = 32
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_ROWS = 2048   # rows per slab: bounds the fp32/fp64 temporaries for a vocab-sized matrix


class Int4Weights(NamedTuple):
    packed: np.ndarray   # uint8 [N, K/2]
    scales: np.ndarray   # fp16 | fp32 [N, K/128]
    zeros: np.ndarray    # same dtype as scales [N, K/128], integers in [0, 15]


class MXFP4Weights(NamedTuple):
    packed: np.ndarray   # uint8 [N, K/2], E2M1 codes
    scales: np.ndarray   # uint8 [N, K/32], E8M0 biased exponents


def _check(w, group: int, what: str) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype == np.uint16:
        raise TypeError(f"{what}: got uint16 (bf16 bits?); convert with kernels.dtypes.bf16_to_f32 first")
    if w.ndim != 2 or w.shape[1] % group or w.shape[1] == 0:
        raise ValueError(f"{what}: weight must be [N, K] with K a positive multiple of {group}, got {w.shape}")
    w = w.astype(np.float32, copy=False)
    bad = ~np.isfinite(w)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"{what}: weight has {int(bad.sum())} NaN/inf values (first at [{r}, {c}] = {w[r, c]}); "
                         "quantization needs finite weights")
    return w


def _words(packed: np.ndarray) -> np.ndarray:
    p = np.ascontiguousarray(packed, np.uint8)
    if p.ndim != 2 or p.shape[1] % 4:
        raise ValueError(f"MXFP4 packed codes must be [N, K/2] with K a multiple of 8, got {p.shape}")
    return p.view("<u4")


def pack_e2m1(q) -> np.ndarray:
    """E2M1 codes uint8 [N, K] (0..15, bit 3 the sign; K a multiple of 8) -> MXFP4 packed [N, K/2] (nibbles,
    module docstring)."""
    return _words(pack_nibbles(q)).view(np.uint8)


def unpack_e2m1(packed) -> np.ndarray:
    """MXFP4 packed [N, K/2] -> E2M1 codes uint8 [N, K]."""
    return unpack_nibbles(_words(packed).view(np.uint8))


def pack_nibbles(q) -> np.ndarray:
    """uint8 codes [N, K] (0..15) -> [N, K/2], low nibble = even k."""
    q = np.asarray(q, np.uint8)
    return (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)


def unpack_nibbles(packed) -> np.ndarray:
    """[N, K/2] -> uint8 codes [N, K]."""
    p = np.asarray(packed, np.uint8)
    q = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
    q[:, 0::2] = p & 0xF
    q[:, 1::2] = p >> 4
    return q


# ---------------------------------------------------------------------------------------------- int4

def _scale_up(s: np.ndarray, dtype) -> np.ndarray:
    """s rounded to ``dtype``, then nudged up where rounding went down (so (hi - lo) / scale <= 15)."""
    st = s.astype(dtype)
    low = st.astype(np.float64) < s
    if low.any():
        st = np.where(low, np.nextafter(st, dtype(np.inf)), st)
    return st


def quantize_int4(w, *, scale_dtype=np.float16) -> Int4Weights:
    """Round-to-nearest int4, groups of 128 along K (see the module docstring for the exact layout)."""
    scale_dtype = np.dtype(scale_dtype).type
    if scale_dtype not in (np.float16, np.float32):
        raise ValueError(f"scale_dtype must be float16 or float32, got {scale_dtype}")
    w = _check(w, INT4_GROUP, "quantize_int4")
    n, k = w.shape
    g = k // INT4_GROUP
    packed = np.empty((n, k // 2), np.uint8)
    scales = np.empty((n, g), scale_dtype)
    zeros = np.empty((n, g), scale_dtype)
    for r0 in range(0, n, _ROWS):
        wg = w[r0:r0 + _ROWS].reshape(-1, g, INT4_GROUP).astype(np.float64)
        lo = np.minimum(wg.min(axis=2), 0.0)
        hi = np.maximum(wg.max(axis=2), 0.0)
        rng = hi - lo
        s = _scale_up(np.where(rng > 0, rng / 15.0, 1.0), scale_dtype)
        if not np.all(np.isfinite(s)):
            raise ValueError("quantize_int4: a group's range overflows the fp16 scale; use scale_dtype=np.float32")
        sf = s.astype(np.float64)
        z = np.clip(np.round(-lo / sf), 0, 15)
        q = np.clip(np.round(wg / sf[..., None]) + z[..., None], 0, 15).astype(np.uint8)
        packed[r0:r0 + _ROWS] = pack_nibbles(q.reshape(-1, k))
        scales[r0:r0 + _ROWS] = s
        zeros[r0:r0 + _ROWS] = z.astype(scale_dtype)
    return Int4Weights(packed, scales, zeros)


def dequantize_int4(packed, scales, zeros) -> np.ndarray:
    """fp32 [N, K] = (q - zero) * scale per group of 128 (exact)."""
    q = unpack_nibbles(packed).astype(np.float32)
    n, k = q.shape
    s = np.asarray(scales, np.float32)
    z = np.asarray(zeros, np.float32)
    if s.shape != (n, k // INT4_GROUP) or z.shape != s.shape:
        raise ValueError(f"dequantize_int4: packed {np.shape(packed)} needs scales/zeros {(n, k // INT4_GROUP)}, "
                         f"got {s.shape} / {z.shape}")
    qg = q.reshape(n, -1, INT4_GROUP)
    return ((qg - z[..., None]) * s[..., None]).reshape(n, k)


# --------------------------------------------------------------------------------------------- MXFP4

def _e2m1_codes(a: np.ndarray) -> np.ndarray:
    """Magnitudes (>= 0, already divided by the block scale) -> E2M1 magnitude codes 0..7: nearest,
    ties to even (even mantissa = even code), saturating at 6 (code 7). Per binade the grid is uniform,
    so each range is one np.rint (half to even): [0, 2) step 0.5 (codes 0-4), [2, 4) step 1 (codes 4-6),
    [4, 8) step 2 (codes 6-7)."""
    code = np.where(a < 2, np.rint(a * 2), np.where(a < 4, 4 + np.rint(a - 2), 6 + np.rint((a - 4) * 0.5)))
    return np.minimum(code, 7).astype(np.uint8)


def quantize_mxfp4(w) -> MXFP4Weights:
    """OCP MXFP4: E8M0 scale per 32 k, E2M1 elements (see the module docstring for the exact layout)."""
    w = _check(w, MX_BLOCK, "quantize_mxfp4")
    n, k = w.shape
    nbk = k // MX_BLOCK
    packed = np.empty((n, k // 2), np.uint8)
    scales = np.empty((n, nbk), np.uint8)
    for r0 in range(0, n, _ROWS):
        wb = w[r0:r0 + _ROWS].reshape(-1, nbk, MX_BLOCK)
        amax = np.abs(wb).max(axis=2)
        _, ex = np.frexp(amax)                                   # amax = m * 2^ex, m in [0.5, 1)
        shared = np.where(amax > 0, ex - 1 - 2, 0)               # floor(log2 amax) - emax(E2M1)
        shared = np.clip(shared, -127, 127)
        a = np.ldexp(np.abs(wb), -shared[..., None])             # exact: a power-of-two scaling
        code = _e2m1_codes(a)
        code = code | np.where((wb < 0) & (code > 0), np.uint8(8), np.uint8(0))
        packed[r0:r0 + _ROWS] = pack_e2m1(code.reshape(-1, k))
        scales[r0:r0 + _ROWS] = (shared + 127).astype(np.uint8)
    return MXFP4Weights(packed, scales)


def e8m0_to_f32(e) -> np.ndarray:
    """E8M0 biased exponents -> 2^(e-127) as fp32 (e = 0 is the subnormal 2^-127; 255 is NaN)."""
    e = np.asarray(e, np.uint8)
    with np.errstate(over="ignore"):   # e = 255 (2^128) overflows; it is NaN anyway
        v = np.ldexp(np.float64(1.0), e.astype(np.int32) - 127).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), v)


def dequantize_mxfp4(packed, scales) -> np.ndarray:
    """fp32 [N, K] = E2M1 value * 2^(e-127) per block of 32 (exact)."""
    q = unpack_e2m1(packed)
    n, k = q.shape
    s = np.asarray(scales, np.uint8)
    if s.shape != (n, k // MX_BLOCK):
        raise ValueError(f"dequantize_mxfp4: packed {np.shape(packed)} needs scales {(n, k // MX_BLOCK)}, "
                         f"got {s.shape}")
    v = E2M1_VALUES[q].reshape(n, -1, MX_BLOCK)
    return (v * e8m0_to_f32(s)[..., None]).reshape(n, k)


# ------------------------------------------------------------------------------------------- report

def quantize(w, kind: str):
    if kind == "int4":
        return quantize_int4(w)
    if kind == "mxfp4":
        return quantize_mxfp4(w)
    raise ValueError(f"unknown quantization kind {kind!r}: expected 'int4' or 'mxfp4'")


def dequantize(qw, kind: str) -> np.ndarray:
    return dequantize_int4(*qw) if kind == "int4" else dequantize_mxfp4(*qw)


def quantized_nbytes(qw) -> int:
    return int(sum(a.nbytes for a in qw))


def quantization_error(w, kind: str) -> dict:
    """Quantize ``w`` [N, K] with ``kind`` ('int4' | 'mxfp4') and report the round-trip error:
    ``max_abs`` (max |w - deq|), ``rel_rms`` (‖w - deq‖₂ / ‖w‖₂, 0 for an all-zero w), ``bytes``
    (stored size) and ``bytes_bf16`` (the unquantized bf16 size)."""
    qw = quantize(w, kind)
    wf = np.asarray(w, np.float32).astype(np.float64)
    d = dequantize(qw, kind).astype(np.float64) - wf
    norm = float(np.sqrt(np.sum(wf * wf)))
    return {
        "kind": kind,
        "shape": tuple(wf.shape),
        "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
        "rel_rms": float(np.sqrt(np.sum(d * d)) / norm) if norm > 0 else 0.0,
        "bytes": quantized_nbytes(qw),
        "bytes_bf16": int(wf.size * 2),
    }
