"""Quantized decode GEMV on tensor cores: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias), W int4 group-wise or MXFP4
(``kernels/quant.py``), one ``mma.sync.m16n8k16`` bf16 per 16 × 16 slice, fp32 accumulation.

The scalar route (``kernels/qgemv.py``) spends several integer and float instructions per 4-bit value;
here two values become one packed bf16 pair in a few bit operations and one packed fma, and the tensor
core does the multiply-adds. At the decode shapes the loads alone run near the copy rate (the sweep's probe,
docs/BENCHMARKS.md); what costs is the decode and mma work that the loads do not hide, so the layout keeps
the instructions per value low:

- a block is 4 warps over 16 rows of W and up to 8 columns of x (the batch; B = 1 leaves 7 idle); warp w
  takes the int4 groups (128 values) w, w + 4, ... and the warps' partial sums meet in shared memory at the
  end;
- lane (g, t) = (lane / 4, lane % 4) loads one 16-byte chunk (32 values) of rows g and g + 8 per group:
  values 32t .. 32t + 31 of the group (for MXFP4 that is exactly one block: one scale per lane and row).
  The next group's chunks and scales are loaded before the current group is multiplied (``prefetch``),
  so every warp has a load in flight while it computes;
- the mma's k order inside a 16-wide step is free as long as the A and B fragments agree: the step pairs
  nibbles (j, j + 4) of a 32-bit word, which a shift and one mask place in the two bf16 halves. x's
  matching pairs (x[j], x[j + 4]) are built once per block: x is staged in shared memory already
  permuted (a tile of 4096 values for B = 1, 512 per column for B > 1), so the loop reads each step's
  B fragment with plain shared loads; a lane's four 16-byte slots are rotated by t so the quad's reads
  fall in distinct banks;
- int4: a nibble in the low bits of bf16 128.0 (``| 0x43004300``) is 128 + q, and one ``fma.rn.bf16x2``
  with 1.0 and −(128 + zero) leaves q − zero exactly (integers below 256 are exact in bf16); each group's
  D is scaled by its row's group scale once;
- MXFP4: the three magnitude bits of an E2M1 code go to bf16 bits 8..6 and the sign to bit 15, which is
  the value times 2^-126 (the code 0.5 a subnormal); one packed fma by 2^(e - 1) gives value · 2^(e - 127)
  exactly. 2^(e - 1) is a bf16 for e <= 128 (block scales up to 2, every weight a model has); where a lane
  of the warp holds a larger scale, the warp takes a second fma per pair for that group (a warp vote).

Contract beyond the scalar route's: K a multiple of 128; int4 zero points integers in [0, 15]
(``quantize_int4`` makes them so; a fractional zero would be rounded to bf16). Capture-safe; no workspace.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32

from . import mma_helpers as mh
from .dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from .launch import cp_async16, cp_async_commit, cp_async_waiter, ld4w, ld8_ro, prefetch_l2, st4w, u32_add, u32_mad, \
    warp_any
from .workspace import NONE

CAPTURE_SAFE = True      # no allocation, no synchronize, device arrays only
W = mh.WARPS             # warps per block (the simulator's mma scratch is sized for it)
ROWS, COLS = 16, 8       # rows of W and columns of x per block
GROUP = 128
XS_WORDS = 2048          # staged x per block: 4096 bf16 (B = 1) or 8 columns of 512, as permuted pairs
MIN_BLOCKS = 7           # launch bounds: 7 resident blocks per SM (<= 72 registers) fill a wave of 896 blocks


@cuda.jit(device=True, inline="always")
def _e2m1_raw(w, s):
    """E2M1 codes at nibbles s/4 and s/4 + 4 of ``w`` (s = 0, 4, 8, 12; a constant) -> a bf16 pair of
    value · 2^-126: magnitude bits to 8..6, sign to 15, in each half."""
    if s <= 6:
        m = w << uint32(6 - s)
    else:
        m = w >> uint32(s - 6)
    return (m & uint32(0x01C001C0)) | ((w << uint32(12 - s)) & uint32(0x80008000))


@cuda.jit(device=True, inline="always")
def _mx_pair(w, s, c1, c2, two):
    a = mh.fma_bf16x2(_e2m1_raw(w, s), c1, uint32(0))
    if two:
        a = mh.fma_bf16x2(a, c2, uint32(0))
    return a


@cuda.jit(device=True, inline="always")
def _q4_pair(w, s, c):
    return mh.fma_bf16x2(((w >> uint32(s)) & uint32(0x000F000F)) | uint32(0x43004300), uint32(0x3F803F80), c)


@cuda.jit(device=True, inline="always")
def _group(is_int4, two, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ca, cb, c2a, c2b, xs, xo0, xo1, xo2, xo3, scratch):
    """The 8 mma steps of one group: words a*w (row g) and b*w (row g + 8) of the lane's chunk, their
    per-row constants, the staged B pairs of word om at xs[xo_om ...] (4 words: b0, b1 of step h = 0, 1)."""
    d0 = d1 = d2 = d3 = float32(0.0)
    for om in range(4):                       # word om of the chunk: values 8 om .. 8 om + 7
        wa = a0w if om == 0 else a1w if om == 1 else a2w if om == 2 else a3w
        wb = b0w if om == 0 else b1w if om == 1 else b2w if om == 2 else b3w
        xq0, xq1, xq2, xq3 = ld4w(xs, xo0 if om == 0 else xo1 if om == 1 else xo2 if om == 2 else xo3)
        for h in range(2):                    # k-step: pairs (2h, 2h + 4) -> a0, b0; (2h + 1, 2h + 5) -> a2, b1
            x0 = xq0 if h == 0 else xq2
            x1 = xq1 if h == 0 else xq3
            if is_int4:
                p0 = _q4_pair(wa, 8 * h, ca)
                p2 = _q4_pair(wa, 8 * h + 4, ca)
                p1 = _q4_pair(wb, 8 * h, cb)
                p3 = _q4_pair(wb, 8 * h + 4, cb)
            else:
                p0 = _mx_pair(wa, 8 * h, ca, c2a, two)
                p2 = _mx_pair(wa, 8 * h + 4, ca, c2a, two)
                p1 = _mx_pair(wb, 8 * h, cb, c2b, two)
                p3 = _mx_pair(wb, 8 * h + 4, cb, c2b, two)
            d0, d1, d2, d3 = mh.mma_bf16_16816(p0, p1, p2, p3, x0, x1, d0, d1, d2, d3, scratch)
    return d0, d1, d2, d3


@functools.lru_cache(maxsize=None)
def make(kind: int, has_bias: bool, ncols: int = 1, prefetch: bool = True, l2_ahead: int = 0, probe: bool = False,
         stages: int = 0):
    """``ncols``: columns of x staged per block, 1 (B = 1) or 8; ``prefetch``: load the next group's
    chunks before multiplying the current one (False: at the top of each iteration, for comparison);
    ``l2_ahead``: also ``prefetch.global.L2`` the chunks of the group that many iterations ahead (0: none);
    ``probe`` (measurement only, wrong results): the same loads, staging and loop with no decode and no mma,
    the memory side of the kernel alone; ``stages`` > 1: W's chunks go through a per-warp ring of that many
    groups in shared memory by ``cp.async`` (``stages - 1`` groups in flight while one is multiplied, no
    registers held for them); 0: loaded into registers (one group ahead with ``prefetch``)."""
    from .qgemv import INT4, _ld16_ro
    MS0, MS1 = mh.SIM_MMA_SCRATCH          # simulator-only scratch (1 x 1 on the GPU)
    is_int4 = kind == INT4
    NC = ncols
    CW = XS_WORDS // NC                    # staged words per column: a tile of 2 CW values of K
    CS = CW + (4 if NC > 1 else 0)         # column stride (padded: columns start in different banks)
    TG = 2 * CW // GROUP                   # groups per staged tile: 32 or 4
    TI = TG // W                           # iterations per tile: 8 or 1
    NCH = CW // 4                          # 8-value chunks per column and tile
    XSN = NC * CS
    PF = prefetch
    L2A = l2_ahead
    PROBE = probe
    S = stages
    CPA = S > 1
    RING = W * S * 2 * 128 if CPA else 4   # words: per warp and stage, rows g and g + 8, 16 bytes a lane
    WAIT = cp_async_waiter(S - 1 if CPA else 0)
    u = uint32

    @mh.kernel((mh.THREADS, MIN_BLOCKS))
    def qgemv_q4_mma(packed, scales, zeros, x, bias, y, n_rows, n_batch, k):
        # packed [N * K/2] u8 (rows of W, flattened); int4: scales, zeros [N * K/128] f16|f32; mxfp4: scales
        # [N * K/32] u8 (E8M0), zeros ignored; x [B, K] bf16; bias [N] bf16; y [B, N] bf16.
        # grid (ceil(N / 16), ceil(B / 8)); block 128. Index arithmetic is uint32 (no wraparound code).
        tid = u(cuda.threadIdx.x)
        lane, wid = tid % u(32), tid // u(32)
        g, t = lane // u(4), lane % u(4)
        row0 = u32_mad(cuda.blockIdx.x, ROWS, 0)
        col0 = u32_mad(cuda.blockIdx.y, COLS, 0)
        nr1 = u32_add(n_rows, 0xFFFFFFFF)
        ra = min(u32_add(row0, g), nr1)
        rb = min(u32_add(row0, g + u(8)), nr1)
        ku = u(k)
        ng = ku // u(GROUP)
        ng1 = u32_add(ng, 0xFFFFFFFF)
        wa0 = u32_mad(ra, ku // u(2), u(16) * t)   # the lane's bytes of group 0, rows g and g + 8
        wb0 = u32_mad(rb, ku // u(2), u(16) * t)
        if is_int4:
            sa0, sb0 = u32_mad(ra, ng, 0), u32_mad(rb, ng, 0)   # group scales and zeros: one per row and group
        else:
            sa0, sb0 = u32_mad(ra, ku // u(32), t), u32_mad(rb, ku // u(32), t)   # the lane's MX block of group 0
        # B = 1: lanes g > 0 repeat column 0 into D columns that are never stored
        xb = min(g, u(NC - 1)) * u(CS) + t * u(16)
        xr0 = u(4) * ((t + u(0)) & u(3))      # a lane's 4 slots of a group, rotated by t (distinct banks)
        xr1 = u(4) * ((t + u(1)) & u(3))
        xr2 = u(4) * ((t + u(2)) & u(3))
        xr3 = u(4) * ((t + u(3)) & u(3))
        scratch = cuda.shared.array((MS0, MS1), np.float64)
        xs = cuda.shared.array(XSN, np.uint32)
        red = cuda.shared.array((W, 32, 4), np.float32)
        ring = cuda.shared.array(RING, np.uint32)
        slot = (wid * u(S) * u(2)) * u(128) + lane * u(4)   # + (stage * 2 + row half) * 128
        lo16, hi16 = u(0xFFFF), u(0xFFFF0000)
        n_it = (ng + u(W - 1)) // u(W)         # the same trip count in every warp (the mma is warp-wide)
        acc0 = acc1 = acc2 = acc3 = float32(0.0)
        # the first group's loads (with prefetch: then always one group ahead)
        gc = min(wid, ng1)
        if CPA:                                # stages 0 .. S - 2 in flight before the loop
            pa0 = pa1 = pa2 = pa3 = pb0 = pb1 = pb2 = pb3 = u(0)
            for q in range(S - 1):
                gq = min(u(q * W) + wid, ng1)
                cp_async16(ring, slot + u(2 * q * 128), packed, wa0 + gq * u(64))
                cp_async16(ring, slot + u((2 * q + 1) * 128), packed, wb0 + gq * u(64))
                cp_async_commit()
        else:
            pa0, pa1, pa2, pa3 = _ld16_ro(packed, wa0 + gc * u(64))
            pb0, pb1, pb2, pb3 = _ld16_ro(packed, wb0 + gc * u(64))
        qa = qb = sa = sb = float32(0.0)       # int4: zero points and scales of the loaded group
        na = nb = u(0)                         # mxfp4: the lane's E8M0 exponents of the loaded group
        if is_int4:
            qa, qb = float32(zeros[sa0 + gc]), float32(zeros[sb0 + gc])
            sa, sb = float32(scales[sa0 + gc]), float32(scales[sb0 + gc])
        else:
            na, nb = u(scales[sa0 + u(4) * gc]), u(scales[sb0 + u(4) * gc])
        it = u(0)
        while it < n_it:
            if it % u(TI) == u(0):             # stage the next tile of x, permuted into B pairs
                cuda.syncthreads()             # (the previous tile is no longer read)
                t0 = it * u(W * GROUP)
                e = tid
                while e < u(NC * NCH):
                    col = e // u(NCH)
                    c = e % u(NCH)
                    kk = t0 + u(8) * c
                    w0 = w1 = w2 = w3 = u(0)
                    if kk < ku and col0 + col < u(n_batch):
                        x0, x1, x2, x3 = ld8_ro(x, (col0 + col, kk))
                        w0 = (x0 & lo16) | (x2 << u(16))       # (x[0], x[4])
                        w1 = (x0 >> u(16)) | (x2 & hi16)       # (x[1], x[5])
                        w2 = (x1 & lo16) | (x3 << u(16))       # (x[2], x[6])
                        w3 = (x1 >> u(16)) | (x3 & hi16)       # (x[3], x[7])
                    r = c % u(16)              # chunk r of its group: lane t = r // 4, word om = r % 4
                    o = col * u(CS) + (c // u(16)) * u(64) + (r // u(4)) * u(16) + u(4) * ((r + r // u(4)) & u(3))
                    st4w(xs, o, w0, w1, w2, w3)
                    e += u(mh.THREADS)
                cuda.syncthreads()
            gi = u32_mad(it, W, wid)
            if CPA:                            # issue stage it + S - 1, wait for stage it, read it
                gq = min(gi + u((S - 1) * W), ng1)
                sq = ((it + u(S - 1)) % u(S)) * u(256)
                cp_async16(ring, slot + sq, packed, wa0 + gq * u(64))
                cp_async16(ring, slot + sq + u(128), packed, wb0 + gq * u(64))
                cp_async_commit()
                WAIT()
                sc = (it % u(S)) * u(256)
                a0w, a1w, a2w, a3w = ld4w(ring, slot + sc)
                b0w, b1w, b2w, b3w = ld4w(ring, slot + sc + u(128))
                za, zb, ua, ub, ea, eb = qa, qb, sa, sb, na, nb
                gn = min(gi + u(W), ng1)       # scales: one group ahead in registers (mostly L1 hits)
                if is_int4:
                    qa, qb = float32(zeros[sa0 + gn]), float32(zeros[sb0 + gn])
                    sa, sb = float32(scales[sa0 + gn]), float32(scales[sb0 + gn])
                else:
                    na, nb = u(scales[sa0 + u(4) * gn]), u(scales[sb0 + u(4) * gn])
            elif PF:
                a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w = pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3
                za, zb, ua, ub, ea, eb = qa, qb, sa, sb, na, nb
                gn = min(u32_add(gi, W), ng1)  # the last iteration reloads a group that is still cached
                pa0, pa1, pa2, pa3 = _ld16_ro(packed, u32_mad(gn, 64, wa0))
                pb0, pb1, pb2, pb3 = _ld16_ro(packed, u32_mad(gn, 64, wb0))
                if is_int4:
                    qa, qb = float32(zeros[u32_add(sa0, gn)]), float32(zeros[u32_add(sb0, gn)])
                    sa, sb = float32(scales[u32_add(sa0, gn)]), float32(scales[u32_add(sb0, gn)])
                else:
                    na, nb = u(scales[u32_mad(gn, 4, sa0)]), u(scales[u32_mad(gn, 4, sb0)])
            else:
                gc = min(gi, ng1)
                a0w, a1w, a2w, a3w = _ld16_ro(packed, u32_mad(gc, 64, wa0))
                b0w, b1w, b2w, b3w = _ld16_ro(packed, u32_mad(gc, 64, wb0))
                za = zb = ua = ub = float32(0.0)
                ea = eb = u(0)
                if is_int4:
                    za, zb = float32(zeros[sa0 + gc]), float32(zeros[sb0 + gc])
                    ua, ub = float32(scales[sa0 + gc]), float32(scales[sb0 + gc])
                else:
                    ea, eb = u(scales[sa0 + u(4) * gc]), u(scales[sb0 + u(4) * gc])
            if L2A > 0:
                gl = min(gi + u(L2A * W), ng1)
                prefetch_l2(packed, wa0 + gl * u(64))
                prefetch_l2(packed, wb0 + gl * u(64))
            # groups past K (the clamped reloads) meet staged zeros of x: they add nothing
            xo = u32_mad(u32_mad(it % u(TI), W, wid), 64, xb)
            if PROBE:                          # keep every load live, multiply nothing
                xq0, xq1, xq2, xq3 = ld4w(xs, xo + xr0)
                v = a0w ^ a1w ^ a2w ^ a3w ^ b0w ^ b1w ^ b2w ^ b3w ^ xq0 ^ xq3 ^ u(za + zb + ua + ub) ^ ea ^ eb
                acc0 += float32(v & u(1))
            elif is_int4:                        # c: -(128 + zero) per row, the D scale after the group
                ca = mh.pack_bf16x2(-(za + float32(128.0)), -(za + float32(128.0)))
                cb = mh.pack_bf16x2(-(zb + float32(128.0)), -(zb + float32(128.0)))
                d0, d1, d2, d3 = _group(True, False, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ca, cb, ca, cb,
                                        xs, u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3), scratch)
                acc0 += d0 * ua
                acc1 += d1 * ua
                acc2 += d2 * ub
                acc3 += d3 * ub
            else:                              # ea, eb: the lane's E8M0 exponents e (0..254)
                if warp_any(ea > u(128) or eb > u(128)):
                    # 2^126 then 2^(e - 127) (e = 0: 2^-127, a bf16 subnormal)
                    sa2 = u(0x40) if ea == u(0) else ea << u(7)
                    sb2 = u(0x40) if eb == u(0) else eb << u(7)
                    d0, d1, d2, d3 = _group(False, True, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w,
                                            u(0x7E807E80), u(0x7E807E80),
                                            sa2 | (sa2 << u(16)), sb2 | (sb2 << u(16)),
                                            xs, u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3), scratch)
                else:                          # one fma by 2^(e - 1): bf16 exponent field e + 126
                    sa1 = (ea + u(126)) << u(7)
                    sb1 = (eb + u(126)) << u(7)
                    d0, d1, d2, d3 = _group(False, False, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w,
                                            sa1 | (sa1 << u(16)), sb1 | (sb1 << u(16)), u(0), u(0),
                                            xs, u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3), scratch)
                acc0 += d0
                acc1 += d1
                acc2 += d2
                acc3 += d3
            it = u32_add(it, 1)
        red[wid, lane, 0] = acc0
        red[wid, lane, 1] = acc1
        red[wid, lane, 2] = acc2
        red[wid, lane, 3] = acc3
        cuda.syncthreads()
        if wid == u(0):
            for i in range(4):                   # D: (row g | g + 8) x (col 2t | 2t + 1)
                v = red[0, lane, i]
                for w in range(1, W):
                    v += red[w, lane, i]
                row = row0 + g + u(8 * (i // 2))
                col = col0 + u(2) * t + u(i % 2)
                if row < u(n_rows) and col < u(n_batch):
                    if has_bias:
                        v += dev_bf16_to_f32(bias[row])
                    y[col, row] = dev_f32_to_bf16(v)

    return qgemv_q4_mma


def launch(kind, packed, scales, zeros, x, out, bias, stream, prefetch=True, l2_ahead=0, probe=False, stages=0):
    """Shapes checked by ``qgemv._launch``; x, out 2-D; ``zeros`` None for MXFP4; ``l2_ahead`` and ``probe``
    as in ``make`` (the sweep's measurements)."""
    n, b, k = packed.shape[0], x.shape[0], 2 * packed.shape[1]
    if k % GROUP:
        raise ValueError(f"the mma route takes K in multiples of {GROUP}, got {k}")
    if stages not in (0, 1, 2, 3, 4, 5):
        raise ValueError(f"the mma route's cp.async ring takes 2 to 5 stages (0: none), got {stages}")
    if not (packed.is_c_contiguous() and scales.is_c_contiguous() and (zeros is None or zeros.is_c_contiguous())):
        raise ValueError("the mma route takes C-contiguous packed weights, scales and zeros")
    kern = make(kind, bias is not None, 1 if b == 1 else COLS, bool(prefetch), int(l2_ahead), bool(probe), int(stages))
    flat = [a.reshape(a.shape[0] * a.shape[1]) for a in (packed, scales, scales if zeros is None else zeros)]
    kern[(-(-n // ROWS), -(-b // COLS)), mh.THREADS, stream](*flat, x, x if bias is None else bias, out, n, b, k)


def workspace_requirement(n: int, k: int, batch: int = 1):
    """No scratch: x is staged and the warps' partial sums meet in shared memory."""
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
    s = f"{scale_t}[::1]"
    return f"void(uint8[::1], {s}, {s}, uint16[:, ::1], {bias_t}, uint16[:, ::1], int64, int64, int64)"


def _signatures():
    from .qgemv import INT4, MXFP4
    return ([(make(INT4, hb, nc).py_func, _sig(st, hb))
             for st, hb, nc in (("float16", False, 1), ("float16", True, 1), ("float32", False, 1), ("float16", False, COLS))]
            + [(make(MXFP4, hb, nc).py_func, _sig("uint8", hb)) for hb, nc in ((False, 1), (True, 1), (False, COLS))])


SIGNATURES = _signatures()
