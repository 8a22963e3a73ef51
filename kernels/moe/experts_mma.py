"""The bf16 experts' SwiGLU FFN on the tensor cores (``expert_ffn``'s route for tiles of ``MMA_ROWS`` rows, where
``takes`` says): a tile of up to 8 grouped rows (one expert's tokens) is the n8 operand of ``gemv_mma``'s block body,
a block of 4 warps owns 16 weight rows of the expert and runs ``mma.sync.m16n8k16`` over K in 64-element chunks, so
each routed expert's weights are read once per tile of 8 tokens (the SIMT kernels of ``experts.py`` read them once
per 4) and the multiply-adds run on the tensor cores. h is rounded as the SIMT kernels round it (gate and up to bf16,
silu·mul in fp32, bf16).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.launch import cdiv
from vmmstream.kernels.matmul.dense import gemv_mma as gm

MMA = False                 # off until measured on a GPU (``bench/test_bench_batch.py``; sim-checked meanwhile)
MMA_ROWS = 8                # a tile's rows: the mma's n8
MMA_MIN_TOKENS = 8          # tokens from which a step's tiles are built for it
_MW, _MR, _MT = gm.WARPS, gm.ROWS, gm.NT      # warps, weight rows and threads of a block (plain names: shapes)


def mma_row_tile(tokens: int, hidden: int, inter: int) -> int:
    """The row tile for which ``expert_ffn`` runs its tensor-core kernels (give it to ``group_by_expert`` and
    ``expert_ffn`` both), or 0: the SIMT kernels' default."""
    return MMA_ROWS if tokens >= MMA_MIN_TOKENS and takes(MMA_ROWS, hidden, inter) else 0


@cuda.jit(device=True, inline="always")
def _round_bf16(v):
    return dev_bf16_to_f32(dev_f32_to_bf16(v))


@cuda.jit(device=True, inline="always")
def _mma_tile(tile_expert, tile_row, offsets, tile):
    """Tile ``tile``'s expert, first grouped row and end, and this lane's grouped row (its n8 column; the last
    row of a partial tile repeats, its sums dropped)."""
    e = tile_expert[tile]
    r0 = tile_row[tile]
    r_end = min(r0 + MMA_ROWS, offsets[e + 1])
    return e, r0, r_end, min(r0 + (cuda.threadIdx.x % 32 >> 2), r_end - 1)


@functools.lru_cache(maxsize=None)
def _make_gate_up_mma():
    rows, publish = gm._device(1, True, True)
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    NA = 2 * 2 * 4          # gate and up, and the simulator's spill half

    def moe_mma_gate_up_kernel(wg, wu, x, perm, offsets, tile_expert, tile_row, n_tiles, h, n_inter, hidden, top_k):
        # wg, wu: [E, I, H] bf16; x: [T, H] bf16; routing int32 (row tile 8); h: [T*k, I] bf16 (grouped rows)
        # grid: (max_tiles, ceil(I / 16)); block: 128
        mscr = cuda.shared.array((MS0, MS1), np.float64)
        red = cuda.shared.array((2, _MW, _MR, MMA_ROWS), np.float32)
        acc = cuda.local.array(NA, np.float32)
        tile = cuda.blockIdx.x
        if tile >= n_tiles[0]:
            return                  # the whole block
        e, r0, r_end, lr = _mma_tile(tile_expert, tile_row, offsets, tile)
        xg = perm[lr] // top_k          # this lane's token
        row0 = cuda.blockIdx.y * _MR
        rows(wg[e], wu[e], x, xg, row0, n_inter, MMA_ROWS, hidden, acc, mscr)
        publish(red, acc)
        for el in range(cuda.threadIdx.x, _MR * MMA_ROWS, _MT):
            r, b = el % _MR, el // _MR
            if row0 + r < n_inter and r0 + b < r_end:
                gv = _round_bf16(gm._total(red, 0, r, b))
                uv = _round_bf16(gm._total(red, 1, r, b))
                h[r0 + b, row0 + r] = dev_f32_to_bf16(gm.silu_mul(gv, uv))

    return mh.kernel(gm.NT)(moe_mma_gate_up_kernel)


@functools.lru_cache(maxsize=None)
def _make_down_mma(out_bf16: bool):
    rows, publish = gm._device(1, False, True)
    MS0, MS1 = mh.SIM_MMA_SCRATCH
    NA = 2 * 4

    def moe_mma_down_kernel(wd, h, perm, offsets, tile_expert, tile_row, n_tiles, y, hidden, n_inter, top_k):
        # wd: [E, H, I] bf16; h: [T*k, I] bf16 (grouped rows); y: [T, k, H] f32|bf16
        # grid: (max_tiles, ceil(H / 16)); block: 128
        mscr = cuda.shared.array((MS0, MS1), np.float64)
        red = cuda.shared.array((1, _MW, _MR, MMA_ROWS), np.float32)
        acc = cuda.local.array(NA, np.float32)
        tile = cuda.blockIdx.x
        if tile >= n_tiles[0]:
            return
        e, r0, r_end, xg = _mma_tile(tile_expert, tile_row, offsets, tile)     # this lane's row of h
        row0 = cuda.blockIdx.y * _MR
        rows(wd[e], wd[e], h, xg, row0, hidden, MMA_ROWS, n_inter, acc, mscr)
        publish(red, acc)
        for el in range(cuda.threadIdx.x, _MR * MMA_ROWS, _MT):
            r, b = el % _MR, el // _MR
            if row0 + r < hidden and r0 + b < r_end:
                p = perm[r0 + b]
                t = gm._total(red, 0, r, b)
                if out_bf16:
                    y[p // top_k, p % top_k, row0 + r] = dev_f32_to_bf16(t)
                else:
                    y[p // top_k, p % top_k, row0 + r] = t

    return mh.kernel(gm.NT)(moe_mma_down_kernel)


def takes(row_tile: int, hidden: int, inter: int) -> bool:
    """Whether ``expert_ffn`` runs these kernels for a routing of ``row_tile`` rows per tile."""
    return MMA and row_tile == MMA_ROWS and hidden % gm.KC == 0 and inter % gm.KC == 0


def launch(x, w_gate, w_up, w_down, y, rt, h, top_k, stream) -> None:
    """The two launches (gate/up into h, then down into y) over the routing views ``rt``; shapes checked by
    ``expert_ffn``."""
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    _make_gate_up_mma()[(rt.max_tiles, cdiv(inter, gm.ROWS)), gm.NT, stream](
        w_gate, w_up, x, rt.perm, rt.offsets, rt.tile_expert, rt.tile_row, rt.n_tiles, h, inter, hidden, top_k)
    _make_down_mma(y.dtype == np.uint16)[(rt.max_tiles, cdiv(hidden, gm.ROWS)), gm.NT, stream](
        w_down, h, rt.perm, rt.offsets, rt.tile_expert, rt.tile_row, rt.n_tiles, y, hidden, inter, top_k)
