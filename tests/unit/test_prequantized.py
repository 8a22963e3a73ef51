"""GPTQ and AWQ 4-bit layers repacked into the int4 layout: written here from known codes, zero points and scales
with packers of the test's own (loops over the published bit layouts), they come back as the same codes, zero
points and scales, and dequantize exactly to (q - zero) * scale."""

from __future__ import annotations

import numpy as np
import pytest

from vmmstream.kernels.matmul.quant.formats import dequantize_int4, unpack_nibbles
from vmmstream.prequantized import PrequantizedFormatError, awq_int4, gptq_int4

pytestmark = pytest.mark.unit

N, K, G = 24, 256, 128


def _layer(seed, zero_lo=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (N, K), dtype=np.uint8)
    z = rng.integers(zero_lo, 16, (N, K // G), dtype=np.uint8)
    s = (rng.uniform(0.001, 0.05, (N, K // G))).astype(np.float16)
    want = (q.astype(np.float32) - np.repeat(z, G, axis=1)) * np.repeat(s.astype(np.float32), G, axis=1)
    return q, z, s, want


def _word(values):
    """8 codes -> one int32, values[j] in bits 4j..4j+3."""
    w = 0
    for j, v in enumerate(values):
        w |= int(v) << (4 * j)
    return np.uint32(w).view(np.int32)


def _gptq(q, z, s, stored_offset):
    qweight = np.array([[_word(q[n, 8 * r:8 * r + 8]) for n in range(N)] for r in range(K // 8)], np.int32)
    zs = z.T.astype(np.int64) - stored_offset                     # [G, N]
    qzeros = np.array([[_word(zs[g, 8 * c:8 * c + 8]) for c in range(N // 8)] for g in range(K // G)], np.int32)
    return qweight, qzeros, np.ascontiguousarray(s.T)


def _awq(q, z, s):
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    qt = q.T                                                      # [K, N]
    qweight = np.array([[_word([qt[k, 8 * c + order[i]] for i in range(8)]) for c in range(N // 8)]
                        for k in range(K)], np.int32)
    zt = z.T
    qzeros = np.array([[_word([zt[g, 8 * c + order[i]] for i in range(8)]) for c in range(N // 8)]
                       for g in range(K // G)], np.int32)
    return qweight, qzeros, np.ascontiguousarray(s.T)


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_layer_is_repacked_exactly(v2):
    q, z, s, want = _layer(1, zero_lo=0 if v2 else 1)             # the original format stores zero - 1 >= 0
    qweight, qzeros, scales = _gptq(q, z, s, 0 if v2 else 1)
    got = gptq_int4(qweight, qzeros, scales, np.arange(K, dtype=np.int32) // G, v2=v2)
    np.testing.assert_array_equal(unpack_nibbles(got.packed), q)
    np.testing.assert_array_equal(got.zeros, z.astype(np.float16))
    np.testing.assert_array_equal(got.scales, s)
    np.testing.assert_array_equal(dequantize_int4(*got), want)


def test_awq_layer_is_repacked_exactly():
    q, z, s, want = _layer(2)
    got = awq_int4(*_awq(q, z, s))
    np.testing.assert_array_equal(unpack_nibbles(got.packed), q)
    np.testing.assert_array_equal(got.zeros, z.astype(np.float16))
    np.testing.assert_array_equal(dequantize_int4(*got), want)


def test_layouts_that_are_not_ours_are_refused_by_name():
    q, z, s, _ = _layer(3, zero_lo=1)
    qweight, qzeros, scales = _gptq(q, z, s, 1)
    with pytest.raises(PrequantizedFormatError, match="act-order"):
        gptq_int4(qweight, qzeros, scales, np.random.default_rng(0).permutation(K) // G)
    with pytest.raises(PrequantizedFormatError, match="group_size 32"):
        gptq_int4(qweight, qzeros, scales, group_size=32)
    with pytest.raises(PrequantizedFormatError, match="scales: float32"):
        gptq_int4(qweight, qzeros, scales.astype(np.float32))
    with pytest.raises(PrequantizedFormatError, match="qweight"):
        awq_int4(qweight.astype(np.int64), qzeros, scales)
    z16 = np.full_like(z, 15)
    qweight, qzeros, scales = _gptq(q, z16, s, 0)                   # stored 15 in the original format: zero 16
    with pytest.raises(PrequantizedFormatError, match="outside"):
        gptq_int4(qweight, qzeros, scales)
