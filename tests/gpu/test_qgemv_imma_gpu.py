"""The batch-1 MXFP4 GEMV on integer tensor cores (``kernels/matmul/quant/gemv_imma.py``) on the GPU, at the decode shapes:
against the x the kernel applies (``x_as_applied``, the fp64 product; one bf16 rounding plus fp32 slack), and
against the given x with the rounding's bound added; a non-finite x gives NaN; a captured replay gives the same
bits as the eager launch."""

from __future__ import annotations

import numpy as np
import pytest

from vmmstream.kernels.matmul.quant import gemv_imma as qgemv_imma
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import dequantize_mxfp4, quantize_mxfp4

from gpuutil import HALF_ULP, captured, get, to_dev

pytestmark = pytest.mark.gpu

H, I = 4096, 14336


def assert_close(got_bits, wf, xq, bias=None, extra=0.0):
    w64 = wf.astype(np.float64)
    ref = xq @ w64.T
    if bias is not None:
        ref = ref + bf16_to_f32(bias)
    slack = 1e-5 * (np.abs(xq) @ np.abs(w64).T) + 1e-6 + extra
    got = bf16_to_f32(got_bits).astype(np.float64)
    excess = np.abs(got - ref) - (2 * HALF_ULP * np.abs(ref) + slack)
    assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


def _case(n, k, bias, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05))
    qw = quantize_mxfp4(w)
    xf = rng.standard_normal((1, k)).astype(np.float32)
    xf[0, 7] = 200.0                                   # an outlier: its block keeps fewer bits
    x = f32_to_bf16(xf)
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    return qw, x, bb


def _launch(stream, qw, x, bb, row_tiles=0):
    n = qw.packed.shape[0]
    out = to_dev(np.zeros((1, n), np.uint16), stream)
    args = (to_dev(qw.packed, stream), to_dev(qw.scales, stream), to_dev(x, stream),
            out, None if bb is None else to_dev(bb, stream))
    return out, args


@pytest.mark.parametrize("n,k,bias,row_tiles", [
    (I, H, False, 0),      # gate/up projection, 7 row tiles per block (auto)
    (H, I, True, 0),       # down projection: K over 3.5 x tiles; bias
    (I, H, False, 1),      # one row tile per block
    (37, 384, False, 2),   # odd N, blocks half past N
])
def test_qgemv_imma_matches_reference(stream, n, k, bias, row_tiles):
    qw, x, bb = _case(n, k, bias, n + k)
    out, args = _launch(stream, qw, x, bb)
    qgemv_imma.launch(*args, stream, row_tiles=row_tiles)
    got = get(out, stream)
    wf = dequantize_mxfp4(*qw)
    xq = qgemv_imma.x_as_applied(x)
    assert_close(got, wf, xq, bb)
    xf = bf16_to_f32(x).astype(np.float64)
    assert_close(got, wf, xf, bb, extra=np.abs(xq - xf) @ np.abs(wf.astype(np.float64)).T)


def test_qgemv_imma_nonfinite_x_gives_nan(stream):
    qw, x, bb = _case(64, 256, False, 5)
    x = x.copy()
    x[0, 200] = 0x7FC0                                 # NaN in block 6
    out, args = _launch(stream, qw, x, bb)
    qgemv_imma.launch(*args, stream)
    assert np.all(np.isnan(bf16_to_f32(get(out, stream))))


def test_qgemv_imma_captured_replay_same_bits(stream):
    qw, x, bb = _case(I, H, False, 9)
    out, args = _launch(stream, qw, x, bb)
    qgemv_imma.launch(*args, stream)
    eager = get(out, stream).copy()
    out2, args2 = _launch(stream, qw, x, bb)
    with captured(stream, lambda: qgemv_imma.launch(*args2, stream)) as replay:
        replay()
        replay()
        assert np.array_equal(get(out2, stream), eager)


@pytest.mark.filterwarnings("error:Passing foreign stream objects:DeprecationWarning")   # launch_pdl's stream
@pytest.mark.parametrize("pdl", [False, True])
def test_qgemv_mxfp4_default_route_is_imma_and_waits_for_x(stream, pdl):
    """``qgemv_mxfp4`` at batch 1 with the default config takes this kernel (the same bits as a direct launch);
    with ``pdl`` it may start while the kernel before it runs: the producer here lets it start at once, sleeps
    a few ms and only then writes x over zeros; the GEMV, loading W meanwhile, must multiply the new x."""
    from numba import cuda
    from vmmstream.kernels.matmul.quant import gemv as qgemv
    from vmmstream.kernels.base.launch import grid_dependents_launch

    @cuda.jit
    def produce(src, dst):
        grid_dependents_launch()
        for _ in range(2000):
            cuda.nanosleep(1000)
        i = cuda.threadIdx.x
        while i < src.size:
            dst[0, i] = src[0, i]
            i += cuda.blockDim.x

    qw, x, _ = _case(I, H, False, 11)
    out, args = _launch(stream, qw, x, None)
    qgemv_imma.launch(*args, stream)
    direct = get(out, stream).copy()
    src, dx = to_dev(x, stream), to_dev(np.zeros_like(x), stream)
    got = cuda.device_array((1, I), np.uint16, stream=stream)
    produce[1, 256, stream](src, dx)
    qgemv.qgemv_mxfp4(args[0], args[1], dx, got, stream=stream, config=qgemv.QgemvConfig(pdl=pdl))
    assert np.array_equal(get(got, stream), direct)
