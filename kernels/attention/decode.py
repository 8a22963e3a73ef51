"""Grouped-query decode attention (one query token per sequence) over a bf16 KV cache, split over the sequence.

    q:        [B, Hq, D]             bf16 (uint16)
    k, v:     [B, S_max, Hkv, D]     the layers' sequence-major caches ([S_max, Hkv, D] when B == 1)
    seq_len:  [B] int32 on the device: how many cache positions each sequence attends to
    out:      [B, Hq, D]             bf16

The length is read on the device, so one captured graph serves every length up to S_max. The grid is a
fixed function of S_max (the capture-time bound), never of the runtime length:

pass 1 (``_split``, flash-decoding): block (split, kv head, b) covers positions [split*chunk,
  (split+1)*chunk); blocks at or past the length return at once. A block is ``WARPS`` warps; a warp is
  32 / L lane groups of L = D / 8 lanes, each lane holding 8 dims (one 16-byte ``ld.global.nc``) of a K
  or V row. Every lane group is an independent stream: per iteration it takes ``KEYS`` consecutive keys
  (the block's streams sweep the chunk together, ``WARPS * 32 / L * KEYS`` keys per step), issues all
  their K and V loads at once (the next step's too with ``PREFETCH``; ``FLAT_LOADS``: addressed by a
  running element offset instead of the 4-D index), forms the G = Hq / Hkv dot
  products with xor-butterfly shuffles inside the group, and folds them into a per-head running max /
  sum / output in registers (online softmax, base 2). No barrier in the main loop. At the end the
  groups of a warp merge by shuffles, the warps through shared memory once, and the block writes one
  partial (max, sum of exp, unnormalised output per query head) to the session-lifetime workspace.
pass 2 (``_combine``): block (query head, b); each thread folds a few splits' partials online (its
  loads for ``C_UNROLL`` splits in flight at once), the threads merge through shared memory, bf16 out.

Head dims 64, 128 and 256 (a whole warp per key row). Up to 8 query heads per KV head go in one pass-1 block;
more (multi-query attention, wide groups) go in groups of ``head_group(G)``, the groups of a KV head side by side on
the grid's y (one launch; each group's block reads the KV head's chunk, from L2 after the first). Maxima are kept in
log2 units (q is pre-scaled by scale * log2 e).
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import cuda, float32, uint32

from vmmstream.kernels.base import launch as la, mma as mh
from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.workspace import Lifetime, WorkspaceRequirement, layout

HEAD_DIMS = tuple(range(16, 257, 16))   # a lane holds 8 dims: D / 8 lanes per key row, padded to a power of two
                                        # (head_dim 80 / 96 / 112 run 10 / 12 / 14 live lanes of 16)
MAX_GROUP = 8
CAPTURE_SAFE = True      # device arrays only, length read on the device, grid fixed by S_max

# pass 1 tuning, swept on an H200 by bench/tools/sweep_decode.py (32q/8kv heads, D=128, S=32768, SDPA 37.7 us; raw
# data docs/bench/h200-2026-12-02b-decode-sweep.json): one wave of 3 blocks per SM (672 keys x 49 splits) with
# flat loads and the scatter-sum, 45.1 us (0.84); the same at 1024 keys without the 3-block bound 50.3; 4 blocks
# per SM at 512 keys 46.4; 8 warps 54.5; 2 keys per step 47.2; 8 keys 48.4; no prefetch 58.6; 2 warps 51.3.
# The grid that fills one wave exactly matters most: ``plan`` sizes the chunk for it. Pass 2: ~4 us of the total.
WARPS = 4                # warps per pass-1 block
KEYS = 4                 # keys per lane group per step: 2 * KEYS 16-byte loads per lane per step
PREFETCH = True          # issue the next step's loads before using this step's (doubles the loads in flight)
FLAT_LOADS = True        # K/V addresses as a running element offset (fewer loop instructions than 4-D indexing)
SCATTER_SUM = True       # dot products summed over the lane group by a reduce-scatter then an all-gather of the
                         # U * G scores (~31 shuffles a step for G = 4, U = 4, D = 128) instead of a full
                         # butterfly of every score (64)
MIN_BLOCKS = 3           # launch-bounds minimum of resident blocks per SM (ptxas then keeps to 168 registers)
CHUNK_STEP = 32          # a chunk is a multiple of this many keys (one block step at D = 128)
CHUNK_MAX = 1024         # keys per block at most (more blocks than one wave: several waves of this size)
SMS = 132                # an H200's SMs: a constant, so the plan (and the workspace) is portable
RESIDENT_BLOCKS = MIN_BLOCKS * SMS   # pass-1 blocks resident at once with the settings above
# pass 2
C_THREADS = 512          # D / 4 dim lanes (4 dims each) x C_THREADS / (D / 4) split lanes
C_UNROLL = 4             # splits per thread per step

NEG_INF = float32(-math.inf)
M_INIT = float32(-3.4028234663852886e38)   # running max before any key: finite, so exp2(m - m') never NaNs
LOG2E = 1.4426950408889634
FULL_MASK = 0xFFFFFFFF


# ----------------------------------------------------------------------------- host side

def reference(q, k, v, seq_len, *, scale=None):
    """NumPy reference; bf16 (uint16) inputs, 4-D or (B == 1) 3-D caches; returns fp32 ``[B, Hq, D]``.
    A zero length gives zeros."""
    k, v = (x[None] if x.ndim == 3 else x for x in (k, v))
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = np.zeros((B, Hq, D), np.float32)
    for b in range(B):
        n = int(seq_len[b])
        if n == 0:
            continue
        qf = bf16_to_f32(q[b]).astype(np.float64).reshape(Hkv, Hq // Hkv, D)   # [Hkv, G, D]
        kf = bf16_to_f32(k[b, :n]).astype(np.float64).transpose(1, 2, 0)       # [Hkv, D, n]
        vf = bf16_to_f32(v[b, :n]).astype(np.float64).transpose(1, 0, 2)       # [Hkv, n, D]
        s = (qf @ kf) * scale                                                  # [Hkv, G, n]
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[b] = ((p / p.sum(axis=-1, keepdims=True)) @ vf).reshape(Hq, D)
    return out


def plan(B, Hkv, S_max, group):
    """(chunk, n_splits) at the capture-time bound S_max, so every length reuses one grid and workspace:
    as many splits as one wave of resident pass-1 blocks holds (``RESIDENT_BLOCKS`` over the B * Hkv
    (sequence, KV head) pairs), the chunk rounded up to ``CHUNK_STEP`` keys and at most ``CHUNK_MAX``.
    ``group`` (Hq / Hkv) is accepted for the interface; the chunk does not depend on it."""
    ns = max(1, RESIDENT_BLOCKS // max(1, B * Hkv))
    chunk = min(CHUNK_MAX, -(-max(1, -(-S_max // ns)) // CHUNK_STEP) * CHUNK_STEP)
    return chunk, -(-max(1, S_max) // chunk)


def combine_threads(D: int, T: int = C_THREADS) -> int:
    """Pass 2's block: the whole split lanes of D / 4 dim lanes that fit in ``T`` threads."""
    return T // (D // 4) * (D // 4)


def head_group(G: int) -> int:
    """Query heads per pass-1 block: all ``G`` of a KV head when ``G <= MAX_GROUP``; else the largest divisor of
    ``G`` up to ``MAX_GROUP`` (multi-query and wide groups: ``G / head_group(G)`` blocks per KV head and split,
    side by side in one launch, each reading that head's K and V, from L2 after the first)."""
    return G if G <= MAX_GROUP else max(d for d in range(1, MAX_GROUP + 1) if G % d == 0)


def _pairs(B, Hkv, G):
    """Pass-1 blocks per split: one per sequence, KV head and group of query heads."""
    return B * Hkv * (G // head_group(G))


def _layout(B, Hq, Hkv, D, S_max):
    _, ns = plan(_pairs(B, Hkv, Hq // Hkv), 1, S_max, Hq // Hkv)
    # per (b, query head, split): max, sum of exp (fp32) and the unnormalised output [D] (fp32)
    return layout(m=B * Hq * ns * 4, l=B * Hq * ns * 4, o=B * Hq * ns * D * 4)


def workspace_requirement(B, Hq, Hkv, D, S_max):
    """Session lifetime: the partials sit at a stable address inside the captured decode graph."""
    return WorkspaceRequirement(_layout(B, Hq, Hkv, D, S_max).total, Lifetime.SESSION)


def flops(B, Hq, D, lengths):
    """q.k and p.v: 4 * D flops per (query head, position)."""
    return 4 * D * Hq * int(np.sum(lengths)) if B else 0


def bytes_moved(B, Hq, Hkv, D, lengths, S_max):
    """HBM bytes: K and V rows up to each length, q and out, and the fp32 partials written then read."""
    chunk, _ = plan(B, Hkv, S_max, Hq // Hkv)
    total_len = int(np.sum(lengths))
    splits = int(sum(-(-int(n) // chunk) for n in lengths))
    return 2 * 2 * total_len * Hkv * D + 2 * 2 * B * Hq * D + 2 * splits * Hq * (D + 2) * 4


# ----------------------------------------------------------------------------- device helpers

if la.SIM:
    def _lanes_values(values):
        """Every lane's tuple of values, in lane order (the simulator has no shuffles: a barrier-separated
        exchange through the block manager, as in launch.py; every thread of the block calls it)."""
        th = threading.current_thread()
        box = th._manager.__dict__.setdefault("_vmm_decode_xchg", {})
        tid = th.thread_id
        box[tid] = values
        th.syncthreads()
        base = tid - tid % 32
        vals = [box[t] for t in range(base, base + 32)]
        th.syncthreads()
        return vals

    def _group_sum(vals, n, lanes):
        """vals[:n] summed over the ``lanes`` aligned lanes of this lane's group, in every lane of it."""
        lane = threading.current_thread().thread_id % 32
        allv = _lanes_values(tuple(vals[i] for i in range(n)))
        base = lane - lane % lanes
        for i in range(n):
            vals[i] = np.float32(sum(np.float64(allv[j][i]) for j in range(base, base + lanes)))

    def _xor_get(src, dst, n, off):
        """dst[:n] = src[:n] of lane ^ off."""
        lane = threading.current_thread().thread_id % 32
        allv = _lanes_values(tuple(src[i] for i in range(n)))
        for i in range(n):
            dst[i] = allv[lane ^ off][i]

    def _exp2(x):
        return np.float32(math.pow(2.0, float(x)))

    def _shfl_xor1(v, off):
        """One value from lane ^ off."""
        lane = threading.current_thread().thread_id % 32
        return _lanes_values((v,))[lane ^ off][0]

    def _shfl_idx1(v, src):
        """One value from lane ``src`` of the warp."""
        return _lanes_values((v,))[src % 32][0]

    def _ld8_ro_at(arr, off):
        """8 bf16 at element offset ``off`` from the array's first element, as four packed words."""
        a = arr._ary if hasattr(arr, "_ary") else arr
        off = int(off)
        flat = np.lib.stride_tricks.as_strided(a, shape=(off + 8,), strides=(a.itemsize,), writeable=False)
        w = flat[off:off + 8].astype(np.uint32)
        w = w[0::2] | (w[1::2] << np.uint32(16))
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def _group_sum(vals, n, lanes):
        off = lanes // 2
        while off > 0:
            for i in range(n):
                vals[i] += cuda.shfl_xor_sync(FULL_MASK, vals[i], off)
            off //= 2

    @cuda.jit(device=True, inline="always")
    def _xor_get(src, dst, n, off):
        for i in range(n):
            dst[i] = cuda.shfl_xor_sync(FULL_MASK, src[i], off)

    @cuda.jit(device=True, inline="always")
    def _exp2(x):
        return libdevice.exp2f(x)

    @cuda.jit(device=True, inline="always")
    def _shfl_xor1(v, off):
        return cuda.shfl_xor_sync(FULL_MASK, v, off)

    @cuda.jit(device=True, inline="always")
    def _shfl_idx1(v, src):
        return cuda.shfl_sync(FULL_MASK, v, src)

    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    _V4 = ir.VectorType(ir.IntType(32), 4)

    @intrinsic
    def _ld8_ro_at(typingctx, arr, off):
        """``ld.global.nc.v4.u32`` of the 8 bf16 at element offset ``off`` from the array's first element
        (the caller keeps it 16-byte aligned, like ``launch.ld8_ro``): the address is one add on a
        running offset instead of a full multi-index computation per load."""
        sig = types.UniTuple(types.uint32, 4)(arr, off)

        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, value=args[0])
            o = context.cast(builder, args[1], sig.args[1], types.intp)
            p = builder.gep(a.data, [o], inbounds=True)
            v = builder.load(builder.bitcast(p, _V4.as_pointer()), align=16)
            v.set_metadata("invariant.load", builder.module.add_metadata([]))
            words = [builder.extract_element(v, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, words)

        return sig, codegen


@cuda.jit(device=True, inline="always")
def _unpack8(dst, i, w0, w1, w2, w3, mul):
    """dst[i:i+8] = mul * the 8 bf16 of four packed words (explicit, so indices stay compile-time)."""
    dst[i], dst[i + 1] = mh.bf16_lo(w0) * mul, mh.bf16_hi(w0) * mul
    dst[i + 2], dst[i + 3] = mh.bf16_lo(w1) * mul, mh.bf16_hi(w1) * mul
    dst[i + 4], dst[i + 5] = mh.bf16_lo(w2) * mul, mh.bf16_hi(w2) * mul
    dst[i + 6], dst[i + 7] = mh.bf16_lo(w3) * mul, mh.bf16_hi(w3) * mul


def _make_scatter_sum(P, L, NG):
    """A device function ``(vals, tmp)``: vals[:NG] summed over the L aligned lanes of this lane's group, in
    every lane (the same result as ``_group_sum(vals, NG, L)``), as a reduce-scatter then an all-gather.
    P (a power of two >= NG) is the padded count: vals[NG:P] must be zero. At a scatter level with lane
    offset o, a lane keeps the half of its values its o-bit selects, adds the partner's copy of that
    half, and sends the other half: P/2 + P/4 + ... shuffles, after which lane i of the group holds
    indices [(i // STRIDE) * C, +C). The gather then fetches each of the NG sums from its holder."""
    LOG_P, LOG_L = P.bit_length() - 1, L.bit_length() - 1
    NLEV = min(LOG_P, LOG_L)               # scatter levels
    NRED = LOG_L - NLEV                     # levels left when P < L: plain butterfly of the one value
    C = max(1, P // L)                      # values a lane holds after the scatter
    STRIDE = max(1, L // P)                 # lanes between holders of consecutive blocks of C

    @cuda.jit(device=True, inline="always")
    def scatter_sum(vals, tmp):
        lane = cuda.threadIdx.x % 32
        for j in range(NLEV):
            off = L >> (j + 1)
            half = P >> (j + 1)
            up = (lane & off) != 0
            for i in range(half):
                a, b = vals[i], vals[i + half]
                send = a if up else b
                keep = b if up else a
                vals[i] = keep + _shfl_xor1(send, off)
        for j in range(NRED):
            vals[0] += _shfl_xor1(vals[0], L >> (NLEV + j + 1))
        base = lane - lane % L
        for i in range(NG):
            tmp[i] = _shfl_idx1(vals[i % C], base + (i // C) * STRIDE)
        for i in range(NG):
            vals[i] = tmp[i]

    return scatter_sum


# ----------------------------------------------------------------------------- pass 1

def _make_split(G, D, W=None, U=None, PF=None, MINB=None, FLAT=None, RS=None, NG=1):
    W = WARPS if W is None else W
    RS = SCATTER_SUM if RS is None else RS
    FLAT = FLAT_LOADS if FLAT is None else FLAT
    U = KEYS if U is None else U
    PF = PREFETCH if PF is None else PF
    MINB = MIN_BLOCKS if MINB is None else MINB
    DL8 = D // 8          # lanes holding dims: 8 dims (one 16-byte load) per lane
    L = 1 << (DL8 - 1).bit_length()   # lanes per key row: DL8 padded to a power of two; the rest load nothing
    PAD = L != DL8
    R = 32 // L           # lane groups (independent streams) per warp
    LOGR = R.bit_length() - 1
    KPB = W * R * U       # keys per block step
    THR = 32 * W
    QN, SN = 8 * G, U * G
    MO, LO, NST = 8 * G, 9 * G, 10 * G   # state: acc [8G] | running max [G] | running sum [G]
    BW = 4 * U
    G2 = 2 * G
    SP = 1 << (SN - 1).bit_length()       # scores padded to a power of two for the reduce-scatter
    SA = SP if RS else SN
    rs_sum = _make_scatter_sum(SP, L, SN)

    @mh.kernel((THR, MINB) if MINB else THR)
    def split(q, k, v, seq_len, part_m, part_l, part_o, chunk, scale):
        # q: [B, Hq, D] u16; k, v: [B, S_max, Hkv, D] u16; seq_len: [B] i32
        # part_m, part_l: [B, Hq, NS] f32; part_o: [B, Hq, NS, D] f32
        sm_s = cuda.shared.array((W, G2), float32)     # per warp: max, sum per head
        sm_o = cuda.shared.array((W, G, D), float32)      # per warp: unnormalised output per head
        sp, kvh, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        hg = 0
        if NG > 1:                                 # NG groups of G query heads per KV head: y = kvh * NG + group
            hg = kvh % NG
            kvh = kvh // NG
        c0 = sp * chunk
        n_all = min(seq_len[b], k.shape[1])
        if c0 >= n_all:
            return                                 # uniform over the block: before any shuffle or barrier
        n = min(chunk, n_all - c0)
        tid = cuda.threadIdx.x
        lane, wid = tid % 32, tid // 32
        d0 = 8 * (lane % L)
        live = True
        if PAD:
            live = lane % L < DL8                  # a padding lane: zero q, K and V, so it adds nothing
        r_st = (wid * R + lane // L) * U           # this stream's first key of a step, relative to c0
        h0 = (kvh * NG + hg) * G

        qr = cuda.local.array(QN, float32)         # this lane's 8 dims of every query head, pre-scaled
        for h in range(G):
            if live:
                w0, w1, w2, w3 = la.ld8_ro(q, (b, h0 + h, d0))
            else:
                w0 = w1 = w2 = w3 = uint32(0)
            _unpack8(qr, 8 * h, w0, w1, w2, w3, scale * float32(LOG2E))
        st = cuda.local.array(NST, float32)
        for i in range(MO):
            st[i] = 0.0
        for h in range(G):
            st[MO + h] = M_INIT
            st[LO + h] = 0.0

        kb = cuda.local.array(BW, uint32)          # K / V words of the step in flight
        vb = cuda.local.array(BW, uint32)
        kc = cuda.local.array(BW, uint32)          # K / V words of the step being used
        vc = cuda.local.array(BW, uint32)
        kf = cuda.local.array(8, float32)
        s = cuda.local.array(SA, float32)          # scores, then probabilities, [u * G + h]
        s_t = cuda.local.array(SA, float32)        # the reduce-scatter's gather target
        n_it = (n + KPB - 1) // KPB
        # FLAT: element offsets of this lane's 8 dims of the next key to load, running by one step each step
        k_row, v_row = k.strides[1] // 2, v.strides[1] // 2
        kq = (b * k.strides[0] + kvh * k.strides[2]) // 2 + (c0 + r_st) * k_row + d0
        vq = (b * v.strides[0] + kvh * v.strides[2]) // 2 + (c0 + r_st) * v_row + d0
        if PF:
            for u in range(U):
                if r_st + u < n and live:
                    if FLAT:
                        w0, w1, w2, w3 = _ld8_ro_at(k, kq + u * k_row)
                        x0, x1, x2, x3 = _ld8_ro_at(v, vq + u * v_row)
                    else:
                        w0, w1, w2, w3 = la.ld8_ro(k, (b, c0 + r_st + u, kvh, d0))
                        x0, x1, x2, x3 = la.ld8_ro(v, (b, c0 + r_st + u, kvh, d0))
                else:
                    w0 = w1 = w2 = w3 = x0 = x1 = x2 = x3 = uint32(0)
                kb[4 * u], kb[4 * u + 1], kb[4 * u + 2], kb[4 * u + 3] = w0, w1, w2, w3
                vb[4 * u], vb[4 * u + 1], vb[4 * u + 2], vb[4 * u + 3] = x0, x1, x2, x3
            kq += KPB * k_row
            vq += KPB * v_row
        for it in range(n_it):
            r0 = it * KPB + r_st
            if PF:
                for i in range(BW):
                    kc[i] = kb[i]
                    vc[i] = vb[i]
                rn = r0 + KPB                      # the next step's loads go out before this step's math
            else:
                rn = r0
            for u in range(U):
                if rn + u < n and live:
                    if FLAT:
                        w0, w1, w2, w3 = _ld8_ro_at(k, kq + u * k_row)
                        x0, x1, x2, x3 = _ld8_ro_at(v, vq + u * v_row)
                    else:
                        w0, w1, w2, w3 = la.ld8_ro(k, (b, c0 + rn + u, kvh, d0))
                        x0, x1, x2, x3 = la.ld8_ro(v, (b, c0 + rn + u, kvh, d0))
                else:
                    w0 = w1 = w2 = w3 = x0 = x1 = x2 = x3 = uint32(0)
                if PF:
                    kb[4 * u], kb[4 * u + 1], kb[4 * u + 2], kb[4 * u + 3] = w0, w1, w2, w3
                    vb[4 * u], vb[4 * u + 1], vb[4 * u + 2], vb[4 * u + 3] = x0, x1, x2, x3
                else:
                    kc[4 * u], kc[4 * u + 1], kc[4 * u + 2], kc[4 * u + 3] = w0, w1, w2, w3
                    vc[4 * u], vc[4 * u + 1], vc[4 * u + 2], vc[4 * u + 3] = x0, x1, x2, x3
            kq += KPB * k_row
            vq += KPB * v_row

            # ---- partial dots over this lane's 8 dims, then summed over the lane group
            for u in range(U):
                for x in range(4):
                    kf[2 * x] = mh.bf16_lo(kc[4 * u + x])
                    kf[2 * x + 1] = mh.bf16_hi(kc[4 * u + x])
                for h in range(G):
                    a = float32(0.0)
                    for x in range(8):
                        a += qr[8 * h + x] * kf[x]
                    s[u * G + h] = a
            if RS:
                for i in range(SN, SA):
                    s[i] = 0.0
                rs_sum(s, s_t)
            else:
                _group_sum(s, SN, L)
            for u in range(U):
                if r0 + u >= n:
                    for h in range(G):
                        s[u * G + h] = NEG_INF

            # ---- online softmax (base 2) per head
            for h in range(G):
                mx = s[h]
                for u in range(1, U):
                    mx = max(mx, s[u * G + h])
                m_old = st[MO + h]
                m_new = max(m_old, mx)
                corr = _exp2(m_old - m_new)
                st[MO + h] = m_new
                ps = float32(0.0)
                for u in range(U):
                    p = _exp2(s[u * G + h] - m_new)
                    s[u * G + h] = p
                    ps += p
                st[LO + h] = st[LO + h] * corr + ps
                for x in range(8):
                    st[8 * h + x] *= corr
            for u in range(U):
                for x in range(4):
                    lo, hi = mh.bf16_lo(vc[4 * u + x]), mh.bf16_hi(vc[4 * u + x])
                    for h in range(G):
                        p = s[u * G + h]
                        st[8 * h + 2 * x] += p * lo
                        st[8 * h + 2 * x + 1] += p * hi

        # ---- merge the warp's lane groups (xor over the group bits), then the warps through shared memory
        ot = cuda.local.array(NST, float32)
        for j in range(LOGR):
            _xor_get(st, ot, NST, L << j)
            for h in range(G):
                m_a, m_b = st[MO + h], ot[MO + h]
                m_new = max(m_a, m_b)
                fa, fb = _exp2(m_a - m_new), _exp2(m_b - m_new)
                st[MO + h] = m_new
                st[LO + h] = st[LO + h] * fa + ot[LO + h] * fb
                for x in range(8):
                    st[8 * h + x] = st[8 * h + x] * fa + ot[8 * h + x] * fb
        if lane < DL8:
            for h in range(G):
                for x in range(8):
                    sm_o[wid, h, d0 + x] = st[8 * h + x]
                if lane == 0:
                    sm_s[wid, h] = st[MO + h]
                    sm_s[wid, G + h] = st[LO + h]
        cuda.syncthreads()
        for i in range(tid, G * D, THR):
            h, d = i // D, i % D
            m = sm_s[0, h]
            for w in range(1, W):
                m = max(m, sm_s[w, h])
            o = float32(0.0)
            for w in range(W):
                o += _exp2(sm_s[w, h] - m) * sm_o[w, h, d]
            part_o[b, h0 + h, sp, d] = o
        if tid < G:
            m = sm_s[0, tid]
            for w in range(1, W):
                m = max(m, sm_s[w, tid])
            lsum = float32(0.0)
            for w in range(W):
                lsum += _exp2(sm_s[w, tid] - m) * sm_s[w, G + tid]
            part_m[b, h0 + tid, sp] = m
            part_l[b, h0 + tid, sp] = lsum

    return split


# ----------------------------------------------------------------------------- pass 2

def _make_combine(D, T=None, CU=None):
    T = combine_threads(D, C_THREADS if T is None else T)   # whole split lanes (head_dim 80: 25 x 20 = 500)
    CU = C_UNROLL if CU is None else CU
    DL = D // 4            # dim lanes, 4 contiguous dims each
    SL = T // DL           # split lanes
    CU4 = 4 * CU

    @mh.kernel(T)
    def combine(part_m, part_l, part_o, seq_len, out, chunk):
        # part_*: as in pass 1; out: [B, Hq, D] u16
        sm_s = cuda.shared.array((2, SL), float32)
        sm_o = cuda.shared.array((SL, D), float32)
        h, b = cuda.blockIdx.x, cuda.blockIdx.y
        tid = cuda.threadIdx.x
        sl, d0 = tid // DL, 4 * (tid % DL)
        ns = part_m.shape[2]
        n_active = min((seq_len[b] + chunk - 1) // chunk, ns)
        m = M_INIT
        den = float32(0.0)
        acc = cuda.local.array(4, float32)
        pm = cuda.local.array(CU, float32)
        pl = cuda.local.array(CU, float32)
        po = cuda.local.array(CU4, float32)
        for e in range(4):
            acc[e] = 0.0
        for s0 in range(sl * CU, n_active, SL * CU):
            for c in range(CU):                    # every load of the step first
                if s0 + c < n_active:
                    pm[c] = part_m[b, h, s0 + c]
                    pl[c] = part_l[b, h, s0 + c]
                    for e in range(4):
                        po[4 * c + e] = part_o[b, h, s0 + c, d0 + e]
                else:
                    pm[c] = NEG_INF
                    pl[c] = 0.0
                    for e in range(4):
                        po[4 * c + e] = 0.0
            mx = pm[0]
            for c in range(1, CU):
                mx = max(mx, pm[c])
            m_new = max(m, mx)
            corr = _exp2(m - m_new)
            den *= corr
            for e in range(4):
                acc[e] *= corr
            for c in range(CU):
                wgt = _exp2(pm[c] - m_new)
                den += wgt * pl[c]
                for e in range(4):
                    acc[e] += wgt * po[4 * c + e]
            m = m_new
        for e in range(4):
            sm_o[sl, d0 + e] = acc[e]
        if d0 == 0:
            sm_s[0, sl] = m
            sm_s[1, sl] = den
        cuda.syncthreads()
        for d in range(tid, D, T):
            mm = sm_s[0, 0]
            for i in range(1, SL):
                mm = max(mm, sm_s[0, i])
            tot = float32(0.0)
            dd = float32(0.0)
            for i in range(SL):
                wgt = _exp2(sm_s[0, i] - mm)
                tot += wgt * sm_o[i, d]
                dd += wgt * sm_s[1, i]
            out[b, h, d] = dev_f32_to_bf16(tot / dd) if n_active > 0 else 0

    return combine


# ----------------------------------------------------------------------------- launch

_KERNELS = {}


def _kernel(kind, *key):
    if (kind, *key) not in _KERNELS:
        _KERNELS[(kind, *key)] = _make_split(*key) if kind == "split" else _make_combine(*key)
    return _KERNELS[(kind, *key)]


def launch(q, k, v, seq_len, out, workspace, *, scale=None, stream):
    """out[B, Hq, D] = attention of q[B, Hq, D] over k/v[B, :seq_len[b]] (bf16 uint16 device arrays; caches
    [B, S_max, Hkv, D] or [S_max, Hkv, D] for B == 1; seq_len an int32 device array). ``workspace``: 1-D
    uint8 device view of at least ``workspace_requirement(B, Hq, Hkv, D, S_max).bytes``; a short view
    raises ``WorkspaceShortfall``. Never allocates, never synchronizes: safe inside a stream capture."""
    if len(k.shape) == 3:
        k, v = k.reshape(1, *k.shape), v.reshape(1, *v.shape)
    B, Hq, D = q.shape
    S_max, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if (Hq % Hkv or D not in HEAD_DIMS or tuple(k.shape) != (B, S_max, Hkv, D)
            or tuple(v.shape) != tuple(k.shape) or tuple(out.shape) != (B, Hq, D) or seq_len.shape[0] < B):
        raise ValueError(f"decode shapes q{q.shape} k{k.shape} v{v.shape} out{out.shape} seq_len{seq_len.shape}: "
                         "need Hq % Hkv == 0 and D a multiple of 16 up to 256")
    if not la.vec8_ok(q, k, v):
        raise ValueError("decode attention needs 16-byte aligned, contiguous q, k and v rows")
    lay = _layout(B, Hq, Hkv, D, S_max)
    la.check_workspace("attention_decode", workspace, lay.total)
    chunk, ns = plan(_pairs(B, Hkv, G), 1, S_max, G)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    part = {name: workspace[lay.offsets[name]:lay.offsets[name] + lay.sizes[name]].view(np.float32)
            for name in ("m", "l", "o")}
    part_m, part_l = part["m"].reshape(B, Hq, ns), part["l"].reshape(B, Hq, ns)
    part_o = part["o"].reshape(B, Hq, ns, D)
    st = la.as_stream(stream)
    gs = head_group(G)
    ng = G // gs            # groups of gs query heads per KV head, side by side on the grid's y
    split = _kernel("split", gs, D, WARPS, KEYS, PREFETCH, MIN_BLOCKS, FLAT_LOADS, SCATTER_SUM, ng)
    split[(ns, Hkv * ng, B), 32 * WARPS, st](q, k, v, seq_len, part_m, part_l, part_o, chunk, float32(scale))
    _kernel("combine", D, C_THREADS, C_UNROLL)[(Hq, B), combine_threads(D, C_THREADS), st](
        part_m, part_l, part_o, seq_len, out, chunk)


# ----------------------------------------------------------------------------- compile check

_U16_3D, _U16_4D = "uint16[:, :, ::1]", "uint16[:, :, :, ::1]"
_F32_3D, _F32_4D = "float32[:, :, ::1]", "float32[:, :, :, ::1]"
_SPLIT_SIG = f"void({_U16_3D}, {_U16_4D}, {_U16_4D}, int32[::1], {_F32_3D}, {_F32_3D}, {_F32_4D}, int64, float32)"
_SWEPT = (64, 128)        # head dims whose pass-1 variants (addressing, summation) are compiled too
SIGNATURES = (
    [(_make_split(G, D).py_func, _SPLIT_SIG) for G in (4, 1) for D in _SWEPT]
    + [(_make_split(4, 256).py_func, _SPLIT_SIG), (_make_split(4, 96).py_func, _SPLIT_SIG)]   # padded lanes: 96
    + [(_make_split(4, D, FLAT=not FLAT_LOADS).py_func, _SPLIT_SIG) for D in _SWEPT]   # the other addressing
    + [(_make_split(G, D, RS=not SCATTER_SUM).py_func, _SPLIT_SIG) for G in (4, 3) for D in _SWEPT]
    + [(_make_split(8, 128, NG=4).py_func, _SPLIT_SIG)]      # multi-query: 4 groups of 8 heads on the grid
    + [(_make_combine(D).py_func, f"void({_F32_3D}, {_F32_3D}, {_F32_4D}, int32[::1], {_U16_3D}, int64)")
       for D in (64, 128, 256, 96)]
)
