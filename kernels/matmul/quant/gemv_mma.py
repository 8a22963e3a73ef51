"""Quantized decode GEMV on tensor cores: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias), W int4 group-wise or MXFP4
(``kernels/matmul/quant/formats.py``), one ``mma.sync.m16n8k16`` bf16 per 16 × 16 slice, fp32 accumulation.

The scalar route (``kernels/matmul/quant/gemv.py``) spends several integer and float instructions per 4-bit value;
here two values become one packed bf16 pair in a few bit operations and one packed fma, and the tensor
core does the multiply-adds. At the decode shapes the loads alone run near the copy rate (the sweep's probe,
docs/bench/HISTORY.md); what costs is the decode and mma work that the loads do not hide, so the layout keeps
the instructions per value low:

- a block is 4 warps over 16 rows of W and up to 8 columns of x (the batch); warp w takes the int4 groups
  (128 values) w, w + 4, ... and the warps' partial sums meet in shared memory at the end. At B = 1 the
  loop takes two groups per step through two register sets, so that neither set is copied into the other.
  At B = 1 a block may hold up to 7 such row tiles (``row_tiles``, 4 warps each, 896 threads at most: the
  warps of 7 blocks of 128 in one), so that x is staged once for all of them instead of once per tile;
- lane (g, t) = (lane / 4, lane % 4) loads one 16-byte chunk (32 values) of rows g and g + 8 per group:
  values 32t .. 32t + 31 of the group (for MXFP4 that is exactly one block: one scale per lane and row).
  The next group's chunks and scales are loaded before the current group is multiplied (``prefetch``),
  so every warp has a load in flight while it computes;
- the mma's k order inside a 16-wide step is free as long as the A and B fragments agree: the step pairs
  values (j, j + 4) of a 32-bit word (nibbles j, j + 4, ``kernels/matmul/quant/formats.py``), which shifts and masks place
  in the two bf16 halves. x's
  matching pairs (x[j], x[j + 4]) are built once per block: x is staged in shared memory already
  permuted (a tile of 4096 values for B = 1, 512 per column for B > 1), so the loop reads each step's
  B fragment with plain shared loads; a lane's four 16-byte slots are rotated by t so the quad's reads
  fall in distinct banks;
- int4: a nibble in the low bits of bf16 128.0 (``| 0x43004300``) is 128 + q, and one ``fma.rn.bf16x2``
  with 1.0 and −(128 + zero) leaves q − zero exactly (integers below 256 are exact in bf16); each group's
  D is scaled by its row's group scale once;
- MXFP4: the three magnitude bits of an E2M1 code go to bf16 bits 8..6 and the sign to bit 15, which is
  the value times 2^-126 (the code 0.5 a subnormal): two shifts, a mask and a masked or per pair (15 integer
  instructions per 8 codes; the batch-1 default is ``kernels/matmul/quant/gemv_imma.py``, on integer tensor cores). At B > 1 one packed fma by 2^(e - 1) gives value · 2^(e - 127) exactly (2^(e - 1) is a bf16 for e <= 128; where a
  lane of the warp holds a larger scale, the warp takes a second fma per pair for that group, a warp vote). At B = 1 the codes enter the
  mma as they are and the block scale goes on D instead: B's column 2t holds x only at the k of lane t's
  chunk (the other lanes read a zero block), so D column 2t is MX block t's sum alone and lane t scales it
  by its own 2^(e - 127) in fp32, two fma per group instead of one per pair. x is staged as bf16 x · 2^c
  (exact, a power of two) so the products stay in fp32's normal range: c = 116 while every |x| of the
  tile is below 2^12, found in the staging's own barrier (``bar.red.or``), else from the tile's largest |x|;
  the tile's sum is taken back by 2^-c. A group's 8 mma steps there run as two dependency chains of 4 (steps
  h = 0 and h = 1 into two D, added at the end), and in blocks of 4 or more row tiles each thread loads its
  chunk of the first x tile in the same burst as W's first loads, so that the staging does not wait behind
  them (``split``, ``x_first``; on an H100, in three runs, from 5 % faster to 0.6 % slower together, and the
  compute side alone unchanged: docs/bench/HISTORY.md).

Contract beyond the scalar route's: K a multiple of 128; int4 zero points integers in [0, 15]
(``quantize_int4`` makes them so; a fractional zero would be rounded to bf16). Capture-safe; no workspace.
With ``pdl`` (opt-in) it reads W before waiting for the kernel launched before it, x after.
The device steps (decode, a group's mma steps, x staging, group constants) are in ``gemv_mma_steps.py``.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from vmmstream.kernels.base import mma as mh
from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.launch import (SHARED_ALIGN16, cp_async16, cp_async_commit, cp_async_waiter,
    grid_dependency_wait, grid_dependents_launch, launch_pdl, ld4w, ld16_ro, lane_ptr, prefetch_l2, u32_add, u32_mad, u32_pin)
from vmmstream.kernels.matmul.quant.gemv_mma_steps import (X_EF, XS_WORDS, acc_group, acc_group_cols, acc_group_mxd,
    b1_set, group_scales, stage_x, stage_x_mx, stage_x_mx_pre, tile_fac, x_first_words)
from vmmstream.kernels.base.workspace import NONE
from vmmstream.kernels.matmul.quant.formats import INT4, MXFP4

CAPTURE_SAFE = True      # no allocation, no synchronize, device arrays only
W = mh.WARPS             # warps per block (the simulator's mma scratch is sized for it)
ROWS, COLS = 16, 8       # rows of W and columns of x per block
GROUP = 128
MAX_ROW_TILES = 7        # B = 1: 16-row tiles per block (4 warps each; 7 make 896 threads, the 7 blocks of 128)
MIN_BLOCKS = 7           # launch bounds: 7 resident blocks per SM (<= 72 registers) fill a wave of 896 blocks
MAX_REGS = 72            # registers per thread: 65,536 per SM / (7 * 128 threads), in allocation units of 8


@functools.lru_cache(maxsize=None)
def make(kind: int, has_bias: bool, ncols: int = 1, prefetch: bool = True, l2_ahead: int = 0, probe: bool = False,
         stages: int = 0, row_tiles: int = 1, early_y: bool = False, carveout=None, split: bool = False,
         x_first: bool = False, col_tiles: int = 1):
    """``ncols``: columns of x staged per block, 1 (B = 1) or 8; ``prefetch``: load the next group's
    chunks before multiplying the current one (False: at the top of each iteration, for comparison);
    ``l2_ahead``: also ``prefetch.global.L2`` the chunks of the group that many iterations ahead (0: none);
    ``probe`` (measurement only, wrong results): the same loads, staging and loop with no decode and no mma,
    the memory side of the kernel alone; ``stages`` > 1: W's chunks go through a per-warp ring of that many
    groups in shared memory by ``cp.async`` (``stages - 1`` groups in flight while one is multiplied, no
    registers held for them); 0: loaded into registers (one group ahead with ``prefetch``). ``row_tiles`` (the
    batch-1 loop only): 16-row tiles per block, 4 warps each, that share one staging of x (``launch``).
    ``early_y`` (the batch-1 loop only): the first pair's second group is loaded before x is staged, and each
    pair's after the pair before it is multiplied (False: at the top of each step). ``carveout``: the shared
    memory carveout preference (``cuda.jit``'s ``shared_memory_carveout``; None: the driver's default).
    ``split`` (MXFP4, the batch-1 loop): each group's 8 mma steps as two dependency chains of 4 (``launch``
    takes it there by default). ``x_first`` (MXFP4, the batch-1 loop; a launch without ``pdl``): the first x
    tile's loads written before W's (ptxas issues them among W's first loads), held in registers (up to 4
    chunks of 16 bytes) until it is staged. ``col_tiles`` (B > 1, the register loop with prefetch): column tiles
    of 8 per block, 1, 2 or 4: each group of W is loaded and decoded once and multiplied into every tile (the
    grid has ``col_tiles`` times fewer column blocks); each column's sums are those of a block of one tile."""
    MS0, MS1 = mh.SIM_MMA_SCRATCH          # simulator-only scratch (1 x 1 on the GPU)
    QS = mh.SIM_RED_SCRATCH
    is_int4 = kind == INT4
    NC = ncols
    CT = col_tiles
    CW = XS_WORDS // NC                    # staged words per column: a tile of 2 CW values of K
    CS = CW + (4 if NC > 1 else 0)         # column stride (padded: columns start in different banks)
    TG = 2 * CW // GROUP                   # groups per staged tile: 32 or 4
    TI = TG // W                           # iterations per tile: 8 or 1
    NCH = CW // 4                          # 8-value chunks per column and tile
    XSN = NC * CT * CS                     # every column tile's staged x
    CSO = 8 * CS                           # words from one column tile's staging to the next
    CT4 = 4 * CT                           # accumulators of a lane: 4 per column tile (a constant for the arrays)
    if CT not in (1, 2, 4):
        raise ValueError(f"col_tiles must be 1, 2 or 4, got {CT}")
    if CT > 1 and (NC != COLS or not prefetch or stages > 1 or l2_ahead or probe):
        raise ValueError("col_tiles > 1 is an option of the batched register loop with prefetch (no cp.async "
                         "ring, no L2 prefetch, no probe)")
    PF = prefetch
    L2A = l2_ahead
    PROBE = probe
    S = stages
    CPA = S > 1
    RING = W * S * 2 * 128 if CPA else 4   # words: per warp and stage, rows g and g + 8, 16 bytes a lane
    B1 = NC == 1 and PF and not CPA and L2A == 0   # the two-set loop below (the others: the general one)
    MXD = B1 and not is_int4               # MXFP4 at B = 1: block scales applied to D (``acc_group_mxd``)
    XSA = XSN + (16 if MXD else 0)         # + a zero block read by the lanes whose B column is not theirs
    WAIT = cp_async_waiter(S - 1 if CPA else 0)
    RT = row_tiles
    EY = bool(early_y)
    SPL = bool(split)
    if SPL and not MXD:
        raise ValueError("split is an option of the MXFP4 batch-1 register loop")
    XF = bool(x_first)
    if XF and not MXD:
        raise ValueError("x_first is an option of the MXFP4 batch-1 register loop")
    if EY and not B1:
        raise ValueError("early_y is an option of the batch-1 register loop")
    if RT != 1 and not B1:
        raise ValueError(f"row_tiles > 1 is a batch-1 option of the register loop, got {RT}")
    if not 1 <= RT <= MAX_ROW_TILES:
        raise ValueError(f"row_tiles must be 1 to {MAX_ROW_TILES}, got {RT}")
    NT = mh.THREADS * RT                   # threads per block
    RW = RT * W                            # warps per block
    MSR = MS0 * RT if MS0 > 1 else 1       # simulator scratch: one row per thread
    QSR = QS * RT if QS > 1 else 1
    u = uint32

    # launch bounds of 7 blocks of 128 threads per SM (72 registers); blocks of several row tiles take that
    # register cap explicitly (896 threads in 1 to 7 blocks)
    @mh.kernel((NT, max(1, MIN_BLOCKS // RT // (2 * CT - 1))), max_registers=MAX_REGS if RT > 1 else None,
               carveout=carveout)
    def qgemv_q4_mma(packed, scales, zeros, x, bias, y, n_rows, n_batch, k):
        # packed [N * K/2] u8 (rows of W, flattened); int4: scales, zeros [N * K/128] f16|f32; mxfp4: scales
        # [N * K/32] u8 (E8M0), zeros ignored; x [B, K] bf16; bias [N] bf16; y [B, N] bf16.
        # grid (ceil(N / (16 RT)), 1) at B = 1, (ceil(B / 8), ceil(N / 16)) above it: the blocks of one row tile's
        # column tiles are scheduled together, so all but the first read W from L2. Block 128 RT: warp
        # gw = 4 rt + wid takes row tile rt's share wid of K. Index arithmetic is uint32 (no wraparound code).
        tid = u(cuda.threadIdx.x)
        lane, gw = tid % u(32), tid // u(32)
        if RT == 1:
            wid = gw
            row0 = u32_mad(cuda.blockIdx.y if NC > 1 else cuda.blockIdx.x, ROWS, 0)
        else:
            wid = gw % u(W)
            row0 = u32_mad(u32_mad(cuda.blockIdx.x, RT, gw // u(W)), ROWS, 0)
        g, t = lane // u(4), lane % u(4)
        col0 = u32_mad(cuda.blockIdx.x if NC > 1 else cuda.blockIdx.y, COLS * CT, 0)
        nr1 = u32_add(n_rows, 0xFFFFFFFF)
        ra = min(u32_add(row0, g), nr1)
        rb = min(u32_add(row0, g + u(8)), nr1)
        ku = u(k)
        ng = u32_pin(ku // u(GROUP))
        ng1 = u32_add(ng, 0xFFFFFFFF)
        wa0 = u32_pin(u32_mad(ra, ku // u(2), u(16) * t))   # the lane's bytes of group 0, rows g and g + 8
        wb0 = u32_pin(u32_mad(rb, ku // u(2), u(16) * t))
        if is_int4:          # group scales and zeros: one per row and group
            sa0, sb0 = u32_pin(u32_mad(ra, ng, 0)), u32_pin(u32_mad(rb, ng, 0))
        else:                # the lane's MX block of group 0
            sa0, sb0 = u32_pin(u32_mad(ra, ku // u(32), t)), u32_pin(u32_mad(rb, ku // u(32), t))
        # B = 1: lanes g > 0 repeat column 0 into D columns that are never stored
        xb = min(g, u(NC - 1)) * u(CS) + t * u(16)
        xr0 = u(4) * ((t + u(0)) & u(3))      # a lane's 4 slots of a group, rotated by t (distinct banks)
        xr1 = u(4) * ((t + u(1)) & u(3))
        xr2 = u(4) * ((t + u(2)) & u(3))
        xr3 = u(4) * ((t + u(3)) & u(3))
        scratch = cuda.shared.array((MSR, MS1), np.float64)
        xs = cuda.shared.array(XSA, np.uint32, alignment=SHARED_ALIGN16)
        red = cuda.shared.array((RW, 32, CT4), np.float32)
        acc = cuda.local.array(CT4, np.float32)      # col_tiles > 1: tile c's sums at 4c .. 4c + 3
        dcol = cuda.local.array(CT4, np.float32)
        xw = cuda.local.array(CT4, np.uint32)
        if CT > 1:
            for i in range(CT4):
                acc[i] = float32(0.0)
        qsum = cuda.shared.array(QSR, np.float32)
        mx = cuda.shared.array(2, np.int32)    # MXD: the x tile's scale source (``tile_ef``), two slots alternating
        ring = cuda.shared.array(RING, np.uint32, alignment=SHARED_ALIGN16)
        slot = (wid * u(S) * u(2)) * u(128) + lane * u(4)   # + (stage * 2 + row half) * 128
        acc0 = acc1 = acc2 = acc3 = float32(0.0)
        # the lane's scale rows as views from group 0: a load's 64-bit offset is one wide mad of the group index
        psa, psb = scales[int64(sa0):], scales[int64(sb0):]
        pza, pzb = zeros[int64(sa0):], zeros[int64(sb0):]
        if B1:
            # B = 1: warp w multiplies groups w, w + 4, ... of each tile, two per iteration through two
            # register sets (X, Y): Y loads while X is multiplied, the next X while Y is; no copies between
            # them, one loop step per two groups. Slots past the last group of K hold staged zeros of x, so
            # the clamped reloads there add nothing (nor does the Y past the tile's groups, which is therefore
            # multiplied without a branch: behind one, ptxas moved Y's loads down to their use).
            # MXFP4 (MXD): B's column 2t holds x only at the k of lane t's MX block (lanes g != 2t read a
            # zero block), so D column 2t is block t's sum alone and lane t scales it by its own block scale:
            # no per-pair scaling. x is staged scaled by 2^c per tile (``stage_x_mx``); the tile's sums
            # (ta*) are taken back by ``tile_fac``.
            ta0 = ta2 = float32(0.0)
            if MXD:          # the finished tiles' sums wait in the thread's own slots of ``red``: registers held
                red[gw, lane, 0] = float32(0.0)    # across the whole loop were spilled to local memory
                red[gw, lane, 2] = float32(0.0)
            xst = u(0 if MXD else 64)
            xbb = u(XSN) if MXD else xb
            if MXD:          # only lanes 0, 9, 18, 27 read x, one per quarter warp: no bank rotation needed
                if tid < u(16):
                    xs[u32_add(tid, XSN)] = u(0)
                if tid == u(0):
                    mx[0] = int32(X_EF << 7)
                if g == u(2) * t:
                    xst = u(64)
                    xbb = u32_mad(t, 16, 0)
                xr0, xr1, xr2, xr3 = u(0), u(4), u(8), u(12)
            xst, xbb = u32_pin(xst), u32_pin(xbb)
            # the lane's bytes of W (and MXFP4 its scales) through 64-bit bases in registers: one wide
            # multiply-add per load
            qa, qb = lane_ptr(packed, int64(wa0)), lane_ptr(packed, int64(wb0))
            qsa, qsb = lane_ptr(scales, int64(sa0)), lane_ptr(scales, int64(sb0))
            n_tiles = (ng + u(TG - 1)) // u(TG)
            ti = u(u32_add(min(u(TG), ng), 3) >> u(2))         # the tile's groups per warp
            if XF:           # the first x tile's loads ahead of W's in the PTX (ptxas issues them in W's first burst)
                f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15 = x_first_words(x, tid, ku, NT)
            gx = min(wid, ng1)
            x0w, x1w, x2w, x3w, x4w, x5w, x6w, x7w, xza, xzb, xua, xub, xea, xeb = b1_set(
                is_int4, packed, scales, qa, qb, qsa, qsb, psa, psb, pza, pzb, gx)
            if EY:           # the first Y too, before x is staged: two groups in flight from the start
                gy = min(u32_add(wid, W), ng1)
                y0w, y1w, y2w, y3w, y4w, y5w, y6w, y7w, yza, yzb, yua, yub, yea, yeb = b1_set(
                    is_int4, packed, scales, qa, qb, qsa, qsb, psa, psb, pza, pzb, gy)
            # W and its scales are read before the wait, x after it (launch_pdl: this kernel may start while
            # the one before it, which may be writing x, still runs)
            grid_dependency_wait()
            grid_dependents_launch()
            base = u(0)                                         # the tile's first group
            tile = u(0)
            while tile < n_tiles:
                cuda.syncthreads()             # (the previous tile is no longer read)
                if MXD:
                    if tile > u(0):
                        red[gw, lane, 0] += ta0 * tile_fac(mx, (tile + u(1)) % u(2))
                        red[gw, lane, 2] += ta2 * tile_fac(mx, (tile + u(1)) % u(2))
                    ta0 = ta2 = float32(0.0)
                    if XF and tile == u(0):
                        stage_x_mx_pre(xs, x, tid, ku, mx, NT, f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11,
                                       f12, f13, f14, f15)
                    else:
                        stage_x_mx(xs, x, tid, u32_mad(base, GROUP, 0), ku, mx, tile % u(2), NT)   # ends at a barrier
                else:
                    stage_x(xs, x, tid, u32_mad(base, GROUP, 0), ku, col0, n_batch, NC, NCH, CS, NT)
                    cuda.syncthreads()
                nbase = u32_add(base, TG)      # the next tile (for the last pair's X)
                nti = u(u32_add(min(u(TG), u32_mad(nbase, 0xFFFFFFFF, ng)), 3) >> u(2)) if nbase < ng else u(0)
                p = u(0)
                while p < ti:                  # slots 4p + w (X) and 4p + 4 + w (Y)
                    qy = u32_mad(u32_add(p, 1), W, wid)
                    if not EY:
                        gy = min(u32_add(base, qy), ng1)
                        y0w, y1w, y2w, y3w, y4w, y5w, y6w, y7w, yza, yzb, yua, yub, yea, yeb = b1_set(
                            is_int4, packed, scales, qa, qb, qsa, qsb, psa, psb, pza, pzb, gy)
                    xo = u32_mad(u32_mad(p, W, wid), xst, xbb)
                    if MXD and not PROBE:
                        ta0, ta2 = acc_group_mxd(x0w, x1w, x2w, x3w, x4w, x5w, x6w, x7w, xea, xeb,
                                                  xs, xo, scratch, ta0, ta2, SPL)
                    else:
                        acc0, acc1, acc2, acc3 = acc_group(
                            is_int4, PROBE, x0w, x1w, x2w, x3w, x4w, x5w, x6w, x7w, xza, xzb, xua, xub, xea, xeb,
                            xs, xo, xr0, xr1, xr2, xr3, scratch, acc0, acc1, acc2, acc3)
                    p = u32_add(p, 2)
                    gx = min(u32_add(base, u32_mad(p, W, wid)) if p < ti else u32_add(nbase, wid), ng1)
                    x0w, x1w, x2w, x3w, x4w, x5w, x6w, x7w, xza, xzb, xua, xub, xea, xeb = b1_set(
                        is_int4, packed, scales, qa, qb, qsa, qsb, psa, psb, pza, pzb, gx)
                    # Y (past the tile's groups when ti is odd: staged zeros)
                    xo = u32_mad(qy, xst, xbb)
                    if MXD and not PROBE:
                        ta0, ta2 = acc_group_mxd(y0w, y1w, y2w, y3w, y4w, y5w, y6w, y7w, yea, yeb,
                                                  xs, xo, scratch, ta0, ta2, SPL)
                    else:
                        acc0, acc1, acc2, acc3 = acc_group(
                            is_int4, PROBE, y0w, y1w, y2w, y3w, y4w, y5w, y6w, y7w, yza, yzb, yua, yub, yea,
                            yeb, xs, xo, xr0, xr1, xr2, xr3, scratch, acc0, acc1, acc2, acc3)
                    if EY:       # the next pair's Y (in the next tile past this tile's last pair)
                        gy = min(u32_add(base, u32_mad(u32_add(p, 1), W, wid)) if p < ti
                                 else u32_add(nbase, u32_add(wid, W)), ng1)
                        y0w, y1w, y2w, y3w, y4w, y5w, y6w, y7w, yza, yzb, yua, yub, yea, yeb = b1_set(
                            is_int4, packed, scales, qa, qb, qsa, qsb, psa, psb, pza, pzb, gy)
                base = nbase
                ti = nti
                tile = u32_add(tile, 1)
            if MXD:                            # the last tile's sums; then the 4 blocks of a row: lanes t
                tfac = tile_fac(mx, (n_tiles + u(1)) % u(2))
                acc0 = mh.quad_sum(red[gw, lane, 0] + ta0 * tfac, qsum)
                acc2 = mh.quad_sum(red[gw, lane, 2] + ta2 * tfac, qsum)
        else:
            n_it = (ng + u(W - 1)) // u(W)         # the same trip count in every warp (the mma is warp-wide)
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
                pa0, pa1, pa2, pa3 = ld16_ro(packed, wa0 + gc * u(64))
                pb0, pb1, pb2, pb3 = ld16_ro(packed, wb0 + gc * u(64))
            # the loaded group's constants (int4 zero points and scales, MXFP4 the lane's E8M0 exponents)
            qa, qb, sa, sb, na, nb = group_scales(is_int4, psa, psb, pza, pzb, int64(gc))
            grid_dependency_wait()                 # x after the wait, as above
            grid_dependents_launch()
            it = u(0)
            while it < n_it:
                if it % u(TI) == u(0):             # stage the next tile of x, permuted into B pairs
                    cuda.syncthreads()             # (the previous tile is no longer read)
                    stage_x(xs, x, tid, it * u(W * GROUP), ku, col0, n_batch, NC * CT, NCH, CS, NT)
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
                    qa, qb, sa, sb, na, nb = group_scales(is_int4, psa, psb, pza, pzb, int64(gn))
                elif PF:
                    a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w = pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3
                    za, zb, ua, ub, ea, eb = qa, qb, sa, sb, na, nb
                    gn = min(u32_add(gi, W), ng1)  # the last iteration reloads a group that is still cached
                    pa0, pa1, pa2, pa3 = ld16_ro(packed, u32_mad(gn, 64, wa0))
                    pb0, pb1, pb2, pb3 = ld16_ro(packed, u32_mad(gn, 64, wb0))
                    qa, qb, sa, sb, na, nb = group_scales(is_int4, psa, psb, pza, pzb, int64(gn))
                else:
                    gc = min(gi, ng1)
                    a0w, a1w, a2w, a3w = ld16_ro(packed, u32_mad(gc, 64, wa0))
                    b0w, b1w, b2w, b3w = ld16_ro(packed, u32_mad(gc, 64, wb0))
                    za, zb, ua, ub, ea, eb = group_scales(is_int4, psa, psb, pza, pzb, int64(gc))
                if L2A > 0:
                    gl = min(gi + u(L2A * W), ng1)
                    prefetch_l2(packed, wa0 + gl * u(64))
                    prefetch_l2(packed, wb0 + gl * u(64))
                # groups past K (the clamped reloads) meet staged zeros of x: they add nothing
                xo = u32_mad(u32_mad(it % u(TI), W, wid), 64, xb)
                if CT == 1:
                    acc0, acc1, acc2, acc3 = acc_group(is_int4, PROBE, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, za, zb,
                                                        ua, ub, ea, eb, xs, xo, xr0, xr1, xr2, xr3, scratch,
                                                        acc0, acc1, acc2, acc3)
                else:                              # one decode of the group for every column tile
                    acc_group_cols(is_int4, CT, a0w, a1w, a2w, a3w, b0w, b1w, b2w, b3w, za, zb, ua, ub, ea, eb,
                                   xs, xo, u(CSO), xr0, xr1, xr2, xr3, scratch, acc, dcol, xw)
                it = u32_add(it, 1)
        # the one-tile reduction is kept as written for the measured kernels (a loop shared with the several-tile
        # one below compiles to other PTX for them); the two differ only in the column tile of i // 4
        if CT == 1:
            red[gw, lane, 0] = acc0
            red[gw, lane, 1] = acc1
            red[gw, lane, 2] = acc2
            red[gw, lane, 3] = acc3
            cuda.syncthreads()
            if wid == u(0):                          # warp 0 of each row tile
                w0 = u(0) if RT == 1 else gw
                for i in range(4):                   # D: (row g | g + 8) x (col 2t | 2t + 1)
                    v = red[w0, lane, i]
                    for w in range(1, W):
                        v += red[w0 + u(w), lane, i]
                    row = row0 + g + u(8 * (i // 2))
                    col = col0 + u(2) * t + u(i % 2)
                    if row < u(n_rows) and col < u(n_batch):
                        if has_bias:
                            v += dev_bf16_to_f32(bias[row])
                        y[col, row] = dev_f32_to_bf16(v)
        else:
            for i in range(CT4):
                red[gw, lane, i] = acc[i]
            cuda.syncthreads()
            if wid == u(0):
                for i in range(CT4):                 # D of column tile i // 4, as above
                    v = red[0, lane, i]
                    for w in range(1, W):
                        v += red[u(w), lane, i]
                    row = row0 + g + u(8 * ((i % 4) // 2))
                    col = col0 + u(8 * (i // 4)) + u(2) * t + u(i % 2)
                    if row < u(n_rows) and col < u(n_batch):
                        if has_bias:
                            v += dev_bf16_to_f32(bias[row])
                        y[col, row] = dev_f32_to_bf16(v)

    return qgemv_q4_mma


def launch(kind, packed, scales, zeros, x, out, bias, stream, prefetch=True, l2_ahead=0, probe=False, stages=0,
           pdl=False, row_tiles=0, early_y=False, split=None, x_first=None, col_tiles=1):
    """Shapes checked by ``qgemv._launch``; x, out 2-D; ``zeros`` None for MXFP4; ``l2_ahead`` and ``probe``
    as in ``make`` (the sweep's measurements). ``pdl``: programmatic dependent launch (``launch_pdl``): the
    kernel loads its first groups of W while the kernel before it on the stream finishes, and reads x, bias
    and ``out`` only after that kernel is done; the kernel before it must not write W, scales or zeros.
    ``row_tiles``: 16-row tiles per block at batch 1 (1 to 7; 0: ``auto_row_tiles`` for this device);
    ``early_y``, ``split``, ``x_first``: as in ``make``; ``split`` None: where it applies (MXFP4 at batch 1 in
    the register loop), ``x_first`` None: there too, in blocks of 4 or more row tiles (a thread holds one chunk
    of x; with fewer it holds up to four, and ptxas spills) and without ``pdl``. ``col_tiles``: at batch 9 or
    more, column tiles of 8 per block (1, 2 or 4; ``make``); batch 8 or less takes 1."""
    n, b, k = packed.shape[0], x.shape[0], 2 * packed.shape[1]
    if k % GROUP:
        raise ValueError(f"the mma route takes K in multiples of {GROUP}, got {k}")
    if stages not in (0, 1, 2, 3, 4, 5):
        raise ValueError(f"the mma route's cp.async ring takes 2 to 5 stages (0: none), got {stages}")
    if not (packed.is_c_contiguous() and scales.is_c_contiguous() and (zeros is None or zeros.is_c_contiguous())):
        raise ValueError("the mma route takes C-contiguous packed weights, scales and zeros")
    b1 = b == 1 and prefetch and stages <= 1 and not l2_ahead
    if row_tiles == 0:
        row_tiles = auto_row_tiles(n) if b1 else 1
    elif not (isinstance(row_tiles, int) and 1 <= row_tiles <= MAX_ROW_TILES):
        raise ValueError(f"row_tiles must be 0 (auto) or 1 to {MAX_ROW_TILES}, got {row_tiles!r}")
    elif row_tiles > 1 and not b1:
        raise ValueError(f"row_tiles > 1 takes batch 1 with prefetch, no cp.async ring and no L2 prefetch "
                         f"(got batch {b}, prefetch {prefetch}, stages {stages}, l2_ahead {l2_ahead})")
    if early_y and not b1:
        raise ValueError("early_y takes batch 1 with prefetch, no cp.async ring and no L2 prefetch")
    mxd = b1 and zeros is None
    if split is None:
        split = mxd
    if x_first is None:
        x_first = mxd and row_tiles >= 4 and not pdl
    if split and not mxd:
        raise ValueError("split takes MXFP4 at batch 1 with prefetch, no cp.async ring and no L2 prefetch")
    if x_first and not (mxd and not pdl):
        raise ValueError("x_first takes MXFP4 at batch 1 with prefetch, no cp.async ring, no L2 prefetch and "
                         "no pdl (it reads x before W)")
    if col_tiles not in (1, 2, 4):
        raise ValueError(f"col_tiles must be 1, 2 or 4, got {col_tiles!r}")
    ct = col_tiles if b > COLS else 1
    kern = make(kind, bias is not None, 1 if b == 1 else COLS, bool(prefetch), int(l2_ahead), bool(probe), int(stages),
                int(row_tiles), bool(early_y), split=bool(split), x_first=bool(x_first), col_tiles=ct)
    flat = [a.reshape(a.shape[0] * a.shape[1]) for a in (packed, scales, scales if zeros is None else zeros)]
    args = (*flat, x, x if bias is None else bias, out, n, b, k)
    tiles = -(-n // (ROWS * row_tiles))
    if b > 1 and tiles > 65535:
        raise ValueError(f"qgemv mma route, batch {b}: {n} rows are more than 65,535 row tiles of {ROWS}")
    grid = (tiles, 1) if b == 1 else (-(-b // (COLS * ct)), tiles)
    threads = mh.THREADS * row_tiles
    if pdl:
        launch_pdl(kern, grid, threads, stream, args)
    else:
        kern[grid, threads, stream](*args)


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    from numba import config
    if config.ENABLE_CUDASIM:
        return 0
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def auto_row_tiles(n: int, sms: int | None = None) -> int:
    """16-row tiles per block for a batch-1 GEMV with ``n`` rows on ``sms`` SMs (default: this device's;
    1 in the simulator). A block of r tiles stages x once for all of them (one staging per SM instead of up
    to 7). Taken only where the grid of r-tile blocks still fills the device in one wave and loads no SM with
    more tiles than blocks of one tile would: the largest such r of 2 .. 7, else 1."""
    sms = _sm_count() if sms is None else sms
    tiles = -(-n // ROWS)
    if sms <= 0 or tiles > MIN_BLOCKS * sms:
        return 1
    worst = -(-tiles // sms)                       # tiles on the busiest SM with blocks of one tile
    for r in range(MAX_ROW_TILES, 1, -1):
        blocks = -(-tiles // r)
        per_sm = max(1, MIN_BLOCKS // r)           # resident blocks of r tiles per SM (72 registers)
        if blocks <= per_sm * sms and -(-blocks // sms) * r <= worst and blocks >= 0.9 * min(sms, tiles):
            return r
    return 1


def workspace_requirement(n: int, k: int, batch: int = 1):
    """No scratch: x is staged and the warps' partial sums meet in shared memory."""
    return NONE


def bytes_moved(n: int, k: int, batch: int = 1, *, scale_itemsize: int = 2, bias: bool = False,
                col_tiles: int = 1) -> int:
    """HBM bytes: packed W, scales and zeros once per block column (``col_tiles`` tiles of 8), x, bf16 out, bias."""
    w = n * k // 2 + 2 * n * (k // GROUP) * scale_itemsize
    return w * -(-batch // (COLS * col_tiles)) + 2 * batch * k + 2 * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    """Useful multiply-adds (the tensor core also multiplies the padding columns)."""
    return 2 * n * k * batch


def _sig(scale_t: str, has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    s = f"{scale_t}[::1]"
    return f"void(uint8[::1], {s}, {s}, uint16[:, ::1], {bias_t}, uint16[:, ::1], int64, int64, int64)"


def _signatures():
    return ([(make(INT4, hb, nc).py_func, _sig(st, hb))
             for st, hb, nc in (("float16", False, 1), ("float16", True, 1), ("float32", False, 1), ("float16", False, COLS))]
            + [(make(MXFP4, hb, nc, split=nc == 1).py_func, _sig("uint8", hb))
               for hb, nc in ((False, 1), (True, 1), (False, COLS))]
            + [(make(INT4, True, COLS, col_tiles=4).py_func, _sig("float16", True)),   # one decode, 4 column tiles
               (make(MXFP4, False, COLS, col_tiles=2).py_func, _sig("uint8", False))]
            + [(make(INT4, False, 1, row_tiles=2).py_func, _sig("float16", False)),      # blocks of several row
               (make(MXFP4, False, 1, row_tiles=7, split=True, x_first=True).py_func,    # tiles (auto_row_tiles)
                _sig("uint8", False))])


SIGNATURES = _signatures()
