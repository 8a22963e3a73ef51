"""Causal grouped-query prefill attention: bf16 storage (uint16 bit patterns), fp32 accumulation.

    q:   [T, Hq, D]      queries at positions [start_pos, start_pos + T)
    k,v: [S, Hkv, D]     the layer's sequence-major KV cache, S >= start_pos + T (a longer cache is fine)
    out: [T, Hq, D]      query row i attends to keys [0, start_pos + i]

Hq is a multiple of Hkv; query head h reads KV head h // (Hq // Hkv).

Routes (``choose_route`` picks one, ``route=`` overrides):
- ``"fused_mma"``: flash-style, tensor cores via ``mma.sync`` (see ``kernels/base/mma.py``), online softmax in
  registers, D in {64, 128}. No workspace (``NONE``).
- ``"fused_mma_async"``: the same on FlashAttention-2's memory path: ``cp.async`` K/V tiles overlapping the
  mma work, ``ldmatrix`` fragments, the mask only on diagonal tiles. D in {64, 96, 128}. No workspace.
- ``"fused"``: the same algorithm on fp32 FMA, K/V tiles through shared memory. D in {64, 128}. No
  workspace. The fallback, and the route the simulator checks the algorithm with.
- ``"cudnn"``: cuDNN's fused SDPA (``cudnn_sdpa.py``: the ``nvidia-cudnn-frontend`` package, optional), taken by
  ``choose_route`` for long prompts where it loads, ``VMMSTREAM_CUDNN=1`` (opt-in) and a session workspace is given
  (``session_workspace=``; ``session_requirement`` sizes it). On an H100 it runs at 0.99 / 1.00 of torch SDPA's
  TFLOP/s at S = 2,048 / 8,192 where ``fused_mma_async`` runs at 0.41 / 0.37 (run 12-07 k). A shape it cannot
  plan, or one first met inside a capture, runs the route below it.
- ``"materialized"``: any D. Writes fp32 scores ``[Hq, T, Sk]`` (Sk = start_pos + T) into a declared
  step-lifetime workspace, then a row-softmax-times-V kernel. For shapes the fused routes do not take.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int64, uint32

from vmmstream.kernels.base import launch as la, mma as mh
from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.env import switch
from vmmstream.kernels.base.workspace import NONE, Lifetime, WorkspaceRequirement, check_view, layout

FUSED, FUSED_MMA, FUSED_MMA_ASYNC, MATERIALIZED = "fused", "fused_mma", "fused_mma_async", "materialized"
CUDNN = "cudnn"
ROUTES = (CUDNN, FUSED_MMA_ASYNC, FUSED_MMA, FUSED, MATERIALIZED)
FUSED_HEAD_DIMS = (64, 128)                 # the fp32-FMA fused route
MMA_HEAD_DIMS = tuple(range(16, 129, 16))   # the tensor-core fused route: Q and O fragments in registers up to 128
ASYNC_HEAD_DIMS = (64, 96, 128)     # fused_mma_async: multiples of 32 (one ldmatrix.x4 of K covers two k16 steps)
ASYNC_DEFAULT = True                # choose_route takes fused_mma_async where it applies: 1.7x fused_mma on the H100
CAPTURE_SAFE = True   # no allocation, no host sync, fixed grid for fixed shapes (prefill itself runs eagerly)
NEG_INF = float32(-math.inf)
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- host side

def default_scale(D: int) -> float:
    """The attention scale when none is given: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(D)


def reference(q, k, v, *, start_pos=0, scale=None):
    """NumPy reference. Inputs are bf16 bit patterns (uint16); returns fp32 ``[T, Hq, D]``."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    n_keys = start_pos + T
    scale = default_scale(D) if scale is None else scale
    qf = bf16_to_f32(q).astype(np.float64).transpose(1, 0, 2)                        # [Hq, T, D]
    kf = np.repeat(bf16_to_f32(k[:n_keys]).astype(np.float64), Hq // Hkv, axis=1)   # [Sk, Hq, D]
    vf = np.repeat(bf16_to_f32(v[:n_keys]).astype(np.float64), Hq // Hkv, axis=1)
    s = (qf @ kf.transpose(1, 2, 0)) * scale                                          # [Hq, T, Sk]
    mask = np.arange(n_keys)[None, :] > (start_pos + np.arange(T))[:, None]          # [T, Sk]
    s[:, mask] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ vf.transpose(1, 0, 2)).transpose(1, 0, 2).astype(np.float32)


# cuDNN from this much work up (query-key pairs of one head: a 2,048-token prompt's), on prompts of 256 or more
# queries: measured ahead of ours at 2,048 and 8,192 tokens; at 16 tokens it took 44 us where SDPA took 19.
CUDNN_MIN_PAIRS = 2048 * 2049 // 2
CUDNN_MIN_QUERIES = 256


def cudnn_min_prompt() -> int:
    """The shortest prompt (from position 0) the cuDNN route takes."""
    return max(CUDNN_MIN_QUERIES, math.isqrt(2 * CUDNN_MIN_PAIRS))


def _prefer_cudnn() -> bool:
    # opt-in: checked on an H100 in kernels and in a model's walk (run 12-07 l), and faster for a length seen
    # before, but each new prompt length builds a graph (40-70 ms), which a server's varied prompts would pay
    return switch("VMMSTREAM_CUDNN", False)


PREFER_CUDNN = _prefer_cudnn()


_warned = []


def cudnn_usable() -> bool:
    """Whether ``choose_route`` may take the cuDNN route (given a session workspace and a long enough prompt).
    Asked for (``VMMSTREAM_CUDNN=1``) but not loadable: a warning, once, then our kernels."""
    if la.SIM or not PREFER_CUDNN:
        return False
    from vmmstream.kernels.attention import cudnn_sdpa
    ok = cudnn_sdpa.available()
    if not ok and not _warned:
        _warned.append(True)
        import warnings
        warnings.warn(f"VMMSTREAM_CUDNN=1 but cuDNN's SDPA cannot be loaded ({cudnn_sdpa.unavailable_reason()}); "
                      "prefill attention runs our kernel (pip install 'vmmstream[cudnn]')", stacklevel=2)
    return ok


def cudnn_takes(T, Hq, Hkv, D, start_pos=0) -> bool:
    """The shapes the cuDNN route is chosen for (where it is usable): enough work, D a multiple of 8 up to 256."""
    pairs = T * start_pos + T * (T + 1) // 2
    return T >= CUDNN_MIN_QUERIES and pairs >= CUDNN_MIN_PAIRS and D % 8 == 0 and D <= 256 and Hq % Hkv == 0


def cudnn_wanted() -> bool:
    """Asked for (``VMMSTREAM_CUDNN=1``) and installed, found without loading cuDNN (``cudnn_usable`` loads it)."""
    if la.SIM or not PREFER_CUDNN:
        return False
    from vmmstream.kernels.attention import cudnn_sdpa
    return cudnn_sdpa.installed()


def session_requirement(max_context, Hq, Hkv, D):
    """The session workspace the cuDNN route draws for a model of these shapes (``NONE`` where no prompt of up to
    ``max_context`` tokens would take it, or it is not wanted). Does not load cuDNN: a model's load starts it on a
    thread of its own (``cudnn_sdpa.prewarm``)."""
    if not (cudnn_takes(max_context, Hq, Hkv, D) and cudnn_wanted()):
        return NONE
    from vmmstream.kernels.attention import cudnn_sdpa
    return cudnn_sdpa.workspace_requirement()


def choose_route(T, Hq, Hkv, D, *, start_pos=0, session_workspace_bytes=0):
    """cuDNN for long prompts where it is usable and its session workspace is given (``session_workspace_bytes``),
    else the fused tensor-core route where it applies, else the materialized fallback."""
    if session_workspace_bytes and cudnn_takes(T, Hq, Hkv, D, start_pos) and cudnn_usable():
        from vmmstream.kernels.attention import cudnn_sdpa
        if session_workspace_bytes >= cudnn_sdpa.WORKSPACE:
            return CUDNN
    if ASYNC_DEFAULT and D in ASYNC_HEAD_DIMS and Hq % Hkv == 0:
        return FUSED_MMA_ASYNC
    if D in MMA_HEAD_DIMS and Hq % Hkv == 0:
        return FUSED_MMA
    return MATERIALIZED


def _layout(T, Hq, D, start_pos, route):
    if route in (CUDNN, FUSED, FUSED_MMA, FUSED_MMA_ASYNC):
        return layout()
    if route != MATERIALIZED:
        raise ValueError(f"unknown prefill route {route!r}; expected one of {ROUTES}")
    return layout(scores=Hq * T * (start_pos + T) * 4)      # fp32 [Hq, T, Sk]


def workspace_requirement(T, Hq, Hkv, D, *, start_pos=0, route=None):
    """What a launch at these shapes needs: ``NONE`` for the fused routes, step-lifetime scores for the materialized
    one, the cuDNN route's session buffer for ``route="cudnn"`` (``route=None`` describes the route taken without a
    session workspace; ``session_requirement`` gives the cuDNN route's)."""
    if route == CUDNN:
        from vmmstream.kernels.attention import cudnn_sdpa
        return cudnn_sdpa.workspace_requirement()
    route = route or choose_route(T, Hq, Hkv, D, start_pos=start_pos)
    total = _layout(T, Hq, D, start_pos, route).total
    return NONE if total == 0 else WorkspaceRequirement(total, Lifetime.STEP)


def flops(T, Hq, D, *, start_pos=0):
    """Causal attention FLOPs: 2 matmuls x 2 flops x D per (query, visible key) pair."""
    pairs = T * start_pos + T * (T + 1) // 2
    return 4 * D * Hq * pairs


def bytes_moved(T, Hq, Hkv, D, *, start_pos=0, route=None):
    """Compulsory HBM bytes: q, k and v up to start_pos + T, out (bf16); plus scores if materialized."""
    n = 2 * (2 * T * Hq * D + 2 * (start_pos + T) * Hkv * D)
    if (route or choose_route(T, Hq, Hkv, D, start_pos=start_pos)) == MATERIALIZED:
        n += 3 * Hq * T * (start_pos + T) * 4        # scores written, read twice (max/sum, then p @ v)
    return n


# ----------------------------------------------------------------------------- fused fp32-FMA route

@cuda.jit(device=True, inline="always")
def _tile_load(src, buf, k0, kvh, n_keys, NU, DG, NT):
    """buf <- this thread's NU 16-byte pieces of rows [k0, k0 + NU*NT/DG) of src[:, kvh, :] (zeros past
    n_keys). All loads are issued before any use: one memory round trip per tile, not one per piece."""
    tid = cuda.threadIdx.x
    for u in range(NU):
        c, dg = (tid + NT * u) // DG, (tid + NT * u) % DG
        if k0 + c < n_keys:
            w0, w1, w2, w3 = la.ld8(src, (k0 + c, kvh, 8 * dg))
        else:
            w0 = w1 = w2 = w3 = uint32(0)
        buf[4 * u], buf[4 * u + 1], buf[4 * u + 2], buf[4 * u + 3] = w0, w1, w2, w3


@cuda.jit(device=True, inline="always")
def _tile_store_f32(dst, buf, NU, DG, NT):
    """dst[row, 8*dg + e] = fp32 of the pieces ``_tile_load`` left in buf."""
    tid = cuda.threadIdx.x
    for u in range(NU):
        c, dg = (tid + NT * u) // DG, (tid + NT * u) % DG
        for x in range(4):
            dst[c, 8 * dg + 2 * x] = mh.bf16_lo(buf[4 * u + x])
            dst[c, 8 * dg + 2 * x + 1] = mh.bf16_hi(buf[4 * u + x])


_F_BM, _F_BN, _F_THREADS = 64, 32, 256   # query rows per block, keys per tile; threads as 16 x 16


def _make_fused(D):
    """Kernel for head dim D: thread (ty, tx) owns score rows 4ty..4ty+3 x keys {tx, tx+16} and output
    rows 4ty..4ty+3 x dims {tx + 16j}. Row softmax is done by 64 row-owner threads from shared memory, so
    no warp shuffles are needed and the simulator runs exactly this code."""
    BM, BN, NT = _F_BM, _F_BN, _F_THREADS
    DW, NJ, DG = D // 2, D // 16, D // 8
    KVW, PW = D + 1, BN + 1           # padded row lengths (+1 word: no bank conflicts down a column)
    QU, KU = BM * DG // NT, BN * DG // NT   # 16-byte loads per thread: Q tile, K (or V) tile
    KB4 = 4 * KU

    @mh.kernel((NT, 2))   # <= 128 registers: two blocks (16 warps) per SM
    def fused(q, k, v, out, start_pos, n_keys, scale, group):
        # q: [T, Hq, D], k/v: [S, Hkv, D], out: [T, Hq, D]; all bf16 (u16), rows 16-byte aligned
        qs = cuda.shared.array((BM, DW), uint32)         # Q tile, packed bf16 (halves shared use)
        kv = cuda.shared.array((BN, KVW), float32)       # K then V tile, fp32
        ps = cuda.shared.array((BM, PW), float32)    # scores, then probabilities
        alpha = cuda.shared.array(BM, float32)           # per-row rescale of this tile, then 1/l
        kb = cuda.local.array(KB4, uint32)               # a tile's 16-byte loads, in flight together
        T = q.shape[0]
        h = cuda.blockIdx.y
        kvh = h // group
        q0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BM   # longest causal rows first
        tid = cuda.threadIdx.x
        ty, tx = tid // 16, tid % 16
        for u in range(QU):
            r, dg = (tid + NT * u) // DG, (tid + NT * u) % DG
            if q0 + r < T:
                w0, w1, w2, w3 = la.ld8(q, (q0 + r, h, 8 * dg))
            else:
                w0 = w1 = w2 = w3 = uint32(0)
            qs[r, 4 * dg], qs[r, 4 * dg + 1], qs[r, 4 * dg + 2], qs[r, 4 * dg + 3] = w0, w1, w2, w3
        o = cuda.local.array((4, NJ), float32)
        for i in range(4):
            for j in range(NJ):
                o[i, j] = 0.0
        m_run = NEG_INF       # running max / sum, meaningful in row-owner threads (tid < BM)
        l_run = float32(0.0)
        last = min(start_pos + min(q0 + BM, T), n_keys)     # keys this block can see: [0, last)
        for k0 in range(0, last, BN):
            _tile_load(k, kb, k0, kvh, n_keys, KU, DG, NT)
            _tile_store_f32(kv, kb, KU, DG, NT)
            cuda.syncthreads()
            s = cuda.local.array((4, 2), float32)
            for i in range(4):
                for j in range(2):
                    s[i, j] = 0.0
            for w in range(DW):
                ka0, ka1 = kv[tx, 2 * w], kv[tx, 2 * w + 1]
                kb0, kb1 = kv[tx + 16, 2 * w], kv[tx + 16, 2 * w + 1]
                for i in range(4):
                    u = qs[4 * ty + i, w]
                    qa, qb = mh.bf16_lo(u), mh.bf16_hi(u)
                    s[i, 0] += qa * ka0 + qb * ka1
                    s[i, 1] += qa * kb0 + qb * kb1
            for i in range(4):
                qpos = start_pos + q0 + 4 * ty + i
                for j in range(2):
                    kpos = k0 + tx + 16 * j
                    ps[4 * ty + i, tx + 16 * j] = s[i, j] * scale if kpos <= qpos and kpos < n_keys else NEG_INF
            cuda.syncthreads()
            _tile_load(v, kb, k0, kvh, n_keys, KU, DG, NT)   # V into the K buffer (K reads are done)
            _tile_store_f32(kv, kb, KU, DG, NT)
            if tid < BM:      # online softmax of row tid; key 0 is visible to every row, so m is finite
                m_new = m_run
                for c in range(BN):
                    m_new = max(m_new, ps[tid, c])
                a = math.exp(m_run - m_new)
                lsum = float32(0.0)
                for c in range(BN):
                    p = math.exp(ps[tid, c] - m_new)
                    ps[tid, c] = p
                    lsum += p
                l_run = l_run * a + lsum
                m_run = m_new
                alpha[tid] = a
            cuda.syncthreads()
            for i in range(4):
                a = alpha[4 * ty + i]
                for j in range(NJ):
                    o[i, j] *= a
            for c in range(BN):
                for j in range(NJ):
                    vv = kv[c, tx + 16 * j]
                    for i in range(4):
                        o[i, j] += ps[4 * ty + i, c] * vv
            cuda.syncthreads()
        if tid < BM:
            alpha[tid] = float32(1.0) / l_run
        cuda.syncthreads()
        for i in range(4):
            r = q0 + 4 * ty + i
            if r < T:
                inv = alpha[4 * ty + i]
                for j in range(NJ):
                    out[r, h, tx + 16 * j] = dev_f32_to_bf16(o[i, j] * inv)

    return fused


# ----------------------------------------------------------------------------- fused mma.sync route

@cuda.jit(device=True, inline="always")
def _vt_store(vt, d, kp, wa, wb):
    """Transpose one word pair: wa = dims (d, d+1) of key 2kp, wb = the same dims of key 2kp+1."""
    vt[d, kp] = (wa & uint32(0xFFFF)) | (wb << uint32(16))
    vt[d + 1, kp] = (wa >> uint32(16)) | (wb & uint32(0xFFFF0000))


_M_BM, _M_BN = 16 * mh.WARPS, 64   # each warp owns 16 query rows; 64-key tiles


def _mma_parts(D, BN):
    """The register-side pieces both tensor-core routes share, for head dim D and BN-key tiles: the Q fragments,
    the online-softmax update of a tile's scores, and the normalised output."""
    KQK, NS, NO = D // 16, BN // 8, D // 8

    @cuda.jit(device=True, inline="always")
    def load_q(q32, qf, r0, h, T, t):
        """A fragments of Q (rows r0 and r0 + 8 of this lane) for every k16 step."""
        for kk in range(KQK):
            for i in range(4):
                r = r0 + 8 * (i & 1)
                qf[4 * kk + i] = q32[r, h, kk * 8 + 4 * (i >> 1) + t] if r < T else uint32(0)

    @cuda.jit(device=True, inline="always")
    def softmax_update(s, o, m0, m1, l0, l1, rscr):
        """Scores (log2 units) -> p = 2^(s - m) in place, the running max / sum updated and O rescaled."""
        mx0, mx1 = m0, m1
        for nt in range(NS):
            mx0 = max(mx0, max(s[4 * nt], s[4 * nt + 1]))
            mx1 = max(mx1, max(s[4 * nt + 2], s[4 * nt + 3]))
        mx0 = mh.quad_max(mx0, rscr)          # key 0 is visible to every row: finite after tile 0
        mx1 = mh.quad_max(mx1, rscr)
        a0, a1 = math.exp2(m0 - mx0), math.exp2(m1 - mx1)
        m0, m1 = mx0, mx1
        l0 *= a0
        l1 *= a1
        for nt in range(NS):                  # scores are in log2 units: p = 2^(s - m)
            s[4 * nt] = math.exp2(s[4 * nt] - m0)
            s[4 * nt + 1] = math.exp2(s[4 * nt + 1] - m0)
            s[4 * nt + 2] = math.exp2(s[4 * nt + 2] - m1)
            s[4 * nt + 3] = math.exp2(s[4 * nt + 3] - m1)
            l0 += s[4 * nt] + s[4 * nt + 1]
            l1 += s[4 * nt + 2] + s[4 * nt + 3]
        for nt in range(NO):
            o[4 * nt] *= a0
            o[4 * nt + 1] *= a0
            o[4 * nt + 2] *= a1
            o[4 * nt + 3] *= a1
        return m0, m1, l0, l1

    @cuda.jit(device=True, inline="always")
    def store_out(out32, o, l0, l1, r0, h, T, t, rscr):
        """O / l (l summed over the lane quad) of rows r0 and r0 + 8, as packed bf16."""
        inv0 = float32(1.0) / mh.quad_sum(l0, rscr)
        inv1 = float32(1.0) / mh.quad_sum(l1, rscr)
        r1 = r0 + 8
        for nt in range(NO):
            if r0 < T:
                out32[r0, h, nt * 4 + t] = mh.pack_bf16x2(o[4 * nt] * inv0, o[4 * nt + 1] * inv0)
            if r1 < T:
                out32[r1, h, nt * 4 + t] = mh.pack_bf16x2(o[4 * nt + 2] * inv1, o[4 * nt + 3] * inv1)

    return load_q, softmax_update, store_out


def _make_mma(D):
    """FlashAttention-2 style: Q fragments and the O accumulator stay in registers for the whole key loop;
    the S accumulator is turned into the A operand of P @ V in place (its C layout matches A's)."""
    BM, BN, NT = _M_BM, _M_BN, mh.THREADS
    DW = D // 2
    KQK, NS = D // 16, BN // 8      # k-steps of Q K^T, n8-tiles of S
    KPV, NO = BN // 16, D // 8      # k-steps of P V, n8-tiles of O
    KPAD, VPAD = DW + 4, BN // 2 + 4   # row strides in words: fragment reads hit 32 distinct banks
    QF, OF, SF = 4 * KQK, 4 * NO, 4 * NS   # fragment registers per thread: Q, O, S
    DG = D // 8
    KN, VN = BN * DG, BN // 2 * DG   # 16-byte loads of a K tile, of a V tile (x2: key pairs)
    KU, VU = -(-KN // NT), -(-VN // NT)   # per thread; the last round partial where NT does not divide them
    KREM, VREM = KN % NT != 0, VN % NT != 0   # (head_dim 80: 5 K rounds, 2.5 V rounds)
    MS0, MS1 = mh.SIM_MMA_SCRATCH      # simulator-only scratch (1 x 1 on the GPU)
    RS = mh.SIM_RED_SCRATCH
    load_q, softmax_update, store_out = _mma_parts(D, BN)

    @mh.kernel(NT)
    def fused_mma(q32, k, v, out32, start_pos, n_keys, scale_log2, group):
        # q32: [T, Hq, D/2] u32, out32: [T, Hq, D/2] u32 (bf16 pairs); k/v: [S, Hkv, D] u16, rows 16-byte aligned
        ks = cuda.shared.array((BN, KPAD), uint32)      # K tile: [key][d pair]
        vt = cuda.shared.array((D, VPAD), uint32)       # V tile transposed: [d][key pair]
        mscr = cuda.shared.array((MS0, MS1), float64)
        rscr = cuda.shared.array(RS, float32)
        T = q32.shape[0]
        h = cuda.blockIdx.y
        kvh = h // group
        q0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BM
        tid = cuda.threadIdx.x
        g, t = (tid % 32) >> 2, tid & 3
        r0 = q0 + (tid // 32) * 16 + g            # this thread's two query rows: r0 and r0 + 8
        r1 = r0 + 8
        qf = cuda.local.array(QF, uint32)
        load_q(q32, qf, r0, h, T, t)
        o = cuda.local.array(OF, float32)
        for i in range(OF):
            o[i] = 0.0
        s = cuda.local.array(SF, float32)
        m0, m1 = NEG_INF, NEG_INF
        l0, l1 = float32(0.0), float32(0.0)      # partial over this thread's columns; quad-summed at the end
        qpos0, qpos1 = start_pos + r0, start_pos + r1
        last = min(start_pos + min(q0 + BM, T), n_keys)
        for k0 in range(0, last, BN):
            cuda.syncthreads()                    # the previous tile's fragment reads are done
            for u in range(KU):
                if KREM and tid + NT * u >= KN:
                    break
                c, dg = (tid + NT * u) // DG, (tid + NT * u) % DG
                if k0 + c < n_keys:
                    w0, w1, w2, w3 = la.ld8(k, (k0 + c, kvh, 8 * dg))
                else:
                    w0 = w1 = w2 = w3 = uint32(0)
                ks[c, 4 * dg], ks[c, 4 * dg + 1], ks[c, 4 * dg + 2], ks[c, 4 * dg + 3] = w0, w1, w2, w3
            for u in range(VU):
                if VREM and tid + NT * u >= VN:
                    break
                # lanes take consecutive key pairs: the transposed stores hit 32 distinct banks
                kp, dg = (tid + NT * u) % (BN // 2), (tid + NT * u) // (BN // 2)
                c = k0 + 2 * kp
                if c < n_keys:
                    a0, a1, a2, a3 = la.ld8(v, (c, kvh, 8 * dg))
                else:
                    a0 = a1 = a2 = a3 = uint32(0)
                if c + 1 < n_keys:
                    b0, b1, b2, b3 = la.ld8(v, (c + 1, kvh, 8 * dg))
                else:
                    b0 = b1 = b2 = b3 = uint32(0)
                _vt_store(vt, 8 * dg, kp, a0, b0)     # word x of keys c, c+1 -> dims 8dg+2x, 8dg+2x+1
                _vt_store(vt, 8 * dg + 2, kp, a1, b1)
                _vt_store(vt, 8 * dg + 4, kp, a2, b2)
                _vt_store(vt, 8 * dg + 6, kp, a3, b3)
            cuda.syncthreads()
            for nt in range(NS):                  # S = Q K^T
                c0 = c1 = c2 = c3 = float32(0.0)
                for kk in range(KQK):
                    c0, c1, c2, c3 = mh.mma_bf16_16816(
                        qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3],
                        ks[nt * 8 + g, kk * 8 + t], ks[nt * 8 + g, kk * 8 + 4 + t],
                        c0, c1, c2, c3, mscr)
                kpos = k0 + nt * 8 + 2 * t
                s[4 * nt] = c0 * scale_log2 if kpos <= qpos0 and kpos < n_keys else NEG_INF
                s[4 * nt + 1] = c1 * scale_log2 if kpos + 1 <= qpos0 and kpos + 1 < n_keys else NEG_INF
                s[4 * nt + 2] = c2 * scale_log2 if kpos <= qpos1 and kpos < n_keys else NEG_INF
                s[4 * nt + 3] = c3 * scale_log2 if kpos + 1 <= qpos1 and kpos + 1 < n_keys else NEG_INF
            m0, m1, l0, l1 = softmax_update(s, o, m0, m1, l0, l1, rscr)
            for kk in range(KPV):                 # O += P V, P from S's registers (C layout == A layout)
                pa0 = mh.pack_bf16x2(s[8 * kk], s[8 * kk + 1])
                pa1 = mh.pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
                pa2 = mh.pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
                pa3 = mh.pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
                for nt in range(NO):
                    o[4 * nt], o[4 * nt + 1], o[4 * nt + 2], o[4 * nt + 3] = mh.mma_bf16_16816(
                        pa0, pa1, pa2, pa3,
                        vt[nt * 8 + g, kk * 8 + t], vt[nt * 8 + g, kk * 8 + 4 + t],
                        o[4 * nt], o[4 * nt + 1], o[4 * nt + 2], o[4 * nt + 3], mscr)
        store_out(out32, o, l0, l1, r0, h, T, t, rscr)

    return fused_mma


# ----------------------------------------------------------------------------- fused mma.sync, cp.async + ldmatrix

_wait_all = la.cp_async_waiter(0)
_wait_one = la.cp_async_waiter(1)
# The async route's block shape per head dim: (keys per tile BN, warps per block, Q fragments from shared memory,
# register cap or None).
# Each warp owns 16 query rows, so a block covers 16 * warps rows. With Q in shared memory (read by ldmatrix
# for every tile) a thread holds no Q registers: at D = 128 that is what keeps it under 255 without spilling.
ASYNC_SHAPE = {64: (64, 4, False, None), 96: (64, 4, False, None), 128: (64, 4, False, None)}


def async_rows(D):
    """Query rows per block of the async route at head dim D."""
    return 16 * ASYNC_SHAPE[D][1]


def _make_mma_async(D, BN=64, WARPS=4, QS=False, MAXREG=None, DB=False):
    """The ``fused_mma`` algorithm with the memory path of FlashAttention-2: K and V tiles reach shared memory by
    ``cp.async`` (V of tile j copied while Q·Kᵀ of tile j runs, K of tile j+1 while P·V of tile j runs), both stored
    as they are in the cache (no transpose), fragments read with ``ldmatrix`` (x4: K as the "col" B operand of
    Q·Kᵀ; x4.trans: V as the B operand of P·V), and the causal mask applied only on tiles that cross a warp's
    diagonal or the last key. ``QS``: the Q tile too is copied to shared memory once and its A fragments read by
    ``ldmatrix`` x4 at every k16 step, instead of living in registers. ``MAXREG``: a register cap per thread
    (more blocks per SM, at the cost of the compiler's lookahead). ``DB``: K and V double-buffered, tile j + 1's
    copies issued before tile j's work, so a whole tile's work hides them (instead of V behind Q·Kᵀ and K
    behind P·V)."""
    NT = 32 * WARPS
    BM = 16 * WARPS
    DW = D // 2
    KP = DW + 4                    # row stride in words: the 8 rows of an ldmatrix hit 32 distinct banks
    TW = BN * KP                   # words per K / V tile
    NB = 2 if DB else 1            # K / V buffers
    KVW = NB * TW                  # words of the K (and of the V) buffers
    QW = BM * KP if QS else 1      # words of the Q tile
    DG = D // 8                    # 16-byte pieces per row
    CU = (BN * DG + NT - 1) // NT  # pieces per thread per K / V tile
    QU = (BM * DG + NT - 1) // NT  # pieces per thread of the Q tile
    KQK, NS, KPV, NO = D // 16, BN // 8, BN // 16, D // 8
    QF, OF, SF = (1 if QS else 4 * KQK), 4 * NO, 4 * NS
    SIM = la.SIM
    MS0, MS1 = (NT, 14) if SIM else (1, 1)
    RS, LS = (NT, NT) if SIM else (1, 1)
    if 4 * (2 * NB * TW + QW) > 48 * 1024 - 1024:
        raise ValueError(f"fused_mma_async D={D} BN={BN} warps={WARPS} QS={QS} DB={DB}: {4 * (2 * NB * TW + QW)} bytes of "
                         "shared memory, more than a block's static 48 KiB")
    load_q, softmax_update, store_out = _mma_parts(D, BN)
    ZERO = uint32(0)
    A16 = la.SHARED_ALIGN16

    def row_copier(NR, NU, EPP):
        """A device function issuing the copies of rows [r0, r0 + NR) of src[:, head, :] (16-byte pieces of EPP
        elements, NU per thread) into buf, zeros for rows at or past ``limit``."""
        @cuda.jit(device=True, inline="always")
        def copy(buf, src, r0, head, limit, tid, base):
            for u in range(NU):
                c = tid + NT * u
                if NU * NT == NR * DG or c < NR * DG:
                    r, dg = c // DG, c % DG
                    if r0 + r < limit:
                        la.cp_async16(buf, base + r * KP + 4 * dg, src, (r0 + r, head, EPP * dg))
                    else:
                        la.st4w(buf, base + r * KP + 4 * dg, ZERO, ZERO, ZERO, ZERO)
        return copy

    copy_tile = row_copier(BN, CU, 8)      # K / V: uint16 elements
    copy_q = row_copier(BM, QU, 4)         # Q: uint32 words (bf16 pairs)

    @mh.kernel(NT, max_registers=MAXREG)
    def fused_mma_async(q32, k, v, out32, start_pos, n_keys, scale_log2, group):
        # q32: [T, Hq, D/2] u32, out32: [T, Hq, D/2] u32 (bf16 pairs); k/v: [S, Hkv, D] u16, rows 16-byte aligned
        ks = cuda.shared.array(KVW, uint32, alignment=A16)    # K tile(s): [key][d pair]
        vs = cuda.shared.array(KVW, uint32, alignment=A16)    # V tile(s): [key][d pair]
        qsm = cuda.shared.array(QW, uint32, alignment=A16)    # Q tile (QS): [row][d pair]
        mscr = cuda.shared.array((MS0, MS1), float64)
        rscr = cuda.shared.array(RS, float32)
        lscr = cuda.shared.array(LS, int64)
        T = q32.shape[0]
        h = cuda.blockIdx.y
        kvh = h // group
        q0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BM
        tid = cuda.threadIdx.x
        lane = tid % 32
        g, t = lane >> 2, lane & 3
        last = min(start_pos + min(q0 + BM, T), n_keys)
        if QS:
            copy_q(qsm, q32, q0, h, T, tid, 0)
        copy_tile(ks, k, 0, kvh, n_keys, tid, 0)      # the first K tile (and Q) land while Q is read
        if DB:
            copy_tile(vs, v, 0, kvh, n_keys, tid, 0)
        la.cp_async_commit()
        w0 = q0 + (tid // 32) * 16                    # this warp's first query row
        r0 = w0 + g                                   # this thread's two query rows: r0 and r0 + 8
        r1 = r0 + 8
        qf = cuda.local.array(QF, uint32)
        if not QS:
            load_q(q32, qf, r0, h, T, t)
        o = cuda.local.array(OF, float32)
        for i in range(OF):
            o[i] = 0.0
        s = cuda.local.array(SF, float32)
        m0, m1 = NEG_INF, NEG_INF
        l0, l1 = float32(0.0), float32(0.0)
        qpos0, qpos1 = start_pos + r0, start_pos + r1
        mi, ri = lane >> 3, lane & 7                  # this lane's ldmatrix row: row ri of matrix mi
        k_lane = ri * KP + 4 * mi                     # K: matrices = d columns 0-7, 8-15, 16-23, 24-31
        v_lane = ((mi & 1) * 8 + ri) * KP + 4 * (mi >> 1)   # V: keys 0-7 / 8-15 x dims 0-7 / 8-15
        q_lane = (tid // 32) * 16 * KP + v_lane      # Q (QS): rows 0-7 / 8-15 x k 0-7 / 8-15 of the warp's rows
        clear = min(start_pos + w0 + 1, n_keys)       # keys [0, clear) are visible to every row of this warp
        for k0 in range(0, last, BN):
            cur = ((k0 // BN) & 1) * TW if DB else 0  # this tile's buffer
            if DB:
                cuda.syncthreads()                    # every warp is done with the other buffers (tile j - 1)
                if k0 + BN < last:                    # tile j + 1's K and V, in flight during all of tile j
                    copy_tile(ks, k, k0 + BN, kvh, n_keys, tid, TW - cur)
                    copy_tile(vs, v, k0 + BN, kvh, n_keys, tid, TW - cur)
                    la.cp_async_commit()
                    _wait_one()
                else:
                    _wait_all()
                cuda.syncthreads()                    # tile j's K and V have landed
            else:
                _wait_all()
                cuda.syncthreads()                    # K(k0) has landed; every warp is done reading V
                copy_tile(vs, v, k0, kvh, n_keys, tid, 0)
                la.cp_async_commit()
            for nt in range(NS):                      # S = Q K^T
                s[4 * nt] = s[4 * nt + 1] = s[4 * nt + 2] = s[4 * nt + 3] = float32(0.0)
            for j in range(KQK // 2):
                if QS:
                    a0, a1, a2, a3 = mh.ldmatrix_x4(qsm, q_lane + 16 * j, lscr)
                    a4, a5, a6, a7 = mh.ldmatrix_x4(qsm, q_lane + 16 * j + 8, lscr)
                else:
                    a0, a1, a2, a3 = qf[8 * j], qf[8 * j + 1], qf[8 * j + 2], qf[8 * j + 3]
                    a4, a5, a6, a7 = qf[8 * j + 4], qf[8 * j + 5], qf[8 * j + 6], qf[8 * j + 7]
                for nt in range(NS):
                    b0, b1, b2, b3 = mh.ldmatrix_x4(ks, cur + k_lane + nt * 8 * KP + 16 * j, lscr)
                    c0, c1, c2, c3 = mh.mma_bf16_16816(
                        a0, a1, a2, a3, b0, b1, s[4 * nt], s[4 * nt + 1], s[4 * nt + 2], s[4 * nt + 3], mscr)
                    s[4 * nt], s[4 * nt + 1], s[4 * nt + 2], s[4 * nt + 3] = mh.mma_bf16_16816(
                        a4, a5, a6, a7, b2, b3, c0, c1, c2, c3, mscr)
            for i in range(SF):
                s[i] *= scale_log2
            if k0 + BN > clear:                       # this tile crosses the warp's diagonal or the last key
                for nt in range(NS):
                    kpos = k0 + nt * 8 + 2 * t
                    if kpos > qpos0 or kpos >= n_keys:
                        s[4 * nt] = NEG_INF
                    if kpos + 1 > qpos0 or kpos + 1 >= n_keys:
                        s[4 * nt + 1] = NEG_INF
                    if kpos > qpos1 or kpos >= n_keys:
                        s[4 * nt + 2] = NEG_INF
                    if kpos + 1 > qpos1 or kpos + 1 >= n_keys:
                        s[4 * nt + 3] = NEG_INF
            m0, m1, l0, l1 = softmax_update(s, o, m0, m1, l0, l1, rscr)
            if not DB:
                _wait_all()
                cuda.syncthreads()                    # V(k0) has landed; every warp is done reading K
                if k0 + BN < last:
                    copy_tile(ks, k, k0 + BN, kvh, n_keys, tid, 0)
                    la.cp_async_commit()
            for kk in range(KPV):                     # O += P V
                pa0 = mh.pack_bf16x2(s[8 * kk], s[8 * kk + 1])
                pa1 = mh.pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
                pa2 = mh.pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
                pa3 = mh.pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
                for p in range(NO // 2):
                    b0, b1, b2, b3 = mh.ldmatrix_x4_trans(vs, cur + v_lane + kk * 16 * KP + 8 * p, lscr)
                    o[8 * p], o[8 * p + 1], o[8 * p + 2], o[8 * p + 3] = mh.mma_bf16_16816(
                        pa0, pa1, pa2, pa3, b0, b1, o[8 * p], o[8 * p + 1], o[8 * p + 2], o[8 * p + 3], mscr)
                    o[8 * p + 4], o[8 * p + 5], o[8 * p + 6], o[8 * p + 7] = mh.mma_bf16_16816(
                        pa0, pa1, pa2, pa3, b2, b3, o[8 * p + 4], o[8 * p + 5], o[8 * p + 6], o[8 * p + 7], mscr)
        store_out(out32, o, l0, l1, r0, h, T, t, rscr)

    return fused_mma_async


# ----------------------------------------------------------------------------- materialized route

_S_TILE, _S_PAD, _R_THREADS = 16, 17, 64


@mh.kernel(_S_TILE * _S_TILE)
def _scores(q, k, scores, start_pos, scale, group):
    # q: [T, Hq, D] u16, k: [S, Hkv, D] u16, scores: [Hq, T, Sk] f32 (masked entries = -inf)
    qt = cuda.shared.array((_S_TILE, _S_PAD), float32)
    kt = cuda.shared.array((_S_TILE, _S_PAD), float32)
    T, D = q.shape[0], q.shape[2]
    Sk = scores.shape[2]
    h = cuda.blockIdx.z
    kvh = h // group
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    i = cuda.blockIdx.y * _S_TILE + ty           # query row
    j = cuda.blockIdx.x * _S_TILE + tx           # key
    jl = cuda.blockIdx.x * _S_TILE + ty          # key this thread loads
    acc = float32(0.0)
    for d0 in range(0, D, _S_TILE):
        d = d0 + tx
        qt[ty, tx] = dev_bf16_to_f32(q[i, h, d]) if i < T and d < D else float32(0.0)
        kt[ty, tx] = dev_bf16_to_f32(k[jl, kvh, d]) if jl < Sk and d < D else float32(0.0)
        cuda.syncthreads()
        for e in range(_S_TILE):
            acc += qt[ty, e] * kt[tx, e]
        cuda.syncthreads()
    if i < T and j < Sk:
        scores[h, i, j] = acc * scale if j <= start_pos + i else NEG_INF


@mh.kernel(_R_THREADS)
def _softmax_pv(scores, v, out, start_pos, group):
    # scores: [Hq, T, Sk] f32 (overwritten with probabilities), v: [S, Hkv, D] u16, out: [T, Hq, D] u16
    red = cuda.shared.array(_R_THREADS, float32)
    i, h = cuda.blockIdx.x, cuda.blockIdx.y
    kvh = h // group
    tid = cuda.threadIdx.x
    n = start_pos + i + 1            # visible keys of row i
    m = NEG_INF
    for j in range(tid, n, _R_THREADS):
        m = max(m, scores[h, i, j])
    m = mh.block_reduce(red, m, True)
    lsum = float32(0.0)
    for j in range(tid, n, _R_THREADS):
        p = math.exp(scores[h, i, j] - m)
        scores[h, i, j] = p
        lsum += p
    inv = float32(1.0) / mh.block_reduce(red, lsum, False)   # its syncthreads also publish the p writes
    for d in range(tid, out.shape[2], _R_THREADS):
        acc = float32(0.0)
        for j in range(n):
            acc += scores[h, i, j] * dev_bf16_to_f32(v[j, kvh, d])
        out[i, h, d] = dev_f32_to_bf16(acc * inv)


# ----------------------------------------------------------------------------- launch

_KERNELS = {}


def _kernel(route, D):
    key = (route, D, ASYNC_SHAPE[D]) if route == FUSED_MMA_ASYNC else (route, D)
    if key not in _KERNELS:
        if route == FUSED_MMA_ASYNC:
            _KERNELS[key] = _make_mma_async(D, *key[2])
        else:
            _KERNELS[key] = {FUSED: _make_fused, FUSED_MMA: _make_mma}[route](D)
    return _KERNELS[key]


def launch(q, k, v, out, workspace, *, start_pos=0, scale=None, route=None, stream, session_workspace=None,
           spare_rows=0, spare_keys=0):
    """out[T, Hq, D] = causal GQA attention of q[T, Hq, D] over k/v[:start_pos + T] (all bf16 uint16
    device arrays). ``workspace``: 1-D uint8 device view sized by ``workspace_requirement`` (None for the
    fused routes). ``session_workspace``: a session-lifetime uint8 view (the same address in every capture) that
    lets ``choose_route`` take cuDNN; with ``route="cudnn"`` it is that route's workspace. Never allocates; a
    short view raises ``WorkspaceShortfall``. Returns the route that ran (a refused cuDNN shape: ours).
    ``spare_rows`` / ``spare_keys``: rows of q and out past T, and committed cache rows past start_pos + T, that
    the cuDNN route's length buckets may touch (``cudnn_sdpa.launch``)."""
    T, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    n_keys = start_pos + T
    if Hq % Hkv or k.shape[2] != D or v.shape != k.shape or out.shape != q.shape or S < n_keys:
        raise ValueError(f"prefill shapes q{q.shape} k{k.shape} v{v.shape} out{out.shape} start_pos={start_pos}")
    scale = default_scale(D) if scale is None else float(scale)
    asked = route
    sw = 0 if session_workspace is None else session_workspace.shape[0] * session_workspace.dtype.itemsize
    route = route or choose_route(T, Hq, Hkv, D, start_pos=start_pos, session_workspace_bytes=sw)
    if route == CUDNN:
        from vmmstream.kernels.attention import cudnn_sdpa
        if T == 0:                  # nothing to attend (our routes, too, check their views and launch nothing)
            return CUDNN
        try:
            cudnn_sdpa.launch(q, k, v, out, session_workspace, start_pos=start_pos, scale=scale, stream=stream,
                              spare_rows=spare_rows, spare_keys=spare_keys)
            return CUDNN
        except cudnn_sdpa.Unsupported:
            if asked == CUDNN:
                raise
        route = choose_route(T, Hq, Hkv, D, start_pos=start_pos)      # this shape: our kernels
    dims = {FUSED: FUSED_HEAD_DIMS, FUSED_MMA: MMA_HEAD_DIMS, FUSED_MMA_ASYNC: ASYNC_HEAD_DIMS}.get(route, ())
    if route != MATERIALIZED and D not in dims:
        raise ValueError(f"route {route!r} takes head_dim in {dims}, got {D}; use {MATERIALIZED!r}")
    lay = _layout(T, Hq, D, start_pos, route)
    check_view(f"attention_prefill[{route}]", 0 if workspace is None else workspace.nbytes, lay.total)
    group = Hq // Hkv
    stream = la.as_stream(stream)
    if T == 0:
        return route
    if route == MATERIALIZED:
        off = lay.offsets["scores"]
        scores = workspace[off:off + lay.sizes["scores"]].view(np.float32).reshape(Hq, T, n_keys)
        grid = ((n_keys + _S_TILE - 1) // _S_TILE, (T + _S_TILE - 1) // _S_TILE, Hq)
        _scores[grid, (_S_TILE, _S_TILE), stream](q, k, scores, start_pos, float32(scale), group)
        _softmax_pv[(T, Hq), _R_THREADS, stream](scores, v, out, start_pos, group)
        return route
    if not la.vec8_ok(q, k, v, out):
        raise ValueError(f"route {route!r} needs contiguous, 16-byte aligned q, k, v and out rows")
    if route == FUSED:
        grid = ((T + _F_BM - 1) // _F_BM, Hq)
        _kernel(FUSED, D)[grid, _F_THREADS, stream](q, k, v, out, start_pos, n_keys, float32(scale), group)
    else:
        bm = async_rows(D) if route == FUSED_MMA_ASYNC else _M_BM
        grid = ((T + bm - 1) // bm, Hq)
        _kernel(route, D)[grid, bm * 2, stream](
            q.view(np.uint32), k, v, out.view(np.uint32), start_pos, n_keys, float32(scale * LOG2E), group)
    return route


# ----------------------------------------------------------------------------- compile check

_U16_3D = "uint16[:, :, ::1]"
_U32_3D = "uint32[:, :, ::1]"
_FUSED_SIG = f"void({_U16_3D}, {_U16_3D}, {_U16_3D}, {_U16_3D}, int64, int64, float32, int64)"
_MMA_SIG = f"void({_U32_3D}, {_U16_3D}, {_U16_3D}, {_U32_3D}, int64, int64, float32, int64)"
SIGNATURES = (
    [(_make_fused(d).py_func, _FUSED_SIG) for d in FUSED_HEAD_DIMS]
    + [(_make_mma(d).py_func, _MMA_SIG) for d in (64, 128, 96)]
    + [(_make_mma_async(d, *ASYNC_SHAPE[d]).py_func, _MMA_SIG) for d in ASYNC_HEAD_DIMS]
    + [(_scores.py_func, f"void({_U16_3D}, {_U16_3D}, float32[:, :, ::1], int64, float32, int64)"),
       (_softmax_pv.py_func, f"void(float32[:, :, ::1], {_U16_3D}, {_U16_3D}, int64, int64)")]
)
