"""The device steps of the tensor-core quantized GEMV (``kernels/matmul/quant/gemv_mma.py``, whose docstring gives the
layout): E2M1 and int4 words decoded into bf16 pairs, one group's eight ``mma.sync`` steps, x staged in shared
memory as permuted B pairs (MXFP4 at batch 1: scaled by a power of two per tile), and the group constants.
IR-inlined device functions; every name here is used only by that kernel."""

from __future__ import annotations

from numba import cuda, float32, int32, int64, uint32

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.launch import ld16_at, ld1b_at, ld4w, ld8_ro, ptr_add, st4w, u32_add, u32_as_f32, warp_any

XS_WORDS = 2048          # staged x per block: 4096 bf16 (B = 1) or 8 columns of 512, as permuted pairs
X_CHUNKS = XS_WORDS // 4  # 8-value chunks of a B = 1 tile


@cuda.jit(device=True, inline="always")
def e2m1_raw(w, s):
    """E2M1 codes i and i + 4 (i = s/4; s = 0, 4, 8, 12, a constant) of an MXFP4 word (nibbles,
    ``kernels/matmul/quant/formats.py``) -> a bf16 pair of value · 2^-126: the magnitude bits (nibble bits 0-2) to bf16 bits
    8..6 and the sign (nibble bit 3) to bit 15, in each half. Two shifts (one for i = 3, whose sign is at bit
    15 already), a mask and a masked or."""
    u = uint32
    m, sg = u(0x01C001C0), u(0x80008000)
    if s == 0:
        return ((w << u(6)) & m) | ((w << u(12)) & sg)
    if s == 4:
        return ((w << u(2)) & m) | ((w << u(8)) & sg)
    if s == 8:
        return ((w >> u(2)) & m) | ((w << u(4)) & sg)
    return ((w >> u(6)) & m) | (w & sg)


@cuda.jit(device=True, inline="always")
def mx_pair(w, s, c1, c2, two, raw):
    a = e2m1_raw(w, s)
    if not raw:
        a = mh.fma_bf16x2(a, c1, uint32(0))
        if two:
            a = mh.fma_bf16x2(a, c2, uint32(0))
    return a


@cuda.jit(device=True, inline="always")
def q4_pair(w, s, c):
    return mh.fma_bf16x2(((w >> uint32(s)) & uint32(0x000F000F)) | uint32(0x43004300), uint32(0x3F803F80), c)


@cuda.jit(device=True, inline="always")
def a_pairs(is_int4, two, raw, wa, wb, h, ca, cb, c2a, c2b):
    """The A fragment of k-step ``h`` of a chunk word: rows g (``wa``) and g + 8 (``wb``), pairs (2h, 2h + 4) and
    (2h + 1, 2h + 5) decoded to bf16 pairs with the rows' constants: (a0, a1, a2, a3)."""
    if is_int4:                          # (in this order: the instruction order of the measured kernels)
        p0 = q4_pair(wa, 8 * h, ca)
        p2 = q4_pair(wa, 8 * h + 4, ca)
        p1 = q4_pair(wb, 8 * h, cb)
        p3 = q4_pair(wb, 8 * h + 4, cb)
    else:
        p0 = mx_pair(wa, 8 * h, ca, c2a, two, raw)
        p2 = mx_pair(wa, 8 * h + 4, ca, c2a, two, raw)
        p1 = mx_pair(wb, 8 * h, cb, c2b, two, raw)
        p3 = mx_pair(wb, 8 * h + 4, cb, c2b, two, raw)
    return p0, p1, p2, p3


@cuda.jit(device=True, inline="always")
def group_mma(is_int4, two, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ca, cb, c2a, c2b, xs, xo0, xo1, xo2, xo3, scratch,
           raw=False, split=False):
    """The 8 mma steps of one group: words a*w (row g) and b*w (row g + 8) of the lane's chunk, their
    per-row constants, the staged B pairs of word om at xs[xo_om ...] (4 words: b0, b1 of step h = 0, 1).
    ``raw`` (MXFP4): the E2M1 codes enter the mma as value · 2^-126, the block scale left to the caller.
    ``split``: steps h = 1 accumulate into a second D, added to the first at the end (two dependency chains
    of 4 mma each instead of one of 8)."""
    d0 = d1 = d2 = d3 = float32(0.0)
    e0 = e1 = e2 = e3 = float32(0.0)
    for om in range(4):                       # word om of the chunk: values 8 om .. 8 om + 7
        wa = a0w if om == 0 else a1w if om == 1 else a2w if om == 2 else a3w
        wb = b0w if om == 0 else b1w if om == 1 else b2w if om == 2 else b3w
        xq0, xq1, xq2, xq3 = ld4w(xs, xo0 if om == 0 else xo1 if om == 1 else xo2 if om == 2 else xo3)
        for h in range(2):                    # k-step: pairs (2h, 2h + 4) -> a0, b0; (2h + 1, 2h + 5) -> a2, b1
            x0 = xq0 if h == 0 else xq2
            x1 = xq1 if h == 0 else xq3
            p0, p1, p2, p3 = a_pairs(is_int4, two, raw, wa, wb, h, ca, cb, c2a, c2b)
            if split and h == 1:
                e0, e1, e2, e3 = mh.mma_bf16_16816(p0, p1, p2, p3, x0, x1, e0, e1, e2, e3, scratch)
            else:
                d0, d1, d2, d3 = mh.mma_bf16_16816(p0, p1, p2, p3, x0, x1, d0, d1, d2, d3, scratch)
    if split:
        return d0 + e0, d1 + e1, d2 + e2, d3 + e3
    return d0, d1, d2, d3


@cuda.jit(device=True, inline="always")
def b_pairs(x0, x1, x2, x3):
    """Eight bf16 values of x (four words) -> the B pairs (x[0], x[4]), (x[1], x[5]), (x[2], x[6]), (x[3], x[7])."""
    lo16, hi16 = uint32(0xFFFF), uint32(0xFFFF0000)
    return ((x0 & lo16) | (x2 << uint32(16)), (x0 >> uint32(16)) | (x2 & hi16),
            (x1 & lo16) | (x3 << uint32(16)), (x1 >> uint32(16)) | (x3 & hi16))


@cuda.jit(device=True, inline="always")
def stage_x(xs, x, tid, t0, ku, col0, n_batch, NC, NCH, CS, NT):
    """Stage the x tile starting at K index t0 into ``xs``, permuted into B pairs (every one of the block's
    ``NT`` threads calls it)."""
    u = uint32
    e = tid
    while e < u(NC * NCH):
        col = e // u(NCH)
        c = e % u(NCH)
        kk = t0 + u(8) * c
        w0 = w1 = w2 = w3 = u(0)
        if kk < ku and col0 + col < u(n_batch):
            x0, x1, x2, x3 = ld8_ro(x, (col0 + col, kk))
            w0, w1, w2, w3 = b_pairs(x0, x1, x2, x3)
        r = c % u(16)              # chunk r of its group: lane t = r // 4, word om = r % 4
        o = col * u(CS) + (c // u(16)) * u(64) + (r // u(4)) * u(16) + u(4) * ((r + r // u(4)) & u(3))
        st4w(xs, o, w0, w1, w2, w3)
        e += u(NT)


@cuda.jit(device=True, inline="always")
def tile_ef(mx, slot):
    """The exponent field ef of the staged tile's scale 2^(253 - ef) (``mx[slot]``: bf16 bits, ``X_EF << 7`` or
    the tile's largest |x|), clamped to [126, 254] (inf, NaN: 255)."""
    return min(max(uint32(mx[slot]) >> uint32(7), uint32(126)), uint32(254))


@cuda.jit(device=True, inline="always")
def tile_fac(mx, slot):
    """2^(126 - c) of the tile staged from ``mx[slot]`` (``stage_x_mx``): the factor that takes its block-scaled
    mma sums back to x's scale. Read again from shared memory where it is needed (valid until the next tile's
    staging has passed its first barrier): a register held across the loop was spilled."""
    return u32_as_f32(tile_ef(mx, slot) << uint32(23))


# B = 1, MXFP4: x staged as bf16 x · 2^c. While every |x| of a tile is below 2^12 (the usual case), c is the
# fixed 253 - X_EF = 116: x · 2^116 stays below 2^128, and products of it with the codes (value · 2^-126) are
# value · x · 2^-10, in fp32's normal range down to |value · x| = 2^-116. A tile with a larger |x| (or inf,
# NaN) is staged again with c from its largest |x|.
X_EF = 137               # the fixed case's exponent field (``tile_ef``): c = 116, tile factor 2^10
X_BIG = 0x3A803A80       # added to |x| (two bf16 halves, 15 bits each): carries into bit 15 of a half iff
                         # |x| >= 2^12 (bits 0x4580); the halves cannot carry into each other


@cuda.jit(device=True, inline="always")
def stage_x_mx_words(xs, x, tid, t0, ku, ef, NT):
    """Store the thread's chunks of the tile at K index t0 (chunk tid + NT j of 512, ``NT`` threads in the
    block) as bf16 x · 2^(253 - ef) in the B-pair order of ``stage_x``; returns the thread's X_BIG carries
    (bits 15 and 31 set where some |x| >= 2^12)."""
    u = uint32
    big = u(0)
    for j in range(-(-X_CHUNKS // NT)):    # chunk c = tid + NT j: values t0 + 8c .. t0 + 8c + 7
        c = tid + u(NT * j)
        if X_CHUNKS % NT != 0 and c >= u(X_CHUNKS):   # (NT not dividing the tile's chunks: past the tile)
            break
        x0, x1, x2, x3 = x_chunk(x, c, t0, ku)
        big = big | store_x_chunk(xs, c, x0, x1, x2, x3, ef)
    return big & u(0x80008000)


@cuda.jit(device=True, inline="always")
def x_chunk(x, c, t0, ku):
    """Chunk c of the x tile at K index t0: 8 bf16 values as four words (zeros past K)."""
    kk = u32_add(t0, uint32(8) * c)
    x0 = x1 = x2 = x3 = uint32(0)
    if kk < ku:
        x0, x1, x2, x3 = ld8_ro(x, (0, kk))
    return x0, x1, x2, x3


@cuda.jit(device=True, inline="always")
def store_x_chunk(xs, c, x0, x1, x2, x3, ef):
    """Chunk c's words stored as bf16 x · 2^(253 - ef) in the B-pair order of ``stage_x``; returns its X_BIG
    carries (bits 15 and 31 among others: the caller masks)."""
    u = uint32
    sc = (u(380) - ef) << u(7)             # bf16 2^c (exponent field c + 127), c = 253 - ef in [-1, 127]
    sc = sc | (sc << u(16))
    m = u(0x7FFF7FFF)
    big = u32_add(x0 & m, u(X_BIG)) | u32_add(x1 & m, u(X_BIG)) | u32_add(x2 & m, u(X_BIG)) \
        | u32_add(x3 & m, u(X_BIG))
    r = c % u(16)
    o = (c // u(16)) * u(64) + r * u(4)     # group, lane r // 4, word r % 4 (no rotation: see the kernel)
    w0, w1, w2, w3 = b_pairs(x0, x1, x2, x3)
    st4w(xs, o, mh.fma_bf16x2(w0, sc, u(0)), mh.fma_bf16x2(w1, sc, u(0)), mh.fma_bf16x2(w2, sc, u(0)),
         mh.fma_bf16x2(w3, sc, u(0)))
    return big


@cuda.jit(device=True, inline="always")
def x_first_words(x, tid, ku, NT):
    """The thread's chunks (tid + NT j, j < 4) of the first x tile, loaded ahead of W (``stage_x_mx_pre``);
    NT >= 128, so a thread has at most 4. Zeros past the tile or K."""
    u = uint32
    a0 = a1 = a2 = a3 = u(0)
    if X_CHUNKS >= NT or tid < u(X_CHUNKS):
        a0, a1, a2, a3 = x_chunk(x, tid, u(0), ku)
    b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = u(0)
    if X_CHUNKS > NT and tid + u(NT) < u(X_CHUNKS):
        b0, b1, b2, b3 = x_chunk(x, tid + u(NT), u(0), ku)
    if X_CHUNKS > 2 * NT and tid + u(2 * NT) < u(X_CHUNKS):
        c0, c1, c2, c3 = x_chunk(x, tid + u(2 * NT), u(0), ku)
    if X_CHUNKS > 3 * NT and tid + u(3 * NT) < u(X_CHUNKS):
        d0, d1, d2, d3 = x_chunk(x, tid + u(3 * NT), u(0), ku)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@cuda.jit(device=True, inline="always")
def stage_x_mx_pre(xs, x, tid, ku, mx, NT, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3):
    """``stage_x_mx`` of the first tile (slot 0) from the words of ``x_first_words``."""
    u = uint32
    big = u(0)
    if X_CHUNKS >= NT or tid < u(X_CHUNKS):
        big = big | store_x_chunk(xs, tid, a0, a1, a2, a3, u(X_EF))
    if X_CHUNKS > NT and tid + u(NT) < u(X_CHUNKS):
        big = big | store_x_chunk(xs, tid + u(NT), b0, b1, b2, b3, u(X_EF))
    if X_CHUNKS > 2 * NT and tid + u(2 * NT) < u(X_CHUNKS):
        big = big | store_x_chunk(xs, tid + u(2 * NT), c0, c1, c2, c3, u(X_EF))
    if X_CHUNKS > 3 * NT and tid + u(3 * NT) < u(X_CHUNKS):
        big = big | store_x_chunk(xs, tid + u(3 * NT), d0, d1, d2, d3, u(X_EF))
    stage_x_mx_rest(xs, x, tid, u(0), ku, mx, u(0), NT, big & u(0x80008000))


@cuda.jit(device=True, inline="always")
def stage_x_mx(xs, x, tid, t0, ku, mx, slot, NT):
    """B = 1, MXFP4: stage the x tile starting at K index t0 as bf16 x · 2^c in the B-pair order of
    ``stage_x`` (exact: a power-of-two scale; ``tile_fac`` gives the factor back), and end at a barrier.
    c = 116 (``X_EF``) when every |x| of the tile is below 2^12 (one pass; the barrier also tells whether
    some thread saw a larger one); otherwise the tile is staged again with c = 253 - (exponent field of its
    largest |x|) so that the largest lands below 2^127. ``mx[slot]``: the tile's exponent source, X_EF << 7
    unless raised by the second pass (reset by the previous tile)."""
    stage_x_mx_rest(xs, x, tid, t0, ku, mx, slot, NT, stage_x_mx_words(xs, x, tid, t0, ku, uint32(X_EF), NT))


@cuda.jit(device=True, inline="always")
def stage_x_mx_rest(xs, x, tid, t0, ku, mx, slot, NT, big):
    """``stage_x_mx`` after the fixed-scale pass (``big``: the thread's carries): its barrier, and the second
    pass where some |x| of the tile is large."""
    u = uint32
    again = cuda.syncthreads_or(int32(big != u(0)))
    if tid == u(0):
        mx[u(1) - slot] = int32(X_EF << 7)   # reset the other slot for the next tile
    if again != 0:                         # the same branch in every thread of the block
        mlo = mhi = u(0)                   # the largest |x| of the low and the high halves (bf16 bits)
        for j in range(-(-X_CHUNKS // NT)):
            c = tid + u(NT * j)
            kk = u32_add(t0, u(8) * c)
            if kk < ku and (X_CHUNKS % NT == 0 or c < u(X_CHUNKS)):
                x0, x1, x2, x3 = ld8_ro(x, (0, kk))
                mlo = max(mlo, x0 & u(0x7FFF), x1 & u(0x7FFF), x2 & u(0x7FFF), x3 & u(0x7FFF))
                mhi = max(mhi, x0 & u(0x7FFF0000), x1 & u(0x7FFF0000), x2 & u(0x7FFF0000), x3 & u(0x7FFF0000))
        cuda.atomic.max(mx, slot, int32(max(mlo, mhi >> u(16))))
        cuda.syncthreads()
        stage_x_mx_words(xs, x, tid, t0, ku, tile_ef(mx, slot), NT)
        cuda.syncthreads()


@cuda.jit(device=True, inline="always")
def acc_group_mxd(a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ea, eb, xs, xo, scratch, acc0, acc2, split=False):
    """B = 1, MXFP4: one group through the mma with the codes as value · 2^-126 and x staged so that D
    column 2t holds MX block t alone (the lane's own block); the lane scales its D by 2^(e - 127) (fp32,
    e = 0 a subnormal). Returns the row g and row g + 8 accumulators."""
    u = uint32
    xi = int64(xo)                         # 64-bit: the four loads share one address (immediate offsets)
    d0, d1, d2, d3 = group_mma(False, False, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, u(0), u(0), u(0), u(0),
                            xs, xi, xi + int64(4), xi + int64(8), xi + int64(12), scratch, True, split)
    acc0 += d0 * u32_as_f32(max(ea << u(23), u(0x400000)))
    acc2 += d2 * u32_as_f32(max(eb << u(23), u(0x400000)))
    return acc0, acc2


@cuda.jit(device=True, inline="always")
def group_scales(is_int4, sa, sb, za, zb, gi):
    """Group ``gi``'s constants from views of rows g (``sa``, ``za``) and g + 8 (``sb``, ``zb``) that start at
    the lane's group 0: int4 zero points and scales; MXFP4 the lane's E8M0 exponents (the other four zeros)."""
    if is_int4:
        return (float32(za[gi]), float32(zb[gi]), float32(sa[gi]), float32(sb[gi]), uint32(0), uint32(0))
    return (float32(0.0), float32(0.0), float32(0.0), float32(0.0),
            uint32(sa[gi * int64(4)]), uint32(sb[gi * int64(4)]))


@cuda.jit(device=True, inline="always")
def b1_scales(is_int4, sa, sb, za, zb, scales, qsa, qsb, gi):
    """``group_scales`` of the batch-1 loop: MXFP4's exponents at the lane's 64-bit bases (``lane_ptr``)."""
    if is_int4:
        return group_scales(True, sa, sb, za, zb, int64(gi))
    return (float32(0.0), float32(0.0), float32(0.0), float32(0.0),
            ld1b_at(scales, ptr_add(qsa, gi, 4)), ld1b_at(scales, ptr_add(qsb, gi, 4)))


@cuda.jit(device=True, inline="always")
def acc_group(is_int4, probe, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, za, zb, ua, ub, ea, eb,
               xs, xo, xr0, xr1, xr2, xr3, scratch, acc0, acc1, acc2, acc3):
    """One group of the lane's chunk (words a*w of row g, b*w of row g + 8) multiplied into the accumulators;
    its staged x at ``xs[xo ...]``. ``probe``: no decode and no mma, the loads kept live."""
    u = uint32
    if probe:
        xq0, xq1, xq2, xq3 = ld4w(xs, xo + xr0)
        v = a0w ^ a1w ^ a2w ^ a3w ^ b0w ^ b1w ^ b2w ^ b3w ^ xq0 ^ xq3 ^ u(za + zb + ua + ub) ^ ea ^ eb
        acc0 += float32(v & u(1))
    elif is_int4:                          # c: -(128 + zero) per row, the D scale after the group
        ca = mh.pack_bf16x2(-(za + float32(128.0)), -(za + float32(128.0)))
        cb = mh.pack_bf16x2(-(zb + float32(128.0)), -(zb + float32(128.0)))
        d0, d1, d2, d3 = group_mma(True, False, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ca, cb, ca, cb,
                                xs, u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3), scratch)
        acc0 += d0 * ua
        acc1 += d1 * ua
        acc2 += d2 * ub
        acc3 += d3 * ub
    else:                                  # ea, eb: the lane's E8M0 exponents e (0..254)
        if warp_any(ea > u(128) or eb > u(128)):
            # 2^126 then 2^(e - 127) (e = 0: 2^-127, a bf16 subnormal)
            sa2 = u(0x40) if ea == u(0) else ea << u(7)
            sb2 = u(0x40) if eb == u(0) else eb << u(7)
            d0, d1, d2, d3 = group_mma(False, True, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w,
                                    u(0x7E807E80), u(0x7E807E80), sa2 | (sa2 << u(16)), sb2 | (sb2 << u(16)),
                                    xs, u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3), scratch)
        else:                              # one fma by 2^(e - 1): bf16 exponent field e + 126
            sa1 = (ea + u(126)) << u(7)
            sb1 = (eb + u(126)) << u(7)
            d0, d1, d2, d3 = group_mma(False, False, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w,
                                    sa1 | (sa1 << u(16)), sb1 | (sb1 << u(16)), u(0), u(0),
                                    xs, u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3), scratch)
        acc0 += d0
        acc1 += d1
        acc2 += d2
        acc3 += d3
    return acc0, acc1, acc2, acc3


@cuda.jit(device=True, inline="always")
def b1_set(is_int4, packed, scales, qa, qb, qsa, qsb, psa, psb, pza, pzb, gi):
    """One register set of the batch-1 loop: the lane's chunk of group ``gi`` in rows g (``qa``) and g + 8
    (``qb``), four words each, then the group's constants (``b1_scales``)."""
    a0, a1, a2, a3 = ld16_at(packed, ptr_add(qa, gi, 64))
    b0, b1, b2, b3 = ld16_at(packed, ptr_add(qb, gi, 64))
    za, zb, ua, ub, ea, eb = b1_scales(is_int4, psa, psb, pza, pzb, scales, qsa, qsb, gi)
    return a0, a1, a2, a3, b0, b1, b2, b3, za, zb, ua, ub, ea, eb


@cuda.jit(device=True, inline="always")
def group_mma_cols(is_int4, two, CT, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ca, cb, c2a, c2b, xs, xo0, xo1, xo2,
                   xo3, cso, scratch, d, xw):
    """``group_mma`` over ``CT`` column tiles of 8 at once (``cso`` words apart in ``xs``): each pair of W values
    is decoded once and multiplied into every tile's D (``d[4c .. 4c + 3]``); ``xw``: 4 CT words of scratch
    registers for the tiles' staged x. Each tile's D is what ``group_mma`` gives for that tile alone."""
    for i in range(4 * CT):
        d[i] = float32(0.0)
    for om in range(4):
        wa = a0w if om == 0 else a1w if om == 1 else a2w if om == 2 else a3w
        wb = b0w if om == 0 else b1w if om == 1 else b2w if om == 2 else b3w
        xo = xo0 if om == 0 else xo1 if om == 1 else xo2 if om == 2 else xo3
        for c in range(CT):
            xw[4 * c], xw[4 * c + 1], xw[4 * c + 2], xw[4 * c + 3] = ld4w(xs, xo + uint32(c) * cso)
        for h in range(2):
            p0, p1, p2, p3 = a_pairs(is_int4, two, False, wa, wb, h, ca, cb, c2a, c2b)
            for c in range(CT):
                d[4 * c], d[4 * c + 1], d[4 * c + 2], d[4 * c + 3] = mh.mma_bf16_16816(
                    p0, p1, p2, p3, xw[4 * c + 2 * h], xw[4 * c + 2 * h + 1],
                    d[4 * c], d[4 * c + 1], d[4 * c + 2], d[4 * c + 3], scratch)


@cuda.jit(device=True, inline="always")
def acc_group_cols(is_int4, CT, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, za, zb, ua, ub, ea, eb,
                   xs, xo, cso, xr0, xr1, xr2, xr3, scratch, acc, d, xw):
    """``acc_group`` over ``CT`` column tiles: ``acc[4c .. 4c + 3]`` takes tile c's sums, with the same
    constants and in the same order as ``acc_group`` gives each tile alone."""
    u = uint32
    xo0, xo1, xo2, xo3 = u32_add(xo, xr0), u32_add(xo, xr1), u32_add(xo, xr2), u32_add(xo, xr3)
    if is_int4:
        ca = mh.pack_bf16x2(-(za + float32(128.0)), -(za + float32(128.0)))
        cb = mh.pack_bf16x2(-(zb + float32(128.0)), -(zb + float32(128.0)))
        group_mma_cols(True, False, CT, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, ca, cb, ca, cb,
                       xs, xo0, xo1, xo2, xo3, cso, scratch, d, xw)
        for c in range(CT):
            acc[4 * c] += d[4 * c] * ua
            acc[4 * c + 1] += d[4 * c + 1] * ua
            acc[4 * c + 2] += d[4 * c + 2] * ub
            acc[4 * c + 3] += d[4 * c + 3] * ub
    else:
        if warp_any(ea > u(128) or eb > u(128)):
            sa2 = u(0x40) if ea == u(0) else ea << u(7)
            sb2 = u(0x40) if eb == u(0) else eb << u(7)
            group_mma_cols(False, True, CT, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w,
                           u(0x7E807E80), u(0x7E807E80), sa2 | (sa2 << u(16)), sb2 | (sb2 << u(16)),
                           xs, xo0, xo1, xo2, xo3, cso, scratch, d, xw)
        else:
            sa1 = (ea + u(126)) << u(7)
            sb1 = (eb + u(126)) << u(7)
            group_mma_cols(False, False, CT, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w,
                           sa1 | (sa1 << u(16)), sb1 | (sb1 << u(16)), u(0), u(0),
                           xs, xo0, xo1, xo2, xo3, cso, scratch, d, xw)
        for i in range(4 * CT):
            acc[i] += d[i]
