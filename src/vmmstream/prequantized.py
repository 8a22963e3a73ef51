"""Weights published already quantized (GPTQ and AWQ 4-bit safetensors) turned into the int4 layout of
``kernels/matmul/quant/formats.py`` without dequantizing: the same 4-bit codes, zero points and fp16 scales,
repacked. Exact wherever the published layout is one of ours: 4 bits, groups of 128 along K, asymmetric zero
points, groups in order (GPTQ without act-order); anything else is a ``PrequantizedFormatError`` naming what
differs.

GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``), for a linear layer ``W[N, K]``:
    ``qweight`` int32 [K/8, N]: nibble j of word w is the code of k = 8w + j;
    ``qzeros`` int32 [K/g, N/8]: nibble j of word c is the zero point of n = 8c + j, stored minus 1 in the
    original checkpoint format (``checkpoint_format: gptq``) and as is in ``gptq_v2``;
    ``scales`` fp16 [K/g, N]; ``g_idx`` int32 [K], the group of each k (k // g without act-order).
    ``W[n, k] = (q - zero) * scale``.
AWQ (AutoAWQ GEMM, ``quant_method: awq``, ``version: gemm``):
    ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/g, N/8], packed along N, nibble i of word c holding
    column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; ``scales`` fp16 [K/g, N]. ``W[n, k] = (q - zero) * scale``.
"""

from __future__ import annotations

import numpy as np

from .errors import PrequantizedFormatError
from vmmstream.kernels.matmul.quant.formats import INT4_GROUP, Int4Weights

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble i of a word holds column AWQ_ORDER[i] of its 8
_AWQ_COLUMN_NIBBLE = np.argsort(AWQ_ORDER)  # column j of the 8 is in nibble _AWQ_COLUMN_NIBBLE[j]


def unpack_words(words: np.ndarray) -> np.ndarray:
    """int32 [..., M] -> uint8 [..., 8 M]: nibble j of word w (from the least significant) at index 8w + j."""
    w = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((w[..., :, None] >> shifts) & 0xF).astype(np.uint8).reshape(*w.shape[:-1], 8 * w.shape[-1])


def _pack_rows(q: np.ndarray) -> np.ndarray:
    """codes uint8 [N, K] -> our packed [N, K/2] (low nibble = even k)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _check(name: str, a, dtype, shape) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.dtype(dtype) or a.shape != tuple(shape):
        raise PrequantizedFormatError(f"{name}: {a.dtype}{list(a.shape)}, expected {np.dtype(dtype)}{list(shape)}")
    return a


def _group(group_size: int, k: int) -> int:
    if group_size != INT4_GROUP:
        raise PrequantizedFormatError(f"group_size {group_size}: the int4 layout here groups {INT4_GROUP} values "
                                      "along K (group_size -1, per-channel, or other sizes are not supported)")
    if k % INT4_GROUP:
        raise PrequantizedFormatError(f"in_features {k} is not a multiple of the group size {INT4_GROUP}")
    return k // INT4_GROUP


def _zeros(z: np.ndarray, what: str) -> np.ndarray:
    if z.min() < 0 or z.max() > 15:
        raise PrequantizedFormatError(f"{what}: zero points outside [0, 15] ({int(z.min())}..{int(z.max())})")
    return z.astype(np.float16)


def gptq_int4(qweight, qzeros, scales, g_idx=None, *, group_size: int = 128, v2: bool = False) -> Int4Weights:
    """A GPTQ 4-bit linear layer as ``Int4Weights`` (codes, zero points and scales unchanged)."""
    qweight = np.asarray(qweight)
    if qweight.ndim != 2 or qweight.dtype != np.int32:
        raise PrequantizedFormatError(f"qweight: {qweight.dtype}{list(qweight.shape)}, expected int32 [K/8, N]")
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    if n % 8:
        raise PrequantizedFormatError(f"out_features {n} is not a multiple of 8")
    g = _group(group_size, k)
    qzeros = _check("qzeros", qzeros, np.int32, (g, n // 8))
    scales = _check("scales", scales, np.float16, (g, n))
    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (k,) or not np.array_equal(g_idx, np.arange(k) // group_size):
            raise PrequantizedFormatError("g_idx is not k // group_size: act-order (desc_act) checkpoints, whose "
                                          "groups are permuted, are not supported")
    q = unpack_words(qweight.T)                                   # [N, K]
    z = unpack_words(qzeros).astype(np.int16) + (0 if v2 else 1)  # [G, N]
    return Int4Weights(_pack_rows(q), np.ascontiguousarray(scales.T), np.ascontiguousarray(_zeros(z, "qzeros").T))


def awq_int4(qweight, qzeros, scales, *, group_size: int = 128) -> Int4Weights:
    """An AWQ (GEMM) 4-bit linear layer as ``Int4Weights`` (codes, zero points and scales unchanged)."""
    qweight = np.asarray(qweight)
    if qweight.ndim != 2 or qweight.dtype != np.int32:
        raise PrequantizedFormatError(f"qweight: {qweight.dtype}{list(qweight.shape)}, expected int32 [K, N/8]")
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    g = _group(group_size, k)
    qzeros = _check("qzeros", qzeros, np.int32, (g, n // 8))
    scales = _check("scales", scales, np.float16, (g, n))

    def columns(words):          # int32 [R, N/8] -> uint8 [R, N] in column order
        nib = unpack_words(words).reshape(words.shape[0], -1, 8)
        return nib[:, :, _AWQ_COLUMN_NIBBLE].reshape(words.shape[0], -1)
    q = columns(qweight).T                                        # [N, K]
    z = columns(qzeros)                                           # [G, N]
    return Int4Weights(_pack_rows(np.ascontiguousarray(q)), np.ascontiguousarray(scales.T),
                       np.ascontiguousarray(_zeros(z, "qzeros").T))


def repack(parts) -> Int4Weights:
    """One stored layer (``vmmstream.model.quantized.Int4Parts``) as ``Int4Weights``; a layout not run exactly is a
    ``PrequantizedFormatError`` naming the layer."""
    a = parts.arrays
    try:
        if parts.method == "gptq":
            return gptq_int4(a["qweight"], a["qzeros"], a["scales"], a.get("g_idx"), group_size=parts.group_size,
                             v2=parts.v2)
        return awq_int4(a["qweight"], a["qzeros"], a["scales"], group_size=parts.group_size)
    except PrequantizedFormatError as exc:
        raise PrequantizedFormatError(f"{parts.name} ({parts.method}): {exc}") from None
