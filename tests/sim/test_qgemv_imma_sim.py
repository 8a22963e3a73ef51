"""The batch-1 MXFP4 GEMV on integer tensor cores (``kernels/matmul/quant/gemv_imma.py``) in the Numba CUDA simulator:
``prmt`` and ``mma.sync.m16n8k32`` s8 emulated, against NumPy.

The kernel's sums are exact integers for the x it applies (``x_as_applied``: x rounded per block of 32 to 14
bits below the block's largest |x|), so the output is checked against that x with the tolerance of the other
GEMV tests (one bf16 rounding plus fp32 slack), and against the given x with the rounding's bound added.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.kernels.matmul.quant import gemv_imma as qgemv_imma
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import dequantize_mxfp4, quantize_mxfp4

from simutil import HALF_ULP, dev

pytestmark = pytest.mark.sim


def check(got_bits, wf, xq, bias=None, extra=0.0):
    ref = xq @ wf.astype(np.float64).T
    if bias is not None:
        ref = ref + bf16_to_f32(bias)
    slack = 1e-5 * (np.abs(xq) @ np.abs(wf.astype(np.float64)).T) + 1e-6 + extra
    got = bf16_to_f32(got_bits).astype(np.float64)
    excess = np.abs(got - ref) - (2 * HALF_ULP * np.abs(ref) + slack)
    assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


def case(seed, n, k, bias, outlier=False):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] *= 2.0 ** 20                            # a large block scale
    w[1, 32:64] *= 2.0 ** -100                        # a tiny one
    qw = quantize_mxfp4(w)
    xf = rng.standard_normal((1, k)).astype(np.float32)
    if outlier:
        xf[0, 5] = 3000.0                             # block 0: the others keep about 6 bits
        xf[0, 40:72] *= 2.0 ** -120                   # tiny values (subnormal bf16 among them)
    x = f32_to_bf16(xf)
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    return qw, x, bb


def run(qw, x, bb, row_tiles):
    n = qw.packed.shape[0]
    out = cuda.device_array((1, n), np.uint16)
    qgemv_imma.launch(dev(qw.packed), dev(qw.scales), dev(x), out,
                      None if bb is None else dev(bb), 0, row_tiles=row_tiles)
    return out.copy_to_host()


@pytest.mark.parametrize("n,k,bias,row_tiles,outlier", [
    (37, 256, True, 1, True),       # odd N: clamped rows; bias; an outlier and tiny values in x
    (45, 384, False, 2, False),     # two row tiles per block, the last block half past N; 3 groups per 4 warps
])
def test_qgemv_imma_matches_reference(n, k, bias, row_tiles, outlier):
    qw, x, bb = case(n * k, n, k, bias, outlier)
    got = run(qw, x, bb, row_tiles)
    wf = dequantize_mxfp4(*qw)
    xq = qgemv_imma.x_as_applied(x)
    check(got, wf, xq, bb)
    # against the given x: the rounding moves each value by at most half a step of its block
    xf = bf16_to_f32(x).astype(np.float64)
    assert np.all(np.abs(xq - xf) <= np.repeat(np.abs(xf).reshape(-1, 32).max(axis=1), 32) * 2.0 ** -14 + 2.0 ** -140)
    check(got, wf, xf, bb, extra=np.abs(xq - xf) @ np.abs(wf.astype(np.float64)).T)


def test_qgemv_imma_two_x_tiles():
    """K 4096 + 256: a second x tile with 2 groups (warps 2, 3 multiply staged zeros)."""
    qw, x, bb = case(7, 16, 4352, False)
    got = run(qw, x, bb, 1)
    check(got, dequantize_mxfp4(*qw), qgemv_imma.x_as_applied(x))


def test_qgemv_imma_nonfinite_x_gives_nan():
    qw, x, bb = case(3, 16, 256, False)
    x = x.copy()
    x[0, 100] = 0x7F80                                # +inf in block 3
    got = bf16_to_f32(run(qw, x, bb, 1))
    assert np.all(np.isnan(got))


def test_x_as_applied_rounding():
    x = f32_to_bf16(np.array([[1.0, -3.0, 2.0 ** -7, 2.0 ** -8, 1.5 * 2.0 ** -8] + [0.0] * 27], np.float32))
    q = qgemv_imma.x_as_applied(x)[0]
    # largest |x| 3 (exponent field 128): step 2^-12; 2^-7 and 2^-8 exact, 1.5 · 2^-8 exact (a multiple of 2^-12)
    assert q[:5].tolist() == [1.0, -3.0, 2.0 ** -7, 2.0 ** -8, 1.5 * 2.0 ** -8]
    x = f32_to_bf16(np.array([[2.0 ** 10, 1.0 + 2.0 ** -7] + [0.0] * 30], np.float32))
    q = qgemv_imma.x_as_applied(x)[0]
    assert q[1] == 1.0                                # step 2^-3 (exponent 10): 1 + 2^-7 rounds to 1


def test_qgemv_mxfp4_default_route_at_batch_1_is_imma():
    """``qgemv_mxfp4`` with the default config: batch 1 on this kernel (the same bits as a direct launch),
    batch 2 on the bf16 route (against the unrounded x, the other GEMV tests' tolerance)."""
    from vmmstream.kernels.matmul.quant import gemv as qgemv
    qw, x, _ = case(21, 16, 256, False, outlier=True)
    direct = run(qw, x, None, 1)
    out = cuda.device_array((1, 16), np.uint16)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), direct)
    x2 = np.concatenate([x, x[:, ::-1]])
    out2 = cuda.device_array((2, 16), np.uint16)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(np.ascontiguousarray(x2)), out2)
    check(out2.copy_to_host(), dequantize_mxfp4(*qw), bf16_to_f32(x2).astype(np.float64))
    with pytest.raises(ValueError, match="batch 1"):
        qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(np.ascontiguousarray(x2)), out2,
                          config=qgemv.QgemvConfig(route="imma"))
