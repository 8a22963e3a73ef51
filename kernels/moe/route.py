"""MoE routing: the router's top-k over the router logits, and the grouping of the routed (token, slot) pairs
by expert into the workspace the expert launches (``experts.py``) read; the overview, layouts and workspace
contract are in ``moe.py``.

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

Workspace (``workspace_requirement``): the routing buffers (int32) first, then the expert launches' bf16 h;
``routing_views`` and ``h_view`` are views of them (no allocation).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import dev_bf16_to_f32
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import as_stream, cdiv, check_threads, check_workspace, warp_argmax, warp_sum
from vmmstream.kernels.base.workspace import NONE, Lifetime, WorkspaceRequirement, layout

MAX_EXPERTS = 128
MAX_TOPK = 8
_VALS = MAX_EXPERTS // 32       # router: logits held per lane
_NO_EXPERT = 1 << 30            # router: "no candidate" index (loses every tie)
_NOFF = MAX_EXPERTS + 1         # grouping: offsets entries (shared array shapes must be plain names)
MIXTRAL, QWEN = 0, 1
SCORING = {"mixtral": MIXTRAL, "qwen2_moe": QWEN, "qwen3_moe": QWEN}


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

    return jit(router_topk_kernel)


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

    return jit(moe_group_kernel)


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
