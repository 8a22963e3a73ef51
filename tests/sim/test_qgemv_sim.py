"""Quantized GEMVs (int4, MXFP4) in the Numba CUDA simulator, at small odd N, against their NumPy
references (dequantize, fp64 matmul). A few blocks of one or two warps: the simulator runs one Python
thread per CUDA thread.

Tolerance: the bf16 output may differ from the unrounded reference by one rounding (2⁻⁸·|ref|) plus the
fp32 accumulation slack, 1e-5 · Σ|xᵢ·wᵢ| with w the dequantized weight.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.kernels import NONE
from vmmstream.kernels.matmul.quant import gemv as qgemv
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import dequantize_int4, dequantize_mxfp4, quantize_int4, quantize_mxfp4

from simutil import HALF_ULP, dev

pytestmark = pytest.mark.sim


def check(got_bits, wf, x, bias=None):
    xf = bf16_to_f32(x).astype(np.float64)
    ref = xf @ wf.astype(np.float64).T
    if bias is not None:
        ref = ref + bf16_to_f32(bias)
    slack = 1e-5 * (np.abs(xf) @ np.abs(wf.astype(np.float64)).T) + 1e-6
    got = bf16_to_f32(got_bits).astype(np.float64)
    excess = np.abs(got - ref) - (2 * HALF_ULP * np.abs(ref) + slack)
    assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


def make_x(rng, b, k):
    return f32_to_bf16(rng.standard_normal((b, k)).astype(np.float32))


def int4_case(seed, n, k, b, bias, scale_dtype):
    """Quantized random W [N, K], x [B, K], optional bias and an output array: (qw, x, bias bits, out)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qw = quantize_int4(w, scale_dtype=scale_dtype)
    x = make_x(rng, b, k)
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    return qw, x, bb, cuda.device_array((b, n), np.uint16)


@pytest.mark.parametrize("n,k,b,bias,threads,rpw,scale_dtype,tile_k", [
    (37, 256, 1, False, 64, 4, np.float16, 0),      # odd N: a clamped last warp
    (13, 640, 1, True, 32, 2, np.float32, 256),     # K over three shared-memory tiles (256 + 256 + 128), bias
    (5, 128, 3, False, 32, 3, np.float16, 0),       # batch tile 4 with a clamped x row
])
def test_qgemv_int4_matches_reference(n, k, b, bias, threads, rpw, scale_dtype, tile_k):
    qw, x, bb, out = int4_case(n * k + b, n, k, b, bias, scale_dtype)
    qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(x), out,
                     bias=None if bb is None else dev(bb),
                     config=qgemv.QgemvConfig(threads=threads, rows_per_warp=rpw, tile_k=tile_k, route="simt"))
    got = out.copy_to_host()
    check(got, dequantize_int4(*qw), x, bb)
    ref = qgemv.reference_int4(*qw, x, bb)
    assert ref.shape == got.shape and ref.dtype == np.uint16
    # the rounded reference differs by at most one bf16 step where the accumulation order tips it
    assert np.all(np.abs(got.astype(np.int32) - ref.astype(np.int32)) <= 1)


@pytest.mark.parametrize("n,k,b,bias,threads,rpw,tile_k", [
    (37, 256, 1, False, 64, 4, 0),
    (11, 96, 2, True, 32, 2, 0),       # K = 3 blocks (not a multiple of 128), batch tile 2, bias
    (6, 416, 1, False, 32, 1, 160),    # tiles of 5 blocks: 160 + 160 + 96
])
def test_qgemv_mxfp4_matches_reference(n, k, b, bias, threads, rpw, tile_k):
    rng = np.random.default_rng(n * k + b + 1)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[1, :32] *= 1e-4                         # blocks with very different scales
    qw = quantize_mxfp4(w)
    x = make_x(rng, b, k)
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    out = cuda.device_array((b, n), np.uint16)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out, bias=None if bb is None else dev(bb),
                      config=qgemv.QgemvConfig(threads=threads, rows_per_warp=rpw, tile_k=tile_k, route="simt"))
    got = out.copy_to_host()
    check(got, dequantize_mxfp4(*qw), x, bb)
    assert np.all(np.abs(got.astype(np.int32) - qgemv.reference_mxfp4(*qw, x, bb).astype(np.int32)) <= 1)


def test_qgemv_vector_input_and_default_config():
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((3, 128)) * 0.1).astype(np.float32)
    qw = quantize_mxfp4(w)
    x = make_x(rng, 1, 128)[0]
    out = cuda.device_array(3, np.uint16)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out)
    check(out.copy_to_host()[None], dequantize_mxfp4(*qw), x[None])


def test_qgemv_rejects_bad_shapes_and_types():
    rng = np.random.default_rng(8)
    qw = quantize_int4((rng.standard_normal((4, 256)) * 0.1).astype(np.float32))
    x, out = dev(make_x(rng, 1, 256)), cuda.device_array((1, 4), np.uint16)
    with pytest.raises(ValueError, match="shapes"):
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales[:, :1]), dev(qw.zeros[:, :1]), x, out)
    with pytest.raises(ValueError, match="shapes"):
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), x, cuda.device_array((1, 4), np.float32))
    with pytest.raises(ValueError, match="float16 or float32"):
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros.astype(np.float32)), x, out)
    with pytest.raises(ValueError, match="tile_k"):
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), x, out, config=qgemv.QgemvConfig(tile_k=100, route="simt"))
    with pytest.raises(ValueError, match="uint8 E8M0"):
        qgemv.qgemv_mxfp4(dev(qw.packed), dev(np.zeros((4, 8), np.float16)), x, out)


def test_qgemv_declares_no_workspace():
    assert qgemv.workspace_requirement(14336, 4096) == NONE
    assert qgemv.CAPTURE_SAFE is True and qgemv.SIGNATURES
    n, k = 4096, 14336
    assert qgemv.bytes_moved(n, k, kind="int4") == n * k // 2 + 4 * n * k // 128 + 2 * k + 2 * n
    assert qgemv.bytes_moved(n, k, kind="mxfp4") == n * k // 2 + n * k // 32 + 2 * k + 2 * n
    assert qgemv.flops(n, k, 2) == 4 * n * k


@pytest.mark.parametrize("n,k,b,bias,scale_dtype,prefetch,stages", [
    (20, 640, 1, True, np.float16, True, 0),    # 5 groups over 4 warps: 3 clamped reloads meet staged zeros; 2 row tiles
    (20, 4608, 1, False, np.float16, True, 0),  # 36 groups: x staged in two tiles of 32 groups (the second partial)
    (20, 640, 1, False, np.float16, False, 0),  # loads at the top of each iteration
    (20, 2560, 1, False, np.float16, True, 4),  # W through a cp.async ring of 4 stages, 5 iterations (wraps)
    (9, 640, 10, False, np.float32, True, 3),   # batch 10: two column tiles of 8 (tiles of 4 groups), N < 16; ring of 3
    (40, 256, 12, True, np.float16, True, 0),   # batch 12: a grid of 2 column tiles x 3 row tiles (column tile fastest)
])
def test_qgemv_int4_mma_route_matches_reference(n, k, b, bias, scale_dtype, prefetch, stages):
    """The tensor-core route (kernels/matmul/quant/gemv_mma.py): packed bf16 pairs of nibbles (j, j + 4), zero point
    taken off by the packed fma, x staged in shared memory as the matching pairs, the mma emulated lane by
    lane with the PTX fragment layouts."""
    qw, x, bb, out = int4_case(n * k + b + 7, n, k, b, bias, scale_dtype)
    qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(x), out,
                     bias=None if bb is None else dev(bb),
                     config=qgemv.QgemvConfig(route="mma", mma_prefetch=prefetch, mma_stages=stages))
    got = out.copy_to_host()
    check(got, dequantize_int4(*qw), x, bb)
    assert np.all(np.abs(got.astype(np.int32) - qgemv.reference_int4(*qw, x, bb).astype(np.int32)) <= 1)
    with pytest.raises(ValueError, match="route"):
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(x), out,
                         config=qgemv.QgemvConfig(route="wmma"))


@pytest.mark.parametrize("n,k,b,bias,prefetch,stages", [
    (20, 640, 1, True, True, 0),    # 5 groups of 4 MX blocks over 4 warps, two row tiles, bias
    (20, 640, 1, False, False, 0),  # loads at the top of each iteration
    (20, 1664, 1, False, True, 3),  # W through a cp.async ring of 3 stages, 4 iterations (wraps)
    (9, 256, 3, False, True, 0),    # batch 3 in one column tile
])
def test_qgemv_mxfp4_mma_route_matches_reference(n, k, b, bias, prefetch, stages):
    """MXFP4 on the tensor-core route: E2M1 pairs placed as bf16 (value * 2^-126, subnormal for the
    smallest code) and scaled exactly by one packed fma with 2^(e - 1); a warp holding a block scale above 2
    (row 2's second block here) takes 2^126 then 2^(e - 127) for that group."""
    rng = np.random.default_rng(n * k + b + 11)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[1, :32] *= 1e-4                         # blocks with very different scales
    w[2, 32:64] *= 300.0
    qw = quantize_mxfp4(w)
    assert (qw.scales > 128).any() and (qw.scales <= 128).any()   # both scale paths run
    x = make_x(rng, b, k)
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    out = cuda.device_array((b, n), np.uint16)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out, bias=None if bb is None else dev(bb),
                      config=qgemv.QgemvConfig(route="mma", mma_prefetch=prefetch, mma_stages=stages))
    got = out.copy_to_host()
    check(got, dequantize_mxfp4(*qw), x, bb)
    assert np.all(np.abs(got.astype(np.int32) - qgemv.reference_mxfp4(*qw, x, bb).astype(np.int32)) <= 1)


@pytest.mark.parametrize("route", ["mx16", "mma"])
@pytest.mark.parametrize("n,k,bias,x_scale,outlier_tile,edge", [
    (20, 640, True, 1.0, 0, None),      # 5 groups over 4 warps, two row tiles, bias
    (9, 8320, False, 3e-3, 0, None),    # 65 groups: x staged in three tiles (4096, 4096, 128), each with its own E
    (9, 8320, False, 3.0, 0, None),     # the same with |x| above 1, where the tiles' factors differ from the floor's
    (9, 8320, False, 3.0, 1, None),     # the outlier in the middle tile only (mma: its own scale, the others the fixed one)
    (20, 640, False, 1.0, 0, 4080.0),   # mma: the largest bf16 below 2^12 stays on the fixed scale (x · 2^116 finite)
    (20, 640, False, 1.0, 0, 4096.0),   # mma: 2^12 takes the tile's own scale
])
def test_qgemv_mxfp4_batch1_block_scale_on_d_matches_reference(route, n, k, bias, x_scale, outlier_tile, edge):
    """MXFP4 at batch 1 with the block scale applied to the mma's D, x staged scaled by its tile's
    largest value: ``mx16`` (kernels/matmul/quant/gemv_mx16.py: E2M1 codes spread into E4M3 bytes, converted to exact
    f16 pairs, x as f16) and the default ``mma`` route (kernels/matmul/quant/gemv_mma.py: bf16 codes · 2^-126, x as
    bf16 · 2^c, B's column 2t holding x only at MX block t so that D column 2t is that block's sum).
    Rows with block scales 2^-127 (e = 0), tiny and large. With three tiles, the first holds only an
    outlier 10^10 times the later values (against zero weights): a later tile scaled by the first tile's
    largest would lose its values' low bits (f16), or its products would fall below fp32's range (bf16);
    the mma route stages a tile whose |x| stay below 2^12 at a fixed 2^116 and any other at its own scale,
    so the outlier in the middle tile and values at the threshold take both paths."""
    rng = np.random.default_rng(n * k + 5)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[1, :32] *= 1e-37                        # e = 0: scale 2^-127
    w[2, 32:64] *= 300.0
    w[3, 64:96] *= 1e-4
    w[:, 7] = 0.0
    xf = rng.standard_normal((1, k)).astype(np.float32) * np.float32(x_scale)
    if k > 4096:
        t0 = 4096 * outlier_tile
        xf[0, t0:t0 + 4096] = 0.0
        xf[0, t0 + 7] = 1e10 * x_scale
        w[4:, 8192:] *= 30.0                  # the last tile's values dominate y
    if edge is not None:
        xf[0, 3] = edge                       # the mma route's fixed scale holds for |x| < 2^12 (X_EF)
    qw = quantize_mxfp4(w)
    assert (qw.scales == 0).any() and (qw.scales > 128).any()
    x = f32_to_bf16(xf)
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    out = cuda.device_array((1, n), np.uint16)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out, bias=None if bb is None else dev(bb),
                      config=qgemv.QgemvConfig(route=route))
    got = out.copy_to_host()
    check(got, dequantize_mxfp4(*qw), x, bb)
    assert np.all(np.abs(got.astype(np.int32) - qgemv.reference_mxfp4(*qw, x, bb).astype(np.int32)) <= 1)
    if route == "mx16":
        with pytest.raises(ValueError, match="mx16"):
            qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(np.concatenate([x, x])),
                              cuda.device_array((2, n), np.uint16), config=qgemv.QgemvConfig(route="mx16"))


def test_qgemv_mma_pdl_option():
    """``QgemvConfig(pdl=True)`` (programmatic dependent launch, a plain launch in the simulator) runs the mma
    route's kernel, with its grid-dependency wait, to the same result; on an explicit other route it is an
    error, and where "auto" takes the scalar route it does not apply."""
    qw, x, _, out = int4_case(641, 20, 640, 1, False, np.float16)
    qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(x), out,
                     config=qgemv.QgemvConfig(route="mma", pdl=True))
    assert np.all(np.abs(out.copy_to_host().astype(np.int32) - qgemv.reference_int4(*qw, x, None).astype(np.int32)) <= 1)
    for route in ("simt", "mx16"):
        with pytest.raises(ValueError, match="pdl"):
            qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(x), out,
                             config=qgemv.QgemvConfig(route=route, pdl=True))
    # "auto" with K not a multiple of 128 (MXFP4, K = 96) takes the scalar route: pdl does not apply there
    rng = np.random.default_rng(643)
    qm = quantize_mxfp4((rng.standard_normal((20, 96)) * 0.05).astype(np.float32))
    x = make_x(rng, 1, 96)
    out = cuda.device_array((1, 20), np.uint16)
    qgemv.qgemv_mxfp4(dev(qm.packed), dev(qm.scales), dev(x), out, config=qgemv.QgemvConfig(pdl=True))
    assert np.all(np.abs(out.copy_to_host().astype(np.int32) - qgemv.reference_mxfp4(*qm, x, None).astype(np.int32)) <= 1)


@pytest.mark.parametrize("kind,n,k,row_tiles,bias,outlier,early_y", [
    ("int4", 40, 640, 2, True, False, False),      # 3 row tiles in blocks of 2: the second block's last tile past N
    ("mxfp4", 40, 640, 2, False, False, False),
    ("mxfp4", 40, 4608, 3, True, True, False),     # 384 threads (not dividing the 512 chunks of a tile), two x
    # tiles, the second staged again at its own scale; early_y: the second groups loaded one step earlier,
    # across a tile boundary (4608: 36 groups, a second tile of 4) and with an odd count per warp (640: 5)
    # (early_y is an option, off by default: the slow tier)
    pytest.param("int4", 40, 4608, 1, False, False, True, marks=pytest.mark.slow),
    pytest.param("mxfp4", 40, 640, 2, True, False, True, marks=pytest.mark.slow),
    pytest.param("mxfp4", 40, 4608, 3, False, True, True, marks=pytest.mark.slow),
])
def test_qgemv_mma_row_tiles_share_one_staging(kind, n, k, row_tiles, bias, outlier, early_y):
    """Batch 1 with several 16-row tiles per block (``QgemvConfig(mma_row_tiles=r)``): 4 r warps stage x once
    for all the block's tiles and each tile's 4 warps sum their rows as before. Same bits as the reference."""
    rng = np.random.default_rng(n * k + row_tiles)
    cfg = qgemv.QgemvConfig(route="mma", mma_row_tiles=row_tiles, mma_early_y=early_y)
    if kind == "int4":
        qw, x, bb, out = int4_case(n * k + 1, n, k, 1, bias, np.float16)
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(x), out,
                         bias=None if bb is None else dev(bb), config=cfg)
        ref, wf = qgemv.reference_int4(*qw, x, bb), dequantize_int4(*qw)
    else:
        xf = rng.standard_normal((1, k)).astype(np.float32)
        if outlier:
            xf[0, 4096 + 5] = 1e6                # |x| >= 2^12 in the second tile only
        x = f32_to_bf16(xf)
        qw = quantize_mxfp4((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
        out = cuda.device_array((1, n), np.uint16)
        qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out, bias=None if bb is None else dev(bb),
                          config=cfg)
        ref, wf = qgemv.reference_mxfp4(*qw, x, bb), dequantize_mxfp4(*qw)
    got = out.copy_to_host()
    check(got, wf, x, bb)
    assert np.all(np.abs(got.astype(np.int32) - ref.astype(np.int32)) <= 1)


@pytest.mark.parametrize("row_tiles,split,x_first", [
    (4, None, None),      # the defaults at 4 row tiles: two mma chains, x loaded first (one chunk per thread)
    (7, None, None),      # 896 threads: threads 512 and up hold no chunk of x
    pytest.param(4, False, False, marks=pytest.mark.slow),  # one chain, x after W (the loop before both options)
    pytest.param(2, True, True, marks=pytest.mark.slow),    # x first at 2 row tiles: two chunks per thread
])
def test_qgemv_mma_mxfp4_chains_and_x_first(row_tiles, split, x_first):
    """MXFP4 at batch 1: a group's mma steps in two dependency chains (``mma_split``) and the first x tile
    loaded ahead of W (``mma_x_first``) give the reference's bits, across a second x tile staged again at its
    own scale (K 4608, |x| >= 2^12 there) and a last row tile past N."""
    rng = np.random.default_rng(row_tiles)
    n, k = 40, 4608           # one block at 4 and 7 row tiles, two at 2; the last tile past N in every case
    xf = rng.standard_normal((1, k)).astype(np.float32)
    xf[0, 4096 + 9] = -3e5
    x = f32_to_bf16(xf)
    qw = quantize_mxfp4((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    out = cuda.device_array((1, n), np.uint16)
    cfg = qgemv.QgemvConfig(route="mma", mma_row_tiles=row_tiles, mma_split=split, mma_x_first=x_first)
    qgemv.qgemv_mxfp4(dev(qw.packed), dev(qw.scales), dev(x), out, config=cfg)
    got = out.copy_to_host()
    check(got, dequantize_mxfp4(*qw), x, None)
    assert np.all(np.abs(got.astype(np.int32) - qgemv.reference_mxfp4(*qw, x, None).astype(np.int32)) <= 1)


def test_qgemv_mma_mxfp4_options_checked():
    """``mma_split`` and ``mma_x_first`` are options of MXFP4 at batch 1; x first reads x before W, so not
    with programmatic dependent launch."""
    qm = quantize_mxfp4(np.random.default_rng(3).standard_normal((20, 256)).astype(np.float32))
    x = f32_to_bf16(np.ones((1, 256), np.float32))
    out = cuda.device_array((1, 20), np.uint16)
    with pytest.raises(ValueError, match="no pdl"):
        qgemv.qgemv_mxfp4(dev(qm.packed), dev(qm.scales), dev(x), out,
                          config=qgemv.QgemvConfig(route="mma", pdl=True, mma_x_first=True))
    qw, xi, _, outi = int4_case(7, 20, 256, 1, False, np.float16)
    with pytest.raises(ValueError, match="split takes MXFP4"):
        qgemv.qgemv_int4(dev(qw.packed), dev(qw.scales), dev(qw.zeros), dev(xi), outi,
                         config=qgemv.QgemvConfig(route="mma", mma_split=True))
    x2 = np.concatenate([x, x])
    with pytest.raises(ValueError, match="x_first takes MXFP4 at batch 1"):
        qgemv.qgemv_mxfp4(dev(qm.packed), dev(qm.scales), dev(x2), cuda.device_array((2, 20), np.uint16),
                          config=qgemv.QgemvConfig(route="mma", mma_x_first=True))


def test_qgemv_mma_row_tiles_checked():
    """``mma_row_tiles`` is 0 (auto) or 1 to 7, and more than 1 only at batch 1 (the register loop); so is
    ``mma_early_y``."""
    qw, x, _, out = int4_case(7, 20, 256, 1, False, np.float16)
    args = (dev(qw.packed), dev(qw.scales), dev(qw.zeros))
    for bad in (8, -1):
        with pytest.raises(ValueError, match="row_tiles"):
            qgemv.qgemv_int4(*args, dev(x), out, config=qgemv.QgemvConfig(route="mma", mma_row_tiles=bad))
    x2 = np.concatenate([x, x])
    with pytest.raises(ValueError, match="batch 2"):
        qgemv.qgemv_int4(*args, dev(x2), cuda.device_array((2, 20), np.uint16),
                         config=qgemv.QgemvConfig(route="mma", mma_row_tiles=2))
    with pytest.raises(ValueError, match="early_y takes batch 1"):     # early_y: the batch-1 loop only
        qgemv.qgemv_int4(*args, dev(x2), cuda.device_array((2, 20), np.uint16),
                         config=qgemv.QgemvConfig(route="mma", mma_early_y=True))


def test_auto_row_tiles():
    """Blocks of several row tiles are picked only where they fill a 132-SM device in one wave without
    loading an SM with more tiles than blocks of one tile would."""
    from vmmstream.kernels.matmul.quant.gemv_mma import auto_row_tiles
    got = {n: auto_row_tiles(n, 132) for n in (14336, 8192, 6144, 4096, 3072, 1024, 28672)}
    assert got == {14336: 7, 8192: 4, 6144: 3, 4096: 2, 3072: 1, 1024: 1, 28672: 1}
    assert auto_row_tiles(14336, 0) == 1          # the simulator (no SM count)
    assert auto_row_tiles(14336, 100) == 1        # 896 tiles > 7 per SM: more than one wave either way


@pytest.mark.parametrize("kind,n,k,b,bias,col_tiles", [
    ("int4", 20, 640, 16, True, 2),     # 2 column tiles a block, 2 row tiles, bias; 5 groups over 4 warps
    ("int4", 9, 256, 27, False, 4),     # 4 column tiles a block, the last partial (27 = 3 x 8 + 3), N < 16
    ("mxfp4", 20, 640, 13, False, 2),   # the second tile partial; both MX scale paths
])
def test_qgemv_mma_column_tiles_decode_once_and_give_each_column_its_bits(kind, n, k, b, bias, col_tiles):
    """``QgemvConfig(mma_col_tiles=c)``: a block multiplies each decoded group of W into c column tiles of 8; every
    column's output is bit for bit what blocks of one tile give it (so a batch's rows stay the tokens each gets
    alone), and matches the dequantized reference."""
    rng = np.random.default_rng(n + k + b)
    if kind == "int4":
        qw, x, bb, out = int4_case(n * k + b, n, k, b, bias, np.float16)
        args, fn, deq = (dev(qw.packed), dev(qw.scales), dev(qw.zeros)), qgemv.qgemv_int4, dequantize_int4(*qw)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w[2, 32:64] *= 300.0                  # a block scale above 2: the warp's two-fma path
        qw = quantize_mxfp4(w)
        x, bb, out = make_x(rng, b, k), None, cuda.device_array((b, n), np.uint16)
        args, fn, deq = (dev(qw.packed), dev(qw.scales)), qgemv.qgemv_mxfp4, dequantize_mxfp4(*qw)
    got = {}
    for ct in (1, col_tiles):
        out = cuda.to_device(np.full((b, n), 0x7FC0, np.uint16))
        fn(*args, dev(x), out, bias=None if bb is None else dev(bb),
           config=qgemv.QgemvConfig(route="mma", mma_col_tiles=ct))
        got[ct] = out.copy_to_host()
    assert np.array_equal(got[col_tiles], got[1])
    check(got[col_tiles], deq, x, bb)


def test_qgemv_mma_column_tiles_checked():
    from vmmstream.kernels.matmul.quant import gemv_mma
    with pytest.raises(ValueError, match="col_tiles"):
        gemv_mma.make(0, False, 8, col_tiles=3)
    with pytest.raises(ValueError, match="col_tiles"):
        gemv_mma.make(0, False, 8, stages=3, col_tiles=2)
    assert gemv_mma.bytes_moved(64, 256, 32, col_tiles=4) < gemv_mma.bytes_moved(64, 256, 32)
