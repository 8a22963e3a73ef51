"""Token selection on device: greedy argmax, and temperature / top-k / top-p sampling.

Greedy (``argmax``): two passes. Pass 1 splits each row of logits [B, V] over S blocks and writes one
(max, index) per block into a declared workspace; pass 2 reduces the S partials of each row into
``out_ids[b]``. The partials are ``session`` workspace: decode is captured, so the buffer needs a
stable address. Ties go to the lowest index, like ``np.argmax``; NaN logits are ignored.

Sampling (``sample``): one block per row, no workspace. Semantics are transformers' warpers in their
order — temperature, then top-k (keep scores >= the k-th largest), then top-p (keep the smallest
set of highest-probability tokens whose mass reaches top_p) — and the draw uses the Gumbel-max trick:
token = argmax over kept i of (logit_i - max) / T + g_i, with g_i = -log(-log(u_i)), which samples
exactly from the renormalised softmax of the kept set and needs no scan. Thresholds come from a radix
select on order-preserving uint32 keys of the logits (4 passes of 8-bit digit histograms in shared
memory), counting tokens for top-k and summing fixed-point probability mass (exp(...) · 2³², integer
atomics, so the result is deterministic) for top-p. Ties at a threshold are all kept.

Random source: counter-based Philox4x32-10, key = seed, counter = (i // 4, row, offset). The state
is a device uint64 array ``[seed, offset, blocks_done, 0]`` (``make_rng_state``); the last block of
each launch increments ``offset``, so a captured graph samples differently on every replay while a
given (seed, offset) always gives the same tokens. Sampling parameters are kernel arguments: a graph
captured with them keeps them (capture again to change them).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import (as_stream, cdiv, check_threads, check_workspace, f32_as_u32, warp_argmax,
    warp_incl_scan, warp_sum)
from vmmstream.kernels.base.workspace import Lifetime, WorkspaceRequirement, layout

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only

_MASK32 = 0xFFFFFFFF
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_SPLIT_CHUNK = 4096   # greedy pass 1: vocabulary entries per block (S = ceil(V / chunk), at most 256)
_MAX_SPLIT = 256


# ---------------------------------------------------------------------------------------- philox

def _philox_py(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 values holding 32-bit words; works on NumPy arrays and on device."""
    m32 = np.uint64(_MASK32)
    s32 = np.uint64(32)
    for _ in range(10):
        p0 = np.uint64(_M0) * c0
        p1 = np.uint64(_M1) * c2
        n0 = (p1 >> s32) ^ c1 ^ k0
        n2 = (p0 >> s32) ^ c3 ^ k1
        c1 = p1 & m32
        c3 = p0 & m32
        c0 = n0
        c2 = n2
        k0 = (k0 + np.uint64(_W0)) & m32
        k1 = (k1 + np.uint64(_W1)) & m32
    return c0, c1, c2, c3


philox4x32 = cuda.jit(device=True, inline="always")(_philox_py)


def make_rng_state(seed: int, offset: int = 0) -> np.ndarray:
    """Host array to copy into the device state: [seed, offset, blocks_done (0), reserved]."""
    return np.array([seed & 0xFFFFFFFFFFFFFFFF, offset, 0, 0], dtype=np.uint64)


# ---------------------------------------------------------------------------------- device helpers

@cuda.jit(device=True, inline="always")
def _logit(logits, b, i, in_bf16):
    if in_bf16:
        return dev_bf16_to_f32(logits[b, i])
    return np.float32(logits[b, i])


@cuda.jit(device=True, inline="always")
def _okey(v):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest)."""
    u = f32_as_u32(v)
    if u & np.uint32(0x80000000):
        return np.uint32(~u)
    return np.uint32(u | np.uint32(0x80000000))


@cuda.jit(device=True, inline="always")
def _mass(v, m, inv_temp):
    """Unnormalised probability exp((v - max) / T) in 32.32 fixed point: integer sums are exact,
    so the top-p threshold does not depend on the order of atomic additions."""
    return np.int64(math.exp((v - m) * inv_temp) * np.float32(4294967296.0))


@cuda.jit(device=True, inline="always")
def _gumbel(r):
    # 23 random bits -> u in (0, 1) exactly representable in fp32 (never 0, never 1)
    u = (np.float32(r >> np.uint64(9)) + np.float32(0.5)) * np.float32(1.1920928955078125e-07)
    return -math.log(-math.log(u))


@cuda.jit(device=True, inline="always")
def _block_argmax(v, i, sv, si):
    """(max, lowest index) over the block, in every thread. sv/si: shared, one slot per warp."""
    v, i = warp_argmax(v, i)
    tid = cuda.threadIdx.x
    if tid % 32 == 0:
        sv[tid // 32] = v
        si[tid // 32] = i
    cuda.syncthreads()
    bv = sv[0]
    bi = si[0]
    for w in range(1, cuda.blockDim.x // 32):
        if sv[w] > bv or (sv[w] == bv and si[w] < bi):
            bv = sv[w]
            bi = si[w]
    cuda.syncthreads()
    return bv, bi


@cuda.jit(device=True, inline="always")
def _radix_select(logits, b, vocab, in_bf16, mass_mode, m, inv_temp, target, top_p, min_key, hist, sel):
    """Largest key t with weight(key > t) < target <= weight(key >= t), over keys >= min_key.

    weight = token count (top-k, target = k) or fixed-point mass (top-p, target = ceil(top_p · total),
    computed from the first histogram). One 8-bit digit per pass, most significant first.
    """
    tid = cuda.threadIdx.x
    lane = tid % 32
    prefix = np.uint32(0)
    above = np.int64(0)   # signed: warp shuffles take int32/int64/float only; sums stay < 2^63
    for level in range(4):
        shift = np.uint32(24 - 8 * level)
        high = np.uint32((np.uint64(_MASK32) << np.uint64(32 - 8 * level)) & np.uint64(_MASK32))
        for j in range(tid, 256, cuda.blockDim.x):
            hist[j] = np.int64(0)
        if tid == 0:
            sel[0] = np.int64(0)     # fallback if no digit reaches the target: keep the whole group
            sel[1] = above
        cuda.syncthreads()
        for i in range(tid, vocab, cuda.blockDim.x):
            v = _logit(logits, b, i, in_bf16)
            key = _okey(v)
            if key >= min_key and (key & high) == prefix:
                wgt = np.int64(1)
                if mass_mode:
                    wgt = _mass(v, m, inv_temp)
                cuda.atomic.add(hist, (key >> shift) & np.uint32(0xFF), wgt)
        cuda.syncthreads()
        # lane l owns digits 255 - 8l down to 248 - 8l: a prefix scan over lanes walks digits downwards
        loc = np.int64(0)
        for e in range(8):
            loc += hist[255 - 8 * lane - e]
        if mass_mode and level == 0:
            total = warp_sum(loc)
            target = np.int64(max(1.0, math.ceil(np.float64(top_p) * np.float64(total))))
        incl = warp_incl_scan(loc)
        excl = incl - loc
        if tid < 32 and above + excl < target and target <= above + incl:
            cum = above + excl
            for e in range(8):
                d = 255 - 8 * lane - e
                nxt = cum + hist[d]
                if nxt >= target:
                    sel[0] = np.int64(d)
                    sel[1] = cum
                    break
                cum = nxt
        cuda.syncthreads()
        prefix = prefix | (np.uint32(sel[0]) << shift)
        above = sel[1]
        cuda.syncthreads()   # hist and sel are rewritten by the next level
    return prefix


# ------------------------------------------------------------------------------------------ kernels

@functools.lru_cache(maxsize=None)
def _make_argmax(in_bf16: bool):
    def argmax_partial_kernel(logits, part_v, part_i, vocab, chunk):
        # logits: [B, V] f32|bf16; part_v: [B, S] f32; part_i: [B, S] int32. grid: (S, B)
        s = cuda.blockIdx.x
        b = cuda.blockIdx.y
        sv = cuda.shared.array(32, np.float32)
        si = cuda.shared.array(32, np.int32)
        lo = s * chunk
        hi = min(lo + chunk, vocab)
        bv = np.float32(-np.inf)
        bi = np.int32(lo)
        for i in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
            v = _logit(logits, b, i, in_bf16)
            if v > bv:            # i grows within a thread: the first maximum wins
                bv = v
                bi = np.int32(i)
        bv, bi = _block_argmax(bv, bi, sv, si)
        if cuda.threadIdx.x == 0:
            part_v[b, s] = bv
            part_i[b, s] = bi

    return jit(argmax_partial_kernel)


def _argmax_final(part_v, part_i, out_ids, nsplit):
    # part_v, part_i: [B, S]; out_ids: [B] int32. grid: B
    b = cuda.blockIdx.x
    sv = cuda.shared.array(32, np.float32)
    si = cuda.shared.array(32, np.int32)
    bv = np.float32(-np.inf)
    bi = part_i[b, 0]
    for j in range(cuda.threadIdx.x, nsplit, cuda.blockDim.x):
        v = part_v[b, j]
        i = part_i[b, j]
        if v > bv or (v == bv and i < bi):
            bv = v
            bi = i
    bv, bi = _block_argmax(bv, bi, sv, si)
    if cuda.threadIdx.x == 0:
        out_ids[b] = bi


_argmax_final_kernel = jit(_argmax_final)


@functools.lru_cache(maxsize=None)
def _make_draw(in_bf16: bool):
    """``draw(logits, b, vocab, inv_temp, greedy, top_k, top_p, seed, offset, sv, si, hist, sel)``: the block's
    token for row b, the same value in every thread (Philox counter row 0: a row draws as a batch of one)."""
    @cuda.jit(device=True, inline="always")
    def draw(logits, b, vocab, inv_temp, greedy, top_k, top_p, seed, offset, sv, si, hist, sel):
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        m32 = np.uint64(_MASK32)
        m = np.float32(-np.inf)
        for i in range(tid, vocab, nthreads):
            m = max(m, _logit(logits, b, i, in_bf16))
        m, _unused = _block_argmax(m, np.int32(0), sv, si)

        thr = np.uint32(0)
        if not greedy:
            if top_k > 0 and top_k < vocab:
                thr = _radix_select(logits, b, vocab, in_bf16, False, m, inv_temp, np.int64(top_k),
                                    top_p, np.uint32(0), hist, sel)
            if top_p < 1.0:
                thr = _radix_select(logits, b, vocab, in_bf16, True, m, inv_temp, np.int64(1),
                                    top_p, thr, hist, sel)

        bv = np.float32(-np.inf)
        bi = np.int32(0)
        for q in range(tid, (vocab + 3) // 4, nthreads):
            r0, r1, r2, r3 = philox4x32(np.uint64(q), np.uint64(b), offset & m32, offset >> np.uint64(32),
                                        seed & m32, seed >> np.uint64(32))
            for e in range(4):
                i = 4 * q + e
                if i < vocab:
                    v = _logit(logits, b, i, in_bf16)
                    if _okey(v) >= thr:
                        if greedy:
                            score = v
                        else:
                            r = r0 if e == 0 else r1 if e == 1 else r2 if e == 2 else r3
                            score = (v - m) * inv_temp + _gumbel(r)
                        if score > bv or (score == bv and i < bi):
                            bv = score
                            bi = np.int32(i)
        bv, bi = _block_argmax(bv, bi, sv, si)
        return bi

    return draw


@functools.lru_cache(maxsize=None)
def _make_sample(in_bf16: bool):
    draw = _make_draw(in_bf16)

    def sample_kernel(logits, out_ids, rng, vocab, inv_temp, greedy, top_k, top_p):
        # logits: [B, V] f32|bf16; out_ids: [B] int32; rng: [4] uint64 (seed, offset, blocks_done, -)
        # grid: B; block: threads (multiple of 32)
        b = cuda.blockIdx.x
        sv = cuda.shared.array(32, np.float32)
        si = cuda.shared.array(32, np.int32)
        hist = cuda.shared.array(256, np.int64)
        sel = cuda.shared.array(2, np.int64)
        offset = rng[1]
        bi = draw(logits, b, vocab, inv_temp, greedy, top_k, top_p, rng[0], offset, sv, si, hist, sel)
        if cuda.threadIdx.x == 0:
            out_ids[b] = bi
            # every block has read `offset` (before its barriers); the last one to finish advances it
            if cuda.atomic.add(rng, 2, np.uint64(1)) == np.uint64(cuda.gridDim.x - 1):
                rng[1] = offset + np.uint64(1)
                rng[2] = np.uint64(0)

    return jit(sample_kernel)


@functools.lru_cache(maxsize=None)
def _make_sample_rows(in_bf16: bool):
    draw = _make_draw(in_bf16)

    def sample_rows_kernel(logits, out_ids, rng_rows, params, top_ks, vocab):
        # Each row with its own parameters and Philox state: params[b] = (1 / temperature, top_p), 1 / T <= 0
        # leaves row b as it is (greedy: out_ids[b] already holds its argmax); rng_rows[b] = (seed, offset, -, -),
        # set by the caller before each launch. grid: the rows; block: threads (multiple of 32)
        b = cuda.blockIdx.x
        inv_temp = params[b, 0]
        if inv_temp <= np.float32(0.0):
            return                                  # the whole block: no barrier is skipped by part of it
        sv = cuda.shared.array(32, np.float32)
        si = cuda.shared.array(32, np.int32)
        hist = cuda.shared.array(256, np.int64)
        sel = cuda.shared.array(2, np.int64)
        bi = draw(logits[b:b + 1], 0, vocab, inv_temp, False, top_ks[b], params[b, 1], rng_rows[b, 0],
                  rng_rows[b, 1], sv, si, hist, sel)
        if cuda.threadIdx.x == 0:
            out_ids[b] = bi

    return jit(sample_rows_kernel)


# -------------------------------------------------------------------------------------------- host

def _nsplit(vocab: int, nsplit: int | None) -> int:
    return int(nsplit) if nsplit else max(1, min(_MAX_SPLIT, cdiv(vocab, _SPLIT_CHUNK)))


def _layout(batch: int, vocab: int, nsplit: int | None):
    s = _nsplit(vocab, nsplit)
    return s, layout(values=4 * batch * s, indices=4 * batch * s)


def workspace_requirement(batch: int, vocab: int, route: str = "greedy", nsplit: int | None = None):
    """greedy: the per-block partial maxima, ``session`` lifetime (captured decode); sample: none."""
    if route == "sample":
        return WorkspaceRequirement(0, Lifetime.SESSION)
    if route != "greedy":
        raise ValueError(f"unknown sampling route {route!r}")
    return WorkspaceRequirement(_layout(batch, vocab, nsplit)[1].total, Lifetime.SESSION)


def argmax(logits, out_ids, *, workspace, stream=None, nsplit: int | None = None, threads: int = 256):
    """out_ids[b] = argmax(logits[b]) for logits [B, V] (fp32, or bf16 as uint16); out_ids int32 [B]."""
    b, v = logits.shape
    s, lay = _layout(b, v, nsplit)
    check_workspace("argmax", workspace, lay.total)
    if out_ids.shape != (b,):
        raise ValueError(f"argmax: out_ids {out_ids.shape} for logits {logits.shape}")
    chunk = cdiv(v, s)
    s = cdiv(v, chunk)   # no empty block
    off_v, off_i = lay.offsets["values"], lay.offsets["indices"]
    part_v = workspace[off_v:off_v + 4 * b * s].view(np.float32).reshape(b, s)
    part_i = workspace[off_i:off_i + 4 * b * s].view(np.int32).reshape(b, s)
    st = as_stream(stream)
    threads = check_threads(threads)
    _make_argmax(logits.dtype == np.uint16)[(s, b), threads, st](logits, part_v, part_i, v, chunk)
    _argmax_final_kernel[b, threads, st](part_v, part_i, out_ids, s)


def sample(logits, out_ids, rng_state, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           workspace=None, stream=None, threads: int = 512):
    """Sample out_ids[b] from softmax(logits[b] / T) restricted by top-k then top-p (0 / 1.0 = off).

    temperature <= 0 is greedy. rng_state: device uint64 [4] from ``make_rng_state``; its offset
    advances by one per launch.
    """
    b, v = logits.shape
    check_workspace("sample", workspace, workspace_requirement(b, v, "sample").bytes)
    if out_ids.shape != (b,) or rng_state.shape != (4,):
        raise ValueError(f"sample: out_ids {out_ids.shape}, rng_state {rng_state.shape}")
    greedy = temperature <= 0
    inv_temp = np.float32(1.0 if greedy else 1.0 / temperature)
    _make_sample(logits.dtype == np.uint16)[b, check_threads(threads), as_stream(stream)](
        logits, out_ids, rng_state, v, inv_temp, greedy, int(top_k), np.float32(top_p))


def sample_rows(logits, out_ids, rng_rows, params, top_ks, *, stream=None, threads: int = 512):
    """Row b of logits [B, V] drawn with its own parameters: ``params`` float32 [B, 2] = (1 / temperature, top_p),
    ``top_ks`` int32 [B] (0 = off), ``rng_rows`` uint64 [B, 4] = (seed, offset, -, -) (``make_rng_state``); the
    draw is the one ``sample`` makes for that row alone with that state. A row with 1 / temperature <= 0 is
    not touched (out_ids keeps what ``argmax`` wrote). Nothing advances: the caller sets the states before each
    launch, so a captured graph may replay it with new parameters."""
    b, v = logits.shape
    if out_ids.shape != (b,) or rng_rows.shape != (b, 4) or params.shape != (b, 2) or top_ks.shape != (b,):
        raise ValueError(f"sample_rows: logits {logits.shape}, out_ids {out_ids.shape}, rng_rows "
                         f"{rng_rows.shape}, params {params.shape}, top_ks {top_ks.shape}")
    _make_sample_rows(logits.dtype == np.uint16)[b, check_threads(threads), as_stream(stream)](
        logits, out_ids, rng_rows, params, top_ks, v)


def row_params(temperature: float, top_k: int, top_p: float) -> tuple[np.float32, np.float32, np.int32]:
    """One row's ``sample_rows`` parameters: (1 / temperature, top_p, top_k); greedy is (0, 1, 0)."""
    if temperature <= 0:
        return np.float32(0.0), np.float32(1.0), np.int32(0)
    return np.float32(1.0 / temperature), np.float32(top_p), np.int32(top_k)


# --------------------------------------------------------------------------------------- reference

def _as_f32(logits) -> np.ndarray:
    logits = np.asarray(logits)
    return bf16_to_f32(logits) if logits.dtype == np.uint16 else logits.astype(np.float32)


def reference_argmax(logits) -> np.ndarray:
    return np.argmax(_as_f32(logits), axis=-1).astype(np.int32)


def reference_keep_mask(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """[B, V] bool: the tokens transformers' temperature/top-k/top-p warpers leave (sorting, fp64)."""
    x = _as_f32(logits).astype(np.float64) / (temperature if temperature > 0 else 1.0)
    keep = np.ones(x.shape, bool)
    if 0 < top_k < x.shape[-1]:
        kth = -np.sort(-x, axis=-1)[:, top_k - 1:top_k]
        keep &= x >= kth
    if top_p < 1.0:
        for b in range(x.shape[0]):
            s = np.where(keep[b], x[b], -np.inf)
            order = np.argsort(s, kind="stable")          # ascending
            p = np.exp(s[order] - s.max())
            cum = np.cumsum(p / p.sum())
            drop = cum <= 1.0 - top_p
            drop[-1] = False                               # keep at least one token
            keep[b, order[drop]] = False
    return keep


def reference_sample(logits, rng_state, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0) -> np.ndarray:
    """The kernel's draw with the HF keep-set: Gumbel-max with the same Philox stream."""
    x = _as_f32(logits)
    bsz, vocab = x.shape
    if temperature <= 0:
        return reference_argmax(x)
    keep = reference_keep_mask(x, temperature, top_k, top_p)
    seed, offset = np.uint64(rng_state[0]), np.uint64(rng_state[1])
    m32 = np.uint64(_MASK32)
    q = np.arange(cdiv(vocab, 4), dtype=np.uint64)
    out = np.empty(bsz, np.int32)
    for b in range(bsz):
        words = _philox_py(q, np.full_like(q, b), np.full_like(q, offset & m32),
                           np.full_like(q, offset >> np.uint64(32)), seed & m32, seed >> np.uint64(32))
        r = np.stack(words, axis=1).reshape(-1)[:vocab]
        u = ((r >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)
        g = -np.log(-np.log(u.astype(np.float64)))
        score = (x[b].astype(np.float64) - x[b].max()) / temperature + g
        out[b] = np.argmax(np.where(keep[b], score, -np.inf))
    return out


def reference_sample_rows(logits, out_ids, rng_rows, params, top_ks) -> np.ndarray:
    """``sample_rows`` on the host: out_ids with each drawing row replaced by its ``reference_sample``."""
    out = np.array(out_ids, np.int32, copy=True)
    for b in range(out.shape[0]):
        inv_temp = np.float32(params[b, 0])
        if inv_temp > 0:
            out[b] = reference_sample(np.asarray(logits)[b:b + 1], rng_rows[b], float(1.0 / np.float64(inv_temp)),
                                      int(top_ks[b]), float(params[b, 1]))[0]
    return out


def reference(logits, **kw):
    return reference_argmax(logits) if not kw else reference_sample(logits, **kw)


def bytes_moved(batch: int, vocab: int, *, itemsize: int = 4, route: str = "greedy",
                top_k: int = 0, top_p: float = 1.0) -> int:
    """Logits passes: 1 for greedy; sampling reads them 2 + 4 (top-k) + 4 (top-p) times (L2-resident)."""
    passes = 1 if route == "greedy" else 2 + (4 if top_k else 0) + (4 if top_p < 1.0 else 0)
    return passes * batch * vocab * itemsize + 4 * batch


def flops(batch: int, vocab: int) -> int:
    return batch * vocab


_SAMPLE_SIG = "void({t}[:, ::1], int32[::1], uint64[::1], int64, float32, boolean, int64, float32)"
SIGNATURES = [
    (_make_argmax(False).py_func, "void(float32[:, ::1], float32[:, ::1], int32[:, ::1], int64, int64)"),
    (_make_argmax(True).py_func, "void(uint16[:, ::1], float32[:, ::1], int32[:, ::1], int64, int64)"),
    (_argmax_final, "void(float32[:, ::1], int32[:, ::1], int32[::1], int64)"),
    (_make_sample(False).py_func, _SAMPLE_SIG.format(t="float32")),
    (_make_sample(True).py_func, _SAMPLE_SIG.format(t="uint16")),
    (_make_sample_rows(False).py_func,
     "void(float32[:, ::1], int32[::1], uint64[:, ::1], float32[:, ::1], int32[::1], int64)"),
]
