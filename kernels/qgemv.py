"""Quantized decode GEMVs: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias) with W stored int4 or MXFP4
(``kernels/quant.py`` layouts), dequantized in registers, fp32 accumulation, bf16 (uint16) out.

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

That is the ``simt`` route. Where K is a multiple of 128 and the weights are C-contiguous the default
(``route="auto"``) is a tensor-core route, faster at the decode shapes (docs/BENCHMARKS.md): MXFP4 at batch 1
``kernels/qgemv_imma.py`` (int8 tensor cores; x rounded per block of 32 to 14 bits below the block's largest
|x|, every product and sum after that exact), otherwise ``kernels/qgemv_mma.py`` (bf16), which takes int4
zero points as integers in [0, 15], which is what ``quantize_int4`` stores.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from .dtypes import as_f32, dev_bf16_to_f32, dev_f32_to_bf16, f32_to_bf16
from .launch import SIM, as_stream, cdiv, check_threads, check_workspace, data_ptr, hi_f32, ld8_ro, lo_f32, \
    vec8_ok, warp_sum
from .quant import INT4_GROUP, MX_BLOCK, dequantize_int4, dequantize_mxfp4
from .workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only
SMEM_X = 8192        # fp32 values of x staged per block (32 KiB): tile_k = SMEM_X / batch_tile
INT4, MXFP4 = 0, 1


@dataclass(frozen=True)
class QgemvConfig:
    threads: int = 128
    rows_per_warp: int = 4
    batch_tile: int = 0      # 0: pick from B (1, 2 or 4)
    tile_k: int = 0          # 0: SMEM_X // batch_tile; else a multiple of 32 (tests use small tiles)
    route: str = "auto"      # "mma": kernels/qgemv_mma.py (bf16 tensor cores; K a multiple of 128, int4 zero points
                             # integers); "imma": kernels/qgemv_imma.py (MXFP4 at batch 1, int8 tensor cores;
                             # K a multiple of 128); "simt": this module's kernel; "auto": imma for MXFP4 at
                             # batch 1, else mma, where K allows it, else simt;
                             # "mx16": kernels/qgemv_mx16.py (MXFP4 at batch 1 on f16 tensor cores; measured
                             # slower than mma on the H200, docs/BENCHMARKS.md, so never chosen by "auto")
    mma_prefetch: bool = True  # mma route: load the next group while multiplying the current one
    mma_l2_ahead: int = 0    # mma route: prefetch.global.L2 the group this many iterations ahead (0: none)
    mma_stages: int = 0      # mma route: > 1: W through a per-warp cp.async ring of this many groups (3, 4 or 5)
    mma_row_tiles: int = 0   # mma route, batch 1: 16-row tiles per block sharing one staging of x (1 to 7;
                             # 0: picked for the device's SM count, ``qgemv_mma.auto_row_tiles``: 7 at N 14336
                             # on 132 SMs; there, on an H100, int4 10-13 % faster than 1 and MXFP4, with
                             # ``mma_split`` and ``mma_x_first``, within 1 %, docs/BENCHMARKS.md)
    mma_early_y: bool = False  # mma route, batch 1: load each pair's second group one step earlier (the first
                             # before x is staged): two groups in flight from the start
    mma_split: bool | None = None  # mma route, MXFP4 at batch 1: each group's 8 mma steps as two dependency
                             # chains of 4 (None: there; on an H100 at 7 row tiles 3.7 % faster, docs/BENCHMARKS.md)
    mma_x_first: bool | None = None  # mma route, MXFP4 at batch 1: the first x tile loaded before W (None: in
                             # blocks of 4 or more row tiles without pdl; True with pdl is refused)
    pdl: bool = False        # mma and imma routes: programmatic dependent launch (loads W while the previous
                             # kernel on the stream finishes); only where that kernel does not write these
                             # weights. With route "auto" it applies where a tensor-core route is taken (a simt
                             # launch is plain); the mma_* options do not apply to the imma route


if SIM:
    def _ld16_ro(arr, idx):
        """16 bytes of a uint8 row (or of a 1-D uint8 array) as four little-endian uint32 words (the
        simulator's twin)."""
        a = arr._ary if hasattr(arr, "_ary") else arr
        if isinstance(idx, tuple):
            r, j = int(idx[0]), int(idx[1])
            v = np.ascontiguousarray(a[r, j:j + 16], dtype=np.uint8)
        else:
            j = int(idx)
            v = np.ascontiguousarray(a[j:j + 16], dtype=np.uint8)
        if v.shape[0] != 16:
            raise IndexError("vector load past the end of the last axis")
        w = v.view(np.uint32)
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])
else:
    _ld16_ro = ld8_ro   # the intrinsic loads 16 bytes at the element's address, whatever the dtype


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
                    wd[r, 0], wd[r, 1], wd[r, 2], wd[r, 3] = _ld16_ro(packed, (row, gc * 16))
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

    return cuda.jit(qgemv_kernel)


def workspace_requirement(n: int, k: int, batch: int = 1):
    """No scratch: x tiles live in shared memory."""
    return NONE


def _auto(b: int, cfg: QgemvConfig):
    threads = check_threads(cfg.threads)
    if cfg.rows_per_warp < 1:
        raise ValueError(f"rows_per_warp must be >= 1, got {cfg.rows_per_warp}")
    nb = cfg.batch_tile or (1 if b == 1 else 2 if b == 2 else 4)
    kt = cfg.tile_k or SMEM_X // nb
    if kt % 32 or kt <= 0 or kt * nb > 12288:
        raise ValueError(f"tile_k must be a positive multiple of 32 with tile_k * batch_tile <= 12288, got {kt}")
    return threads, cfg.rows_per_warp, nb, kt


def _launch(name, kind, packed, scales, zeros, x, out, bias, workspace, stream, config):
    check_workspace(name, workspace, 0)
    x = x.reshape(1, x.shape[0]) if x.ndim == 1 else x
    out = out.reshape(1, out.shape[0]) if out.ndim == 1 else out
    n, kh = packed.shape
    k = 2 * kh
    b = x.shape[0]
    group = INT4_GROUP if kind == INT4 else MX_BLOCK
    sshape = (n, k // group)
    if (k % group or x.shape[1] != k or out.shape != (b, n) or out.dtype != np.uint16 or packed.dtype != np.uint8
            or scales.shape != sshape or (zeros is not None and zeros.shape != sshape)
            or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"{name} shapes: packed {packed.shape} {packed.dtype}, scales {scales.shape}, "
                         f"zeros {None if zeros is None else zeros.shape}, x {x.shape}, out {out.shape} {out.dtype}, "
                         f"bias {None if bias is None else bias.shape} (K must be a multiple of {group}; "
                         f"scales/zeros {sshape}; out bf16)")
    if kind == MXFP4 and scales.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 scales are uint8 E8M0 exponents, got {scales.dtype}")
    if kind == INT4 and (scales.dtype not in (np.float16, np.float32) or zeros.dtype != scales.dtype):
        raise ValueError(f"{name}: int4 scales/zeros must both be float16 or float32, got {scales.dtype}/{zeros.dtype}")
    if not vec8_ok(x) or packed.strides[1] != 1 or packed.strides[0] % 16 or data_ptr(packed) % 16:
        raise ValueError(f"{name}: packed weights and x must be contiguous rows on 16-byte boundaries "
                         "(16-byte loads; there is no scalar path)")
    cfg = config or QgemvConfig()
    if cfg.route not in ("auto", "simt", "mma", "imma", "mx16"):
        raise ValueError(f"{name}: route must be 'auto', 'simt', 'mma', 'imma' or 'mx16', got {cfg.route!r}")
    contiguous = packed.is_c_contiguous() and scales.is_c_contiguous() and (zeros is None or zeros.is_c_contiguous())
    tensor = k % INT4_GROUP == 0 and contiguous
    route = cfg.route if cfg.route != "auto" else (
        "imma" if tensor and kind == MXFP4 and b == 1 else "mma" if tensor else "simt")
    if cfg.pdl and cfg.route in ("simt", "mx16"):
        raise ValueError(f"{name}: pdl (programmatic dependent launch) is an mma and imma route option, the route "
                         f"is {route!r}")
    if route == "imma":
        from . import qgemv_imma
        if kind != MXFP4 or b != 1:
            raise ValueError(f"{name}: route 'imma' takes MXFP4 weights at batch 1 (got "
                             f"{'int4' if kind == INT4 else 'MXFP4'}, batch {b})")
        qgemv_imma.launch(packed, scales, x, out, bias, as_stream(stream), pdl=cfg.pdl)
        return
    if route == "mx16":
        from . import qgemv_mx16
        if kind != MXFP4:
            raise ValueError(f"{name}: route 'mx16' takes MXFP4 weights")
        qgemv_mx16.launch(packed, scales, x, out, bias, as_stream(stream))
        return
    if route == "mma":
        from . import qgemv_mma
        qgemv_mma.launch(kind, packed, scales, zeros, x, out, bias, as_stream(stream), cfg.mma_prefetch,
                         cfg.mma_l2_ahead, stages=cfg.mma_stages, pdl=cfg.pdl, row_tiles=cfg.mma_row_tiles,
                         early_y=cfg.mma_early_y, split=cfg.mma_split, x_first=cfg.mma_x_first)
        return
    threads, rpw, nb, kt = _auto(b, cfg)
    kern = _make(kind, nb, rpw, threads, bias is not None, kt)
    kern[(cdiv(n, (threads // 32) * rpw), cdiv(b, nb)), threads, as_stream(stream)](
        packed, scales, scales if zeros is None else zeros, x, x if bias is None else bias, out, n, b, k)


def qgemv_int4(packed, scales, zeros, x, out, *, bias=None, workspace=None, stream=None,
               config: QgemvConfig | None = None):
    """out[B, N] = x[B, K] · dequantize_int4(packed, scales, zeros)ᵀ (+ bias), bf16 out.

    packed uint8 [N, K/2]; scales, zeros fp16 or fp32 [N, K/128]; x, bias, out bf16 (uint16); x may be
    [K] with out [N]. Zero points are integers in [0, 15] (``quantize_int4``); the default tensor-core
    route would round a fractional one. Device arrays; never allocates.
    """
    _launch("qgemv_int4", INT4, packed, scales, zeros, x, out, bias, workspace, stream, config)


def qgemv_mxfp4(packed, scales, x, out, *, bias=None, workspace=None, stream=None,
                config: QgemvConfig | None = None):
    """out[B, N] = x[B, K] · dequantize_mxfp4(packed, scales)ᵀ (+ bias), bf16 out.

    packed uint8 [N, K/2] (E2M1 codes); scales uint8 [N, K/32] (E8M0); x, bias, out bf16 (uint16);
    x may be [K] with out [N]. Device arrays; never allocates.
    """
    _launch("qgemv_mxfp4", MXFP4, packed, scales, None, x, out, bias, workspace, stream, config)


def _reference(wf, x, bias):
    from .dtypes import bf16_to_f32
    y = bf16_to_f32(x).astype(np.float64) @ wf.astype(np.float64).T
    if bias is not None:
        y = y + bf16_to_f32(bias)
    return y.astype(np.float32)


def reference_int4(packed, scales, zeros, x, bias=None, *, rounded: bool = True) -> np.ndarray:
    """Dequantize (fp32), matmul (fp64 accumulation), round to bf16 bits; ``rounded=False``: the fp32
    result before rounding. [B, N] or [N] like x."""
    y = _reference(dequantize_int4(packed, scales, zeros), x, bias)
    return f32_to_bf16(y) if rounded else y


def reference_mxfp4(packed, scales, x, bias=None, *, rounded: bool = True) -> np.ndarray:
    """``reference_int4`` for MXFP4 weights."""
    y = _reference(dequantize_mxfp4(packed, scales), x, bias)
    return f32_to_bf16(y) if rounded else y


def bytes_moved(n: int, k: int, batch: int = 1, *, kind: str = "int4", scale_itemsize: int = 2,
                bias: bool = False, batch_tile: int = 0) -> int:
    """HBM bytes: packed W and its scales (int4: scales + zeros) once per batch tile, x, bf16 out, bias."""
    nb = batch_tile or (1 if batch == 1 else 2 if batch == 2 else 4)
    if kind == "int4":
        w = n * k // 2 + 2 * n * (k // INT4_GROUP) * scale_itemsize
    elif kind == "mxfp4":
        w = n * k // 2 + n * (k // MX_BLOCK)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return w * cdiv(batch, nb) + 2 * batch * k + 2 * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    return 2 * batch * n * k


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
