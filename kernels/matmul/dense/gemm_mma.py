"""Prefill GEMM on the tensor cores: Y[M, N] = X[M, K] · W[N, K]ᵀ (+ bias[N]), bf16 in, fp32 accumulate.

``mma.sync.m16n8k16`` (bf16 → fp32, ``base/mma.py``), fed from shared memory by ``cp.async``:
- a block of 4 warps computes a 64 × 128 tile of Y; warp w takes rows 32·(w & 1) … + 32 and columns
  64·(w >> 1) … + 64 of it, i.e. 2 × 8 mma tiles (64 fp32 accumulators per thread);
- per K step of 32 the block copies the X tile (64 rows × 64 bytes) and the W tile (128 rows × 64 bytes) into
  shared memory with 16-byte ``cp.async`` copies, two stages deep, so the next step's copies run while this
  step is multiplied;
- both operands are read along K, which is what the mma's A (row-major) and B ("col") fragments want, so W stays
  in checkpoint layout and no tile is transposed. A row of a tile is 16 words padded to 20: the 8 rows × 4
  words a fragment load touches fall in 32 distinct banks;
- blockIdx.x walks the M tiles, so the blocks resident at once share W tiles (read from DRAM about once) and
  X, the smaller operand at prefill sizes, is re-read from L2.
Rows of X or W past M or N are zero-filled in shared memory once (the copies never touch them) and their
results are not stored. K must be a multiple of 32 and X and W rows 16-byte aligned (``usable``); ``gemm.gemm``
falls back to the SIMT kernel otherwise. Output bf16 (uint16) or fp32, whatever ``out`` is.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, float64, uint32

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.workspace import NONE
from vmmstream.kernels.base.launch import SHARED_ALIGN16, as_stream, cdiv, cp_async16, cp_async_commit, \
    cp_async_waiter, vec8_ok

CAPTURE_SAFE = True   # no allocation, no synchronize, device arrays only
# Whether gemm() and the quantized qgemm take the tensor-core routes when no route is named (checked on CUDA by
# tests/gpu/test_dense_kernels_gpu.py, test_qgemv_gpu.py and test_load_model_gpu.py). False falls back to the SIMT
# tiles everywhere; named routes (route="mma") run either way.
DEFAULT = True
BM, BN, BK = 64, 128, 32
P = BK // 2 + 4       # words per shared row: 16 of data, 4 of pad
A_WORDS, B_WORDS = BM * P, BN * P
A_LEN, B_LEN = 2 * A_WORDS, 2 * B_WORDS   # two stages
NT = mh.THREADS       # 128: the simulator's mma scratch is sized for 4 warps
assert NT == 128 and BM * BK // 8 == 2 * NT and BN * BK // 8 == 4 * NT
_wait0, _wait1 = cp_async_waiter(0), cp_async_waiter(1)


def usable(x, w) -> bool:
    """Can this kernel take these operands? K a positive multiple of 32, rows contiguous and 16-byte aligned."""
    return x.shape[1] > 0 and x.shape[1] % BK == 0 and vec8_ok(x, w)


@cuda.jit(device=True, inline="always")
def _store(y, row, col, v, m, n, out_bf16):
    if row < m and col < n:
        if out_bf16:
            y[row, col] = dev_f32_to_bf16(v)
        else:
            y[row, col] = v


@cuda.jit(device=True, inline="always")
def zero_rows(s, words, rows, r_lo, tid):
    """Zero, in both stages of ``s`` (``words`` apart), the tile rows ``r >= r_lo`` among the ``rows`` (4 pieces
    of 4 words each; piece c = tid + NT·u is row c >> 2): rows past M or N, which the copies never fill."""
    for u in range(rows // 32):
        c = tid + NT * u
        r, q = c >> 2, c & 3
        if r >= r_lo:
            for st in range(2):
                for e in range(4):
                    s[st * words + r * P + 4 * q + e] = uint32(0)


@cuda.jit(device=True, inline="always")
def copy_rows(s, base, src, r0, k0, n_rows, rows, tid):
    """``cp.async`` the tile ``src[r0 : r0 + rows, k0 : k0 + 32]`` (bf16) into ``s`` at word ``base``: row r at
    ``base + r·P``, 16 bytes per piece; rows at or past ``n_rows`` are left alone."""
    for u in range(rows // 32):
        c = tid + NT * u
        r, q = c >> 2, c & 3
        if r0 + r < n_rows:
            cp_async16(s, base + r * P + 4 * q, src, (r0 + r, k0 + 8 * q))


@cuda.jit(device=True, inline="always")
def mma_stage(a_s, ab, b_s, bb, acc, af, bf, wm, wn, g, t, mscr):
    """One K step of 32 on this warp's 32 × 64 of the tile: A fragments from ``a_s`` at word ``ab``, B from ``b_s``
    at ``bb`` (fragment layouts: ``base/mma.py``), 2 × 8 mma per k16 step into ``acc``."""
    for kk in range(2):
        for mt in range(2):
            ra = ab + (wm + 16 * mt + g) * P + 8 * kk + t
            af[4 * mt] = a_s[ra]
            af[4 * mt + 1] = a_s[ra + 8 * P]
            af[4 * mt + 2] = a_s[ra + 4]
            af[4 * mt + 3] = a_s[ra + 8 * P + 4]
        for nt in range(8):
            rb = bb + (wn + 8 * nt + g) * P + 8 * kk + t
            bf[2 * nt] = b_s[rb]
            bf[2 * nt + 1] = b_s[rb + 4]
        for mt in range(2):
            for nt in range(8):
                i = 4 * (8 * mt + nt)
                acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = mh.mma_bf16_16816(
                    af[4 * mt], af[4 * mt + 1], af[4 * mt + 2], af[4 * mt + 3], bf[2 * nt], bf[2 * nt + 1],
                    acc[i], acc[i + 1], acc[i + 2], acc[i + 3], mscr)


@cuda.jit(device=True, inline="always")
def epilogue(y, acc, bias, m0, n0, wm, wn, g, t, m, n, has_bias, out_bf16):
    """This warp's accumulators (+ bias) to ``y``, rows and columns past M and N dropped."""
    for mt in range(2):
        r0 = m0 + wm + 16 * mt + g
        r1 = r0 + 8
        for nt in range(8):
            c0 = n0 + wn + 8 * nt + 2 * t
            c1 = c0 + 1
            i = 4 * (8 * mt + nt)
            v0, v1, v2, v3 = acc[i], acc[i + 1], acc[i + 2], acc[i + 3]
            if has_bias:
                b0 = dev_bf16_to_f32(bias[c0]) if c0 < n else float32(0.0)
                b1 = dev_bf16_to_f32(bias[c1]) if c1 < n else float32(0.0)
                v0 += b0
                v1 += b1
                v2 += b0
                v3 += b1
            _store(y, r0, c0, v0, m, n, out_bf16)
            _store(y, r0, c1, v1, m, n, out_bf16)
            _store(y, r1, c0, v2, m, n, out_bf16)
            _store(y, r1, c1, v3, m, n, out_bf16)


@functools.lru_cache(maxsize=None)
def _make(has_bias: bool, out_bf16: bool):
    MS0, MS1 = mh.SIM_MMA_SCRATCH

    @mh.kernel((NT, 2))
    def gemm_mma_kernel(x, w, bias, y, m, n, k):
        # x: [M, K] u16; w: [N, K] u16; bias: [N] u16 (unused without bias); y: [M, N] u16|f32
        # grid (ceil(M / 64), ceil(N / 128)); block 128
        a_s = cuda.shared.array(A_LEN, np.uint32, alignment=SHARED_ALIGN16)
        b_s = cuda.shared.array(B_LEN, np.uint32, alignment=SHARED_ALIGN16)
        mscr = cuda.shared.array((MS0, MS1), float64)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane >> 2, lane & 3
        wm, wn = (warp & 1) * 32, (warp >> 1) * 64
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        zero_rows(a_s, A_WORDS, BM, m - m0, tid)          # rows past M / N: zeros in both stages
        zero_rows(b_s, B_WORDS, BN, n - n0, tid)
        acc = cuda.local.array(64, float32)
        for i in range(64):
            acc[i] = float32(0.0)
        af = cuda.local.array(8, uint32)
        bf = cuda.local.array(16, uint32)
        steps = k // BK
        copy_rows(a_s, 0, x, m0, 0, m, BM, tid)              # stage 0
        copy_rows(b_s, 0, w, n0, 0, n, BN, tid)
        cp_async_commit()
        for st in range(steps):
            cur = st & 1
            if st + 1 < steps:          # the next step's copies, into the other stage
                nxt = 1 - cur
                copy_rows(a_s, nxt * A_WORDS, x, m0, (st + 1) * BK, m, BM, tid)
                copy_rows(b_s, nxt * B_WORDS, w, n0, (st + 1) * BK, n, BN, tid)
                cp_async_commit()
                _wait1()                # this step's group has landed (the next may still be in flight)
            else:
                _wait0()
            cuda.syncthreads()
            mma_stage(a_s, cur * A_WORDS, b_s, cur * B_WORDS, acc, af, bf, wm, wn, g, t, mscr)
            cuda.syncthreads()          # every warp is done with this stage before it is copied over
        epilogue(y, acc, bias, m0, n0, wm, wn, g, t, m, n, has_bias, out_bf16)

    return gemm_mma_kernel


def launch(x, w, out, bias=None, stream=None) -> None:
    """out[M, N] = x[M, K] · w[N, K]ᵀ (+ bias); the caller has checked shapes and ``usable(x, w)``."""
    m, k = x.shape
    n = w.shape[0]
    if m and n:
        _make(bias is not None, out.dtype == np.uint16)[(cdiv(m, BM), cdiv(n, BN)), NT, as_stream(stream)](
            x, w, x if bias is None else bias, out, m, n, k)


def workspace_requirement(m: int, n: int, k: int):
    """The tiles live in shared memory: no workspace."""
    return NONE


def bytes_moved(m: int, n: int, k: int, *, out_itemsize: int = 2) -> int:
    """DRAM-level lower bound (each operand once) plus output; tiles re-read from L2 not counted."""
    return 2 * m * k + 2 * n * k + out_itemsize * m * n


def flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def _sig(has_bias: bool, out: str) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    return f"void(uint16[:, ::1], uint16[:, ::1], {bias_t}, {out}[:, ::1], int64, int64, int64)"


SIGNATURES = [(_make(hb, True).py_func, _sig(hb, "uint16")) for hb in (False, True)] + [
    (_make(False, False).py_func, _sig(False, "float32"))]
