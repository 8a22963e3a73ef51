"""MoE experts: the experts' SwiGLU FFN over the rows ``group_by_expert`` grouped (``route.py``), with bf16,
int4 or MXFP4 expert weights, and ``quantize_experts``, the host helper that stacks ``quant.py``'s layouts per
expert; the overview, layouts and workspace contract are in ``moe.py``.

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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.moe import experts_mma
from vmmstream.kernels.matmul.dense.gemv import dot8, stage8_f32, warp_partials, x8_f32
from vmmstream.kernels.base.launch import (as_stream, cdiv, check_threads, check_workspace, data_ptr, ld8_ro,
    ld16_ro, vec8_ok, warp_sum)
from vmmstream.kernels.moe.route import MAX_EXPERTS, _layout, h_view, routing_views
from vmmstream.kernels.matmul.quant.gemv_simt import stage8_cols
from vmmstream.kernels.matmul.quant.formats import (INT4, INT4_GROUP, MX_BLOCK, MXFP4, Int4Weights, MXFP4Weights, quantize_int4,
    quantize_mxfp4)

SMEM_X = 8192                   # quantized experts: fp32 x values staged per block (32 KiB), as in qgemv


@dataclass(frozen=True)
class MoeConfig:
    threads: int = 128
    rows_per_block: int = 0   # bf16 experts: weight rows (of each matrix) per block; 0: gate/up 1, down 2 if H >= 2048
    rows_per_warp: int = 2    # int4 / MXFP4 experts: weight rows (of each matrix) per warp
    tile_k: int = 0           # int4 / MXFP4: K values of x staged per pass; 0: SMEM_X // row_tile


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
                stage8_f32(xf, b, x0, x1, x2, x3)
            for r in range(rpb):
                row = min(row0 + r, n_rows - 1)   # rows past the end: loads stay valid, results dropped
                w0, w1, w2, w3 = ld8_ro(wa, (e, row, c))
                a = x8_f32(w0, w1, w2, w3)
                for b in range(nb):
                    acc[r * nb + b] += dot8(a, xf, b)
                if pair:
                    v0, v1, v2, v3 = ld8_ro(wb, (e, row, c))
                    a = x8_f32(v0, v1, v2, v3)
                    for b in range(nb):
                        acc[rn + r * nb + b] += dot8(a, xf, b)

    stash, total = warp_partials(na, nw)
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

    return jit(moe_gate_up_kernel)


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

    return jit(moe_down_kernel)


# ------------------------------------------------------------------------------ experts (int4, MXFP4)



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
        wd[m, 0], wd[m, 1], wd[m, 2], wd[m, 3] = ld16_ro(pk, (e, row, gc * 16))
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
                        stage8_cols(xs, b, i, c, x0, x1, x2, x3)
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

    return jit(moe_q_kernel)


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
    st = as_stream(stream)
    if experts_mma.takes(rt.row_tile, hidden, inter):          # tiles of 8 rows on the tensor cores
        experts_mma.launch(x, w_gate, w_up, w_down, y, rt, h, k, st)
        return
    cfg = config or MoeConfig()
    threads = check_threads(cfg.threads)
    nb = rt.row_tile
    rpb_gu = cfg.rows_per_block or 1
    rpb_dn = cfg.rows_per_block or (2 if hidden >= 2048 else 1)
    if threads < max(rpb_gu, rpb_dn) * nb:
        raise ValueError(f"{name}: threads per block ({threads}) must cover rows_per_block * row_tile "
                         f"({max(rpb_gu, rpb_dn)} * {nb})")
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
