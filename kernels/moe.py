"""Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE) for decode and prefill: router top-k, grouping of the
routed (token, slot) pairs by expert, the experts' SwiGLU FFN over those groups, and the weighted combine.

One MoE layer is four launches (plus the dense ops around them: the router logits are a ``gemv`` with fp32
out, a Qwen2-MoE shared expert is ``gemv_gate_up_silu`` + ``gemv`` and its gate logit a one-row ``gemv``)::

    router_topk(logits, topk_ids, topk_weights)          logits [T, E] -> ids [T, k] int32, weights [T, k] fp32
    group_by_expert(topk_ids, workspace=ws)              ids -> counts, offsets, perm, tiles   (in ws)
    expert_ffn[_int4|_mxfp4](x, wg, wu, wd, y, workspace=ws)   -> y [T, k, H] (fp32 or bf16), h [T*k, I] (in ws)
    combine(y, topk_weights, out, shared=, shared_gate=) -> out [T, H]

Layouts (bf16 is uint16 bits throughout)
    x [T, H] bf16. Expert weights stacked per expert in checkpoint layout ([out, in]): ``w_gate``, ``w_up``
    [E, I, H], ``w_down`` [E, H, I], bf16; the two halves of a fused [E, 2I, H] gate_up tensor may be passed
    as views. Quantized experts use ``kernels/quant.py``'s layouts per expert, stacked on a leading E axis
    (``quantize_experts``): int4 ``(packed u8 [E, N, K/2], scales [E, N, K/128], zeros [E, N, K/128])`` with
    fp16 or fp32 scales/zeros, MXFP4 ``(packed u8 [E, N, K/2], scales u8 [E, N, K/32])``.
    ``y[t, s]`` is the output of the expert in slot s of token t; ``out`` is bf16 or fp32, whatever it is.

What each kernel does
    router_topk: one warp per token; lane l holds experts l, l+32, l+64, l+96 (E <= 128) and k rounds of a
        warp arg-max pick the top k. **Ties go to the lower expert index** (NaN logits count as -inf). Weights
        are fp32, by the architectures' definitions (``scoring``):
          'mixtral':                softmax over the k selected logits (= softmax, top-k, renormalise);
          'qwen2_moe'/'qwen3_moe':  softmax over all E logits, take the top k, renormalise them to sum 1 only
                                    when ``norm_topk_prob`` (required, from the model config).
        (transformers rounds Qwen's weights to the model dtype; these stay fp32.)
    group_by_expert: one block, a deterministic counting sort: counts per expert (shared-memory atomics),
        ``offsets`` (exclusive scan, E + 1 entries), ``perm`` = the pair indices p = t*k + s in expert order and,
        within an expert, ascending p (by token, then slot), so every run groups identically. Then the
        *tiles*: each expert's rows cut into runs of ``row_tile`` rows, ``tile_expert[j]``, ``tile_row[j]``
        (first grouped row), ``n_tiles[0]``. Expert ids outside [0, E) are dropped (their y rows are not
        written: routing must produce valid ids).
    expert_ffn (bf16): two GEMV-style launches over a grid (tile, block of weight rows) sized for the most
        tiles T*k pairs can make; blocks past ``n_tiles`` exit at once, so only the routed experts' weight rows
        are read, once per tile (a tile shares each weight load between its up to ``row_tile`` rows, so two
        tokens routed to one expert read it once). The block body is ``gemv``'s: 16-byte ``ld.global.nc`` loads,
        fp32 accumulation, warp shuffles then shared memory to reduce.
          gate/up: h[r] = bf16(silu(bf16(x·Wgᵀ)) * bf16(x·Wuᵀ)) for grouped row r (token perm[r] // k), rounded
                   like ``gemv_gate_up_silu`` (gate and up rounded to bf16 as separate GEMVs would store them,
                   silu·mul in fp32, one rounding);
          down:    y[t, s] = h[r] · Wdᵀ, fp32 accumulation, stored fp32 or rounded to bf16.
        **h is bf16** ([T*k, I], grouped-row order, in the workspace): the dense path stores the MLP's h in
        bf16 too, transformers computes it in the model dtype, and it halves the step workspace.
    expert_ffn_int4 / expert_ffn_mxfp4: the same two launches with ``qgemv``'s block body: each warp owns
        ``rows_per_warp`` rows (of each of gate and up), lanes stride over 16-byte chunks (32 weights),
        dequantized in registers; the tile's x rows (or h rows) are staged in shared memory as fp32.
    combine: out[t] = Σ_s topk_weights[t, s] · y[t, s] (slot order, fp32) [+ sigmoid(shared_gate[t]) ·
        shared[t]], rounded once when out is bf16. ``shared``: the shared expert's output [T, H] bf16;
        ``shared_gate``: its gate logit x·w_gateᵀ [T] (or [T, 1]) fp32 (Qwen2-MoE), optional.

Workspace (``workspace_requirement``, ``step`` lifetime): one view holds the routing (counts, offsets, perm,
tiles; int32) and, for the expert launches, h. ``group_by_expert`` fills the routing part, the expert launch
reads it and writes h, so the two take the same view; size it with ``op='experts'`` (``op='group'``: the
routing part only). Router and combine need none. Launches never allocate or synchronize (CAPTURE_SAFE).

Limits: E <= 128, k <= 8 (router), H and I multiples of 8 with 16-byte aligned rows for bf16 experts
(there is no scalar path), multiples of 128 (int4) or 32 (MXFP4) for quantized ones. Prefill runs the same
GEMV-style kernels tile by tile (weights re-read from L2 per tile of 4 rows): correct, not a tensor-core
grouped GEMM. Expert-parallel sharding is not handled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numba import cuda

from .dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16, dev_mx_nibbles, f32_to_bf16
from .launch import SIM, as_stream, cdiv, check_threads, check_workspace, data_ptr, hi_f32, ld8_ro, lo_f32, \
    vec8_ok, warp_argmax, warp_sum
from .quant import INT4_GROUP, MX_BLOCK, Int4Weights, MXFP4Weights, dequantize_int4, dequantize_mxfp4, \
    quantize_int4, quantize_mxfp4
from .workspace import NONE, Lifetime, WorkspaceRequirement, layout

CAPTURE_SAFE = True   # no allocation, no synchronize, device arrays only

MAX_EXPERTS = 128
MAX_TOPK = 8
_VALS = MAX_EXPERTS // 32       # router: logits held per lane
_NO_EXPERT = 1 << 30            # router: "no candidate" index (loses every tie)
_NOFF = MAX_EXPERTS + 1         # grouping: offsets entries (shared array shapes must be plain names)
MIXTRAL, QWEN = 0, 1
SCORING = {"mixtral": MIXTRAL, "qwen2_moe": QWEN, "qwen3_moe": QWEN}
INT4, MXFP4 = 0, 1
SMEM_X = 8192                   # quantized experts: fp32 x values staged per block (32 KiB), as in qgemv


@dataclass(frozen=True)
class MoeConfig:
    threads: int = 128
    rows_per_block: int = 0   # bf16 experts: weight rows (of each matrix) per block; 0: gate/up 1, down 2 if H >= 2048
    rows_per_warp: int = 2    # int4 / MXFP4 experts: weight rows (of each matrix) per warp
    tile_k: int = 0           # int4 / MXFP4: K values of x staged per pass; 0: SMEM_X // row_tile


# ------------------------------------------------------------------------------------------- layout

def _row_tile(tokens: int, row_tile: int = 0) -> int:
    """Rows per tile (and the expert kernels' batch tile): 1, 2 or 4 from T like gemv's batch tile."""
    if row_tile:
        if row_tile not in (1, 2, 4, 8):
            raise ValueError(f"row_tile must be 1, 2, 4 or 8, got {row_tile}")
        return int(row_tile)
    return 1 if tokens <= 1 else 2 if tokens == 2 else 4


def max_tiles(pairs: int, num_experts: int, row_tile: int) -> int:
    """Most tiles ``pairs`` routed rows can make: Σ_e ceil(c_e / R) <= P // R + (experts hit), and <= P."""
    return min(pairs, pairs // row_tile + min(num_experts, pairs))


def _layout(tokens: int, top_k: int, num_experts: int, intermediate: int = 0, row_tile: int = 0):
    """(row_tile, max_tiles, Layout): the routing buffers first (their offsets do not depend on I), then h."""
    r = _row_tile(tokens, row_tile)
    p = int(tokens) * int(top_k)
    mt = max_tiles(p, num_experts, r)
    lay = layout(counts=4 * num_experts, offsets=4 * (num_experts + 1), perm=4 * p, tile_expert=4 * mt,
                 tile_row=4 * mt, n_tiles=4, h=2 * p * int(intermediate))
    return r, mt, lay


def workspace_requirement(tokens: int, top_k: int, num_experts: int, intermediate: int = 0, *,
                          op: str = "experts", row_tile: int = 0):
    """``experts``: routing + h (the view ``group_by_expert`` and ``expert_ffn*`` share); ``group``: the
    routing part only; ``router`` / ``combine``: none. ``step`` lifetime."""
    if op in ("router", "combine"):
        return NONE
    if op not in ("group", "experts"):
        raise ValueError(f"unknown moe op {op!r}: expected 'router', 'group', 'experts' or 'combine'")
    _, _, lay = _layout(tokens, top_k, num_experts, intermediate if op == "experts" else 0, row_tile)
    return WorkspaceRequirement(lay.total, Lifetime.STEP)


class Routing(NamedTuple):
    """Views of the routing buffers in a workspace (int32 device arrays) and the sizes they were laid out for."""
    counts: object        # [E]
    offsets: object       # [E + 1]
    perm: object          # [T*k]: grouped row -> pair index t*k + s
    tile_expert: object   # [max_tiles]
    tile_row: object      # [max_tiles]: first grouped row of the tile
    n_tiles: object       # [1]
    tokens: int
    top_k: int
    num_experts: int
    row_tile: int
    max_tiles: int


def _i32(workspace, lay, name, n):
    o = lay.offsets[name]
    return workspace[o:o + 4 * n].view(np.int32)


def routing_views(workspace, tokens: int, top_k: int, num_experts: int, row_tile: int = 0) -> Routing:
    """The routing buffers ``group_by_expert`` writes, as views of ``workspace`` (no allocation)."""
    r, mt, lay = _layout(tokens, top_k, num_experts, 0, row_tile)
    check_workspace("moe routing", workspace, lay.total)
    p = tokens * top_k
    return Routing(_i32(workspace, lay, "counts", num_experts), _i32(workspace, lay, "offsets", num_experts + 1),
                   _i32(workspace, lay, "perm", p), _i32(workspace, lay, "tile_expert", mt),
                   _i32(workspace, lay, "tile_row", mt), _i32(workspace, lay, "n_tiles", 1),
                   int(tokens), int(top_k), int(num_experts), r, mt)


def h_view(workspace, tokens: int, top_k: int, num_experts: int, intermediate: int, row_tile: int = 0):
    """The bf16 h buffer [T*k, I] (grouped-row order) the expert launches write, as a view of ``workspace``."""
    _, _, lay = _layout(tokens, top_k, num_experts, intermediate, row_tile)
    check_workspace("moe h", workspace, lay.total)
    o, p = lay.offsets["h"], tokens * top_k
    return workspace[o:o + 2 * p * intermediate].view(np.uint16).reshape(p, intermediate)


# --------------------------------------------------------------------------------------------- router

@functools.lru_cache(maxsize=None)
def _make_router(in_bf16: bool, scoring: int, renorm: bool):
    def router_topk_kernel(logits, ids, wts, n_tokens, n_experts, top_k):
        # logits: [T, E] f32|bf16; ids: [T, k] int32; wts: [T, k] f32
        # grid: ceil(T / warps); block: threads (one warp per token)
        tid = cuda.threadIdx.x
        lane = tid % 32
        t = cuda.blockIdx.x * (cuda.blockDim.x // 32) + tid // 32
        tt = min(t, n_tokens - 1)       # warps past the last token compute (shuffles need them), store nothing
        vals = cuda.local.array(_VALS, np.float32)
        used = cuda.local.array(_VALS, np.int32)
        sel_v = cuda.local.array(MAX_TOPK, np.float32)
        sel_i = cuda.local.array(MAX_TOPK, np.int32)
        for j in range(_VALS):
            e = lane + 32 * j
            v = np.float32(-np.inf)
            if e < n_experts:
                if in_bf16:
                    v = dev_bf16_to_f32(logits[tt, e])
                else:
                    v = np.float32(logits[tt, e])
                if v != v:              # NaN counts as -inf
                    v = np.float32(-np.inf)
            vals[j] = v
            used[j] = 0
        for s in range(top_k):
            bv = np.float32(-np.inf)
            bi = np.int32(_NO_EXPERT)
            for j in range(_VALS):      # ascending index: the first of equal values wins
                e = lane + 32 * j
                if e < n_experts and used[j] == 0 and (vals[j] > bv or bi == _NO_EXPERT):
                    bv = vals[j]
                    bi = np.int32(e)
            bv, bi = warp_argmax(bv, bi)   # ties -> lower index
            if bi % 32 == lane:
                used[bi // 32] = 1
            sel_v[s] = bv
            sel_i[s] = bi
        m = sel_v[0]
        if scoring == QWEN:
            loc = np.float32(0.0)
            for j in range(_VALS):
                if lane + 32 * j < n_experts:
                    loc += math.exp(vals[j] - m)
            total = warp_sum(loc)
        else:
            total = np.float32(0.0)
            for s in range(top_k):
                total += math.exp(sel_v[s] - m)
        if lane < top_k and t < n_tokens:
            w = np.float32(math.exp(sel_v[lane] - m)) / total
            if scoring == QWEN and renorm:
                psum = np.float32(0.0)
                for s in range(top_k):
                    psum += np.float32(math.exp(sel_v[s] - m)) / total
                w = w / psum
            ids[t, lane] = sel_i[lane]
            wts[t, lane] = w

    return cuda.jit(router_topk_kernel)


def _scoring(scoring: str, norm_topk_prob):
    if scoring not in SCORING:
        raise ValueError(f"unknown router scoring {scoring!r}: expected one of {sorted(SCORING)}")
    if SCORING[scoring] == MIXTRAL:
        if norm_topk_prob not in (None, True):
            raise ValueError("router_topk: Mixtral always renormalises its top-k weights; norm_topk_prob=False "
                             "is not Mixtral (use scoring='qwen2_moe' for softmax-over-all without renormalising)")
        return MIXTRAL, True
    if not isinstance(norm_topk_prob, (bool, np.bool_)):
        raise ValueError(f"router_topk: scoring={scoring!r} needs norm_topk_prob=True/False from the model config, "
                         f"got {norm_topk_prob!r}")
    return QWEN, bool(norm_topk_prob)


def router_topk(logits, topk_ids, topk_weights, *, scoring: str = "mixtral", norm_topk_prob=None,
                workspace=None, stream=None, threads: int = 128):
    """topk_ids[T, k], topk_weights[T, k] = top-k experts of each row of logits [T, E] and their weights.

    logits fp32 or bf16 (uint16), E <= 128; topk_ids int32, topk_weights fp32, k = topk_ids.shape[1] <= 8
    (and <= E). Ties go to the lower expert index. ``scoring`` 'mixtral' | 'qwen2_moe' | 'qwen3_moe' (see the
    module docstring); Qwen needs ``norm_topk_prob``. One warp per token. Never allocates.
    """
    check_workspace("router_topk", workspace, 0)
    mode, renorm = _scoring(scoring, norm_topk_prob)
    if logits.ndim != 2 or logits.dtype not in (np.float32, np.uint16):
        raise ValueError(f"router_topk: logits must be [T, E] float32 or bf16 (uint16), got {logits.shape} "
                         f"{logits.dtype}")
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"router_topk: E = {e} experts; supported 1..{MAX_EXPERTS}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_ids.dtype != np.int32:
        raise ValueError(f"router_topk: topk_ids must be int32 [T={t}, k], got {topk_ids.shape} {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if not 1 <= k <= min(MAX_TOPK, e):
        raise ValueError(f"router_topk: k = {k}; supported 1..min({MAX_TOPK}, E={e})")
    if topk_weights.shape != (t, k) or topk_weights.dtype != np.float32:
        raise ValueError(f"router_topk: topk_weights must be float32 {(t, k)}, got {topk_weights.shape} "
                         f"{topk_weights.dtype}")
    threads = check_threads(threads)
    if t:
        _make_router(logits.dtype == np.uint16, mode, renorm)[cdiv(t, threads // 32), threads, as_stream(stream)](
            logits, topk_ids, topk_weights, t, e, k)


# ------------------------------------------------------------------------------------------- grouping

@functools.lru_cache(maxsize=None)
def _make_group(threads: int):
    nw = threads // 32

    def moe_group_kernel(ids, counts, offsets, perm, tile_expert, tile_row, n_tiles, n_pairs, top_k,
                         n_experts, row_tile):
        # ids: [T, k] int32; counts [E], offsets [E + 1], perm [T*k], tile_* [max_tiles], n_tiles [1]: int32
        # grid: 1; block: threads
        tid = cuda.threadIdx.x
        lane = tid % 32
        wid = tid // 32
        cnt = cuda.shared.array(MAX_EXPERTS, np.int32)
        cur = cuda.shared.array(MAX_EXPERTS, np.int32)        # next free row of each expert
        soff = cuda.shared.array(_NOFF, np.int32)
        tbase = cuda.shared.array(_NOFF, np.int32)        # first tile of each expert
        she = cuda.shared.array(threads, np.int32)            # the chunk's expert ids
        wc = cuda.shared.array((nw, MAX_EXPERTS), np.int32)    # the chunk's count per (warp, expert)
        for e in range(tid, MAX_EXPERTS, threads):
            cnt[e] = 0
        cuda.syncthreads()
        for p in range(tid, n_pairs, threads):
            e = ids[p // top_k, p % top_k]
            if e >= 0 and e < n_experts:
                cuda.atomic.add(cnt, e, 1)
        cuda.syncthreads()
        if tid == 0:
            off = 0
            tb = 0
            for e in range(n_experts):
                c = cnt[e]
                soff[e] = off
                cur[e] = off
                tbase[e] = tb
                counts[e] = c
                offsets[e] = off
                off += c
                tb += (c + row_tile - 1) // row_tile
            soff[n_experts] = off
            tbase[n_experts] = tb
            offsets[n_experts] = off
            n_tiles[0] = tb
        cuda.syncthreads()
        for e in range(n_experts):
            for j in range(tid, tbase[e + 1] - tbase[e], threads):
                tile_expert[tbase[e] + j] = e
                tile_row[tbase[e] + j] = soff[e] + j * row_tile
        # Stable placement, one chunk of `threads` pairs at a time: rank within the warp (lanes below with the
        # same expert), plus the counts of the warps below, plus the expert's rows already placed.
        for base in range(0, n_pairs, threads):
            p = base + tid
            e = -1
            if p < n_pairs:
                e = ids[p // top_k, p % top_k]
                if e < 0 or e >= n_experts:
                    e = -1
            she[tid] = e
            for q in range(tid, nw * MAX_EXPERTS, threads):
                wc[q // MAX_EXPERTS, q % MAX_EXPERTS] = 0
            cuda.syncthreads()
            before = 0
            last = True
            for q in range(32):
                if she[wid * 32 + q] == e:
                    if q < lane:
                        before += 1
                    elif q > lane:
                        last = False
            if e >= 0 and last:
                wc[wid, e] = before + 1
            cuda.syncthreads()
            if e >= 0:
                pos = cur[e] + before
                for w in range(wid):
                    pos += wc[w, e]
                perm[pos] = p
            cuda.syncthreads()
            for e2 in range(tid, n_experts, threads):
                s = 0
                for w in range(nw):
                    s += wc[w, e2]
                cur[e2] += s
            cuda.syncthreads()

    return cuda.jit(moe_group_kernel)


def group_by_expert(topk_ids, *, workspace, num_experts: int, row_tile: int = 0, stream=None,
                    threads: int = 256) -> Routing:
    """Group the T*k routed pairs of topk_ids [T, k] (int32) by expert into the routing part of ``workspace``
    (counts, offsets, perm, tiles; see the module docstring). Returns the views (``Routing``). One block.
    ``row_tile`` (0: from T) must be the one the expert launch is given (its default picks the same)."""
    if topk_ids.ndim != 2 or topk_ids.dtype != np.int32:
        raise ValueError(f"group_by_expert: topk_ids must be int32 [T, k], got {topk_ids.shape} {topk_ids.dtype}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"group_by_expert: num_experts = {num_experts}; supported 1..{MAX_EXPERTS}")
    t, k = topk_ids.shape
    r, _, lay = _layout(t, k, num_experts, 0, row_tile)
    check_workspace("group_by_expert", workspace, lay.total)
    rt = routing_views(workspace, t, k, num_experts, r)
    threads = check_threads(threads)
    _make_group(threads)[1, threads, as_stream(stream)](
        topk_ids, rt.counts, rt.offsets, rt.perm, rt.tile_expert, rt.tile_row, rt.n_tiles, t * k, k,
        num_experts, r)
    return rt


# ------------------------------------------------------------------------------------ experts (bf16)

@cuda.jit(device=True, inline="always")
def _silu_mul(g, u):
    return g / (np.float32(1.0) + math.exp(-g)) * u


@cuda.jit(device=True, inline="always")
def _round(v):
    return dev_bf16_to_f32(dev_f32_to_bf16(v))


@functools.lru_cache(maxsize=None)
def _ffn_device(nb: int, rpb: int, threads: int, pair: bool):
    """gemv's block body with gathered x rows and an expert index:

    - ``dot_rows(wa, wb, e, x, xr, row0, n_rows, k, acc)``: this thread's partial dots of rows row0 .. row0+rpb
      of ``wa[e]`` (and with ``pair`` of ``wb[e]``, sharing each x load) with rows xr[0..nb) of x;
      ``acc[m * rpb * nb + r * nb + b]``;
    - ``stash(acc, scratch)`` / ``total(scratch, j)``: the block reduction (warp shuffles, then shared memory).
    """
    nw = threads // 32
    rn = rpb * nb
    na = rn * (2 if pair else 1)

    @cuda.jit(device=True, inline="always")
    def dot_rows(wa, wb, e, x, xr, row0, n_rows, k, acc):
        tid = cuda.threadIdx.x
        for j in range(na):
            acc[j] = np.float32(0.0)
        xf = cuda.local.array((nb, 8), np.float32)
        for c in range(tid * 8, k, threads * 8):
            for b in range(nb):
                x0, x1, x2, x3 = ld8_ro(x, (xr[b], c))
                xf[b, 0] = lo_f32(x0)
                xf[b, 1] = hi_f32(x0)
                xf[b, 2] = lo_f32(x1)
                xf[b, 3] = hi_f32(x1)
                xf[b, 4] = lo_f32(x2)
                xf[b, 5] = hi_f32(x2)
                xf[b, 6] = lo_f32(x3)
                xf[b, 7] = hi_f32(x3)
            for r in range(rpb):
                row = min(row0 + r, n_rows - 1)   # rows past the end: loads stay valid, results dropped
                w0, w1, w2, w3 = ld8_ro(wa, (e, row, c))
                a0 = lo_f32(w0)
                a1 = hi_f32(w0)
                a2 = lo_f32(w1)
                a3 = hi_f32(w1)
                a4 = lo_f32(w2)
                a5 = hi_f32(w2)
                a6 = lo_f32(w3)
                a7 = hi_f32(w3)
                for b in range(nb):
                    acc[r * nb + b] += (a0 * xf[b, 0] + a1 * xf[b, 1] + a2 * xf[b, 2] + a3 * xf[b, 3]
                                        + a4 * xf[b, 4] + a5 * xf[b, 5] + a6 * xf[b, 6] + a7 * xf[b, 7])
                if pair:
                    v0, v1, v2, v3 = ld8_ro(wb, (e, row, c))
                    c0 = lo_f32(v0)
                    c1 = hi_f32(v0)
                    c2 = lo_f32(v1)
                    c3 = hi_f32(v1)
                    c4 = lo_f32(v2)
                    c5 = hi_f32(v2)
                    c6 = lo_f32(v3)
                    c7 = hi_f32(v3)
                    for b in range(nb):
                        acc[rn + r * nb + b] += (c0 * xf[b, 0] + c1 * xf[b, 1] + c2 * xf[b, 2] + c3 * xf[b, 3]
                                                 + c4 * xf[b, 4] + c5 * xf[b, 5] + c6 * xf[b, 6] + c7 * xf[b, 7])

    @cuda.jit(device=True, inline="always")
    def stash(acc, scratch):
        tid = cuda.threadIdx.x
        lane = tid % 32
        wid = tid // 32
        for j in range(na):
            s = warp_sum(acc[j])
            if lane == 0:
                scratch[wid * na + j] = s
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def total(scratch, j):
        t = scratch[j]
        for q in range(1, nw):
            t += scratch[q * na + j]
        return t

    return dot_rows, stash, total


@functools.lru_cache(maxsize=None)
def _make_gate_up(nb: int, rpb: int, threads: int):
    rn = rpb * nb
    na = 2 * rn
    n_scratch = (threads // 32) * na
    dot_rows, stash, total = _ffn_device(nb, rpb, threads, True)

    def moe_gate_up_kernel(wg, wu, x, perm, offsets, tile_expert, tile_row, n_tiles, h, n_inter, hidden,
                           top_k, row_tile):
        # wg, wu: [E, I, H] bf16; x: [T, H] bf16; routing int32; h: [T*k, I] bf16 (grouped rows)
        # grid: (max_tiles, ceil(I / rpb)); block: threads
        tile = cuda.blockIdx.x
        if tile >= n_tiles[0]:
            return                      # the whole block: no barrier is left waiting
        tid = cuda.threadIdx.x
        e = tile_expert[tile]
        r0 = tile_row[tile]
        r_end = min(r0 + row_tile, offsets[e + 1])
        row0 = cuda.blockIdx.y * rpb
        xr = cuda.local.array(nb, np.int32)
        acc = cuda.local.array(na, np.float32)
        scratch = cuda.shared.array(n_scratch, np.float32)
        for b0 in range(r0, r_end, nb):
            for b in range(nb):
                xr[b] = perm[min(b0 + b, r_end - 1)] // top_k
            dot_rows(wg, wu, e, x, xr, row0, n_inter, hidden, acc)
            stash(acc, scratch)
            if tid < rn:
                row = row0 + tid // nb
                r = b0 + tid % nb
                if row < n_inter and r < r_end:
                    g = _round(total(scratch, tid))
                    u = _round(total(scratch, rn + tid))
                    h[r, row] = dev_f32_to_bf16(_silu_mul(g, u))
            cuda.syncthreads()           # scratch is rewritten by the next rows of the tile

    return cuda.jit(moe_gate_up_kernel)


@functools.lru_cache(maxsize=None)
def _make_down(nb: int, rpb: int, threads: int, out_bf16: bool):
    rn = rpb * nb
    n_scratch = (threads // 32) * rn
    dot_rows, stash, total = _ffn_device(nb, rpb, threads, False)

    def moe_down_kernel(wd, h, perm, offsets, tile_expert, tile_row, n_tiles, y, hidden, n_inter, top_k,
                        row_tile):
        # wd: [E, H, I] bf16; h: [T*k, I] bf16 (grouped rows); routing int32; y: [T, k, H] f32|bf16
        # grid: (max_tiles, ceil(H / rpb)); block: threads
        tile = cuda.blockIdx.x
        if tile >= n_tiles[0]:
            return
        tid = cuda.threadIdx.x
        e = tile_expert[tile]
        r0 = tile_row[tile]
        r_end = min(r0 + row_tile, offsets[e + 1])
        row0 = cuda.blockIdx.y * rpb
        xr = cuda.local.array(nb, np.int32)
        acc = cuda.local.array(rn, np.float32)
        scratch = cuda.shared.array(n_scratch, np.float32)
        for b0 in range(r0, r_end, nb):
            for b in range(nb):
                xr[b] = min(b0 + b, r_end - 1)
            dot_rows(wd, wd, e, h, xr, row0, hidden, n_inter, acc)
            stash(acc, scratch)
            if tid < rn:
                row = row0 + tid // nb
                r = b0 + tid % nb
                if row < hidden and r < r_end:
                    p = perm[r]
                    t = total(scratch, tid)
                    if out_bf16:
                        y[p // top_k, p % top_k, row] = dev_f32_to_bf16(t)
                    else:
                        y[p // top_k, p % top_k, row] = t
            cuda.syncthreads()

    return cuda.jit(moe_down_kernel)


# ------------------------------------------------------------------------------ experts (int4, MXFP4)

if SIM:
    def _ld16_ro(arr, idx):
        """16 bytes of a uint8 row as four little-endian uint32 words (the simulator's twin)."""
        a = arr._ary if hasattr(arr, "_ary") else arr
        base, j = tuple(int(i) for i in idx[:-1]), int(idx[-1])
        v = np.ascontiguousarray(a[base + (slice(j, j + 16),)], dtype=np.uint8)
        if v.shape[0] != 16:
            raise IndexError("vector load past the end of the last axis")
        w = v.view(np.uint32)
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])
else:
    _ld16_ro = ld8_ro   # the intrinsic loads 16 bytes at the element's address, whatever the dtype


@functools.lru_cache(maxsize=None)
def _make_q(kind: int, pair: bool, nb: int, rpw: int, threads: int, kt: int, out_bf16: bool):
    """qgemv's block body over a tile's gathered rows. ``pair``: the gate/up launch (rows of both matrices per
    warp, silu·mul epilogue into h); else the down launch (x = h rows, out = y[t, s])."""
    nw = threads // 32
    rows_blk = nw * rpw
    ncol = kt // 32
    nr = rpw * (2 if pair else 1)   # weight rows per warp: gate rows then up rows
    na = nr * nb
    cpg = INT4_GROUP // 32

    @cuda.jit(device=True, inline="always")
    def load(pk, s, z, e, row, gc, m, wd, sc, cz):
        wd[m, 0], wd[m, 1], wd[m, 2], wd[m, 3] = _ld16_ro(pk, (e, row, gc * 16))
        if kind == INT4:
            sc[m] = np.float32(s[e, row, gc // cpg]) * np.float32(16.0)
            cz[m] = np.float32(1.0) + np.float32(z[e, row, gc // cpg]) * np.float32(0.0625)
        else:
            sc[m] = dev_bf16_to_f32(np.uint32(s[e, row, gc]) << np.uint32(7))

    def moe_q_kernel(pa, sa, za, pb, sb, zb, x, perm, offsets, tile_expert, tile_row, n_tiles, out, n_rows,
                     k, top_k, row_tile):
        # pa/sa/za: the (gate | down) expert weights, pb/sb/zb: up (ignored for down); packed [E, N, K/2] u8;
        # scales int4 [E, N, K/128] f16|f32 (zeros alike), mxfp4 [E, N, K/32] u8.
        # gate/up: x [T, H] bf16, out = h [T*k, I] bf16; down: x = h, out = y [T, k, H] f32|bf16
        # grid: (max_tiles, ceil(N / (warps * rpw))); block: threads
        tile = cuda.blockIdx.x
        if tile >= n_tiles[0]:
            return
        tid = cuda.threadIdx.x
        lane = tid % 32
        e = tile_expert[tile]
        r0 = tile_row[tile]
        r_end = min(r0 + row_tile, offsets[e + 1])
        row0 = cuda.blockIdx.y * rows_blk + (tid // 32) * rpw
        xs = cuda.shared.array((nb, 32, ncol), np.float32)
        lut = cuda.shared.array(16, np.float32)
        if kind == MXFP4:
            if tid < 16:
                i = tid % 8
                mag = np.float32(i) * np.float32(0.5)
                if i >= 4:
                    mag = np.float32(6.0) if i == 7 else np.float32(i - 2)
                lut[tid] = -mag if tid >= 8 else mag
        xr = cuda.local.array(nb, np.int32)
        acc = cuda.local.array(na, np.float32)      # acc[m * nb + b], m = weight row of the warp
        part = cuda.local.array(na, np.float32)
        wd = cuda.local.array((nr, 4), np.uint32)
        sc = cuda.local.array(nr, np.float32)
        cz = cuda.local.array(nr, np.float32)
        xv = cuda.local.array((nb, 8), np.float32)
        for b0 in range(r0, r_end, nb):
            for b in range(nb):
                rr = min(b0 + b, r_end - 1)
                if pair:
                    xr[b] = perm[rr] // top_k
                else:
                    xr[b] = rr
            for j in range(na):
                acc[j] = np.float32(0.0)
            for t0 in range(0, k, kt):
                tlen = min(kt, k - t0)
                cuda.syncthreads()                  # the previous tile is no longer read
                for q8 in range(tid * 8, nb * kt, threads * 8):
                    b = q8 // kt
                    kk = q8 % kt
                    if kk < tlen:
                        x0, x1, x2, x3 = ld8_ro(x, (xr[b], t0 + kk))
                        c = kk // 32
                        i = kk % 32
                        xs[b, i, c] = lo_f32(x0)
                        xs[b, i + 1, c] = hi_f32(x0)
                        xs[b, i + 2, c] = lo_f32(x1)
                        xs[b, i + 3, c] = hi_f32(x1)
                        xs[b, i + 4, c] = lo_f32(x2)
                        xs[b, i + 5, c] = hi_f32(x2)
                        xs[b, i + 6, c] = lo_f32(x3)
                        xs[b, i + 7, c] = hi_f32(x3)
                cuda.syncthreads()
                for c in range(lane, tlen // 32, 32):
                    gc = t0 // 32 + c
                    for r in range(rpw):
                        row = min(row0 + r, n_rows - 1)
                        load(pa, sa, za, e, row, gc, r, wd, sc, cz)
                        if pair:
                            load(pb, sb, zb, e, row, gc, rpw + r, wd, sc, cz)
                    for j in range(na):
                        part[j] = np.float32(0.0)
                    for q in range(4):
                        for b in range(nb):
                            for j in range(8):
                                xv[b, j] = xs[b, 8 * q + j, c]
                        for m in range(nr):
                            w = wd[m, q]
                            if kind != INT4:
                                w = dev_mx_nibbles(w)
                            for j in range(8):
                                nib = (w >> np.uint32(4 * j)) & np.uint32(0xF)
                                if kind == INT4:
                                    v = dev_bf16_to_f32((nib << np.uint32(3)) | np.uint32(0x3F80)) - cz[m]
                                else:
                                    v = lut[nib]
                                for b in range(nb):
                                    part[m * nb + b] += v * xv[b, j]
                    for m in range(nr):
                        for b in range(nb):
                            acc[m * nb + b] += part[m * nb + b] * sc[m]
            for r in range(rpw):
                for b in range(nb):
                    row = row0 + r
                    rr = b0 + b
                    t = warp_sum(acc[r * nb + b])
                    u = t
                    if pair:
                        u = warp_sum(acc[(rpw + r) * nb + b])
                    if lane == 0 and row < n_rows and rr < r_end:
                        if pair:
                            out[rr, row] = dev_f32_to_bf16(_silu_mul(_round(t), _round(u)))
                        else:
                            p = perm[rr]
                            if out_bf16:
                                out[p // top_k, p % top_k, row] = dev_f32_to_bf16(t)
                            else:
                                out[p // top_k, p % top_k, row] = t

    return cuda.jit(moe_q_kernel)


# ------------------------------------------------------------------------------------ experts (host)

def _check_common(name, x, y, num_experts, hidden, inter):
    if x.ndim != 2 or x.dtype != np.uint16 or x.shape[1] != hidden:
        raise ValueError(f"{name}: x must be bf16 (uint16) [T, H={hidden}], got {x.shape} {x.dtype}")
    t = x.shape[0]
    if y.ndim != 3 or y.shape[0] != t or y.shape[2] != hidden or y.dtype not in (np.float32, np.uint16):
        raise ValueError(f"{name}: y must be float32 or bf16 (uint16) [T={t}, k, H={hidden}], got {y.shape} {y.dtype}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"{name}: E = {num_experts} experts; supported 1..{MAX_EXPERTS}")
    if t == 0 or y.shape[1] == 0 or inter == 0:
        raise ValueError(f"{name}: empty problem (T={t}, k={y.shape[1]}, I={inter})")
    return t, y.shape[1]


def _prepare(name, x, y, num_experts, hidden, inter, workspace, row_tile):
    t, k = _check_common(name, x, y, num_experts, hidden, inter)
    r, mt, lay = _layout(t, k, num_experts, inter, row_tile)
    check_workspace(name, workspace, lay.total)
    rt = routing_views(workspace, t, k, num_experts, r)
    h = h_view(workspace, t, k, num_experts, inter, r)
    return t, k, rt, h


def expert_ffn(x, w_gate, w_up, w_down, y, *, workspace, row_tile: int = 0, stream=None,
               config: MoeConfig | None = None):
    """y[t, s] = (silu(x[t]·Wg[e]ᵀ) * (x[t]·Wu[e]ᵀ)) · Wd[e]ᵀ for e = the expert of slot s of token t, bf16
    expert weights (w_gate, w_up [E, I, H], w_down [E, H, I]), reading only the routed experts' rows.

    x [T, H] bf16; y [T, k, H] fp32 or bf16. ``workspace``: the view ``group_by_expert`` filled (same T, k,
    E, row_tile), sized with ``workspace_requirement(T, k, E, I)``; h goes into it. Two launches; never allocates.
    """
    name = "expert_ffn"
    if w_gate.ndim != 3 or w_gate.dtype != np.uint16:
        raise ValueError(f"{name}: w_gate must be bf16 (uint16) [E, I, H], got {w_gate.shape} {w_gate.dtype}")
    ne, inter, hidden = w_gate.shape
    if w_up.shape != (ne, inter, hidden) or w_up.dtype != np.uint16:
        raise ValueError(f"{name}: w_up must be bf16 {(ne, inter, hidden)} like w_gate, got {w_up.shape} {w_up.dtype}")
    if w_down.shape != (ne, hidden, inter) or w_down.dtype != np.uint16:
        raise ValueError(f"{name}: w_down must be bf16 [E, H, I] = {(ne, hidden, inter)}, got {w_down.shape} "
                         f"{w_down.dtype}")
    t, k, rt, h = _prepare(name, x, y, ne, hidden, inter, workspace, row_tile)
    if not vec8_ok(w_gate, w_up, w_down, x, h):
        raise ValueError(f"{name}: H = {hidden} and I = {inter} must be multiples of 8 and the weights, x and the "
                         "workspace 16-byte aligned with contiguous rows (16-byte loads; there is no scalar path)")
    cfg = config or MoeConfig()
    threads = check_threads(cfg.threads)
    nb = rt.row_tile
    rpb_gu = cfg.rows_per_block or 1
    rpb_dn = cfg.rows_per_block or (2 if hidden >= 2048 else 1)
    if threads < max(rpb_gu, rpb_dn) * nb:
        raise ValueError(f"{name}: threads per block ({threads}) must cover rows_per_block * row_tile "
                         f"({max(rpb_gu, rpb_dn)} * {nb})")
    st = as_stream(stream)
    _make_gate_up(nb, rpb_gu, threads)[(rt.max_tiles, cdiv(inter, rpb_gu)), threads, st](
        w_gate, w_up, x, rt.perm, rt.offsets, rt.tile_expert, rt.tile_row, rt.n_tiles, h, inter, hidden, k, nb)
    _make_down(nb, rpb_dn, threads, y.dtype == np.uint16)[(rt.max_tiles, cdiv(hidden, rpb_dn)), threads, st](
        w_down, h, rt.perm, rt.offsets, rt.tile_expert, rt.tile_row, rt.n_tiles, y, hidden, inter, k, nb)


def _check_q(name, kind, what, w, ne, n, kdim):
    group = INT4_GROUP if kind == INT4 else MX_BLOCK
    parts = 3 if kind == INT4 else 2
    if not isinstance(w, (tuple, list)) or len(w) != parts:
        raise ValueError(f"{name}: {what} must be a tuple of {parts} stacked arrays "
                         f"({'packed, scales, zeros' if kind == INT4 else 'packed, scales'})")
    packed, scales = w[0], w[1]
    if kdim % group:
        unit = "int4 group" if kind == INT4 else "MXFP4 block"
        raise ValueError(f"{name}: {what}: K = {kdim} is not a multiple of the {unit} ({group})")
    sshape = (ne, n, kdim // group)
    if packed.shape != (ne, n, kdim // 2) or packed.dtype != np.uint8:
        raise ValueError(f"{name}: {what} packed must be uint8 {(ne, n, kdim // 2)}, got {packed.shape} {packed.dtype}")
    if scales.shape != sshape:
        raise ValueError(f"{name}: {what} scales must be {sshape}, got {scales.shape}")
    if kind == INT4:
        zeros = w[2]
        if scales.dtype not in (np.float16, np.float32) or zeros.dtype != scales.dtype or zeros.shape != sshape:
            raise ValueError(f"{name}: {what} int4 scales/zeros must both be float16 or float32 {sshape}, got "
                             f"{scales.dtype} {scales.shape} / {zeros.dtype} {zeros.shape}")
    elif scales.dtype != np.uint8:
        raise ValueError(f"{name}: {what} MXFP4 scales are uint8 E8M0 exponents, got {scales.dtype}")
    if packed.strides[2] != 1 or packed.strides[1] % 16 or packed.strides[0] % 16 or data_ptr(packed) % 16:
        raise ValueError(f"{name}: {what} packed weights must be contiguous rows on 16-byte boundaries")
    return tuple(w) if kind == INT4 else (packed, scales, scales)


def _launch_q(name, kind, x, gate, up, down, y, workspace, row_tile, stream, config):
    if not isinstance(gate, (tuple, list)) or len(gate) < 2 or getattr(gate[0], "ndim", 0) != 3:
        raise ValueError(f"{name}: gate must be a tuple of stacked arrays with packed [E, I, H/2]")
    ne, inter, hh = gate[0].shape
    hidden = 2 * hh
    g = _check_q(name, kind, "gate", gate, ne, inter, hidden)
    u = _check_q(name, kind, "up", up, ne, inter, hidden)
    d = _check_q(name, kind, "down", down, ne, hidden, inter)
    if g[1].dtype != u[1].dtype:
        raise ValueError(f"{name}: gate and up scales must share a dtype, got {g[1].dtype} / {u[1].dtype}")
    t, k, rt, h = _prepare(name, x, y, ne, hidden, inter, workspace, row_tile)
    if not vec8_ok(x, h):
        raise ValueError(f"{name}: x and the workspace must allow 16-byte loads (contiguous, aligned rows)")
    cfg = config or MoeConfig()
    threads = check_threads(cfg.threads)
    rpw = cfg.rows_per_warp
    if rpw < 1:
        raise ValueError(f"{name}: rows_per_warp must be >= 1, got {rpw}")
    nb = rt.row_tile
    kt = cfg.tile_k or SMEM_X // nb
    if kt % 32 or kt <= 0 or kt * nb > 12288:
        raise ValueError(f"{name}: tile_k must be a positive multiple of 32 with tile_k * row_tile <= 12288, got {kt}")
    rows_blk = (threads // 32) * rpw
    st = as_stream(stream)
    _make_q(kind, True, nb, rpw, threads, kt, False)[(rt.max_tiles, cdiv(inter, rows_blk)), threads, st](
        g[0], g[1], g[2], u[0], u[1], u[2], x, rt.perm, rt.offsets, rt.tile_expert, rt.tile_row, rt.n_tiles, h,
        inter, hidden, k, nb)
    _make_q(kind, False, nb, rpw, threads, kt, y.dtype == np.uint16)[(rt.max_tiles, cdiv(hidden, rows_blk)),
                                                                     threads, st](
        d[0], d[1], d[2], d[0], d[1], d[2], h, rt.perm, rt.offsets, rt.tile_expert, rt.tile_row, rt.n_tiles, y,
        hidden, inter, k, nb)


def expert_ffn_int4(x, gate, up, down, y, *, workspace, row_tile: int = 0, stream=None,
                    config: MoeConfig | None = None):
    """``expert_ffn`` with int4 group-128 expert weights: gate, up = (packed u8 [E, I, H/2], scales, zeros
    [E, I, H/128] fp16|fp32), down = (packed [E, H, I/2], scales, zeros [E, H, I/128]); H, I multiples of 128."""
    _launch_q("expert_ffn_int4", INT4, x, gate, up, down, y, workspace, row_tile, stream, config)


def expert_ffn_mxfp4(x, gate, up, down, y, *, workspace, row_tile: int = 0, stream=None,
                     config: MoeConfig | None = None):
    """``expert_ffn`` with MXFP4 expert weights: gate, up = (packed u8 [E, I, H/2], scales u8 [E, I, H/32]),
    down = (packed [E, H, I/2], scales [E, H, I/32]); H, I multiples of 32."""
    _launch_q("expert_ffn_mxfp4", MXFP4, x, gate, up, down, y, workspace, row_tile, stream, config)


def quantize_experts(w, kind: str):
    """Host helper: quantize stacked expert weights [E, N, K] (fp32) with ``quant.py``'s quantizer of ``kind``
    ('int4' | 'mxfp4') expert by expert; returns the same NamedTuple with every array stacked on a leading E."""
    w = np.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"quantize_experts: weights must be [E, N, K], got {w.shape}")
    if kind == "int4":
        parts = [quantize_int4(w[e]) for e in range(w.shape[0])]
        return Int4Weights(*(np.stack(a) for a in zip(*parts)))
    if kind == "mxfp4":
        parts = [quantize_mxfp4(w[e]) for e in range(w.shape[0])]
        return MXFP4Weights(*(np.stack(a) for a in zip(*parts)))
    raise ValueError(f"unknown quantization kind {kind!r}: expected 'int4' or 'mxfp4'")


# -------------------------------------------------------------------------------------------- combine

@functools.lru_cache(maxsize=None)
def _make_combine(y_bf16: bool, out_bf16: bool, has_shared: bool, has_gate: bool):
    def moe_combine_kernel(y, wts, out, shared, gate, n_tokens, hidden, top_k):
        # y: [T, k, H] f32|bf16; wts: [T, k] f32; out: [T, H] bf16|f32; shared: [T, H] bf16; gate: [T] f32
        # grid: ceil(T * H / threads); one element per thread
        i = cuda.grid(1)
        if i < n_tokens * hidden:
            t = i // hidden
            c = i - t * hidden
            acc = np.float32(0.0)
            for s in range(top_k):
                if y_bf16:
                    v = dev_bf16_to_f32(y[t, s, c])
                else:
                    v = y[t, s, c]
                acc += wts[t, s] * v
            if has_shared:
                sv = dev_bf16_to_f32(shared[t, c])
                if has_gate:
                    sv = sv / (np.float32(1.0) + math.exp(-gate[t]))
                acc += sv
            if out_bf16:
                out[t, c] = dev_f32_to_bf16(acc)
            else:
                out[t, c] = acc

    return cuda.jit(moe_combine_kernel)


def combine(y, topk_weights, out, *, shared=None, shared_gate=None, workspace=None, stream=None,
            threads: int = 256):
    """out[t] = Σ_s topk_weights[t, s] · y[t, s] (+ sigmoid(shared_gate[t]) · shared[t], or + shared[t]).

    y [T, k, H] fp32|bf16; topk_weights [T, k] fp32; out [T, H] bf16|fp32; shared [T, H] bf16 (the shared
    expert's output); shared_gate [T] or [T, 1] fp32 logits (needs shared). Never allocates.
    """
    check_workspace("combine", workspace, 0)
    if y.ndim != 3 or y.dtype not in (np.float32, np.uint16):
        raise ValueError(f"combine: y must be float32 or bf16 (uint16) [T, k, H], got {y.shape} {y.dtype}")
    t, k, hidden = y.shape
    if topk_weights.shape != (t, k) or topk_weights.dtype != np.float32:
        raise ValueError(f"combine: topk_weights must be float32 {(t, k)}, got {topk_weights.shape} "
                         f"{topk_weights.dtype}")
    if out.shape != (t, hidden) or out.dtype not in (np.float32, np.uint16):
        raise ValueError(f"combine: out must be float32 or bf16 {(t, hidden)}, got {out.shape} {out.dtype}")
    if shared is not None and (shared.shape != (t, hidden) or shared.dtype != np.uint16):
        raise ValueError(f"combine: shared must be bf16 (uint16) {(t, hidden)}, got {shared.shape} {shared.dtype}")
    if shared_gate is not None:
        if shared is None:
            raise ValueError("combine: shared_gate without shared")
        if shared_gate.ndim == 2 and shared_gate.shape[1] == 1:
            shared_gate = shared_gate.reshape(shared_gate.shape[0])
        if shared_gate.shape != (t,) or shared_gate.dtype != np.float32:
            raise ValueError(f"combine: shared_gate must be float32 [T={t}] or [T, 1], got {shared_gate.shape} "
                             f"{shared_gate.dtype}")
    threads = check_threads(threads)
    total = t * hidden
    if total:
        _make_combine(y.dtype == np.uint16, out.dtype == np.uint16, shared is not None, shared_gate is not None)[
            cdiv(total, threads), threads, as_stream(stream)](
            y, topk_weights, out, topk_weights if shared is None else shared,
            topk_weights if shared_gate is None else shared_gate, t, hidden, k)


# ------------------------------------------------------------------------------------------ reference

def _as_f32(a) -> np.ndarray:
    a = np.asarray(a)
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def reference_router(logits, top_k: int, *, scoring: str = "mixtral", norm_topk_prob=None):
    """(ids int32 [T, k], weights fp32 [T, k]): stable sort (ties -> lower index; NaN as -inf), fp64 softmax
    by the architecture's definition (see the module docstring)."""
    mode, renorm = _scoring(scoring, norm_topk_prob)
    x = _as_f32(logits).astype(np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    ids = np.argsort(-x, axis=1, kind="stable")[:, :top_k]
    sel = np.take_along_axis(x, ids, axis=1)
    m = sel[:, :1]
    if mode == MIXTRAL:
        p = np.exp(sel - m)
        w = p / p.sum(axis=1, keepdims=True)
    else:
        w = np.exp(sel - m) / np.exp(x - m).sum(axis=1, keepdims=True)
        if renorm:
            w = w / w.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


def reference_group(topk_ids, num_experts: int, row_tile: int = 0) -> dict:
    """What ``group_by_expert`` writes: counts, offsets, perm (stable by pair index), tile_expert, tile_row,
    n_tiles (int32 NumPy arrays; ``n_tiles`` an int). ``row_tile`` 0: from T, as the launch picks it."""
    ids = np.asarray(topk_ids, np.int32)
    r = _row_tile(ids.shape[0], row_tile)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[valid], minlength=num_experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    order = np.nonzero(valid)[0]
    perm = order[np.argsort(flat[order], kind="stable")].astype(np.int32)
    te, tr = [], []
    for e in range(num_experts):
        for r0 in range(offsets[e], offsets[e + 1], r):
            te.append(e)
            tr.append(r0)
    return {"counts": counts, "offsets": offsets, "perm": perm, "tile_expert": np.array(te, np.int32),
            "tile_row": np.array(tr, np.int32), "n_tiles": len(te), "row_tile": r}


def _reference_experts(x, topk_ids, wg, wu, wd):
    """(y fp32 [T, k, H], h bf16 [T, k, I]); wg/wu/wd(e) -> fp32 weight matrices of expert e."""
    from .elementwise import reference_silu_mul
    xf = bf16_to_f32(x).astype(np.float64)
    ids = np.asarray(topk_ids)
    t, k = ids.shape
    y = h = None
    for e in np.unique(ids):
        ts, ss = np.nonzero(ids == e)
        g = f32_to_bf16((xf[ts] @ wg(e).astype(np.float64).T).astype(np.float32))
        u = f32_to_bf16((xf[ts] @ wu(e).astype(np.float64).T).astype(np.float32))
        he = reference_silu_mul(g, u)
        ye = bf16_to_f32(he).astype(np.float64) @ wd(e).astype(np.float64).T
        if y is None:
            y = np.zeros((t, k, ye.shape[1]), np.float32)
            h = np.zeros((t, k, he.shape[1]), np.uint16)
        y[ts, ss] = ye
        h[ts, ss] = he
    return y, h


def reference_experts(x, topk_ids, w_gate, w_up, w_down, *, return_h: bool = False):
    """y fp32 [T, k, H] of bf16 experts: gate/up in fp64 rounded to bf16, h = silu·mul rounded once
    (= ``gemv.reference_gate_up_silu`` per routed row), down in fp64 (unrounded).
    ``return_h``: (y, h bf16 [T, k, I])."""
    y, h = _reference_experts(x, topk_ids, lambda e: bf16_to_f32(w_gate[e]), lambda e: bf16_to_f32(w_up[e]),
                              lambda e: bf16_to_f32(w_down[e]))
    return (y, h) if return_h else y


def reference_experts_int4(x, topk_ids, gate, up, down, *, return_h: bool = False):
    """``reference_experts`` of int4 experts (``dequantize_int4`` per expert)."""
    y, h = _reference_experts(x, topk_ids, *(lambda e, w=w: dequantize_int4(w[0][e], w[1][e], w[2][e])
                                              for w in (gate, up, down)))
    return (y, h) if return_h else y


def reference_experts_mxfp4(x, topk_ids, gate, up, down, *, return_h: bool = False):
    """``reference_experts`` of MXFP4 experts (``dequantize_mxfp4`` per expert)."""
    y, h = _reference_experts(x, topk_ids, *(lambda e, w=w: dequantize_mxfp4(w[0][e], w[1][e])
                                              for w in (gate, up, down)))
    return (y, h) if return_h else y


def reference_combine(y, topk_weights, shared=None, shared_gate=None) -> np.ndarray:
    """fp32 [T, H] (unrounded; fp64 sums): Σ_s w[t, s]·y[t, s] (+ sigmoid(gate[t])·shared[t])."""
    yf = _as_f32(y).astype(np.float64)
    w = np.asarray(topk_weights, np.float64)
    out = np.einsum("ts,tsh->th", w, yf)
    if shared is not None:
        sv = bf16_to_f32(shared).astype(np.float64)
        if shared_gate is not None:
            g = np.asarray(shared_gate, np.float64).reshape(-1)
            sv = sv / (1.0 + np.exp(-g))[:, None]
        out = out + sv
    return out.astype(np.float32)


def reference_moe(x, w_router, w_gate, w_up, w_down, top_k: int, *, scoring: str = "mixtral",
                  norm_topk_prob=None, shared_mlp=None, w_shared_gate=None) -> np.ndarray:
    """The whole sparse MoE block as the launches compute it, fp32 [T, H] before the output rounding:
    router logits = ``gemv.reference`` (fp32), ``reference_router``, ``reference_experts`` (fp32 y),
    ``reference_combine``. ``shared_mlp`` = (w_gate [Is, H], w_up [Is, H], w_down [H, Is]) bf16: its output is
    the dense MLP's (``gemv_gate_up_silu`` then ``gemv``, rounded to bf16); ``w_shared_gate`` [1, H] bf16."""
    from . import gemv
    logits = gemv.reference(w_router, x)
    ids, wts = reference_router(logits, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob)
    y = reference_experts(x, ids, w_gate, w_up, w_down)
    shared = gate = None
    if shared_mlp is not None:
        sg, su, sd = shared_mlp
        shared = f32_to_bf16(gemv.reference(sd, gemv.reference_gate_up_silu(sg, su, x)))
        if w_shared_gate is not None:
            gate = gemv.reference(w_shared_gate, x)[:, 0]
    return reference_combine(y, wts, shared, gate)


# ------------------------------------------------------------------------------------- bytes / flops

def _weight_bytes(hidden: int, inter: int, kind: str, scale_itemsize: int) -> int:
    """Bytes of one expert's three matrices."""
    n = 3 * hidden * inter
    if kind == "bf16":
        return 2 * n
    if kind == "int4":
        return n // 2 + 2 * (n // INT4_GROUP) * scale_itemsize
    if kind == "mxfp4":
        return n // 2 + n // MX_BLOCK
    raise ValueError(f"unknown kind {kind!r}")


def bytes_moved(tokens: int, top_k: int, num_experts: int, hidden: int = 0, intermediate: int = 0, *,
                op: str = "experts", kind: str = "bf16", active_experts: int | None = None,
                logits_itemsize: int = 4, y_itemsize: int = 4, out_itemsize: int = 2,
                scale_itemsize: int = 2, shared: bool = False) -> int:
    """HBM bytes of one op. experts: the routed experts' weights once (``active_experts``, default the most
    T*k pairs can hit), x, h written and read back (bf16), y; router: logits in, ids and weights out;
    group: ids in, routing out; combine: y, weights, out (+ shared output and gate)."""
    p = tokens * top_k
    if op == "router":
        return tokens * num_experts * logits_itemsize + 8 * p
    if op == "group":
        r = _row_tile(tokens)
        return 4 * p + 4 * (2 * num_experts + 1) + 4 * p + 8 * max_tiles(p, num_experts, r) + 4
    if op == "experts":
        act = min(num_experts, p) if active_experts is None else active_experts
        return (act * _weight_bytes(hidden, intermediate, kind, scale_itemsize) + 2 * tokens * hidden
                + 2 * 2 * p * intermediate + y_itemsize * p * hidden)
    if op == "combine":
        return (y_itemsize * p * hidden + 4 * p + out_itemsize * tokens * hidden
                + ((2 * tokens * hidden + 4 * tokens) if shared else 0))
    raise ValueError(f"unknown moe op {op!r}")


def flops(tokens: int, top_k: int, num_experts: int, hidden: int = 0, intermediate: int = 0, *,
          op: str = "experts") -> int:
    p = tokens * top_k
    if op == "router":
        return 3 * tokens * num_experts
    if op == "group":
        return 0
    if op == "experts":
        return 6 * p * hidden * intermediate + 4 * p * intermediate
    if op == "combine":
        return 2 * p * hidden
    raise ValueError(f"unknown moe op {op!r}")


# -------------------------------------------------------------------------------------- signatures

_R = "int32[::1]"
_ROUTE = ", ".join([_R] * 5)   # perm, offsets, tile_expert, tile_row, n_tiles
_I64 = "int64"


def _sig_router(t: str) -> str:
    return f"void({t}[:, ::1], int32[:, ::1], float32[:, ::1], int64, int64, int64)"


_SIG_GROUP = f"void(int32[:, ::1], {', '.join([_R] * 6)}, int64, int64, int64, int64)"
_SIG_GATE_UP = f"void(uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, ::1], {_ROUTE}, uint16[:, ::1], " \
               "int64, int64, int64, int64)"


def _sig_down(y: str) -> str:
    return f"void(uint16[:, :, ::1], uint16[:, ::1], {_ROUTE}, {y}[:, :, ::1], int64, int64, int64, int64)"


def _sig_q(kind: int, scale_t: str, pair: bool, y: str) -> str:
    s = f"{scale_t}[:, :, ::1]"
    w = f"uint8[:, :, ::1], {s}, {s}"
    out = "uint16[:, ::1]" if pair else f"{y}[:, :, ::1]"
    return f"void({w}, {w}, uint16[:, ::1], {_ROUTE}, {out}, int64, int64, int64, int64)"


def _sig_combine(y: str, out: str, has_shared: bool, has_gate: bool) -> str:
    sh = "uint16[:, ::1]" if has_shared else "float32[:, ::1]"
    g = "float32[::1]" if has_gate else "float32[:, ::1]"
    return f"void({y}[:, :, ::1], float32[:, ::1], {out}[:, ::1], {sh}, {g}, int64, int64, int64)"


# Router: fp32 and bf16 logits, each scoring; grouping at the default block; bf16 experts at the row tiles
# T = 1, 2, >= 3 pick (gate/up one row of each matrix per block; down two rows for H >= 2048, one below),
# y fp32 and bf16; int4 (fp16 and fp32 scales) and MXFP4 experts, both launches, row tiles 1 and 4;
# combine plain, with a shared expert, with a gated shared expert, fp32 out.
SIGNATURES = [
    (_make_router(bf, mode, rn).py_func, _sig_router("uint16" if bf else "float32"))
    for bf in (False, True) for mode, rn in ((MIXTRAL, True), (QWEN, True), (QWEN, False))
] + [(_make_group(256).py_func, _SIG_GROUP)] + [
    (_make_gate_up(nb, 1, 128).py_func, _SIG_GATE_UP) for nb in (1, 2, 4)
] + [
    (_make_down(nb, rpb, 128, ob).py_func, _sig_down("uint16" if ob else "float32"))
    for nb, rpb, ob in ((1, 2, False), (1, 2, True), (4, 2, False), (1, 1, False))
] + [
    (_make_q(INT4, pair, nb, 2, 128, SMEM_X // nb, False).py_func, _sig_q(INT4, st, pair, "float32"))
    for pair in (True, False) for nb, st in ((1, "float16"), (4, "float16"), (1, "float32"))
] + [
    (_make_q(MXFP4, pair, nb, 2, 128, SMEM_X // nb, ob).py_func,
     _sig_q(MXFP4, "uint8", pair, "uint16" if ob else "float32"))
    for pair, nb, ob in ((True, 1, False), (True, 4, False), (False, 1, False), (False, 4, False), (False, 1, True))
] + [
    (_make_combine(yb, ob, sh, g).py_func, _sig_combine("uint16" if yb else "float32", "uint16" if ob else "float32",
                                                       sh, g))
    for yb, ob, sh, g in ((False, True, False, False), (False, True, True, True), (False, True, True, False),
                          (True, True, False, False), (False, False, False, False))
]
