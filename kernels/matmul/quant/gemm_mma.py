"""Quantized prefill GEMM on the tensor cores: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]) with W stored int4 or MXFP4
(``formats.py``), dequantized in the load path; bf16 ``mma.sync`` with fp32 accumulation, bf16 out, no workspace.

The tiling, the x operand and the fragment reads are those of the dense route (``matmul/dense/gemm_mma.py``: 64 × 128
tiles, 4 warps of 2 × 8 mma tiles, K steps of 32, x copied by ``cp.async`` two stages deep). The W tile differs:
- each of the 128 threads owns one row of the W tile; per K step it loads that row's 16 packed bytes (32 values,
  one MXFP4 block or a quarter of an int4 group) and its scale (and zero) into registers one step ahead, so the
  loads are in flight while the current step multiplies;
- at the top of the next step it decodes the 32 values (the bit tricks of ``quant/gemm.py``'s in-register route:
  int4 (q - zero)·scale in fp32, MXFP4 code × 2^(e-127) exactly), rounds them to bf16 pairs and stores the row's
  16 words into the shared W tile, which the warps read as the mma's B fragments.
So W is read at 4 bits a value, once per 64-row M tile, and never written out densely. The bf16 rounding of the
dequantized int4 values is the ``dense_cache`` route's (``reference(..., route="dense_cache")`` models it exactly);
MXFP4 values are exact in bf16. Rows of x past M are zero-filled (never copied); rows of W past N are clamped to
the last row (loaded, never stored). K a multiple of 128 (int4) or 32 (MXFP4); x rows 16-byte aligned.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, float64, uint32

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32
from vmmstream.kernels.base.launch import SHARED_ALIGN16, as_stream, cdiv, cp_async_commit, \
    cp_async_waiter, ld16_ro
from vmmstream.kernels.matmul.dense.gemm_mma import A_LEN, A_WORDS, BK, BM, BN, NT, P, copy_rows, epilogue, \
    mma_stage, zero_rows
from vmmstream.kernels.base.workspace import NONE
from vmmstream.kernels.matmul.quant.formats import INT4, INT4_GROUP, MX_BLOCK, MXFP4

CAPTURE_SAFE = True
B_TILE = BN * P       # one stage: each thread decodes its row at the top of a step, after the last step's reads
assert BN == NT and BK == MX_BLOCK and INT4_GROUP % BK == 0
_wait0, _wait1 = cp_async_waiter(0), cp_async_waiter(1)


@cuda.jit(device=True, inline="always")
def _decode(w, sc, cz, j, kind):
    """fp32 value of nibble j of word w (int4: (q - zero)·scale via 16·scale and 1 + zero/16; MXFP4: E2M1 × scale)."""
    nib = (w >> uint32(4 * j)) & uint32(0xF)
    if kind == INT4:
        return (dev_bf16_to_f32((nib << uint32(3)) | uint32(0x3F80)) - cz) * sc
    c = nib & uint32(7)
    bits = (c << uint32(6)) + uint32(0x3F00) if c >= uint32(2) else c * uint32(0x3F00)
    bits |= (nib & uint32(8)) << uint32(12)
    return dev_bf16_to_f32(bits) * sc


@functools.lru_cache(maxsize=None)
def _make(kind: int, has_bias: bool):
    MS0, MS1 = mh.SIM_MMA_SCRATCH

    @mh.kernel((NT, 2))
    def qgemm_mma_kernel(x, packed, scales, zeros, bias, y, m, n, k):
        # x: [M, K] u16; packed: [N, K/2] u8; scales: int4 [N, K/128] f16|f32, mxfp4 [N, K/32] u8 (E8M0);
        # zeros: int4 like scales (mxfp4: unused); bias: [N] u16 (unused without bias); y: [M, N] u16
        # grid (ceil(M / 64), ceil(N / 128)); block 128
        a_s = cuda.shared.array(A_LEN, np.uint32, alignment=SHARED_ALIGN16)
        b_s = cuda.shared.array(B_TILE, np.uint32, alignment=SHARED_ALIGN16)
        mscr = cuda.shared.array((MS0, MS1), float64)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane >> 2, lane & 3
        wm, wn = (warp & 1) * 32, (warp >> 1) * 64
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        wrow = min(n0 + tid, n - 1)         # this thread's W row (clamped: rows past N are never stored)
        zero_rows(a_s, A_WORDS, BM, m - m0, tid)          # rows of x past M: zeros in both stages
        acc = cuda.local.array(64, float32)
        for i in range(64):
            acc[i] = float32(0.0)
        af = cuda.local.array(8, uint32)
        bf = cuda.local.array(16, uint32)
        steps = k // BK
        # step 0: x by cp.async, W row into registers
        copy_rows(a_s, 0, x, m0, 0, m, BM, tid)
        cp_async_commit()
        w0, w1, w2, w3 = ld16_ro(packed, (wrow, 0))
        if kind == INT4:
            sc = float32(scales[wrow, 0]) * float32(16.0)
            cz = float32(1.0) + float32(zeros[wrow, 0]) * float32(0.0625)
        else:
            sc = dev_bf16_to_f32(uint32(scales[wrow, 0]) << uint32(7))
            cz = float32(0.0)
        for st in range(steps):
            cur = st & 1
            # decode this step's W row into the shared tile (the last step's reads ended at its barrier)
            o = tid * P
            for wi in range(4):
                wd = w0 if wi == 0 else (w1 if wi == 1 else (w2 if wi == 2 else w3))
                for j in range(4):
                    b_s[o + 4 * wi + j] = mh.pack_bf16x2(_decode(wd, sc, cz, 2 * j, kind),
                                                         _decode(wd, sc, cz, 2 * j + 1, kind))
            if st + 1 < steps:          # next step: x copies into the other stage, the W row into registers
                k1 = (st + 1) * BK
                nxt = 1 - cur
                copy_rows(a_s, nxt * A_WORDS, x, m0, k1, m, BM, tid)
                cp_async_commit()
                w0, w1, w2, w3 = ld16_ro(packed, (wrow, k1 // 2))
                if kind == INT4:
                    gi = k1 // INT4_GROUP
                    sc = float32(scales[wrow, gi]) * float32(16.0)
                    cz = float32(1.0) + float32(zeros[wrow, gi]) * float32(0.0625)
                else:
                    sc = dev_bf16_to_f32(uint32(scales[wrow, k1 // MX_BLOCK]) << uint32(7))
                _wait1()
            else:
                _wait0()
            cuda.syncthreads()
            mma_stage(a_s, cur * A_WORDS, b_s, 0, acc, af, bf, wm, wn, g, t, mscr)
            cuda.syncthreads()
        epilogue(y, acc, bias, m0, n0, wm, wn, g, t, m, n, has_bias, True)

    return qgemm_mma_kernel


def launch(kind: int, x, packed, scales, zeros, out, bias=None, stream=None) -> None:
    """The caller (``quant/gemm.py``) has checked formats, shapes and alignment."""
    m, k = x.shape
    n = packed.shape[0]
    if m and n:
        _make(kind, bias is not None)[(cdiv(m, BM), cdiv(n, BN)), NT, as_stream(stream)](
            x, packed, scales, scales if zeros is None else zeros, x if bias is None else bias, out, m, n, k)


def workspace_requirement(m: int, n: int, k: int):
    """W is decoded into shared memory: no workspace."""
    return NONE


def bytes_moved(m: int, n: int, k: int, *, kind: int = MXFP4, scale_itemsize: int = 2) -> int:
    """DRAM-level lower bound: packed W and its scales (int4: and zeros) once, x once, bf16 out."""
    w = n * k // 2 + (2 * n * (k // INT4_GROUP) * scale_itemsize if kind == INT4 else n * (k // MX_BLOCK))
    return w + 2 * m * k + 2 * m * n


def flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def _sig(kind: int, has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    s = "float16[:, ::1]" if kind == INT4 else "uint8[:, ::1]"
    return f"void(uint16[:, ::1], uint8[:, ::1], {s}, {s}, {bias_t}, uint16[:, ::1], int64, int64, int64)"


SIGNATURES = [(_make(kind, hb).py_func, _sig(kind, hb)) for kind in (INT4, MXFP4) for hb in (False, True)]
