"""Grouped-query decode attention (one query token per sequence) over a bf16 KV cache, split over the sequence.

    q:        [B, Hq, D]             bf16 (uint16)
    k, v:     [B, S_max, Hkv, D]     the layers' sequence-major caches ([S_max, Hkv, D] when B == 1)
    seq_len:  [B] int32 on the device: how many cache positions each sequence attends to
    out:      [B, Hq, D]             bf16

The length is read on the device, so one captured graph serves every length up to S_max. The grid is a
fixed function of S_max (the capture-time bound), never of the runtime length:

pass 1 (``_split``): block (split, kv head, b) covers positions [split*chunk, (split+1)*chunk). Blocks at
  or past the length return at once. The others load each K/V row once for all Hq/Hkv query heads of
  the group (16-byte loads through the read-only path), and write the chunk's max, sum of exp and
  unnormalised output per query head into the session-lifetime workspace.
pass 2 (``_combine``): block (query head, b) rescales and sums the partials of the splits below the
  length and writes bf16.

Head dims 64 and 128; Hq / Hkv <= 8.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from . import launch as la
from . import mma_helpers as mh
from .dtypes import bf16_to_f32, dev_f32_to_bf16
from .workspace import Lifetime, WorkspaceRequirement, layout

HEAD_DIMS = (64, 128)
MAX_GROUP = 8
CAPTURE_SAFE = True      # device arrays only, length read on the device, grid fixed by S_max
THREADS = 128            # pass 1
KB = 64                  # keys per pass-1 sub-tile
CHUNKS = (512, 256, 128, 64)
TARGET_BLOCKS = 4 * 132  # ~4 pass-1 blocks per SM of an H200 (132 SMs); a constant so the plan is portable
UNROLL = 4               # V rows in flight per thread in the P.V phase
C_THREADS = 256          # pass 2: 8 split lanes x 32 dim lanes
C_SPLIT_LANES = 8
NEG_INF = float32(-math.inf)


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
    """(chunk, n_splits): the largest chunk that still gives ~TARGET_BLOCKS pass-1 blocks at full length.
    A function of the capture-time bound S_max only, so every length reuses one grid and workspace."""
    cap = 2048 // group                          # the chunk's scores live in shared memory
    chunks = [c for c in CHUNKS if c <= cap]
    for c in chunks:
        ns = -(-S_max // c)
        if B * Hkv * ns >= TARGET_BLOCKS:
            return c, ns
    return chunks[-1], -(-S_max // chunks[-1])


def _layout(B, Hq, Hkv, D, S_max):
    _, ns = plan(B, Hkv, S_max, Hq // Hkv)
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


# ----------------------------------------------------------------------------- pass 1

@cuda.jit(device=True, inline="always")
def _unpack8(dst, i, w0, w1, w2, w3, mul):
    """dst[i:i+8] = mul * the 8 bf16 of four packed words (explicit, so indices stay compile-time)."""
    dst[i], dst[i + 1] = mh.bf16_lo(w0) * mul, mh.bf16_hi(w0) * mul
    dst[i + 2], dst[i + 3] = mh.bf16_lo(w1) * mul, mh.bf16_hi(w1) * mul
    dst[i + 4], dst[i + 5] = mh.bf16_lo(w2) * mul, mh.bf16_hi(w2) * mul
    dst[i + 6], dst[i + 7] = mh.bf16_lo(w3) * mul, mh.bf16_hi(w3) * mul


def _make_split(G, D):
    # Score phase: NDS lanes share one K row, 16 dims each (two 16-byte loads); NKL rows in parallel,
    # KPT rows per thread per sub-tile. The lanes' partial dots meet in shared memory (no shuffles).
    NDS = D // 16
    NKL = THREADS // NDS
    KPT = KB // NKL
    PW = NDS + 1                       # padded partial row: conflict-free column sums
    # P.V phase: NDV lanes share one V row, 8 dims each (one 16-byte load); NKV rows in parallel.
    NDV = D // 8
    NKV = THREADS // NDV
    MAXC = 2048 // G
    SCR = max(G * KB * PW, NKV * G * D)
    QR, KW, ACC, VW = 16 * G, 8 * KPT, 8 * G, 4 * UNROLL
    U = UNROLL

    @mh.kernel(THREADS)
    def split(q, k, v, seq_len, part_m, part_l, part_o, chunk, scale):
        # q: [B, Hq, D] u16; k, v: [B, S_max, Hkv, D] u16; seq_len: [B] i32
        # part_m, part_l: [B, Hq, NS] f32; part_o: [B, Hq, NS, D] f32
        scr = cuda.shared.array(SCR, float32)      # partial dots, later the per-lane outputs
        ss = cuda.shared.array((G, MAXC), float32)  # scores, then exp(score - chunk max)
        red = cuda.shared.array((G, 32), float32)
        stat = cuda.shared.array(G, float32)
        sp, kvh, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        c0 = sp * chunk
        n_all = min(seq_len[b], k.shape[1])
        if c0 >= n_all:
            return                                 # uniform over the block: before any barrier
        n = min(chunk, n_all - c0)
        tid = cuda.threadIdx.x
        h0 = kvh * G

        # ---- scores: ss[h, key] = scale * q_h . k_key
        ds, kl = tid % NDS, tid // NDS
        qr = cuda.local.array(QR, float32)         # this lane's 16 dims of every query head, pre-scaled
        for h in range(G):
            for r in range(2):
                w0, w1, w2, w3 = la.ld8_ro(q, (b, h0 + h, 8 * (ds + NDS * r)))
                _unpack8(qr, 16 * h + 8 * r, w0, w1, w2, w3, scale)
        kw = cuda.local.array(KW, uint32)
        kf = cuda.local.array(16, float32)
        for t0 in range(0, n, KB):
            for j in range(KPT):                   # issue every load of the sub-tile first
                key = t0 + kl + NKL * j
                for r in range(2):
                    if key < n:
                        w0, w1, w2, w3 = la.ld8_ro(k, (b, c0 + key, kvh, 8 * (ds + NDS * r)))
                    else:
                        w0 = w1 = w2 = w3 = uint32(0)
                    kw[8 * j + 4 * r], kw[8 * j + 4 * r + 1] = w0, w1
                    kw[8 * j + 4 * r + 2], kw[8 * j + 4 * r + 3] = w2, w3
            for j in range(KPT):
                for x in range(8):
                    kf[2 * x] = mh.bf16_lo(kw[8 * j + x])
                    kf[2 * x + 1] = mh.bf16_hi(kw[8 * j + x])
                for h in range(G):
                    acc = float32(0.0)
                    for x in range(16):
                        acc += qr[16 * h + x] * kf[x]
                    scr[(h * KB + kl + NKL * j) * PW + ds] = acc
            cuda.syncthreads()
            for i in range(tid, G * KB, THREADS):
                h, key = i // KB, i % KB
                s = float32(0.0)
                for e in range(NDS):
                    s += scr[(h * KB + key) * PW + e]
                if t0 + key < n:
                    ss[h, t0 + key] = s
            cuda.syncthreads()

        # ---- chunk softmax statistics per head (n >= 1, so the max is finite)
        for i in range(tid, G * 32, THREADS):
            h, lane = i // 32, i % 32
            m = NEG_INF
            for key in range(lane, n, 32):
                m = max(m, ss[h, key])
            red[h, lane] = m
        cuda.syncthreads()
        if tid < G:
            m = NEG_INF
            for lane in range(32):
                m = max(m, red[tid, lane])
            stat[tid] = m
        cuda.syncthreads()
        for i in range(tid, G * 32, THREADS):
            h, lane = i // 32, i % 32
            m = stat[h]
            lsum = float32(0.0)
            for key in range(lane, n, 32):
                p = math.exp(ss[h, key] - m)
                ss[h, key] = p
                lsum += p
            red[h, lane] = lsum
        cuda.syncthreads()
        if tid < G:
            lsum = float32(0.0)
            for lane in range(32):
                lsum += red[tid, lane]
            part_m[b, h0 + tid, sp] = stat[tid]
            part_l[b, h0 + tid, sp] = lsum

        # ---- unnormalised output: sum_key p[h, key] * v[key]
        dv, kv_lane = tid % NDV, tid // NDV
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = 0.0
        vw = cuda.local.array(VW, uint32)
        for base in range(kv_lane, n, NKV * U):
            for u in range(U):                # loads first: UNROLL rows in flight
                key = base + NKV * u
                if key < n:
                    w0, w1, w2, w3 = la.ld8_ro(v, (b, c0 + key, kvh, 8 * dv))
                else:
                    w0 = w1 = w2 = w3 = uint32(0)
                vw[4 * u], vw[4 * u + 1], vw[4 * u + 2], vw[4 * u + 3] = w0, w1, w2, w3
            for u in range(U):
                key = base + NKV * u
                if key < n:
                    for x in range(4):
                        lo, hi = mh.bf16_lo(vw[4 * u + x]), mh.bf16_hi(vw[4 * u + x])
                        for h in range(G):
                            p = ss[h, key]
                            acc[8 * h + 2 * x] += p * lo
                            acc[8 * h + 2 * x + 1] += p * hi
        for h in range(G):                        # scr is free: its last readers passed a barrier
            for e in range(8):
                scr[(kv_lane * G + h) * D + 8 * dv + e] = acc[8 * h + e]
        cuda.syncthreads()
        for i in range(tid, G * D, THREADS):
            h, d = i // D, i % D
            s = float32(0.0)
            for lane in range(NKV):
                s += scr[(lane * G + h) * D + d]
            part_o[b, h0 + h, sp, d] = s

    return split


# ----------------------------------------------------------------------------- pass 2

def _make_combine(D):
    E = D // 32            # dims per thread: d = dim_lane + 32 e
    SL = C_SPLIT_LANES

    @mh.kernel(C_THREADS)
    def combine(part_m, part_l, part_o, seq_len, out, chunk):
        # part_*: as in pass 1; out: [B, Hq, D] u16
        red = cuda.shared.array(C_THREADS, float32)
        osh = cuda.shared.array((SL, D), float32)
        dsh = cuda.shared.array(SL, float32)
        h, b = cuda.blockIdx.x, cuda.blockIdx.y
        tid = cuda.threadIdx.x
        ns = part_m.shape[2]
        n_active = min((seq_len[b] + chunk - 1) // chunk, ns)
        m = NEG_INF
        for s in range(tid, n_active, C_THREADS):
            m = max(m, part_m[b, h, s])
        m = mh.block_reduce(red, m, True)
        sl, dl = tid // 32, tid % 32
        acc = cuda.local.array(E, float32)
        for e in range(E):
            acc[e] = 0.0
        den = float32(0.0)
        for s in range(sl, n_active, SL):
            w = math.exp(part_m[b, h, s] - m)
            den += w * part_l[b, h, s]
            for e in range(E):
                acc[e] += w * part_o[b, h, s, dl + 32 * e]
        for e in range(E):
            osh[sl, dl + 32 * e] = acc[e]
        if dl == 0:
            dsh[sl] = den
        cuda.syncthreads()
        for d in range(tid, D, C_THREADS):
            tot = float32(0.0)
            dd = float32(0.0)
            for i in range(SL):
                tot += osh[i, d]
                dd += dsh[i]
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
    if (Hq % Hkv or D not in HEAD_DIMS or G > MAX_GROUP or tuple(k.shape) != (B, S_max, Hkv, D)
            or tuple(v.shape) != tuple(k.shape) or tuple(out.shape) != (B, Hq, D) or seq_len.shape[0] < B):
        raise ValueError(f"decode shapes q{q.shape} k{k.shape} v{v.shape} out{out.shape} seq_len{seq_len.shape}: "
                         f"need Hq % Hkv == 0, Hq / Hkv <= {MAX_GROUP}, D in {HEAD_DIMS}")
    if not la.vec8_ok(q, k, v):
        raise ValueError("decode attention needs 16-byte aligned, contiguous q, k and v rows")
    lay = _layout(B, Hq, Hkv, D, S_max)
    la.check_workspace("attention_decode", workspace, lay.total)
    chunk, ns = plan(B, Hkv, S_max, G)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    part = {name: workspace[lay.offsets[name]:lay.offsets[name] + lay.sizes[name]].view(np.float32)
            for name in ("m", "l", "o")}
    part_m, part_l = part["m"].reshape(B, Hq, ns), part["l"].reshape(B, Hq, ns)
    part_o = part["o"].reshape(B, Hq, ns, D)
    st = la.as_stream(stream)
    _kernel("split", G, D)[(ns, Hkv, B), THREADS, st](
        q, k, v, seq_len, part_m, part_l, part_o, chunk, float32(scale))
    _kernel("combine", D)[(Hq, B), C_THREADS, st](part_m, part_l, part_o, seq_len, out, chunk)


# ----------------------------------------------------------------------------- compile check

_U16_3D, _U16_4D = "uint16[:, :, ::1]", "uint16[:, :, :, ::1]"
_F32_3D, _F32_4D = "float32[:, :, ::1]", "float32[:, :, :, ::1]"
SIGNATURES = (
    [(_make_split(G, D).py_func,
      f"void({_U16_3D}, {_U16_4D}, {_U16_4D}, int32[::1], {_F32_3D}, {_F32_3D}, {_F32_4D}, int64, float32)")
     for G in (4, 1) for D in HEAD_DIMS]
    + [(_make_combine(D).py_func, f"void({_F32_3D}, {_F32_3D}, {_F32_4D}, int32[::1], {_U16_3D}, int64)")
       for D in HEAD_DIMS]
)
