"""Batch-1 MXFP4 GEMV on the integer tensor cores: y[1, N] = x[1, K] · W[N, K]ᵀ (+ bias), W MXFP4 (nibbles,
``kernels/matmul/quant/formats.py``), one ``mma.sync.m16n8k32`` s8 per 16 rows × 32 values of K, int32 sums. The default
route of ``qgemv_mxfp4`` at batch 1.

Why: the bf16 route (``kernels/matmul/quant/gemv_mma.py``) needs one ``mma.sync.m16n8k16`` per 256 weights; on an H100 that
instruction issues about once per 10 cycles per scheduler (a probe of 12-06, ``docs/bench/HISTORY.md``), and its time adds to the
decode's. ``m16n8k32`` on int8 takes 512 weights per instruction and issues more often (2.4 times the products per
cycle in the same measurement): half the tensor instructions per group, each cheaper.

What changes against the bf16 route, with the row tiles, the two register sets and the per-lane MX block kept
(lane (g, t) loads 16 bytes of rows g and g + 8 per group of 128: MX block t of the group):

- **W to int8, exactly.** Twice an E2M1 value is an integer in [-12, 12]. A code (nibble: magnitude bits 0-2,
  sign bit 3) becomes the byte 12 + 2 · value, in [0, 24], through two ``prmt`` table lookups per 4 codes: the
  table of positive codes keyed by the magnitude, with the sign as ``prmt``'s sign-fill bit (a negative code
  reads the fill of a byte below 128: zero), and the table of negative codes with the sign bit flipped, or'ed
  together. 9 integer instructions per 8 codes (one xor, two shifts, four ``prmt``, two or), as the bf16 decode.
  The offset of 12 is taken back per block: 12 · Σ x of the block, staged with x (below).
- **x to two int8 digits, per MX block.** Each 32 values of x (one block of one group) are rounded to integers
  xi = x · 2^s (half to even), |xi| < 2^14, s from the block's largest |x| (exact for every value within 2^-6 of it, the others
  rounded to the nearest multiple of 2^-14 of it), split as xi = 256 · hi + lo (hi, lo in [-128, 127]). B's
  column 2t holds hi and column 2t + 1 lo, at the k of lane t's block only (the other lanes read a zero
  block), so lane t's D columns are its block's two digit sums, exact in int32. The lane then takes
  256 · D0 + D1 (the offset sum enters as D1's starting value), converts it once and scales it by
  2^(e - 127) of its W block and 2^-s / 2 of its x block, both powers of two.
- A block of x holding inf or NaN makes every row's sum NaN (an integer cannot carry them); a block whose
  largest |x| is below 2^-112 keeps fewer than 14 bits (its scale is held at that of 2^-112).

Contract: batch 1, K a multiple of 128, W and its E8M0 scales [N, K/32] as ``quantize_mxfp4`` stores them.
Capture-safe; no workspace. With ``pdl`` it loads its first groups of W before waiting for the kernel launched
before it, and reads x after.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.launch import (SHARED_ALIGN16, f32_as_u32, grid_dependency_wait, grid_dependents_launch,
    launch_pdl, ld4w, ld8_ro, ld16_at, ld1b_at, lane_ptr, ptr_add, u32_add, u32_as_f32, u32_mad, u32_mul_hi, u32_pin)

CAPTURE_SAFE = True
W = mh.WARPS             # warps per row tile
ROWS = 16
GROUP = 128
TG = 32                  # groups per staged x tile (K 4096)
BLOCKS = 4 * TG          # MX blocks of x per tile
XW = BLOCKS * 16         # staged words per tile: per block 8 words of hi digits, then 8 of lo
ZERO = XW                # 8 words of zeros: the B of the lanes whose D columns are not their block's
XS_LEN = XW + 8
META_LEN = 2 * BLOCKS    # per block: -12 · Σ xi, and the bits of 2^-s / 2
MAX_ROW_TILES = 7
MIN_BLOCKS = 7
MAX_REGS = 72
# 12 + 2 · value of the codes 0..7 (positive) and 8..15 (negative), keyed by the magnitude bits
POS_LO, POS_HI = 0x0F0E0D0C, 0x18141210      # 12 13 14 15 | 16 18 20 24
NEG_LO, NEG_HI = 0x090A0B0C, 0x00040608      # 12 11 10  9 |  8  6  4  0
OFFSET = 12


@cuda.jit(device=True, inline="always")
def dec(w, tp, tn, one):
    """8 E2M1 codes (nibbles, value k = nibble k) -> two words of 4 bytes 12 + 2 · value: values 0-3, 4-7.
    ``tp``, ``tn``: the tables' low words and ``one`` (1), held in registers by the caller. The shifts are
    multiplies-high and the or (of disjoint bytes) a multiply-add, on the FMA pipe: the lookups and the xor
    keep the ALU pipe busy."""
    u = uint32
    wx = w ^ u(0x88888888)
    r0 = u32_mad(mh.prmt(tp, u(POS_HI), w), one, mh.prmt(tn, u(NEG_HI), wx))
    r1 = u32_mad(mh.prmt(tp, u(POS_HI), u32_mul_hi(w, u(0x10000))), one,
                 mh.prmt(tn, u(NEG_HI), u32_mul_hi(wx, u(0x10000))))
    return r0, r1


@cuda.jit(device=True, inline="always")
def group_imma(a0, a1, a2, a3, b0, b1, b2, b3, xs, xo, off, tp, tn, one, scratch):
    """One group: words a* (row g) and b* (row g + 8) of the lane's block, B digits at xs[xo ..] (8 words: steps
    0-3, b0 and b1 each), ``off`` the block's -12 · Σ xi. Two chains of two steps. Returns
    256 · D0 + D1 + off for rows g and g + 8 (32-bit arithmetic)."""
    x0, x1, x2, x3 = ld4w(xs, xo)
    x4, x5, x6, x7 = ld4w(xs, xo + int64(4))
    p0, p1 = dec(a0, tp, tn, one)
    q0, q1 = dec(b0, tp, tn, one)
    c0, c1, c2, c3 = mh.imma_s8_16832(p0, q0, p1, q1, x0, x1, int32(0), int32(0), int32(0), int32(0), scratch)
    p0, p1 = dec(a1, tp, tn, one)
    q0, q1 = dec(b1, tp, tn, one)
    e0, e1, e2, e3 = mh.imma_s8_16832(p0, q0, p1, q1, x2, x3, int32(0), int32(0), int32(0), int32(0), scratch)
    p0, p1 = dec(a2, tp, tn, one)
    q0, q1 = dec(b2, tp, tn, one)
    c0, c1, c2, c3 = mh.imma_s8_16832(p0, q0, p1, q1, x4, x5, c0, c1, c2, c3, scratch)
    p0, p1 = dec(a3, tp, tn, one)
    q0, q1 = dec(b3, tp, tn, one)
    e0, e1, e2, e3 = mh.imma_s8_16832(p0, q0, p1, q1, x6, x7, e0, e1, e2, e3, scratch)
    u = uint32
    return (int32(u32_mad(u32_add(u(c0), u(e0)), 256, u32_add(u32_add(u(c1), u(e1)), u(off)))),
            int32(u32_mad(u32_add(u(c2), u(e2)), 256, u32_add(u32_add(u(c3), u(e3)), u(off)))))


MAGIC = 12615808.0       # 1.5 · 2^23 + 32896: fp32 r = x · 2^s + MAGIC has bits 0x4B408080 + xi (xi = round(x · 2^s))
MAGIC_BITS = 0x4B408080


@cuda.jit(device=True, inline="always")
def rounded(h, f):
    """bf16 x (bits in the high half of ``h``; the low half ignored) times the power of two ``f``, rounded to an
    integer xi (half to even; |xi| < 2^14): the bits of x · f + MAGIC, whose two low bytes are xi + 32896
    (hi digit + 128 in byte 1, lo digit + 128 in byte 0)."""
    return f32_as_u32(u32_as_f32(h & uint32(0xFFFF0000)) * f + float32(MAGIC))


@cuda.jit(device=True, inline="always")
def stage(xs, meta, x, tid, t0, ku, NT, qs):
    """Stage the x tile at K index t0: chunk c (8 values, c = 4 · block + j) by thread c (+ NT ...); the 4 chunks
    of a block sit in 4 adjacent lanes of one warp, which agree on the block's scale through two shuffles.
    Each value: x · 2^(140 - emax) rounded by one fp32 add of MAGIC; its digits are bytes of the sum's bits."""
    u = uint32
    for it in range(-(-(4 * BLOCKS) // NT)):
        c = tid + u(NT * it)
        if (4 * BLOCKS) % NT == 0 or c < u(4 * BLOCKS):   # whole warps: 4 * BLOCKS and NT are multiples of 32
            kk = u32_add(t0, u(8) * c)
            w0 = w1 = w2 = w3 = u(0)
            if kk < ku:
                w0, w1, w2, w3 = ld8_ro(x, (0, kk))
            m = u(0x7FFF)
            mh_ = u(0x7FFF0000)
            mx = max(max(w0 & m, w1 & m, w2 & m, w3 & m), max(w0 & mh_, w1 & mh_, w2 & mh_, w3 & mh_) >> u(16))
            mx = mh.quad_max_u32(mx, qs)
            emax = max(mx >> u(7), u(15))
            f = u32_as_f32((u(267) - emax) << u(23))          # 2^(140 - emax)
            r0, r1 = rounded(w0 << u(16), f), rounded(w0, f)
            r2, r3 = rounded(w1 << u(16), f), rounded(w1, f)
            r4, r5 = rounded(w2 << u(16), f), rounded(w2, f)
            r6, r7 = rounded(w3 << u(16), f), rounded(w3, f)
            s = u32_add(u32_add(u32_add(r0, r1), u32_add(r2, r3)), u32_add(u32_add(r4, r5), u32_add(r6, r7)))
            s = mh.quad_sum_i32(int32(s), qs)                  # Σ bits = 32 · MAGIC_BITS + Σ xi (mod 2^32)
            blk, j = c // u(4), c % u(4)
            o = u32_mad(blk, 16, u(2) * j)
            fl = u(0x80808080)
            xs[o] = mh.prmt(mh.prmt(r0, r1, u(0x51)), mh.prmt(r2, r3, u(0x51)), u(0x5410)) ^ fl       # hi digits
            xs[o + u(1)] = mh.prmt(mh.prmt(r4, r5, u(0x51)), mh.prmt(r6, r7, u(0x51)), u(0x5410)) ^ fl
            xs[o + u(8)] = mh.prmt(mh.prmt(r0, r1, u(0x40)), mh.prmt(r2, r3, u(0x40)), u(0x5410)) ^ fl  # lo digits
            xs[o + u(9)] = mh.prmt(mh.prmt(r4, r5, u(0x40)), mh.prmt(r6, r7, u(0x40)), u(0x5410)) ^ fl
            if j == u(0):
                sx = u32_add(u(s), u((-32 * MAGIC_BITS) % 2 ** 32))    # Σ xi
                meta[u(2) * blk] = int32(u32_mad(sx, u((-OFFSET) % 2 ** 32), 0))
                fx = ((emax - u(14)) << u(23)) if mx < u(0x7F80) else u(0x7FC00000)
                meta[u(2) * blk + u(1)] = int32(fx)


@cuda.jit(device=True, inline="always")
def w_set(packed, scales, qa, qb, qsa, qsb, gi):
    """One register set: the lane's 16 bytes of group ``gi`` in rows g (``qa``) and g + 8 (``qb``), and the two
    E8M0 exponents of its block."""
    a0, a1, a2, a3 = ld16_at(packed, ptr_add(qa, gi, 64))
    b0, b1, b2, b3 = ld16_at(packed, ptr_add(qb, gi, 64))
    return a0, a1, a2, a3, b0, b1, b2, b3, ld1b_at(scales, ptr_add(qsa, gi, 4)), ld1b_at(scales, ptr_add(qsb, gi, 4))


@cuda.jit(device=True, inline="always")
def acc_group(a0, a1, a2, a3, b0, b1, b2, b3, ea, eb, q, t, xs, meta, xst, xbb, tp, tn, one, scratch, acc0, acc2):
    """Group q of the staged tile (a register set of ``w_set``) into the row g and g + 8 accumulators: its
    exact sums times 2^-s / 2 of the lane's x block and 2^(e - 127) of its W blocks (e = 0 a subnormal)."""
    u = uint32
    blk = u32_mad(q, 4, t)
    off, fxb = meta[u(2) * blk], meta[u(2) * blk + u(1)]
    sa, sb = group_imma(a0, a1, a2, a3, b0, b1, b2, b3, xs, int64(u32_mad(q, xst, xbb)), off, tp, tn, one, scratch)
    fx = u32_as_f32(u(fxb))
    acc0 += float32(sa) * fx * u32_as_f32(max(ea << u(23), u(0x400000)))
    acc2 += float32(sb) * fx * u32_as_f32(max(eb << u(23), u(0x400000)))
    return acc0, acc2


@functools.lru_cache(maxsize=None)
def make(has_bias: bool, row_tiles: int = 1):
    """The kernel for blocks of ``row_tiles`` 16-row tiles (4 warps each) sharing one staging of x (the same
    kernel serves plain and programmatic dependent launches: the wait is a no-op in a plain one)."""
    RT = int(row_tiles)
    if not 1 <= RT <= MAX_ROW_TILES:
        raise ValueError(f"row_tiles must be 1 to {MAX_ROW_TILES}, got {RT}")
    NT = mh.THREADS * RT
    RW = RT * W
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    MSR = MS0 * RT if MS0 > 1 else 1
    QSR = mh.SIM_RED_SCRATCH * RT if mh.SIM_RED_SCRATCH > 1 else 1
    u = uint32

    @mh.kernel((NT, max(1, MIN_BLOCKS // RT)), max_registers=MAX_REGS if RT > 1 else None)
    def qgemv_mx_imma(packed, scales, x, bias, y, n_rows, k):
        # packed [N * K/2] u8 nibbles; scales [N * K/32] u8 (E8M0); x [1, K] bf16; bias [N] bf16; y [1, N] bf16
        tid = u(cuda.threadIdx.x)
        lane, gw = tid % u(32), tid // u(32)
        wid = gw % u(W)
        row0 = u32_mad(u32_mad(cuda.blockIdx.x, RT, gw // u(W)), ROWS, 0)
        g, t = lane // u(4), lane % u(4)
        nr1 = u32_add(n_rows, 0xFFFFFFFF)
        ra = min(u32_add(row0, g), nr1)
        rb = min(u32_add(row0, g + u(8)), nr1)
        ku = u(k)
        ng = u32_pin(ku // u(GROUP))
        ng1 = u32_add(ng, 0xFFFFFFFF)
        qa = lane_ptr(packed, int64(u32_mad(ra, ku // u(2), u(16) * t)))
        qb = lane_ptr(packed, int64(u32_mad(rb, ku // u(2), u(16) * t)))
        qsa = lane_ptr(scales, int64(u32_mad(ra, ku // u(32), t)))
        qsb = lane_ptr(scales, int64(u32_mad(rb, ku // u(32), t)))
        scratch = cuda.shared.array((MSR, MS1), np.float64)
        qs = cuda.shared.array(QSR, np.int32)
        xs = cuda.shared.array(XS_LEN, np.uint32, alignment=SHARED_ALIGN16)
        meta = cuda.shared.array(META_LEN, np.int32)
        red = cuda.shared.array((RW, 32, 2), np.float32)
        qf = cuda.shared.array(QSR, np.float32)
        if tid < u(8):
            xs[u32_add(tid, XW)] = u(0)
        # the lanes g = 2t (hi) and 2t + 1 (lo) read their block's digits; the others the zero block
        own = g // u(2) == t
        xst = u32_pin(u(64) if own else u(0))
        xbb = u32_pin(u32_mad(t, 16, u(8) * (g % u(2))) if own else u(ZERO))
        acc0 = acc2 = float32(0.0)
        zero = tid >> u(31)                                    # 0, opaque: the tables stay in registers
        tp, tn = u32_pin(u32_add(u(POS_LO), zero)), u32_pin(u32_add(u(NEG_LO), zero))
        one = u32_pin(u32_add(u(1), zero))
        n_tiles = (ng + u(TG - 1)) // u(TG)
        ti = u(u32_add(min(u(TG), ng), 3) >> u(2))           # the tile's groups per warp
        xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, xea, xeb = w_set(packed, scales, qa, qb, qsa, qsb, min(wid, ng1))
        # W and its scales before the wait, x after it (``launch_pdl``: the kernel before this one may still
        # be writing x)
        grid_dependency_wait()
        grid_dependents_launch()
        base = u(0)
        tile = u(0)
        while tile < n_tiles:
            cuda.syncthreads()                                 # (the previous tile is no longer read)
            stage(xs, meta, x, tid, u32_mad(base, GROUP, 0), ku, NT, qs)
            cuda.syncthreads()
            nbase = u32_add(base, TG)
            nti = u(u32_add(min(u(TG), u32_mad(nbase, 0xFFFFFFFF, ng)), 3) >> u(2)) if nbase < ng else u(0)
            p = u(0)
            while p < ti:                                      # groups 4p + w (X) and 4p + 4 + w (Y) of the tile
                qy = u32_mad(u32_add(p, 1), W, wid)
                ya0, ya1, ya2, ya3, yb0, yb1, yb2, yb3, yea, yeb = w_set(packed, scales, qa, qb, qsa, qsb,
                                                                         min(u32_add(base, qy), ng1))
                acc0, acc2 = acc_group(xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, xea, xeb, u32_mad(p, W, wid), t, xs,
                                       meta, xst, xbb, tp, tn, one, scratch, acc0, acc2)
                p = u32_add(p, 2)
                gx = min(u32_add(base, u32_mad(p, W, wid)) if p < ti else u32_add(nbase, wid), ng1)
                xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, xea, xeb = w_set(packed, scales, qa, qb, qsa, qsb, gx)
                # Y (past the tile's groups when ti is odd: staged zeros, offsets 0)
                acc0, acc2 = acc_group(ya0, ya1, ya2, ya3, yb0, yb1, yb2, yb3, yea, yeb, qy, t, xs,
                                       meta, xst, xbb, tp, tn, one, scratch, acc0, acc2)
            base = nbase
            ti = nti
            tile = u32_add(tile, 1)
        acc0 = mh.quad_sum(acc0, qf)
        acc2 = mh.quad_sum(acc2, qf)
        cuda.syncthreads()
        red[gw, lane, 0] = acc0
        red[gw, lane, 1] = acc2
        cuda.syncthreads()
        if wid == u(0) and t == u(0):
            for i in range(2):
                v = red[gw, lane, i]
                for w in range(1, W):
                    v += red[gw + u(w), lane, i]
                row = row0 + g + u(8 * i)
                if row < u(n_rows):
                    if has_bias:
                        v += dev_bf16_to_f32(bias[row])
                    y[0, row] = dev_f32_to_bf16(v)

    return qgemv_mx_imma


def x_as_applied(x_bits: np.ndarray) -> np.ndarray:
    """The x the kernel multiplies by, on the host (fp64, exact): each block of 32 values rounded as ``stage``
    rounds it (half to even, to a multiple of 2^(emax - 140), emax = max(15, exponent field of the block's
    largest |x|)); a block holding inf or NaN all NaN. ``x_bits``: bf16 bits [1, K] or [K]."""
    from vmmstream.kernels.base.dtypes import bf16_to_f32
    xb = np.asarray(x_bits, dtype=np.uint16).reshape(-1, 32)
    mag = (xb & 0x7FFF).astype(np.int64)
    emax = np.maximum(mag.max(axis=1) >> 7, 15)
    step = np.ldexp(1.0, (emax - 140).astype(np.int64))[:, None]
    xf = bf16_to_f32(xb).astype(np.float64)
    with np.errstate(invalid="ignore"):
        q = np.rint(xf / step) * step
    q[mag.max(axis=1) >= 0x7F80] = np.nan
    return q.reshape(np.asarray(x_bits).shape)


def launch(packed, scales, x, out, bias, stream, row_tiles=0, pdl=False):
    """``packed`` [N, K/2] u8, ``scales`` [N, K/32] u8 (``quantize_mxfp4``), x [1, K] and out [1, N] bf16
    (uint16), ``bias`` [N] bf16 or None; device arrays. ``row_tiles`` 0: as ``gemv_mma``'s
    ``auto_row_tiles``. ``pdl``: programmatic dependent launch (the kernel before it must not write W)."""
    from vmmstream.kernels.matmul.quant.gemv_mma import auto_row_tiles
    n, k = packed.shape[0], 2 * packed.shape[1]
    if x.shape[0] != 1 or out.shape[0] != 1:
        raise ValueError(f"the integer route takes batch 1, got x {tuple(x.shape)}, out {tuple(out.shape)}")
    if k % GROUP or k == 0:
        raise ValueError(f"the integer route takes K in positive multiples of {GROUP}, got {k}")
    if tuple(scales.shape) != (n, k // 32) or x.shape[1] != k or out.shape[1] != n:
        raise ValueError(f"shapes disagree: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
                         f"x {tuple(x.shape)}, out {tuple(out.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if not (packed.is_c_contiguous() and scales.is_c_contiguous()):
        raise ValueError("the integer route takes C-contiguous packed weights and scales")
    if row_tiles == 0:
        row_tiles = auto_row_tiles(n)
    elif not (isinstance(row_tiles, int) and 1 <= row_tiles <= MAX_ROW_TILES):
        raise ValueError(f"row_tiles must be 0 (auto) or 1 to {MAX_ROW_TILES}, got {row_tiles!r}")
    kern = make(bias is not None, int(row_tiles))
    args = (packed.reshape(packed.shape[0] * packed.shape[1]), scales.reshape(scales.shape[0] * scales.shape[1]),
            x, x.reshape(x.shape[1]) if bias is None else bias, out, n, k)
    grid, threads = (-(-n // (ROWS * row_tiles)), 1), mh.THREADS * row_tiles
    if pdl:
        launch_pdl(kern, grid, threads, stream, args)
    else:
        kern[grid, threads, stream](*args)


def workspace_requirement(n: int, k: int, batch: int = 1):
    from vmmstream.kernels.base.workspace import NONE
    return NONE


def bytes_moved(n: int, k: int, batch: int = 1, *, bias: bool = False) -> int:
    """HBM bytes: packed W, E8M0 scales, x, bf16 out, bias."""
    return n * k // 2 + n * (k // 32) + 2 * k + 2 * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    return 2 * n * k


# bias is a 1-D bf16 array in both variants (x's row stands in for it when there is none)
_SIG = "void(uint8[::1], uint8[::1], uint16[:, ::1], uint16[::1], uint16[:, ::1], int64, int64)"
SIGNATURES = [(make(False, 1).py_func, _SIG), (make(True, 1).py_func, _SIG), (make(False, 7).py_func, _SIG)]
