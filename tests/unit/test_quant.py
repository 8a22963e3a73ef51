"""Host quantizers (kernels/matmul/quant/formats.py): round trips within each format's bound, exact values survive,
packing order, degenerate groups, bad input, the error report. No GPU, no simulator."""

from __future__ import annotations

import numpy as np
import pytest

from vmmstream.kernels.matmul.quant import formats as quant
from vmmstream.kernels.matmul.quant.formats import (E2M1_VALUES, dequantize_int4, dequantize_mxfp4, pack_e2m1,
    pack_nibbles, quantization_error, quantize_int4, quantize_mxfp4, unpack_e2m1, unpack_nibbles)

pytestmark = pytest.mark.unit


def weights(rng, shape, scale=0.05):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -------------------------------------------------------------------------------------------- packing

def test_packing_low_nibble_is_even_k():
    q = np.array([[1, 2, 3, 4, 15, 0]], np.uint8)
    p = pack_nibbles(q)
    assert p.tolist() == [[0x21, 0x43, 0x0F]]
    np.testing.assert_array_equal(unpack_nibbles(p), q)


def test_int4_packing_order_matches_codes():
    # one group with a known code per k: w = (k % 16) - 0 with lo = 0, hi = 15 -> scale 1, zero 0
    w = np.tile(np.arange(16, dtype=np.float32), 8)[None, :]
    qw = quantize_int4(w)
    assert qw.scales[0, 0] == 1 and qw.zeros[0, 0] == 0
    np.testing.assert_array_equal(unpack_nibbles(qw.packed)[0], np.arange(128) % 16)
    assert qw.packed[0, 0] == 0x10 and qw.packed[0, 7] == 0xFE


def test_mxfp4_codes_are_plain_nibbles():
    # code of k = 8w + j: nibble j of little-endian word w (magnitude bits 0-2, sign bit 3)
    for j in range(8):
        for code in (0b0001, 0b0010, 0b0100, 0b1000):
            q = np.zeros((1, 16), np.uint8)
            q[0, 8 + j] = code
            words = pack_e2m1(q).view("<u4")[0]
            assert int(words[0]) == 0 and int(words[1]) == code << (4 * j), (j, code, hex(int(words[1])))


def test_mxfp4_pack_round_trip_and_bad_shape():
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, (5, 96)).astype(np.uint8)
    p = pack_e2m1(q)
    assert p.shape == (5, 48) and p.dtype == np.uint8
    np.testing.assert_array_equal(unpack_e2m1(p), q)
    np.testing.assert_array_equal(p, pack_nibbles(q))
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_e2m1(np.zeros((2, 6), np.uint8))


# ----------------------------------------------------------------------------------------------- int4

@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
def test_int4_round_trip_within_half_scale(scale_dtype):
    rng = np.random.default_rng(0)
    w = weights(rng, (37, 384))
    w[3, :128] += 1.0            # an all-positive group
    w[5, 128:256] -= 2.0         # an all-negative group
    qw = quantize_int4(w, scale_dtype=scale_dtype)
    assert qw.packed.shape == (37, 192) and qw.packed.dtype == np.uint8
    assert qw.scales.shape == qw.zeros.shape == (37, 3) and qw.scales.dtype == qw.zeros.dtype == scale_dtype
    z = qw.zeros.astype(np.float64)
    assert np.all((z >= 0) & (z <= 15) & (z == np.round(z)))
    d = dequantize_int4(*qw)
    assert d.dtype == np.float32
    bound = np.repeat(qw.scales.astype(np.float64), 128, axis=1) / 2
    err = np.abs(d.astype(np.float64) - w)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-12), float(np.max(err - bound))


def test_int4_representable_values_survive():
    rng = np.random.default_rng(1)
    s, z = np.float32(0.125), 7
    q = rng.integers(0, 16, (4, 256))
    q[:, ::128] = 0
    q[:, 1::128] = 15                          # every group spans the whole code range
    w = ((q - z) * s).astype(np.float32)
    qw = quantize_int4(w)
    np.testing.assert_array_equal(dequantize_int4(*qw), w)


def test_int4_constant_and_zero_groups():
    w = np.zeros((3, 256), np.float32)
    w[1, :128] = 0.3
    w[2, 128:] = -7.0
    qw = quantize_int4(w)
    d = dequantize_int4(*qw)
    np.testing.assert_allclose(d, w, atol=float(qw.scales.max()) / 2)
    assert d[0].tolist() == [0.0] * 256 and qw.scales[0, 0] == 1 and qw.zeros[0, 0] == 0
    assert abs(d[1, 0] - 0.3) <= float(qw.scales[1, 0]) / 2 and np.all(d[1, 128:] == 0)
    assert abs(d[2, 128] + 7.0) <= float(qw.scales[2, 1]) / 2 and qw.zeros[2, 1] == 15   # scale rounded up to fp16


def test_int4_shape_errors():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_int4(np.zeros((2, 100), np.float32))
    with pytest.raises(TypeError, match="bf16"):
        quantize_int4(np.zeros((2, 128), np.uint16))
    qw = quantize_int4(np.ones((2, 256), np.float32))
    with pytest.raises(ValueError, match="scales"):
        dequantize_int4(qw.packed, qw.scales[:, :1], qw.zeros[:, :1])


# ---------------------------------------------------------------------------------------------- MXFP4

def e2m1_bound(a):
    """|round_e2m1(a) - a| for |a| (block-scaled): half the E2M1 spacing, or the saturation gap above 6."""
    a = np.abs(a)
    half = np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))
    return np.where(a > 6, a - 6, half)


def test_mxfp4_round_trip_within_block_bound():
    rng = np.random.default_rng(2)
    w = weights(rng, (37, 256))
    w[4, :32] *= 1e-30           # tiny block
    w[6, 32:64] *= 1e20          # huge block
    qw = quantize_mxfp4(w)
    assert qw.packed.shape == (37, 128) and qw.scales.shape == (37, 8) and qw.scales.dtype == np.uint8
    d = dequantize_mxfp4(*qw)
    assert d.dtype == np.float32
    scale = np.repeat(quant.e8m0_to_f32(qw.scales).astype(np.float64), 32, axis=1)
    err = np.abs(d.astype(np.float64) - w)
    bound = e2m1_bound(w / scale) * scale
    assert np.all(err <= bound * (1 + 1e-12)), float(np.max(err - bound))
    # the spec's shared exponent: floor(log2(max|x|)) - 2, so the block max scales into [4, 8)
    amax = np.abs(w.reshape(37, 8, 32)).max(axis=2)
    r = amax / quant.e8m0_to_f32(qw.scales)
    assert np.all((r >= 4) & (r < 8))


def test_mxfp4_representable_values_survive_and_codes():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (3, 64)).astype(np.uint8)
    codes[:, ::32] = 7                         # each block holds a 6: shared exponent = its own
    codes[codes == 8] = 0                      # -0 quantizes to +0
    e = np.array([[120, 130], [127, 100], [140, 127]], np.uint8)
    w = (E2M1_VALUES[codes].reshape(3, 2, 32) * quant.e8m0_to_f32(e)[..., None]).reshape(3, 64)
    qw = quantize_mxfp4(w)
    np.testing.assert_array_equal(qw.scales, e)
    np.testing.assert_array_equal(unpack_e2m1(qw.packed), codes)
    np.testing.assert_array_equal(dequantize_mxfp4(*qw), w)


def test_mxfp4_ties_to_even_and_saturation():
    # block max 4 -> shared exponent 0 (scale 1): midpoints go to the even code, 7 saturates to 6
    vals = np.array([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.75, 0.3, 5.0] + [0.0] * 22, np.float32)
    qw = quantize_mxfp4(vals[None, :])
    assert qw.scales[0, 0] == 127
    got = dequantize_mxfp4(*qw)[0, :10].tolist()
    assert got == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, -1.0, 0.5, 4.0]
    big = np.full((1, 32), 7.9, np.float32)  # max 7.9 -> exponent floor(log2 7.9) - 2 = 0, 7.9 -> 6
    assert dequantize_mxfp4(*quantize_mxfp4(big))[0, 0] == 6.0


def test_e2m1_rounding_matches_brute_force():
    a = np.arange(0, 8 * 256) / 256.0                     # every multiple of 1/256 in [0, 8): all ties included
    mags = E2M1_VALUES[:8].astype(np.float64)
    want = []
    for v in a:
        d = np.abs(mags - v)
        near = np.flatnonzero(d == d.min())
        want.append(7 if v > 6 else near[0] if len(near) == 1 else near[near % 2 == 0][0])
    np.testing.assert_array_equal(quant._e2m1_codes(a), want)


def test_mxfp4_zero_block_and_e8m0_special_values():
    qw = quantize_mxfp4(np.zeros((2, 64), np.float32))
    assert np.all(qw.scales == 127) and np.all(qw.packed == 0)
    assert np.all(dequantize_mxfp4(*qw) == 0)
    s = quant.e8m0_to_f32(np.array([0, 127, 254, 255], np.uint8))
    assert s[0] == np.float32(2.0 ** -127) and s[1] == 1 and s[2] == np.float32(2.0 ** 127) and np.isnan(s[3])


# ------------------------------------------------------------------------------------- errors, report

@pytest.mark.parametrize("fn", [quantize_int4, quantize_mxfp4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_rejected(fn, bad):
    w = np.zeros((2, 128), np.float32)
    w[1, 5] = bad
    with pytest.raises(ValueError, match=r"NaN/inf.*\[1, 5\]"):
        fn(w)


def test_quantization_error_report():
    rng = np.random.default_rng(4)
    w = weights(rng, (64, 512), 0.02)
    r4 = quantization_error(w, "int4")
    rm = quantization_error(w, "mxfp4")
    for r, kind in ((r4, "int4"), (rm, "mxfp4")):
        assert r["kind"] == kind and r["shape"] == (64, 512) and r["bytes_bf16"] == 64 * 512 * 2
        assert 0 < r["max_abs"] < 0.05 and 0 < r["rel_rms"] < 0.2
    assert r4["bytes"] == 64 * 256 + 2 * 2 * 64 * 4
    assert rm["bytes"] == 64 * 256 + 64 * 16
    assert r4["rel_rms"] < rm["rel_rms"]      # 16 levels per 128 values vs 8 magnitudes per 32
    assert quantization_error(np.zeros((1, 128), np.float32), "int4")["rel_rms"] == 0.0
    with pytest.raises(ValueError, match="unknown quantization kind"):
        quantization_error(w, "int3")


def test_quantize_is_vectorised_for_large_matrices():
    import time
    w = weights(np.random.default_rng(5), (3072, 8192))   # a 3B MLP matrix
    t = time.perf_counter()
    quantize_int4(w)
    quantize_mxfp4(w)
    assert time.perf_counter() - t < 30
