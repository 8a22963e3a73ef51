"""The ``simt`` route of the quantized decode GEMV (the dispatcher is ``kernels/matmul/quant/gemv.py``):
y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias) with W int4 or MXFP4 (``formats.py``), dequantized in registers,
fp32 accumulation, bf16 (uint16) out. It takes any K that is a multiple of the group; the tensor-core
routes are faster where they apply.

Decode is memory-bound and W is 4 bits a value, so the work per byte is 4x the bf16 GEMV's:
- a block is ``threads / 32`` warps; warp w owns ``rows_per_warp`` consecutive rows, and its lanes
  stride over their 16-byte chunks (32 values, one ``ld.global.nc.v4`` each): a warp load is 512
  contiguous bytes, every lane has ``rows_per_warp`` independent loads in flight, the reduction is a
  warp shuffle only;
- x is staged once per block into shared memory as fp32, ``tile_k`` values of K at a time (default
  8192 / batch_tile: 32 KiB, so K = 4096 is one tile and K = 14336 two; fewer tiles, fewer barriers
  that drain the loads in flight), transposed (``xs[b, i, c]`` = element i of chunk c) so that lanes
  reading consecutive chunks hit distinct banks; every warp of the block reuses it;
- scales are read once per 16-byte chunk and row (int4: 4 chunks share a group; MXFP4: a chunk is a block);
- int4 decode: a nibble q shifted into the top mantissa bits of 1.0f gives f = 1 + q/16 (a shift and one
  and-or: no conversion instruction), and the FMA accumulates f·x. The zero point comes out once per chunk
  and row, not per value: Σ (q - zero)/16 · x = Σ f·x - (1 + zero/16) · Σ x, where Σ x over the chunk is
  summed as x is read (shared by the warp's rows); the result is multiplied by 16·scale once;
- MXFP4 decode: the 16 E2M1 values sit in a shared-memory table (distinct codes hit distinct banks);
  the chunk's partial sum is multiplied by the block scale 2^(e-127) (its bf16 bits are e << 7).
K must be a multiple of the group (128 for int4, 32 for MXFP4); x must allow 16-byte loads (``vec8_ok``):
there is no scalar fallback.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import as_f32, dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import cdiv, check_threads, hi_f32, ld8_ro, ld16_ro, lo_f32, warp_sum
from vmmstream.kernels.matmul.quant.formats import INT4, INT4_GROUP, MXFP4

SMEM_X = 8192        # fp32 values of x staged per block (32 KiB): tile_k = SMEM_X / batch_tile


@cuda.jit(device=True, inline="always")
def stage8_cols(xs, b, i, c, w0, w1, w2, w3):
    """Eight bf16 values (four packed words) of x row b, chunk c, into ``xs[b, i .. i + 8, c]`` as fp32."""
    xs[b, i, c] = lo_f32(w0)
    xs[b, i + 1, c] = hi_f32(w0)
    xs[b, i + 2, c] = lo_f32(w1)
    xs[b, i + 3, c] = hi_f32(w1)
    xs[b, i + 4, c] = lo_f32(w2)
    xs[b, i + 5, c] = hi_f32(w2)
    xs[b, i + 6, c] = lo_f32(w3)
    xs[b, i + 7, c] = hi_f32(w3)


@functools.lru_cache(maxsize=None)
def _make(kind: int, nb: int, rpw: int, threads: int, has_bias: bool, kt: int):
    nw = threads // 32
    rows_blk = nw * rpw
    ncol = kt // 32
    na = rpw * nb
    cpg = INT4_GROUP // 32   # chunks per int4 group

    def qgemv_kernel(packed, scales, zeros, x, bias, y, n_rows, n_batch, k):
        # packed: [N, K/2] u8; scales: int4 [N, K/128] f16|f32, mxfp4 [N, K/32] u8; zeros: int4 like
        # scales (mxfp4: ignored); x: [B, K] bf16; bias: [N] bf16 (ignored without bias); y: [B, N] bf16
        # grid: (ceil(N / (warps * rpw)), ceil(B / nb)); block: threads
        tid = cuda.threadIdx.x
        lane = tid % 32
        row0 = cuda.blockIdx.x * rows_blk + (tid // 32) * rpw
        b0 = cuda.blockIdx.y * nb
        xs = cuda.shared.array((nb, 32, ncol), np.float32)
        lut = cuda.shared.array(16, np.float32)
        if kind == MXFP4:
            if tid < 16:
                i = tid % 8
                m = np.float32(i) * np.float32(0.5)
                if i >= 4:
                    m = np.float32(6.0) if i == 7 else np.float32(i - 2)
                lut[tid] = -m if tid >= 8 else m
        acc = cuda.local.array(na, np.float32)     # acc[r * nb + b]
        part = cuda.local.array(na, np.float32)
        wd = cuda.local.array((rpw, 4), np.uint32)
        sc = cuda.local.array(rpw, np.float32)     # multiplier of the chunk's partial sum
        cz = cuda.local.array(rpw, np.float32)     # int4: 1 + zero / 16
        xv = cuda.local.array((nb, 8), np.float32)
        xsum = cuda.local.array(nb, np.float32)    # int4: the chunk's sum of x per batch row
        for j in range(na):
            acc[j] = np.float32(0.0)
        for t0 in range(0, k, kt):
            tlen = min(kt, k - t0)
            cuda.syncthreads()                      # the previous tile is no longer read
            for e in range(tid * 8, nb * kt, threads * 8):
                b = e // kt
                kk = e % kt
                if kk < tlen:
                    x0, x1, x2, x3 = ld8_ro(x, (min(b0 + b, n_batch - 1), t0 + kk))
                    c = kk // 32
                    i = kk % 32
                    stage8_cols(xs, b, i, c, x0, x1, x2, x3)
            cuda.syncthreads()
            for c in range(lane, tlen // 32, 32):
                gc = t0 // 32 + c                   # chunk index along the row
                for r in range(rpw):
                    row = min(row0 + r, n_rows - 1)  # rows past the end: loads stay valid, results dropped
                    wd[r, 0], wd[r, 1], wd[r, 2], wd[r, 3] = ld16_ro(packed, (row, gc * 16))
                    if kind == INT4:
                        s = np.float32(scales[row, gc // cpg])
                        sc[r] = s * np.float32(16.0)
                        cz[r] = np.float32(1.0) + np.float32(zeros[row, gc // cpg]) * np.float32(0.0625)
                    else:
                        sc[r] = dev_bf16_to_f32(np.uint32(scales[row, gc]) << np.uint32(7))
                for j in range(na):
                    part[j] = np.float32(0.0)
                for b in range(nb):
                    xsum[b] = np.float32(0.0)
                for q in range(4):                  # word q of the chunk: k = 32c + 8q + 0..7
                    for b in range(nb):
                        for j in range(8):
                            xv[b, j] = xs[b, 8 * q + j, c]
                            if kind == INT4:
                                xsum[b] += xv[b, j]
                    for r in range(rpw):
                        w = wd[r, q]
                        for j in range(8):
                            if kind == INT4:   # bits of 1 + q/16: the nibble at mantissa bits 19..22
                                v = as_f32((((w >> np.uint32(4 * j)) << np.uint32(19)) & np.uint32(0x00780000))
                                           | np.uint32(0x3F800000))
                            else:
                                v = lut[(w >> np.uint32(4 * j)) & np.uint32(0xF)]
                            for b in range(nb):
                                part[r * nb + b] += v * xv[b, j]
                for r in range(rpw):
                    for b in range(nb):
                        if kind == INT4:
                            acc[r * nb + b] += (part[r * nb + b] - cz[r] * xsum[b]) * sc[r]
                        else:
                            acc[r * nb + b] += part[r * nb + b] * sc[r]
        for r in range(rpw):
            for b in range(nb):
                t = warp_sum(acc[r * nb + b])
                row = row0 + r
                bb = b0 + b
                if lane == 0 and row < n_rows and bb < n_batch:
                    if has_bias:
                        t += dev_bf16_to_f32(bias[row])
                    y[bb, row] = dev_f32_to_bf16(t)

    return jit(qgemv_kernel)


def _auto(b: int, cfg):
    threads = check_threads(cfg.threads)
    if cfg.rows_per_warp < 1:
        raise ValueError(f"rows_per_warp must be >= 1, got {cfg.rows_per_warp}")
    nb = cfg.batch_tile or (1 if b == 1 else 2 if b == 2 else 4)
    kt = cfg.tile_k or SMEM_X // nb
    if kt % 32 or kt <= 0 or kt * nb > 12288:
        raise ValueError(f"tile_k must be a positive multiple of 32 with tile_k * batch_tile <= 12288, got {kt}")
    return threads, cfg.rows_per_warp, nb, kt


def launch(kind: int, packed, scales, zeros, x, out, bias, stream, cfg) -> None:
    """Shapes and dtypes checked by the dispatcher (``gemv._launch``); x, out 2-D; ``zeros`` None for MXFP4;
    ``cfg`` a ``QgemvConfig`` (threads, rows_per_warp, batch_tile, tile_k)."""
    n, b, k = packed.shape[0], x.shape[0], 2 * packed.shape[1]
    threads, rpw, nb, kt = _auto(b, cfg)
    kern = _make(kind, nb, rpw, threads, bias is not None, kt)
    kern[(cdiv(n, (threads // 32) * rpw), cdiv(b, nb)), threads, stream](
        packed, scales, scales if zeros is None else zeros, x, x if bias is None else bias, out, n, b, k)


def _sig(kind: int, scale_t: str, has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    s = f"{scale_t}[:, ::1]"
    return f"void(uint8[:, ::1], {s}, {s}, uint16[:, ::1], {bias_t}, uint16[:, ::1], int64, int64, int64)"


# Decode launches: B = 1 (with and without a Qwen2-style bias), batch tiles 2 and 4; int4 with fp16
# scales (the default) and fp32 scales.
SIGNATURES = [
    (_make(INT4, nb, 4, 128, hb, SMEM_X // nb).py_func, _sig(INT4, "float16", hb))
    for nb, hb in ((1, False), (1, True), (2, False), (4, False))
] + [(_make(INT4, 1, 4, 128, False, SMEM_X).py_func, _sig(INT4, "float32", False))] + [
    (_make(MXFP4, nb, 4, 128, hb, SMEM_X // nb).py_func, _sig(MXFP4, "uint8", hb))
    for nb, hb in ((1, False), (1, True), (2, False), (4, False))
]
