"""Quantized GEMVs (int4, MXFP4) on a real GPU at Llama-8B MLP shapes (4096 x 14336 both ways), on a
non-default stream, against their NumPy references. Fails (never skips) without a GPU (root conftest).

Tolerances: the weight is the *dequantized* matrix (quantization error is not the kernel's, see
tests/unit/test_quant.py); the bf16 output may differ from the unrounded fp64 reference by one rounding
(2⁻⁸·|ref|) plus the fp32 accumulation slack 3e-5 · Σ|xᵢ·wᵢ|, as in test_dense_kernels_gpu.py. Against
the rounded reference (``reference_int4`` / ``reference_mxfp4``) at most 1 bf16 step apart where the
accumulation slack is under half a step (a 4 x 14336 case with cancellation was 2 steps apart on the H200).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from vmmstream.kernels.matmul.quant import gemv as qgemv
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import dequantize_int4, dequantize_mxfp4, quantize_int4, quantize_mxfp4

from gpuutil import HALF_ULP, get, to_dev

pytestmark = pytest.mark.gpu

H, I = 4096, 14336
SIMT = qgemv.QgemvConfig(route="simt")   # the scalar route; the tensor-core route is tested below


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(2027)


def assert_close(got_bits, wf, x, bias=None, rounded_ref=None):
    xf = bf16_to_f32(x).astype(np.float64)
    w64 = wf.astype(np.float64)
    ref = xf @ w64.T
    if bias is not None:
        ref = ref + bf16_to_f32(bias)
    slack = 3e-5 * (np.abs(xf) @ np.abs(w64).T) + 1e-6
    got = bf16_to_f32(got_bits).astype(np.float64)
    excess = np.abs(got - ref) - (2 * HALF_ULP * np.abs(ref) + slack)
    assert np.all(excess <= 0), f"max excess {excess.max():.3g}"
    if rounded_ref is not None:   # where the accumulation slack is under half a step, at most one step apart
        tight = slack < HALF_ULP * np.abs(ref)
        assert tight.any()
        assert np.max(np.abs(got_bits.astype(np.int32) - rounded_ref.astype(np.int32))[tight]) <= 1


@pytest.mark.parametrize("n,k,b,bias,scale_dtype", [
    (I, H, 1, False, np.float16),     # gate/up projection
    (H, I, 1, False, np.float16),     # down projection (K over several shared-memory tiles)
    (H, I, 4, True, np.float32),      # batch decode, Qwen2-style bias, fp32 scales
    (37, 256, 1, False, np.float16),  # odd N: a clamped last warp
])
def test_qgemv_int4(stream, rng, n, k, b, bias, scale_dtype):
    from numba import cuda
    w = (rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05))
    qw = quantize_int4(w, scale_dtype=scale_dtype)
    x = f32_to_bf16(rng.standard_normal((b, k), dtype=np.float32))
    bb = f32_to_bf16(rng.standard_normal(n, dtype=np.float32)) if bias else None
    out = cuda.device_array((b, n), np.uint16, stream=stream)
    qgemv.qgemv_int4(*(to_dev(a, stream) for a in qw), to_dev(x, stream), out,
                     bias=None if bb is None else to_dev(bb, stream), stream=stream, config=SIMT)
    assert_close(get(out, stream), dequantize_int4(*qw), x, bb, qgemv.reference_int4(*qw, x, bb))


@pytest.mark.parametrize("n,k,b,bias", [
    (I, H, 1, False),
    (H, I, 1, False),
    (H, I, 2, True),
    (37, 96, 1, False),
])
def test_qgemv_mxfp4(stream, rng, n, k, b, bias):
    from numba import cuda
    w = (rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05))
    qw = quantize_mxfp4(w)
    x = f32_to_bf16(rng.standard_normal((b, k), dtype=np.float32))
    bb = f32_to_bf16(rng.standard_normal(n, dtype=np.float32)) if bias else None
    out = cuda.device_array((b, n), np.uint16, stream=stream)
    qgemv.qgemv_mxfp4(*(to_dev(a, stream) for a in qw), to_dev(x, stream), out,
                      bias=None if bb is None else to_dev(bb, stream), stream=stream, config=SIMT)
    assert_close(get(out, stream), dequantize_mxfp4(*qw), x, bb, qgemv.reference_mxfp4(*qw, x, bb))


def test_qgemv_int4_quantization_error_is_small_vs_dense(stream, rng):
    """End to end against the *unquantized* bf16 weight: round-to-nearest int4 g128 has a relative RMS
    weight error of ~0.10 on Gaussian weights (quantization_error), and the output error follows it; a
    sanity bound (0.15), not a kernel tolerance."""
    from numba import cuda
    w = bf16_to_f32(f32_to_bf16(rng.standard_normal((H, H), dtype=np.float32) * np.float32(0.05)))
    qw = quantize_int4(w)
    x = f32_to_bf16(rng.standard_normal((1, H), dtype=np.float32))
    out = cuda.device_array((1, H), np.uint16, stream=stream)
    qgemv.qgemv_int4(*(to_dev(a, stream) for a in qw), to_dev(x, stream), out, stream=stream)
    dense = bf16_to_f32(x).astype(np.float64) @ w.astype(np.float64).T
    got = bf16_to_f32(get(out, stream)).astype(np.float64)
    assert np.sqrt(np.mean((got - dense) ** 2)) / np.sqrt(np.mean(dense ** 2)) < 0.15


# ------------------------------------------------------------------------------------- prefill GEMM

@pytest.mark.parametrize("kind", ["int4", "mxfp4"])
@pytest.mark.parametrize("route", ["in_register", "dense_cache", "mma"])
def test_qgemm_routes_at_llama_shapes(stream, rng, kind, route):
    """qgemm, every route, M = 77 prompt rows x [4096 -> 14336] with bias, against x · dequantized(W)ᵀ."""
    from vmmstream.kernels.matmul.quant import gemm as qgemm
    m, n, k = 77, I, H
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x = f32_to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    bias = f32_to_bf16((rng.standard_normal(n) * 0.1).astype(np.float32))
    qw = quantize_int4(w) if kind == "int4" else quantize_mxfp4(w)
    wf = qgemm.dequantized(qw, kind, route=route)
    req = qgemm.workspace_requirement(m, n, k, kind, route=route)
    ws = to_dev(np.zeros(req.bytes, np.uint8), stream) if req.bytes else None
    out = to_dev(np.zeros((m, n), np.uint16), stream)
    args = [to_dev(a, stream) for a in qw] + [to_dev(x, stream), out]
    launch = qgemm.qgemm_int4 if kind == "int4" else qgemm.qgemm_mxfp4
    launch(*args, bias=to_dev(bias, stream), route=route, workspace=ws, stream=stream)
    assert_close(get(out, stream), wf, x, bias)


@functools.lru_cache(maxsize=None)
def _quantized(kind, n, k):
    w = (np.random.default_rng(n + k).standard_normal((n, k), dtype=np.float32) * np.float32(0.05))
    return quantize_int4(w) if kind == "int4" else quantize_mxfp4(w)


@pytest.mark.parametrize("prefetch,l2,stages,row_tiles", [(True, 0, 0, 0), (True, 0, 0, 1), (False, 0, 0, 1),
                                                           (True, 4, 0, 1), (True, 0, 4, 1)],
                         ids=["prefetch", "prefetch-rt1", "noprefetch", "prefetch-l2", "cpasync4"])
@pytest.mark.parametrize("kind", ["int4", "mxfp4"])
@pytest.mark.parametrize("n,k,b,bias", [(I, H, 1, False), (H, I, 1, True), (H, I, 11, False)])
def test_qgemv_mma_route(stream, rng, kind, n, k, b, bias, prefetch, l2, stages, row_tiles):
    """The tensor-core route at Llama-8B MLP shapes, batch 1 (x staged in 1 or 4 tiles) and 11 (two column
    tiles), with and without the one-group-ahead loads, the L2 prefetch 4 groups ahead and W through a cp.async
    ring of 4 stages, same bounds as the scalar route. ``prefetch`` is the default: at batch 1, blocks of
    several row tiles sharing one staging of x (on 132 SMs 7 at N 14336, 2 at N 4096: ``auto_row_tiles``);
    ``rt1`` one tile per block."""
    from numba import cuda
    x = f32_to_bf16(rng.standard_normal((b, k), dtype=np.float32))
    bb = f32_to_bf16(rng.standard_normal(n, dtype=np.float32)) if bias else None
    out = cuda.device_array((b, n), np.uint16, stream=stream)
    cfg = qgemv.QgemvConfig(route="mma", mma_prefetch=prefetch, mma_l2_ahead=l2, mma_stages=stages,
                            mma_row_tiles=row_tiles)
    dbias = None if bb is None else to_dev(bb, stream)
    qw = _quantized(kind, n, k)
    if kind == "int4":
        qgemv.qgemv_int4(*(to_dev(a, stream) for a in qw), to_dev(x, stream), out, bias=dbias, stream=stream,
                         config=cfg)
        assert_close(get(out, stream), dequantize_int4(*qw), x, bb, qgemv.reference_int4(*qw, x, bb))
    else:
        qgemv.qgemv_mxfp4(*(to_dev(a, stream) for a in qw), to_dev(x, stream), out, bias=dbias, stream=stream,
                          config=cfg)
        assert_close(get(out, stream), dequantize_mxfp4(*qw), x, bb, qgemv.reference_mxfp4(*qw, x, bb))


@pytest.mark.parametrize("kind", ["int4", "mxfp4"])
@pytest.mark.parametrize("n,k,bias,row_tiles", [(I, H, False, 0), (H, I, True, 1)])
def test_qgemv_mma_early_y_same_bits(stream, rng, kind, n, k, bias, row_tiles):
    """Batch 1 with ``mma_early_y`` (each pair's second group loaded one step earlier): the same products in the
    same order, so the same bits as the default launch, at x in one tile and in four."""
    from numba import cuda
    x = to_dev(f32_to_bf16(rng.standard_normal((1, k), dtype=np.float32)), stream)
    bb = to_dev(f32_to_bf16(rng.standard_normal(n, dtype=np.float32)), stream) if bias else None
    parts = [to_dev(a, stream) for a in _quantized(kind, n, k)]
    fn = qgemv.qgemv_int4 if kind == "int4" else qgemv.qgemv_mxfp4
    got = []
    for early in (False, True):
        out = cuda.device_array((1, n), np.uint16, stream=stream)
        fn(*parts, x, out, bias=bb, stream=stream,
           config=qgemv.QgemvConfig(route="mma", mma_row_tiles=row_tiles, mma_early_y=early))
        got.append(get(out, stream))
    assert np.array_equal(got[0], got[1])


@pytest.mark.parametrize("n,k,bias,row_tiles", [(I, H, False, 0), (H, I, True, 4)])
def test_qgemv_mma_mxfp4_chains_and_x_first(stream, rng, n, k, bias, row_tiles):
    """MXFP4 at batch 1, the four loops of ``mma_split`` x ``mma_x_first``: each close to the reference; x
    loaded first changes no arithmetic, so the same bits as x after W (at x in one tile and in four)."""
    from numba import cuda
    x = to_dev(f32_to_bf16(rng.standard_normal((1, k), dtype=np.float32)), stream)
    bbh = f32_to_bf16(rng.standard_normal(n, dtype=np.float32)) if bias else None
    bb = to_dev(bbh, stream) if bias else None
    qw = _quantized("mxfp4", n, k)
    parts = [to_dev(a, stream) for a in qw]
    xh = get(x, stream)
    ref = qgemv.reference_mxfp4(*qw, xh, bbh)
    got = {}
    for split in (False, True):
        for first in (False, True):
            out = cuda.device_array((1, n), np.uint16, stream=stream)
            qgemv.qgemv_mxfp4(*parts, x, out, bias=bb, stream=stream,
                              config=qgemv.QgemvConfig(route="mma", mma_row_tiles=row_tiles, mma_split=split,
                                                       mma_x_first=first))
            got[split, first] = get(out, stream)
            assert_close(got[split, first], dequantize_mxfp4(*qw), xh, bbh, ref)
    for split in (False, True):
        assert np.array_equal(got[split, False], got[split, True])


@pytest.mark.parametrize("n,k,bias", [(I, H, False), (H, I, True)])
def test_qgemv_mx16_route(stream, rng, n, k, bias):
    """MXFP4 at batch 1 on f16 tensor cores (kernels/matmul/quant/gemv_mx16.py) at Llama-8B MLP shapes: x staged in one
    tile (K 4096) and in four (K 14336), then the same call through the default route (the mma route's
    batch-1 path, block scales on D); same bounds as the others."""
    from numba import cuda
    x = f32_to_bf16(rng.standard_normal((1, k), dtype=np.float32))
    bb = f32_to_bf16(rng.standard_normal(n, dtype=np.float32)) if bias else None
    dbias = None if bb is None else to_dev(bb, stream)
    qw = _quantized("mxfp4", n, k)
    for cfg in (qgemv.QgemvConfig(route="mx16"), None):
        out = cuda.device_array((1, n), np.uint16, stream=stream)
        qgemv.qgemv_mxfp4(*(to_dev(a, stream) for a in qw), to_dev(x, stream), out, bias=dbias, stream=stream,
                          config=cfg)
        assert_close(get(out, stream), dequantize_mxfp4(*qw), x, bb, qgemv.reference_mxfp4(*qw, x, bb))


@pytest.mark.parametrize("kind,b", [("int4", 1), ("mxfp4", 1), ("mxfp4", 11)])
def test_qgemv_mma_pdl_reads_x_after_the_kernel_before_it(stream, rng, kind, b):
    """Programmatic dependent launch (``QgemvConfig(pdl=True)``): the GEMV may start while the kernel before
    it runs. The producer here lets it start at once (``grid_dependents_launch`` first), sleeps a few ms
    and only then writes x over zeros; the GEMV, loading W meanwhile, must multiply the new x. Batch 1 and 11
    (the two loops). A second, plain launch on the same data gives the same bits."""
    from numba import cuda
    from vmmstream.kernels.base.launch import grid_dependents_launch

    @cuda.jit
    def produce(src, dst):
        grid_dependents_launch()
        for _ in range(2000):
            cuda.nanosleep(1000)
        i = cuda.threadIdx.x
        while i < src.size:
            dst[i // src.shape[1], i % src.shape[1]] = src[i // src.shape[1], i % src.shape[1]]
            i += cuda.blockDim.x

    n, k = I, H
    x = f32_to_bf16(rng.standard_normal((b, k), dtype=np.float32))
    src = to_dev(x, stream)
    dx = to_dev(np.zeros_like(x), stream)
    qw = _quantized(kind, n, k)
    parts = [to_dev(a, stream) for a in qw]
    outs = [cuda.device_array((b, n), np.uint16, stream=stream) for _ in range(2)]
    for out, pdl in zip(outs[::-1], (False, True)):   # the plain launch first: it compiles both kernels
        dx.copy_to_device(np.zeros_like(x), stream=stream)
        produce[1, 256, stream](src, dx)
        cfg = qgemv.QgemvConfig(route="mma", pdl=pdl)
        if kind == "int4":
            qgemv.qgemv_int4(*parts, dx, out, stream=stream, config=cfg)
        else:
            qgemv.qgemv_mxfp4(*parts, dx, out, stream=stream, config=cfg)
    got = get(outs[0], stream)
    if kind == "int4":
        assert_close(got, dequantize_int4(*qw), x, None, qgemv.reference_int4(*qw, x, None))
    else:
        assert_close(got, dequantize_mxfp4(*qw), x, None, qgemv.reference_mxfp4(*qw, x, None))
    assert np.array_equal(got, get(outs[1], stream))


@pytest.mark.parametrize("kind", ["int4", "mxfp4"])
@pytest.mark.parametrize("b,col_tiles", [(16, 2), (27, 4)])
def test_qgemv_mma_column_tiles_same_bits_as_one_tile(stream, rng, kind, b, col_tiles):
    """Batch 16 / 27 with 2 / 4 column tiles a block (each group of W decoded once for all of them): every output
    bit equal to blocks of one tile, so a batch's rows keep the tokens each gets alone."""
    from numba import cuda
    x = to_dev(f32_to_bf16(rng.standard_normal((b, H), dtype=np.float32)), stream)
    qw = _quantized(kind, I, H)
    fn = qgemv.qgemv_int4 if kind == "int4" else qgemv.qgemv_mxfp4
    got = {}
    for ct in (1, col_tiles):
        out = cuda.device_array((b, I), np.uint16, stream=stream)
        fn(*(to_dev(a, stream) for a in qw), x, out, stream=stream,
           config=qgemv.QgemvConfig(route="mma", mma_col_tiles=ct))
        got[ct] = get(out, stream)
    assert np.array_equal(got[col_tiles], got[1])
