"""int4 decode GEMV on tensor cores: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias), W int4 group-wise
(``kernels/quant.py``), one ``mma.sync.m16n8k16`` bf16 per 16 × 16 slice, fp32 accumulation.

The scalar route (``kernels/qgemv.py``) spends several integer and float instructions per 4-bit value;
here two values become one packed bf16 pair with a shift and one and-or, and a packed ``fma.rn.bf16x2``
takes the zero point off exactly, so the tensor core does the multiply-adds:

- a block is 4 warps over 16 rows of W and 8 columns of x (the batch; B = 1 leaves 7 idle); warp w takes
  the int4 groups w, w + 4, ... and the warps' partial sums meet in shared memory at the end;
- lane (g, t) = (lane / 4, lane % 4) loads one 16-byte chunk (32 values) of rows g and g + 8 per group:
  values 32t .. 32t + 31 of the group. The mma's k order inside a 16-wide step is free as long as the
  A and B fragments agree: the step pairs nibbles (j, j + 4) of a 32-bit word, which a shift and the
  mask 0x000F000F put in the low bits of two bf16 halves of 128.0 (``| 0x43004300``); fma with 1.0 and
  −(128 + zero) leaves q − zero exactly (integers below 256 are exact in bf16). x's pair
  (x[j], x[j + 4]) is assembled from two loaded words the same way;
- each group's D is scaled by that row's group scale once and added to the fp32 accumulators.

Contract beyond the scalar route's: zero points are integers in [0, 15] (``quantize_int4`` makes them so;
a fractional zero would be rounded to bf16). Capture-safe; no workspace.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32

from . import mma_helpers as mh
from .dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from .launch import ld8_ro
from .workspace import NONE

CAPTURE_SAFE = True      # no allocation, no synchronize, device arrays only
W = mh.WARPS             # warps per block (the simulator's mma scratch is sized for it)
ROWS, COLS = 16, 8       # rows of W and columns of x per block
GROUP = 128


@functools.lru_cache(maxsize=None)
def make(kind: int, has_bias: bool, steps: int = 1, adjacent: bool = False):
    """``steps`` groups per warp are loaded before any is multiplied, so that many 16-byte loads of W per
    lane are in flight at once; ``adjacent``: a warp's groups of one step are consecutive in K (a longer
    contiguous run per row) rather than ``WARPS`` groups apart (the block's warps side by side)."""
    from .qgemv import INT4, _ld16_ro
    MS0, MS1 = mh.SIM_MMA_SCRATCH          # simulator-only scratch (1 x 1 on the GPU)
    is_int4 = kind == INT4
    U = steps
    U4 = 4 * steps
    ADJ = adjacent

    @mh.kernel(mh.THREADS)
    def qgemv_q4_mma(packed, scales, zeros, x, bias, y, n_rows, n_batch, k):
        # packed [N, K/2] u8; int4: scales, zeros [N, K/128] f16|f32; mxfp4: scales [N, K/32] u8 (E8M0),
        # zeros ignored; x [B, K] bf16; bias [N] bf16; y [B, N] bf16. grid (ceil(N / 16), ceil(B / 8)); block 128
        tid = cuda.threadIdx.x
        lane, wid = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        row0 = cuda.blockIdx.x * ROWS
        col0 = cuda.blockIdx.y * COLS
        ra = min(row0 + g, n_rows - 1)
        rb = min(row0 + g + 8, n_rows - 1)
        xc = col0 + g
        xr = min(xc, n_batch - 1)
        scratch = cuda.shared.array((MS0, MS1), np.float64)
        red = cuda.shared.array((W, 32, 4), np.float32)
        wa = cuda.local.array(U4, uint32)
        wb = cuda.local.array(U4, uint32)
        ca = cuda.local.array(U, uint32)
        cb = cuda.local.array(U, uint32)
        sa = cuda.local.array(U, float32)
        sb = cuda.local.array(U, float32)
        xw = cuda.local.array(16, uint32)
        ng = k // GROUP
        one = uint32(0x3F803F80)                 # bf16 pair (1.0, 1.0)
        magic = uint32(0x43004300)               # bf16 pair (128.0, 128.0): a nibble in the low bits adds q
        norm = uint32(0x7E807E80)                # bf16 pair (2^126, 2^126)
        lo16, hi16, nib2 = uint32(0xFFFF), uint32(0xFFFF0000), uint32(0x000F000F)
        acc0 = acc1 = acc2 = acc3 = float32(0.0)
        for it in range((ng + W * U - 1) // (W * U)):  # the same trip count in every warp (the mma is warp-wide)
            for u in range(U):                   # all of this step's loads first
                gc = min(((it * W + wid) * U + u) if ADJ else ((it * U + u) * W + wid), ng - 1)
                o = 4 * u
                wa[o], wa[o + 1], wa[o + 2], wa[o + 3] = _ld16_ro(packed, (ra, gc * 64 + 16 * t))
                wb[o], wb[o + 1], wb[o + 2], wb[o + 3] = _ld16_ro(packed, (rb, gc * 64 + 16 * t))
                if is_int4:                      # c: -(128 + zero) per row, the D scale after the group
                    za = float32(zeros[ra, gc]) + float32(128.0)
                    zb = float32(zeros[rb, gc]) + float32(128.0)
                    ca[u] = mh.pack_bf16x2(-za, -za)
                    cb[u] = mh.pack_bf16x2(-zb, -zb)
                    sa[u] = float32(scales[ra, gc])
                    sb[u] = float32(scales[rb, gc])
                else:                            # c: the lane's E8M0 block scale 2^(e - 127) as a bf16 pair
                    ea = uint32(scales[ra, 4 * gc + t])
                    eb = uint32(scales[rb, 4 * gc + t])
                    ea = uint32(0x40) if ea == 0 else ea << uint32(7)      # e = 0: 2^-127, a bf16 subnormal
                    eb = uint32(0x40) if eb == 0 else eb << uint32(7)
                    ca[u] = ea | (ea << uint32(16))
                    cb[u] = eb | (eb << uint32(16))
            for u in range(U):
                gi = ((it * W + wid) * U + u) if ADJ else ((it * U + u) * W + wid)
                gc = min(gi, ng - 1)
                use_x = gi < ng and xc < n_batch
                for om in range(4):
                    x0, x1, x2, x3 = ld8_ro(x, (xr, gc * GROUP + 32 * t + 8 * om))
                    if not use_x:
                        x0 = x1 = x2 = x3 = uint32(0)
                    xw[4 * om], xw[4 * om + 1], xw[4 * om + 2], xw[4 * om + 3] = x0, x1, x2, x3
                d0 = d1 = d2 = d3 = float32(0.0)
                for om in range(4):              # word om of the chunk: values 8 om .. 8 om + 7
                    wao = wa[4 * u + om]
                    wbo = wb[4 * u + om]
                    for h in range(2):           # k-step: pairs j = 2h (a0, a1, b0) and 2h + 1 (a2, a3, b1)
                        xa = xw[4 * om + h]      # (x[2h], x[2h + 1])
                        xb = xw[4 * om + 2 + h]  # (x[2h + 4], x[2h + 5])
                        b0 = (xa & lo16) | (xb << uint32(16))          # (x[2h], x[2h + 4])
                        b1 = (xa >> uint32(16)) | (xb & hi16)          # (x[2h + 1], x[2h + 5])
                        s0 = uint32(8 * h)
                        s1 = uint32(8 * h + 4)
                        if is_int4:
                            a0 = mh.fma_bf16x2(((wao >> s0) & nib2) | magic, one, ca[u])
                            a2 = mh.fma_bf16x2(((wao >> s1) & nib2) | magic, one, ca[u])
                            a1 = mh.fma_bf16x2(((wbo >> s0) & nib2) | magic, one, cb[u])
                            a3 = mh.fma_bf16x2(((wbo >> s1) & nib2) | magic, one, cb[u])
                        else:
                            a0 = _e2m1_pair((wao >> s0) & nib2, norm, ca[u])
                            a2 = _e2m1_pair((wao >> s1) & nib2, norm, ca[u])
                            a1 = _e2m1_pair((wbo >> s0) & nib2, norm, cb[u])
                            a3 = _e2m1_pair((wbo >> s1) & nib2, norm, cb[u])
                        d0, d1, d2, d3 = mh.mma_bf16_16816(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3, scratch)
                if is_int4:
                    acc0 += d0 * sa[u]
                    acc1 += d1 * sa[u]
                    acc2 += d2 * sb[u]
                    acc3 += d3 * sb[u]
                else:
                    acc0 += d0
                    acc1 += d1
                    acc2 += d2
                    acc3 += d3
        red[wid, lane, 0] = acc0
        red[wid, lane, 1] = acc1
        red[wid, lane, 2] = acc2
        red[wid, lane, 3] = acc3
        cuda.syncthreads()
        if wid == 0:
            for i in range(4):                   # D: (row g | g + 8) x (col 2t | 2t + 1)
                v = red[0, lane, i]
                for w in range(1, W):
                    v += red[w, lane, i]
                row = row0 + g + 8 * (i // 2)
                col = col0 + 2 * t + (i % 2)
                if row < n_rows and col < n_batch:
                    if has_bias:
                        v += dev_bf16_to_f32(bias[row])
                    y[col, row] = dev_f32_to_bf16(v)

    return qgemv_q4_mma


@cuda.jit(device=True, inline="always")
def _e2m1_pair(p, norm, scale):
    """Two E2M1 codes (s e1 e0 m) in bits 0..3 and 16..19 of ``p`` -> a bf16 pair of value * scale: the
    e1 e0 m bits go to bf16 bits 8..6 (exponent 0..3, top mantissa bit: value * 2^-126, e = 0 a subnormal),
    the sign to bit 15; one packed fma by 2^126 makes it exact, a second by the block scale."""
    raw = ((p << uint32(6)) & uint32(0x01C001C0)) | ((p << uint32(12)) & uint32(0x80008000))
    return mh.fma_bf16x2(mh.fma_bf16x2(raw, norm, uint32(0)), scale, uint32(0))


def launch(kind, packed, scales, zeros, x, out, bias, stream, steps=1, adjacent=False):
    """Shapes checked by ``qgemv._launch``; x, out 2-D; ``zeros`` None for MXFP4; ``steps`` groups per
    warp loaded at once (1, 2, 4 or 8)."""
    n, b, k = packed.shape[0], x.shape[0], 2 * packed.shape[1]
    if k % GROUP:
        raise ValueError(f"the mma route takes K in multiples of {GROUP}, got {k}")
    if steps not in (1, 2, 4, 8):
        raise ValueError(f"the mma route loads 1, 2, 4 or 8 groups per warp at once, got {steps}")
    kern = make(kind, bias is not None, steps, bool(adjacent) and steps > 1)
    kern[(-(-n // ROWS), -(-b // COLS)), mh.THREADS, stream](
        packed, scales, scales if zeros is None else zeros, x, x if bias is None else bias, out, n, b, k)


def workspace_requirement(n: int, k: int, batch: int = 1):
    """No scratch: the warps' partial sums meet in shared memory."""
    return NONE


def bytes_moved(n: int, k: int, batch: int = 1, *, scale_itemsize: int = 2, bias: bool = False) -> int:
    """HBM bytes: packed W, scales and zeros once per column tile of 8, x, bf16 out, bias."""
    w = n * k // 2 + 2 * n * (k // GROUP) * scale_itemsize
    return w * -(-batch // COLS) + 2 * batch * k + 2 * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    """Useful multiply-adds (the tensor core also multiplies the padding columns)."""
    return 2 * n * k * batch


def _sig(scale_t: str, has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    s = f"{scale_t}[:, ::1]"
    return f"void(uint8[:, ::1], {s}, {s}, uint16[:, ::1], {bias_t}, uint16[:, ::1], int64, int64, int64)"


def _signatures():
    from .qgemv import INT4, MXFP4, QgemvConfig
    u = QgemvConfig().mma_steps          # the depth the model's decode launches use
    return ([(make(INT4, hb, u).py_func, _sig(st, hb)) for st, hb in (("float16", False), ("float16", True), ("float32", False))]
            + [(make(MXFP4, hb, u).py_func, _sig("uint8", hb)) for hb in (False, True)])


SIGNATURES = _signatures()
