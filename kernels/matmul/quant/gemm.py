"""Quantized prefill GEMM: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]) with W stored int4 or MXFP4
(``kernels/matmul/quant/formats.py`` layouts), fp32 accumulation, bf16 (uint16) out. Three routes:

``mma`` (no workspace; the default on a GPU with ``dense.gemm_mma.DEFAULT``): ``gemm_mma.py``, bf16 tensor cores with W decoded to bf16 in the
    load path (the ``dense_cache`` route's numbers, without the cache).


``in_register`` (``qgemm_int4`` / ``qgemm_mxfp4`` with ``route="in_register"``; no workspace)
    Tiled like ``gemm.py``: a 16×16 thread block computes a (16·tm)×(16·tm) tile of y, each thread a
    tm×tm micro-tile strided by 16; per K step of ``BK`` = 32 the block stages the x tile and the
    *dequantized* W tile in shared memory as fp32, transposed to [k][row] with one pad column, and the
    next step is loaded into registers while the current one is multiplied. BK = 32 is one MXFP4 block
    and a quarter of an int4 group, so every W row of a step has a single scale (and zero point). A
    step's tile is ``bm`` rows × 4 pieces of 8 k: thread ``tid`` stages piece ``tid % 4`` of row
    ``tid // 4`` (and of rows 64 further for tm = 8): one 16-byte x load, and one 16-byte load of the
    row's 32 packed values (the 4 threads of a row ask for the same 16 bytes: one transaction) of which
    it keeps its 32-bit word, 8 nibbles, decoded in registers when it is written to shared memory:
    - int4 (the qgemv trick): nibble q in the top mantissa bits of 1.0 gives 1 + q/16 with two integer
      ops; minus 1 + zero/16 is (q - zero)/16 exactly; times 16·scale gives (q - zero)·scale with one
      fp32 rounding, the same value as ``quant.dequantize_int4``;
    - MXFP4: the E2M1 magnitude code c (0..7) is the bf16 pattern (c << 6) + 0x3F00 for c >= 2 and
      c · 0x3F00 (0, 0.5) for c < 2, the sign bit 3 moves to bit 15; times the block scale 2^(e-127),
      whose bf16 bits are e << 7. Exact, like ``quant.dequantize_mxfp4`` (for e in 1..254, which is every
      scale ``quantize_mxfp4`` produces except e = 0, i.e. blocks below ~2^-125: those decode to 0 here,
      and e = 255, the NaN scale, decodes as inf; the same holds for ``qgemv``).
    W is read at 4 bits a value and never written out densely. Rows of x or W past M or N are clamped
    (loads stay in bounds; their results are not stored); K is a whole number of steps.

``dense_cache`` (``route="dense_cache"``; a SESSION-lifetime workspace of N·K bf16)
    ``expand_int4`` / ``expand_mxfp4`` write the dequantized W, rounded to bf16, into the workspace
    (one thread per 32-value chunk: one 16-byte load, four 16-byte stores), then ``gemm.gemm`` (the
    dense bf16 SIMT GEMM) runs on it. The cache outlives the step so that a session pays the expansion
    once: a launch with ``fill=False`` skips it and trusts that the view already holds *these* weights
    (nothing checks that). Note the cached weights are bf16: int4 values (q - zero)·scale carry up to
    15 significant bits (fp16 scales; fp32: 24) and are rounded to 8, so this route's result differs
    from the in-register route's by that rounding (``reference(..., route="dense_cache")`` models it
    exactly); MXFP4 values are exact in bf16.

``choose_route`` picks ``mma`` on a GPU (when ``dense.gemm_mma.DEFAULT``) and ``in_register`` otherwise.
x must be bf16 [M, K] with contiguous, 16-byte aligned rows (``vec8_ok``); packed W uint8 [N, K/2] with
contiguous rows on 16-byte boundaries; K a positive multiple of 128 (int4) or 32 (MXFP4). There is no
scalar fallback.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import config, cuda

from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.matmul.dense import gemm as _gemm
from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16, f32_to_bf16
from vmmstream.kernels.base.launch import (as_stream, cdiv, check_threads, check_workspace, data_ptr, hi_f32, ld8_ro,
    ld16_ro, lo_f32, pack2, st8, vec8_ok)
from vmmstream.kernels.matmul.quant.formats import INT4, INT4_GROUP, MX_BLOCK, MXFP4, dequantize_int4, dequantize_mxfp4
from vmmstream.kernels.base.workspace import NONE, Lifetime, WorkspaceRequirement, layout

CAPTURE_SAFE = True   # every route: launches only (no allocation, no synchronize), device arrays only
BK = 32               # K per step of the in-register kernel: one MXFP4 block, a quarter of an int4 group
TM_DEFAULT = 4        # 64×64 tiles, like gemm.py
FORMATS = {"int4": INT4, "mxfp4": MXFP4}
IN_REGISTER, DENSE_CACHE, MMA = "in_register", "dense_cache", "mma"
ROUTES = (IN_REGISTER, DENSE_CACHE, MMA)
SIM = bool(config.ENABLE_CUDASIM)
EXPAND_THREADS = 256


# ------------------------------------------------------------------------------------------- device

@functools.lru_cache(maxsize=None)
def _make(kind: int, tm: int, has_bias: bool):
    bm = 16 * tm                 # tile edge (rows of x and of W per block)
    pad = bm + 1                 # shared row pitch: conflict-free transposed stores and reads
    n_shared = BK * pad
    items = bm * 4               # pieces of 8 k per operand tile and step (rows × 4)
    lpt = cdiv(items, 256)       # pieces one thread stages per step (tm = 1: only 64 threads stage)
    tt = tm * tm

    def qgemm_kernel(x, packed, scales, zeros, bias, y, m, n, k):
        # x: [M, K] bf16; packed: [N, K/2] u8; scales: int4 [N, K/128] f16|f32, mxfp4 [N, K/32] u8 (E8M0);
        # zeros: int4 like scales (mxfp4: ignored); bias: [N] bf16 (ignored without bias); y: [M, N] bf16
        # grid: (ceil(N / bm), ceil(M / bm)); block: (16, 16)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * 16 + tx
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bm
        q = tid % 4                                    # the piece (k = 8q .. 8q + 7 of the step) this thread stages
        xs = cuda.shared.array(n_shared, np.float32)   # [kk][row of the x tile]
        ws = cuda.shared.array(n_shared, np.float32)   # [kk][row of the W tile], dequantized
        acc = cuda.local.array(tt, np.float32)
        xr = cuda.local.array((lpt, 4), np.uint32)     # prefetched x: 8 bf16 as 4 words
        wr = cuda.local.array(lpt, np.uint32)          # prefetched W: 8 nibbles
        sr = cuda.local.array(lpt, np.float32)         # int4: 16·scale; mxfp4: 2^(e-127)
        zr = cuda.local.array(lpt, np.float32)         # int4: 1 + zero/16
        af = cuda.local.array(tm, np.float32)
        bf = cuda.local.array(tm, np.float32)
        for i in range(tt):
            acc[i] = np.float32(0.0)
        nsteps = k // BK
        # iteration s: decode step s-1 from registers into shared memory, load step s into registers,
        # multiply step s-1 (so the loads of step s are in flight during the FMAs)
        for s in range(nsteps + 1):
            if s > 0:
                for l in range(lpt):
                    e = tid + l * 256
                    if e < items:
                        base = 8 * q * pad + e // 4
                        for j in range(4):
                            xs[base + (2 * j) * pad] = lo_f32(xr[l, j])
                            xs[base + (2 * j + 1) * pad] = hi_f32(xr[l, j])
                        w = wr[l]
                        sc = sr[l]
                        cz = zr[l]
                        for j in range(8):
                            nib = (w >> np.uint32(4 * j)) & np.uint32(0xF)
                            if kind == INT4:
                                v = (dev_bf16_to_f32((nib << np.uint32(3)) | np.uint32(0x3F80)) - cz) * sc
                            else:
                                c = nib & np.uint32(7)
                                bits = (c << np.uint32(6)) + np.uint32(0x3F00) if c >= np.uint32(2) \
                                    else c * np.uint32(0x3F00)
                                bits |= (nib & np.uint32(8)) << np.uint32(12)
                                v = dev_bf16_to_f32(bits) * sc
                            ws[base + j * pad] = v
                cuda.syncthreads()
            if s < nsteps:
                k0 = s * BK
                for l in range(lpt):
                    e = tid + l * 256
                    if e < items:
                        r = e // 4
                        xrow = min(m0 + r, m - 1)
                        wrow = min(n0 + r, n - 1)
                        xr[l, 0], xr[l, 1], xr[l, 2], xr[l, 3] = ld8_ro(x, (xrow, k0 + 8 * q))
                        w0, w1, w2, w3 = ld16_ro(packed, (wrow, k0 // 2))
                        wr[l] = w0 if q == 0 else (w1 if q == 1 else (w2 if q == 2 else w3))
                        if kind == INT4:
                            g = k0 // INT4_GROUP
                            sr[l] = np.float32(scales[wrow, g]) * np.float32(16.0)
                            zr[l] = np.float32(1.0) + np.float32(zeros[wrow, g]) * np.float32(0.0625)
                        else:
                            sr[l] = dev_bf16_to_f32(np.uint32(scales[wrow, k0 // MX_BLOCK]) << np.uint32(7))
            if s > 0:
                for kk in range(BK):
                    for i in range(tm):
                        af[i] = xs[kk * pad + ty + 16 * i]
                        bf[i] = ws[kk * pad + tx + 16 * i]
                    for i in range(tm):
                        for j in range(tm):
                            acc[i * tm + j] += af[i] * bf[j]
                cuda.syncthreads()
        for i in range(tm):
            row = m0 + ty + 16 * i
            if row < m:
                for j in range(tm):
                    col = n0 + tx + 16 * j
                    if col < n:
                        v = acc[i * tm + j]
                        if has_bias:
                            v += dev_bf16_to_f32(bias[col])
                        y[row, col] = dev_f32_to_bf16(v)

    return jit(qgemm_kernel)


@functools.lru_cache(maxsize=None)
def _make_expand(kind: int):
    cpg = INT4_GROUP // 32   # 32-value chunks per int4 group

    def expand_kernel(packed, scales, zeros, dense, n, k):
        # packed: [N, K/2] u8; scales/zeros as in qgemm_kernel; dense: [N, K] bf16 (16-byte aligned rows)
        # one thread per 32-value chunk (one MXFP4 block, a quarter of an int4 group); grid 1-D
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        nc = k // 32
        wd = cuda.local.array(4, np.uint32)
        vals = cuda.local.array(8, np.float32)
        if i < n * nc:
            row = i // nc
            c = i % nc
            wd[0], wd[1], wd[2], wd[3] = ld16_ro(packed, (row, c * 16))
            if kind == INT4:
                sc = np.float32(scales[row, c // cpg]) * np.float32(16.0)
                cz = np.float32(1.0) + np.float32(zeros[row, c // cpg]) * np.float32(0.0625)
            else:
                sc = dev_bf16_to_f32(np.uint32(scales[row, c]) << np.uint32(7))
                cz = np.float32(0.0)
            for qq in range(4):
                w = wd[qq]
                for j in range(8):
                    nib = (w >> np.uint32(4 * j)) & np.uint32(0xF)
                    if kind == INT4:
                        vals[j] = (dev_bf16_to_f32((nib << np.uint32(3)) | np.uint32(0x3F80)) - cz) * sc
                    else:
                        cc = nib & np.uint32(7)
                        bits = (cc << np.uint32(6)) + np.uint32(0x3F00) if cc >= np.uint32(2) \
                            else cc * np.uint32(0x3F00)
                        bits |= (nib & np.uint32(8)) << np.uint32(12)
                        vals[j] = dev_bf16_to_f32(bits) * sc
                st8(dense, (row, c * 32 + 8 * qq), pack2(vals[0], vals[1]), pack2(vals[2], vals[3]),
                    pack2(vals[4], vals[5]), pack2(vals[6], vals[7]))

    return jit(expand_kernel)


# --------------------------------------------------------------------------------------------- host

def _kind(fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}: expected 'int4' or 'mxfp4'")
    return FORMATS[fmt]


def _group(kind: int) -> int:
    return INT4_GROUP if kind == INT4 else MX_BLOCK


def choose_route(M: int, N: int, K: int, fmt: str) -> str:
    """``mma`` (tensor cores, W decoded in the load path, no workspace; ``gemm_mma.py``) on a GPU when the
    tensor-core routes are the default (``dense.gemm_mma.DEFAULT``), for every shape, else ``in_register``: it reads W at 4 bits a value like ``in_register`` and multiplies on the tensor cores. The simulator
    takes ``in_register`` (its emulated mma is slow) unless a route is named. ``dense_cache`` (a session-long
    bf16 copy of W, four times the quantized bytes) is never chosen here: a caller that can afford the cache
    names it."""
    _kind(fmt)
    if M < 0 or N < 0 or K < 0:
        raise ValueError(f"choose_route: negative shape M={M} N={N} K={K}")
    from vmmstream.kernels.matmul.dense import gemm_mma
    return MMA if gemm_mma.DEFAULT and not SIM else IN_REGISTER


def _route(M, N, K, fmt, route):
    route = route or choose_route(M, N, K, fmt)
    if route not in ROUTES:
        raise ValueError(f"unknown qgemm route {route!r}; expected one of {ROUTES}")
    return route


def _layout(N: int, K: int, route: str):
    """The one layout both ``workspace_requirement`` and the launch use: the dense bf16 [N, K] cache."""
    if route in (IN_REGISTER, MMA):
        return layout()
    if route != DENSE_CACHE:
        raise ValueError(f"unknown qgemm route {route!r}; expected one of {ROUTES}")
    return layout(dense=int(N) * int(K) * 2)


def workspace_requirement(M: int, N: int, K: int, fmt: str, route: str | None = None):
    """``NONE`` for ``in_register``; for ``dense_cache`` the bf16 [N, K] cache (aligned), SESSION lifetime
    so that it is filled once and kept at a stable address (captured graphs). ``route=None``: ``choose_route``."""
    route = _route(M, N, K, fmt, route)
    total = _layout(N, K, route).total
    return NONE if total == 0 else WorkspaceRequirement(total, Lifetime.SESSION)


def _shape(a) -> tuple:
    return tuple(int(d) for d in a.shape)


def _check_weights(name: str, kind: int, packed, scales, zeros):
    """Validate packed W and its scales (and zeros); return (N, K)."""
    group = _group(kind)
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise ValueError(f"{name}: packed weights must be 2-D uint8 [N, K/2], got shape {_shape(packed)} "
                         f"dtype {packed.dtype}")
    n, kh = _shape(packed)
    k = 2 * kh
    if k == 0 or k % group:
        raise ValueError(f"{name}: K = 2 * packed.shape[1] = {k} must be a positive multiple of the "
                         f"{'int4 group' if kind == INT4 else 'MXFP4 block'} ({group})")
    if packed.strides[1] != 1 or packed.strides[0] % 16 or data_ptr(packed) % 16:
        raise ValueError(f"{name}: packed weights must be contiguous rows on 16-byte boundaries (16-byte "
                         f"loads; there is no scalar path), got strides {tuple(packed.strides)}")
    sshape = (n, k // group)
    if scales.ndim != 2 or _shape(scales) != sshape:
        raise ValueError(f"{name}: scales must be [N, K/{group}] = {sshape}, got {_shape(scales)}")
    if kind == INT4:
        if zeros is None or zeros.ndim != 2 or _shape(zeros) != sshape:
            raise ValueError(f"{name}: zeros must be [N, K/{group}] = {sshape}, got "
                             f"{None if zeros is None else _shape(zeros)}")
        if scales.dtype not in (np.float16, np.float32) or zeros.dtype != scales.dtype:
            raise ValueError(f"{name}: int4 scales/zeros must both be float16 or float32, got "
                             f"{scales.dtype}/{zeros.dtype}")
    elif scales.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 scales are uint8 E8M0 exponents, got {scales.dtype}")
    return n, k


def _check_dense(name: str, dense, n: int, k: int):
    if dense.ndim != 2 or _shape(dense) != (n, k) or dense.dtype != np.uint16:
        raise ValueError(f"{name}: dense must be bf16 (uint16) [N, K] = {(n, k)}, got shape {_shape(dense)} "
                         f"dtype {dense.dtype}")
    if not vec8_ok(dense):
        raise ValueError(f"{name}: dense must have contiguous rows on 16-byte boundaries (16-byte stores)")


def _expand(kind, packed, scales, zeros, dense, n, k, stream):
    chunks = n * (k // 32)
    if chunks:
        threads = check_threads(EXPAND_THREADS)
        _make_expand(kind)[cdiv(chunks, threads), threads, as_stream(stream)](
            packed, scales, scales if zeros is None else zeros, dense, n, k)


def expand_int4(packed, scales, zeros, dense, *, stream=None):
    """dense[N, K] = bf16(dequantize_int4(packed, scales, zeros)) on the device (round to nearest even).
    dense: bf16 (uint16) [N, K], contiguous 16-byte aligned rows (e.g. the dense-cache workspace view)."""
    n, k = _check_weights("expand_int4", INT4, packed, scales, zeros)
    _check_dense("expand_int4", dense, n, k)
    _expand(INT4, packed, scales, zeros, dense, n, k, stream)


def expand_mxfp4(packed, scales, dense, *, stream=None):
    """dense[N, K] = bf16(dequantize_mxfp4(packed, scales)) (exact) on the device; dense as ``expand_int4``."""
    n, k = _check_weights("expand_mxfp4", MXFP4, packed, scales, None)
    _check_dense("expand_mxfp4", dense, n, k)
    _expand(MXFP4, packed, scales, None, dense, n, k, stream)


def _launch(name, kind, packed, scales, zeros, x, out, bias, route, workspace, fill, stream, tm):
    n, k = _check_weights(name, kind, packed, scales, zeros)
    if x.ndim != 2 or x.dtype != np.uint16 or _shape(x)[1] != k:
        raise ValueError(f"{name}: x must be 2-D bf16 (uint16) [M, K] with K = {k} (from packed), got shape "
                         f"{_shape(x)} dtype {x.dtype}")
    if not vec8_ok(x):
        raise ValueError(f"{name}: x must have contiguous rows on 16-byte boundaries (16-byte loads; there is "
                         f"no scalar path), got strides {tuple(x.strides)}")
    m = _shape(x)[0]
    if out.ndim != 2 or _shape(out) != (m, n) or out.dtype != np.uint16:
        raise ValueError(f"{name}: out must be bf16 (uint16) [M, N] = {(m, n)}, got shape {_shape(out)} "
                         f"dtype {out.dtype}")
    if bias is not None and (bias.ndim != 1 or _shape(bias) != (n,) or bias.dtype != np.uint16):
        raise ValueError(f"{name}: bias must be bf16 (uint16) [N] = {(n,)}, got shape {_shape(bias)} "
                         f"dtype {bias.dtype}")
    if tm not in (1, 2, 4, 8):
        raise ValueError(f"{name}: micro-tile tm must be 1, 2, 4 or 8, got {tm}")
    fmt = "int4" if kind == INT4 else "mxfp4"
    route = _route(m, n, k, fmt, route)
    lay = _layout(n, k, route)
    check_workspace(f"{name}[{route}]", workspace, lay.total)
    if route == MMA:
        from vmmstream.kernels.matmul.quant import gemm_mma
        gemm_mma.launch(kind, x, packed, scales, zeros, out, bias=bias, stream=stream)
        return
    if route == IN_REGISTER:
        if m and n:
            bm = 16 * tm
            _make(kind, tm, bias is not None)[(cdiv(n, bm), cdiv(m, bm)), (16, 16), as_stream(stream)](
                x, packed, scales, scales if zeros is None else zeros, x if bias is None else bias, out, m, n, k)
        return
    if workspace.ndim != 1 or workspace.dtype != np.uint8:
        raise ValueError(f"{name}: workspace must be a 1-D uint8 view, got shape {_shape(workspace)} "
                         f"dtype {workspace.dtype}")
    off = lay.offsets["dense"]
    dense = workspace[off:off + lay.sizes["dense"]].view(np.uint16).reshape(n, k)
    if fill:
        _check_dense(name, dense, n, k)
        _expand(kind, packed, scales, zeros, dense, n, k, stream)
    _gemm.gemm(x, dense, out, bias=bias, stream=stream, tm=tm)


def qgemm_int4(packed, scales, zeros, x, out, *, bias=None, route: str | None = None, workspace=None,
               fill: bool = True, stream=None, tm: int = TM_DEFAULT):
    """out[M, N] = x[M, K] · dequantize_int4(packed, scales, zeros)ᵀ (+ bias), fp32 accumulation, bf16 out.

    packed uint8 [N, K/2]; scales, zeros fp16 or fp32 [N, K/128]; x [M, K], bias [N], out [M, N] bf16
    (uint16). ``route``: ``"in_register"`` | ``"dense_cache"`` | None (``choose_route``). ``dense_cache``
    needs ``workspace``, a 1-D uint8 device view of at least ``workspace_requirement(...).bytes``
    (``WorkspaceShortfall`` otherwise); ``fill=False`` skips the expansion and uses the cache as a previous
    launch left it. Device arrays; never allocates, never synchronizes.
    """
    _launch("qgemm_int4", INT4, packed, scales, zeros, x, out, bias, route, workspace, fill, stream, tm)


def qgemm_mxfp4(packed, scales, x, out, *, bias=None, route: str | None = None, workspace=None,
                fill: bool = True, stream=None, tm: int = TM_DEFAULT):
    """``qgemm_int4`` for MXFP4 weights: packed uint8 [N, K/2] (E2M1 codes), scales uint8 [N, K/32] (E8M0)."""
    _launch("qgemm_mxfp4", MXFP4, packed, scales, None, x, out, bias, route, workspace, fill, stream, tm)


# ---------------------------------------------------------------------------------------- reference

def dequantized(qw, fmt: str, route: str = IN_REGISTER) -> np.ndarray:
    """fp32 [N, K]: the weight each route multiplies by (``dense_cache``: rounded through bf16)."""
    kind = _kind(fmt)
    wf = dequantize_int4(*qw) if kind == INT4 else dequantize_mxfp4(*qw)
    if route in (DENSE_CACHE, MMA):
        return bf16_to_f32(f32_to_bf16(wf))
    if route != IN_REGISTER:
        raise ValueError(f"unknown qgemm route {route!r}; expected one of {ROUTES}")
    return wf


def reference(x, qw, fmt: str, bias=None, *, route: str = IN_REGISTER, rounded: bool = False) -> np.ndarray:
    """NumPy reference: dequantize ``qw`` (``quant.Int4Weights`` / ``MXFP4Weights`` or the same tuple) with
    quant.py (fp32; rounded through bf16 for ``route="dense_cache"``), matmul with bf16 x in fp64, add
    bias. Returns fp32 [M, N], or its bf16 bits (uint16) with ``rounded=True``."""
    y = bf16_to_f32(x).astype(np.float64) @ dequantized(qw, fmt, route).astype(np.float64).T
    if bias is not None:
        y = y + bf16_to_f32(bias)
    y = y.astype(np.float32)
    return f32_to_bf16(y) if rounded else y


def _weight_bytes(N: int, K: int, kind: int, scale_itemsize: int) -> int:
    if kind == INT4:
        return N * K // 2 + 2 * N * (K // INT4_GROUP) * scale_itemsize
    return N * K // 2 + N * (K // MX_BLOCK)


def bytes_moved(M: int, N: int, K: int, fmt: str, route: str | None = None, *, bias: bool = False,
                scale_itemsize: int = 2, fill: bool = True) -> int:
    """DRAM-level lower bound, each operand once (tiles re-read from L2 not counted, as in gemm.py).
    in_register: packed W + scales (int4: + zeros), x, bf16 out, bias. dense_cache: the dense GEMM's
    x, bf16 W and out, bias; plus, with ``fill``, the expansion (packed W + scales read, N·K·2 written)."""
    kind = _kind(fmt)
    route = _route(M, N, K, fmt, route)
    io = 2 * M * K + 2 * M * N + (2 * N if bias else 0)
    if route in (IN_REGISTER, MMA):
        return _weight_bytes(N, K, kind, scale_itemsize) + io
    return io + 2 * N * K + ((_weight_bytes(N, K, kind, scale_itemsize) + 2 * N * K) if fill else 0)


def flops(M: int, N: int, K: int) -> int:
    """2·M·N·K (the dequantization is not counted)."""
    return 2 * M * N * K


# ------------------------------------------------------------------------------------ compile check

def _sig(scale_t: str, has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    s = f"{scale_t}[:, ::1]"
    return f"void(uint16[:, ::1], uint8[:, ::1], {s}, {s}, {bias_t}, uint16[:, ::1], int64, int64, int64)"


def _expand_sig(scale_t: str) -> str:
    s = f"{scale_t}[:, ::1]"
    return f"void(uint8[:, ::1], {s}, {s}, uint16[:, ::1], int64, int64)"


# Prefill launches: default 64×64 tiles and 128×128 tiles, with and without a Qwen2-style bias; int4 with
# fp16 scales (quant.py's default) and fp32 scales; the expansion kernels of the dense-cache route (its
# GEMM is gemm.py's, compiled by gemm.SIGNATURES).
SIGNATURES = [
    (_make(INT4, tm, hb).py_func, _sig("float16", hb)) for tm in (4, 8) for hb in (False, True)
] + [(_make(INT4, TM_DEFAULT, False).py_func, _sig("float32", False))] + [
    (_make(MXFP4, tm, hb).py_func, _sig("uint8", hb)) for tm in (4, 8) for hb in (False, True)
] + [
    (_make_expand(INT4).py_func, _expand_sig("float16")),
    (_make_expand(INT4).py_func, _expand_sig("float32")),
    (_make_expand(MXFP4).py_func, _expand_sig("uint8")),
]
