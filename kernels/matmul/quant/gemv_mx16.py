"""MXFP4 decode GEMV for one token on f16 tensor cores: y[1, N] = x[1, K] · W[N, K]ᵀ (+ bias), W in MXFP4
(``kernels/matmul/quant/formats.py``), two ``mma.sync.m16n8k16`` f16 per MX block of 16 rows.

At batch 1 the bf16 tensor-core route (``kernels/matmul/quant/gemv_mma.py``) is bound by the instructions that turn
4-bit codes into bf16 pairs: the sign and the magnitude bits of a code need different shifts, so every two
values cost four integer instructions and a packed fma (about 280 instructions per lane and group of 128
values, measured compute-bound on the H200). Here a code goes through fp8 instead: an E4M3 byte is an E2M1
code with its fields spread out (sign to bit 7, the three magnitude bits to bits 4..2 give the value
times 2^-6 exactly, the code 0.5 a subnormal of E4M3 and a normal f16), a 32-bit register takes four of
them, so eight codes cost seven integer instructions, and the hardware's ``cvt.rn.f16x2.e4m3x2`` turns
two bytes into an exact f16 pair in one more. The block scale leaves A: the quad of lanes that holds a
row's k-slots of an mma holds exactly one MX block of that row, so D of a block's two mmas is multiplied
by its 2^(e - 127) in fp32 (one fma per used D register).

- a block is 4 warps over 16 rows; warp w takes the groups of 128 values (4 MX blocks) w, w + 4, ...;
  lane (g, t) = (lane / 4, lane % 4) loads word t (values 8t .. 8t + 7) of each of the 4 blocks of rows
  g and g + 8, and the 4 scale bytes of each row, one group ahead of the group it multiplies;
- word -> fragments: nibbles (0, 2 | 4, 6) -> a0 | a2 of the block's first mma, (1, 3 | 5, 7) of the
  second (row g; row g + 8 the same into a1 | a3); x's B fragments list the same values in that order;
- x is staged per tile of 4096 values in shared memory as f16 x·2^-E, E chosen from the tile's largest
  |x| so that it lands in [2^14, 2^15): exact for every bf16 within 2^-28 of the tile's largest; the
  tile's sum is scaled by 2^(6 + E) once; the warps' sums meet in shared memory at the end.

B = 1 only (the D columns all hold x's products: the 7 others are not stored); fp32 accumulation as on the
bf16 route. Contract: batch 1, K a multiple of 128, C-contiguous packed weights and scales, block scales
e <= 253 (the quantizer never stores more: e = 253 already needs weights beyond fp32). Capture-safe; no
workspace.

Measured on the H200 at 1×4096 · [14336, 4096] (docs/bench/HISTORY.md, runs h-j of 2026-12-03): 16.0-16.3 µs
against 14.3-14.6 µs for the bf16 route, so ``route="auto"`` does not take it. Its compute side alone is
faster (12.2 µs against 13.7; 176 instructions per lane and group against about 250), but two things cost:
the hardware conversion ``F2FP.F16.E4M3.UNPACK_B`` (32 per group) runs on the slow conversion pipe, and
the quad-per-block fragment order makes a lane load 4-byte words 16 bytes apart (8 loads per group in
place of 2 of 16 bytes), which alone takes the memory side from 7.6 to 11.9 µs. A weight layout repacked
so that a lane's words are contiguous would remove the second. (Those figures are from when the stored MXFP4
words had a layout made for the bf16 route, which this route first turned back into nibbles, 12 instructions per
word; the stored codes are now nibbles, ``kernels/matmul/quant/formats.py``, and the batch-1 default is ``kernels/matmul/quant/gemv_imma.py``.)
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.launch import SHARED_ALIGN16, ld1w_ro, ld4w, ld8_ro, st4w, u32_add, u32_as_f32, u32_mad
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True      # no allocation, no synchronize, device arrays only
W = mh.WARPS             # warps per block
ROWS = 16                # rows of W per block
GROUP = 128              # values of a row per warp and iteration: 4 MX blocks
TILE = 4096              # values of x staged per tile: f16 pairs -> 2048 words
XS_WORDS = TILE // 2
TI = TILE // (W * GROUP)  # iterations per tile: 8
MIN_BLOCKS = 7


@cuda.jit(device=True, inline="always")
def _even(w):
    """E2M1 nibbles 0, 2, 4, 6 of ``w`` -> 4 E4M3 bytes (value · 2^-6): magnitude to bits 4..2, sign to 7."""
    return ((w << uint32(2)) & uint32(0x1C1C1C1C)) | ((w << uint32(4)) & uint32(0x80808080))


@cuda.jit(device=True, inline="always")
def _odd(w):
    """Nibbles 1, 3, 5, 7 -> 4 E4M3 bytes."""
    return ((w >> uint32(2)) & uint32(0x1C1C1C1C)) | (w & uint32(0x80808080))


@cuda.jit(device=True, inline="always")
def _scale(s1, b):
    """2^(e - 126) for byte b (a constant) of a scale word already plus 0x01010101 (e + 1 per byte): fp32
    bits (e + 1) << 23; exact for e in 0 .. 253 (2^-127 is no subnormal here; the caller halves once)."""
    if b == 3:
        m = (s1 >> uint32(1)) & uint32(0x7F800000)
    else:
        m = (s1 << uint32(23 - 8 * b)) & uint32(0x7F800000)
    return u32_as_f32(m)


@functools.lru_cache(maxsize=None)
def make(has_bias: bool, probe: bool = False):
    """``probe`` (measurement only, wrong results): the same loads, staging and loop without decode or mma."""
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    PROBE = probe
    u = uint32

    @mh.kernel((mh.THREADS, MIN_BLOCKS))
    def qgemv_mx16(pk, sc, x, bias, y, n_rows, k):
        # pk [N * K/8] u32 (packed rows of W as words: nibble j of word i is value 8i + j of the flat row-major
        # matrix); sc [N * K/128] u32 (E8M0 bytes of 4 consecutive MX blocks); x [1, K] bf16; bias [N] bf16;
        # y [1, N] bf16. grid ceil(N / 16); block 128.
        tid = u(cuda.threadIdx.x)
        lane, wid = tid % u(32), tid // u(32)
        g, t = lane // u(4), lane % u(4)
        row0 = u32_mad(cuda.blockIdx.x, ROWS, 0)
        nr1 = u32_add(n_rows, 0xFFFFFFFF)
        ra = min(u32_add(row0, g), nr1)
        rb = min(u32_add(row0, g + u(8)), nr1)
        ku = u(k)
        ng = ku // u(GROUP)
        ng1 = u32_add(ng, 0xFFFFFFFF)
        kw = ku // u(8)
        wa0 = u32_mad(ra, kw, t)               # the lane's word of block 0 of group 0, rows g and g + 8
        wb0 = u32_mad(rb, kw, t)
        sa0, sb0 = u32_mad(ra, ng, 0), u32_mad(rb, ng, 0)   # scale words: one per row and group
        scratch = cuda.shared.array((MS0, MS1), np.float64)
        xs = cuda.shared.array(XS_WORDS, np.uint32, alignment=SHARED_ALIGN16)
        red = cuda.shared.array((W, 32, 2), np.float32)
        mx = cuda.shared.array(2, np.int32)     # the tile's largest |x| (bf16 bits), two slots alternating
        xw = cuda.local.array(16, np.uint32)   # a thread's 4 chunks of x while the tile's largest is found
        if tid == u(0):
            mx[0] = 0
        n_it = (ng + u(W - 1)) // u(W)
        acc0 = acc2 = float32(0.0)             # D registers 0 (row g) and 2 (row g + 8); 1, 3 repeat them
        ta0 = ta2 = float32(0.0)               # the current tile's sums
        tscale = float32(0.0)
        gc = min(wid, ng1)
        ia, ib = u32_mad(gc, 16, wa0), u32_mad(gc, 16, wb0)
        pa0, pa1, pa2, pa3 = ld1w_ro(pk, ia), ld1w_ro(pk, ia + u(4)), ld1w_ro(pk, ia + u(8)), ld1w_ro(pk, ia + u(12))
        pb0, pb1, pb2, pb3 = ld1w_ro(pk, ib), ld1w_ro(pk, ib + u(4)), ld1w_ro(pk, ib + u(8)), ld1w_ro(pk, ib + u(12))
        psa = ld1w_ro(sc, u32_add(sa0, gc))
        psb = ld1w_ro(sc, u32_add(sb0, gc))
        it = u(0)
        while it < n_it:
            if it % u(TI) == u(0):             # stage the next tile of x as scaled f16 pairs
                acc0 += ta0 * tscale
                acc2 += ta2 * tscale
                ta0 = ta2 = float32(0.0)
                slot = (it // u(TI)) % u(2)
                cuda.syncthreads()             # the previous tile is no longer read; this slot was reset
                t0 = it * u(W * GROUP)
                m = u(0)
                for j in range(4):             # chunk c = tid + 128 j: values t0 + 8c .. t0 + 8c + 7
                    kk = t0 + u(8) * (tid + u(128 * j))
                    x0 = x1 = x2 = x3 = u(0)
                    if kk < ku:
                        x0, x1, x2, x3 = ld8_ro(x, (0, kk))
                    xw[4 * j], xw[4 * j + 1], xw[4 * j + 2], xw[4 * j + 3] = x0, x1, x2, x3
                    for q in (x0, x1, x2, x3):
                        m = max(m, q & u(0x7FFF), (q >> u(16)) & u(0x7FFF))
                cuda.atomic.max(mx, slot, int32(m))
                cuda.syncthreads()
                ef = min(max(u(mx[slot]) >> u(7), u(14)), u(254))    # bf16 exponent field of the largest |x|
                if tid == u(0):
                    mx[u(1) - slot] = 0        # reset the other slot for the next tile
                mult = u32_as_f32((u(268) - ef) << u(23))           # 2^(141 - ef): largest |x| -> [2^14, 2^15)
                tscale = u32_as_f32((ef - u(9)) << u(23))           # 2^(5 + E), E = ef - 141 (2^-1: _scale)
                for j in range(4):
                    c = tid + u(128 * j)
                    x0, x1, x2, x3 = xw[4 * j], xw[4 * j + 1], xw[4 * j + 2], xw[4 * j + 3]
                    f0, f1 = dev_bf16_to_f32(x0 & u(0xFFFF)) * mult, dev_bf16_to_f32(x0 >> u(16)) * mult
                    f2, f3 = dev_bf16_to_f32(x1 & u(0xFFFF)) * mult, dev_bf16_to_f32(x1 >> u(16)) * mult
                    f4, f5 = dev_bf16_to_f32(x2 & u(0xFFFF)) * mult, dev_bf16_to_f32(x2 >> u(16)) * mult
                    f6, f7 = dev_bf16_to_f32(x3 & u(0xFFFF)) * mult, dev_bf16_to_f32(x3 >> u(16)) * mult
                    st4w(xs, u(4) * c, mh.f16x2_of_f32(f0, f2), mh.f16x2_of_f32(f4, f6),
                         mh.f16x2_of_f32(f1, f3), mh.f16x2_of_f32(f5, f7))
                cuda.syncthreads()
            gi = u32_mad(it, W, wid)
            a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w = pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3
            sa, sb = u32_add(psa, 0x01010101), u32_add(psb, 0x01010101)   # e + 1 per byte (e <= 253)
            gn = min(u32_add(gi, W), ng1)      # the last iteration reloads a group that is still cached
            ia, ib = u32_mad(gn, 16, wa0), u32_mad(gn, 16, wb0)
            pa0, pa1, pa2, pa3 = ld1w_ro(pk, ia), ld1w_ro(pk, ia + u(4)), ld1w_ro(pk, ia + u(8)), ld1w_ro(pk, ia + u(12))
            pb0, pb1, pb2, pb3 = ld1w_ro(pk, ib), ld1w_ro(pk, ib + u(4)), ld1w_ro(pk, ib + u(8)), ld1w_ro(pk, ib + u(12))
            psa = ld1w_ro(sc, u32_add(sa0, gn))
            psb = ld1w_ro(sc, u32_add(sb0, gn))
            # groups past K (the clamped reloads) meet staged zeros of x: they add nothing
            xo = u32_mad(u32_mad(u32_mad(it % u(TI), W, wid), 16, t), 4, 0)
            if PROBE:
                x0, x1, x2, x3 = ld4w(xs, xo)
                v = a0w ^ a1w ^ a2w ^ a3w ^ b0w ^ b1w ^ b2w ^ b3w ^ sa ^ sb ^ x0 ^ x3
                ta0 += float32(v & u(1))
            else:
                for b in range(4):             # MX block b of the group: values (0, 2, 4, 6), then (1, 3, 5, 7)
                    wa = a0w if b == 0 else a1w if b == 1 else a2w if b == 2 else a3w
                    wb = b0w if b == 0 else b1w if b == 1 else b2w if b == 2 else b3w
                    x0, x1, x2, x3 = ld4w(xs, u32_add(xo, 16 * b))
                    ea, eb, oa, ob = _even(wa), _even(wb), _odd(wa), _odd(wb)
                    d0, d1, d2, d3 = mh.mma_f16_16816(
                        mh.f16x2_of_e4m3x2(ea), mh.f16x2_of_e4m3x2(eb),
                        mh.f16x2_of_e4m3x2_hi(ea), mh.f16x2_of_e4m3x2_hi(eb), x0, x1,
                        float32(0.0), float32(0.0), float32(0.0), float32(0.0), scratch)
                    d0, d1, d2, d3 = mh.mma_f16_16816(
                        mh.f16x2_of_e4m3x2(oa), mh.f16x2_of_e4m3x2(ob),
                        mh.f16x2_of_e4m3x2_hi(oa), mh.f16x2_of_e4m3x2_hi(ob), x2, x3,
                        d0, d1, d2, d3, scratch)
                    ta0 += d0 * _scale(sa, b)
                    ta2 += d2 * _scale(sb, b)
            it = u32_add(it, 1)
        acc0 += ta0 * tscale
        acc2 += ta2 * tscale
        red[wid, lane, 0] = acc0
        red[wid, lane, 1] = acc2
        cuda.syncthreads()
        if wid == u(0) and t == u(0):          # D column 0 (every column holds x's product)
            for i in range(2):
                v = red[0, lane, i]
                for w in range(1, W):
                    v += red[w, lane, i]
                row = row0 + g + u(8 * i)
                if row < u(n_rows):
                    if has_bias:
                        v += dev_bf16_to_f32(bias[row])
                    y[0, row] = dev_f32_to_bf16(v)

    return qgemv_mx16


def supports(b: int, k: int, packed, scales) -> bool:
    """Batch 1, K a multiple of 128, C-contiguous packed weights and scales."""
    return b == 1 and k % GROUP == 0 and packed.is_c_contiguous() and scales.is_c_contiguous()


def launch(packed, scales, x, out, bias, stream, probe=False):
    """Shapes checked by ``qgemv._launch``; x, out [1, K] / [1, N]."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    if not supports(x.shape[0], k, packed, scales):
        raise ValueError(f"the mx16 route takes batch 1, K a multiple of {GROUP} and C-contiguous weights, "
                         f"got batch {x.shape[0]}, K {k}")
    pk = packed.reshape(n * (k // 2)).view(np.uint32)
    sc = scales.reshape(n * (k // 32)).view(np.uint32)
    kern = make(bias is not None, bool(probe))
    kern[-(-n // ROWS), mh.THREADS, stream](pk, sc, x, x if bias is None else bias, out, n, k)


def workspace_requirement(n: int, k: int, batch: int = 1):
    """No scratch: x is staged and the warps' partial sums meet in shared memory."""
    return NONE


def bytes_moved(n: int, k: int, batch: int = 1, *, bias: bool = False) -> int:
    """HBM bytes: packed W and E8M0 scales once, x, bf16 out, bias."""
    return n * k // 2 + n * (k // 32) + 2 * k + 2 * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    """Useful multiply-adds (the tensor core also multiplies the 7 padding columns)."""
    return 2 * n * k * batch


def _sig(has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    return f"void(uint32[::1], uint32[::1], uint16[:, ::1], {bias_t}, uint16[:, ::1], int64, int64)"


SIGNATURES = [(make(hb).py_func, _sig(hb)) for hb in (False, True)]
