"""Batched decode GEMV on the tensor cores: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias), 8 ≤ B ≤ 32, bf16 in, fp32 sums.

A decode step of B sequences is a GEMM with a tiny M. Here W is the mma's A operand (16 of its rows per warp
tile) and x the B operand (8 sequences per n8 tile), so one ``mma.sync.m16n8k16`` serves 16 weight rows × 8
sequences and every weight is read from memory once per step, whatever B is:
- a block of 4 warps owns 16 rows of W; warp w takes the 64-element K chunks w, w + 4, w + 8, …; the partial sums
  of the 4 warps meet in shared memory;
- each lane (g = lane >> 2, t = lane & 3) reads 2 × 16 bytes of W rows g and g + 8 at K offsets 8t and 32 + 8t of
  the chunk, and the same bytes of x row 8j + g for each n8 tile j. Its 8 words are the A (a0/a2 from row g,
  a1/a3 from row g + 8) and B (b0/b1) fragments of four k16 steps: the k order inside a chunk is permuted, the
  same way for W and x, so the dot products are unchanged and no shared-memory staging or transpose is needed;
- W goes through the read-only path (``ld.global.nc``) 16 bytes at a time; x is tiny and hits L1/L2.
The three entry points mirror ``gemv``: one matrix, up to three over one x (q/k/v), and gate/up with the
SiLU·mul epilogue (gate and up rounded to bf16 first, as the separate launches would store them).
K must be a multiple of 64 and rows 16-byte aligned (``usable``); ``gemv`` falls back to its SIMT kernels
otherwise, and below ``MIN_BATCH`` sequences.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import config, cuda, float32, float64

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.launch import cdiv, ld8_ro, vec8_ok
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True            # no allocation, no synchronize, fixed grid for fixed shapes
MIN_BATCH, MAX_BATCH = 8, 32   # ``gemv`` takes this route for batches in [MIN_BATCH, MAX_BATCH]
NT = mh.THREADS                # 4 warps (the simulator's mma scratch is sized for them)
WARPS = NT // 32
ROWS = 16                      # W rows per block
KC = 64                        # K elements per warp chunk
UNIFORM = bool(config.ENABLE_CUDASIM)


def usable(w, x) -> bool:
    """K a positive multiple of 64, B in [MIN_BATCH, MAX_BATCH], rows contiguous and 16-byte aligned."""
    k = w.shape[1]
    return k > 0 and k % KC == 0 and MIN_BATCH <= x.shape[0] <= MAX_BATCH and vec8_ok(w, x)


@functools.lru_cache(maxsize=None)
def _device(nt: int, pair: bool, gathered: bool = False):
    """``rows(wa, wb, x, xg, r0, n_rows, n_batch, k, acc, mscr)``: this warp's partial sums of rows r0 … r0 + 15
    of ``wa`` (and, with ``pair``, of ``wb``) with the ``8·nt`` sequences of x, in C fragment order
    ``acc[m·4nt + 4j + i]`` (m = 0: wa, 1: wb; j: n8 tile; i: c0..c3). With ``gathered`` (one n8 tile), the
    lane's sequence is row ``xg`` of x (a mixture's expert tile: its tokens' rows), else row g (clamped to B).
    ``publish(red, acc)`` / the totals: through the shared ``red[m, warp, row, seq]``."""
    na = 4 * nt * (2 if pair else 1)

    @cuda.jit(device=True, inline="always")
    def mma_chunk(wa, x, xg, ra, rb, c, n_batch, acc, base, g, t, mscr):
        """One 64-element chunk of K at c: rows ra / rb (this lane's g and g + 8) of wa against x."""
        a0, a1, a2, a3 = ld8_ro(wa, (ra, c + 8 * t))
        a4, a5, a6, a7 = ld8_ro(wa, (ra, c + 32 + 8 * t))
        b0, b1, b2, b3 = ld8_ro(wa, (rb, c + 8 * t))
        b4, b5, b6, b7 = ld8_ro(wa, (rb, c + 32 + 8 * t))
        for j in range(nt):
            if gathered:
                xr = xg
            else:
                xr = min(8 * j + g, n_batch - 1)       # sequences past B are clamped; their sums are dropped
            x0, x1, x2, x3 = ld8_ro(x, (xr, c + 8 * t))
            x4, x5, x6, x7 = ld8_ro(x, (xr, c + 32 + 8 * t))
            i = base + 4 * j
            c0, c1, c2, c3 = acc[i], acc[i + 1], acc[i + 2], acc[i + 3]
            c0, c1, c2, c3 = mh.mma_bf16_16816(a0, b0, a1, b1, x0, x1, c0, c1, c2, c3, mscr)
            c0, c1, c2, c3 = mh.mma_bf16_16816(a2, b2, a3, b3, x2, x3, c0, c1, c2, c3, mscr)
            c0, c1, c2, c3 = mh.mma_bf16_16816(a4, b4, a5, b5, x4, x5, c0, c1, c2, c3, mscr)
            c0, c1, c2, c3 = mh.mma_bf16_16816(a6, b6, a7, b7, x6, x7, c0, c1, c2, c3, mscr)
            acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = c0, c1, c2, c3

    @cuda.jit(device=True, inline="always")
    def rows(wa, wb, x, xg, r0, n_rows, n_batch, k, acc, mscr):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane >> 2, lane & 3
        for i in range(na):
            acc[i] = float32(0.0)
        ra = min(r0 + g, n_rows - 1)                 # rows past N are clamped: loads stay unconditional
        rb = min(r0 + g + 8, n_rows - 1)
        # In the simulator every warp runs the same number of chunks, the surplus ones into the spill half of
        # acc (never read): its mma twin is a block-wide barrier, so the calls must stay uniform.
        if UNIFORM:
            for c in range(warp * KC, cdiv(k, WARPS * KC) * WARPS * KC, WARPS * KC):
                base = 0 if c < k else na
                cc = min(c, k - KC)
                mma_chunk(wa, x, xg, ra, rb, cc, n_batch, acc, base, g, t, mscr)
                if pair:
                    mma_chunk(wb, x, xg, ra, rb, cc, n_batch, acc, base + 4 * nt, g, t, mscr)
        else:       # constant offsets: the accumulators stay in registers
            for c in range(warp * KC, k, WARPS * KC):
                mma_chunk(wa, x, xg, ra, rb, c, n_batch, acc, 0, g, t, mscr)
                if pair:
                    mma_chunk(wb, x, xg, ra, rb, c, n_batch, acc, 4 * nt, g, t, mscr)

    @cuda.jit(device=True, inline="always")
    def publish(red, acc):
        """red[m, warp, row, seq] <- this lane's sums, then a barrier."""
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane >> 2, lane & 3
        for m in range(2 if pair else 1):
            for j in range(nt):
                i = m * 4 * nt + 4 * j
                red[m, warp, g, 8 * j + 2 * t] = acc[i]
                red[m, warp, g, 8 * j + 2 * t + 1] = acc[i + 1]
                red[m, warp, g + 8, 8 * j + 2 * t] = acc[i + 2]
                red[m, warp, g + 8, 8 * j + 2 * t + 1] = acc[i + 3]
        cuda.syncthreads()

    return rows, publish


@cuda.jit(device=True, inline="always")
def silu_mul(g, u):
    """The elementwise silu_mul op (``kernels/ops/elementwise.py``) in fp32: the epilogue of both gate/up kernels."""
    return g / (float32(1.0) + math.exp(-g)) * u


@cuda.jit(device=True, inline="always")
def _total(red, m, r, b):
    s = float32(0.0)
    for w in range(WARPS):
        s += red[m, w, r, b]
    return s


@functools.lru_cache(maxsize=None)
def _make(nt: int, has_bias: bool, out_bf16: bool):
    rows, publish = _device(nt, False)
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    NA = 2 * 4 * nt        # and a spill half for the simulator's surplus chunks (never read)
    SB = 8 * nt

    def gemv_mma_kernel(w, x, bias, y, n_rows, n_batch, k):
        # w: [N, K] bf16; x: [B, K] bf16; bias: [N] bf16 (ignored without bias); y: [B, N] bf16|f32
        # grid: ceil(N / 16); block: 128
        mscr = cuda.shared.array((MS0, MS1), float64)
        red = cuda.shared.array((1, WARPS, ROWS, SB), float32)
        acc = cuda.local.array(NA, float32)
        r0 = cuda.blockIdx.x * ROWS
        rows(w, w, x, 0, r0, n_rows, n_batch, k, acc, mscr)
        publish(red, acc)
        for e in range(cuda.threadIdx.x, ROWS * n_batch, NT):
            r, b = e % ROWS, e // ROWS
            if r0 + r < n_rows:
                s = _total(red, 0, r, b)
                if has_bias:
                    s += dev_bf16_to_f32(bias[r0 + r])
                if out_bf16:
                    y[b, r0 + r] = dev_f32_to_bf16(s)
                else:
                    y[b, r0 + r] = s

    return mh.kernel(NT)(gemv_mma_kernel)


@functools.lru_cache(maxsize=None)
def _make_multi(nt: int, has_bias: bool):
    rows, publish = _device(nt, False)
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    NA = 2 * 4 * nt
    SB = 8 * nt

    def gemv_mma_multi_kernel(w0, w1, w2, x, bias0, bias1, bias2, y0, y1, y2, n0, n1, n2, blk0, blk1, n_batch, k):
        # blocks [0, blk0) take rows of w0, the next blk1 rows of w1, the rest rows of w2 (blk_i = ceil(N_i / 16))
        mscr = cuda.shared.array((MS0, MS1), float64)
        red = cuda.shared.array((1, WARPS, ROWS, SB), float32)
        acc = cuda.local.array(NA, float32)
        bx = cuda.blockIdx.x
        if bx < blk0:
            m, n_rows, r0 = 0, n0, bx * ROWS
        elif bx < blk0 + blk1:
            m, n_rows, r0 = 1, n1, (bx - blk0) * ROWS
        else:
            m, n_rows, r0 = 2, n2, (bx - blk0 - blk1) * ROWS
        # each matrix its own call (a selected array argument would lose the ld.global.nc loads)
        if m == 0:
            rows(w0, w0, x, 0, r0, n_rows, n_batch, k, acc, mscr)
        elif m == 1:
            rows(w1, w1, x, 0, r0, n_rows, n_batch, k, acc, mscr)
        else:
            rows(w2, w2, x, 0, r0, n_rows, n_batch, k, acc, mscr)
        publish(red, acc)
        for e in range(cuda.threadIdx.x, ROWS * n_batch, NT):
            r, b = e % ROWS, e // ROWS
            if r0 + r < n_rows:
                s = _total(red, 0, r, b)
                if m == 0:
                    if has_bias:
                        s += dev_bf16_to_f32(bias0[r0 + r])
                    y0[b, r0 + r] = dev_f32_to_bf16(s)
                elif m == 1:
                    if has_bias:
                        s += dev_bf16_to_f32(bias1[r0 + r])
                    y1[b, r0 + r] = dev_f32_to_bf16(s)
                else:
                    if has_bias:
                        s += dev_bf16_to_f32(bias2[r0 + r])
                    y2[b, r0 + r] = dev_f32_to_bf16(s)

    return mh.kernel(NT)(gemv_mma_multi_kernel)


@functools.lru_cache(maxsize=None)
def _make_gate_up(nt: int):
    rows, publish = _device(nt, True)
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    NA = 2 * 2 * 4 * nt
    SB = 8 * nt

    def gemv_mma_gate_up_silu_kernel(wg, wu, x, y, n_rows, n_batch, k):
        mscr = cuda.shared.array((MS0, MS1), float64)
        red = cuda.shared.array((2, WARPS, ROWS, SB), float32)
        acc = cuda.local.array(NA, float32)
        r0 = cuda.blockIdx.x * ROWS
        rows(wg, wu, x, 0, r0, n_rows, n_batch, k, acc, mscr)
        publish(red, acc)
        for e in range(cuda.threadIdx.x, ROWS * n_batch, NT):
            r, b = e % ROWS, e // ROWS
            if r0 + r < n_rows:
                gv = dev_bf16_to_f32(dev_f32_to_bf16(_total(red, 0, r, b)))
                uv = dev_bf16_to_f32(dev_f32_to_bf16(_total(red, 1, r, b)))
                y[b, r0 + r] = dev_f32_to_bf16(silu_mul(gv, uv))

    return mh.kernel(NT)(gemv_mma_gate_up_silu_kernel)


def workspace_requirement(n: int, k: int, batch: int = 1):
    """Partial sums meet in shared memory: no workspace."""
    return NONE


def bytes_moved(n: int, k: int, batch: int = 1, *, bias: bool = False, out_itemsize: int = 2) -> int:
    """W once, x once, y once (and the bias)."""
    return 2 * n * k + 2 * batch * k + out_itemsize * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    return 2 * n * k * batch


def _nt(b: int) -> int:
    return cdiv(b, 8)


def launch(w, x, out, bias, stream):
    """out[B, N] = x · wᵀ (+ bias); the caller has checked shapes and ``usable``."""
    n, k = w.shape
    b = x.shape[0]
    _make(_nt(b), bias is not None, out.dtype == np.uint16)[cdiv(n, ROWS), NT, stream](
        w, x, x if bias is None else bias, out, n, b, k)


def launch_multi(ws, x, outs, biases, stream, n2=None):
    """q/k/v (three matrices; ``n2=0``: the third repeats the second and no block selects it) in one grid."""
    b, k = x.shape
    ns = [int(w.shape[0]) for w in ws]
    if n2 is not None:
        ns[2] = n2
    blk = [cdiv(n, ROWS) for n in ns]
    bs = [x, x, x] if biases is None else list(biases)
    _make_multi(_nt(b), biases is not None)[sum(blk), NT, stream](
        ws[0], ws[1], ws[2], x, bs[0], bs[1], bs[2], outs[0], outs[1], outs[2], ns[0], ns[1], ns[2],
        blk[0], blk[1], b, k)


def launch_gate_up(w_gate, w_up, x, out, stream):
    n, k = w_gate.shape
    _make_gate_up(_nt(x.shape[0]))[cdiv(n, ROWS), NT, stream](w_gate, w_up, x, out, n, x.shape[0], k)


_U16 = "uint16[:, ::1]"
SIGNATURES = (
    [(_make(nt, hb, ob).py_func,
      f"void({_U16}, {_U16}, {'uint16[::1]' if hb else _U16}, {'uint16' if ob else 'float32'}[:, ::1], "
      "int64, int64, int64)")
     for nt in (2, 4) for hb, ob in ((False, True), (True, True), (False, False))]
    + [(_make_multi(nt, hb).py_func,
        f"void({_U16}, {_U16}, {_U16}, {_U16}, " + (", ".join(["uint16[::1]"] * 3) if hb else ", ".join([_U16] * 3))
        + f", {_U16}, {_U16}, {_U16}, " + ", ".join(["int64"] * 7) + ")")
       for nt in (2, 4) for hb in (False, True)]
    + [(_make_gate_up(nt).py_func, f"void({_U16}, {_U16}, {_U16}, {_U16}, int64, int64, int64)") for nt in (2, 4)]
)
# B = 8 (one n8 tile), the smallest batch this route takes
SIGNATURES += [(_make(1, False, True).py_func, SIGNATURES[0][1]),
               (_make_multi(1, False).py_func, SIGNATURES[6][1]),
               (_make_gate_up(1).py_func, SIGNATURES[-1][1])]
