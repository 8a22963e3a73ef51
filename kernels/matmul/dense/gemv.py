"""bf16 GEMV for decode: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias[N]), fp32 accumulation.

W stays in checkpoint layout (row-major [out, in]). Decode is memory-bound: the kernel must stream W
once at HBM speed, so
- one block owns ``rows_per_block`` consecutive rows and all its threads split K between them, so a
  small N still yields enough blocks and every block finishes at about the same time (no wave tail);
- each thread reads W 16 bytes (8 bf16) per load, one load per owned row per step, so ``rows_per_block``
  independent loads are in flight per thread; W goes through the read-only cache path (``ld.global.nc``);
- x is tiny and re-read by every block from L1/L2, also 16 bytes at a time, and shared by ``batch_tile``
  rows of x per W load (batch decode reads W once per tile of up to 4 sequences); the batch tiles of the same
  rows are consecutive blocks (one linear grid, batch tile fastest), so they run together and the re-reads of
  W come from L2, not HBM;
- partial sums are reduced with warp shuffles, then across warps through a few floats of shared memory.
Shapes that cannot be read 16 bytes at a time (K % 8, unaligned views) use a scalar path (slow, correct).
Output is bf16 (uint16) or fp32 — whatever ``out`` is; Qwen2's q/k/v bias is fused.

Two fused decode launches reuse the same block body (``_device``: loads, accumulation, reduction):
- ``gemv_multi``: q, k and v (same K) in one grid; a block picks its matrix from its block index;
- ``gemv_gate_up_silu``: each block computes matching rows of gate and up (one x load feeds both) and
  applies the SiLU·mul epilogue, replacing gate GEMV + up GEMV + silu_mul.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16, f32_to_bf16
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import (as_stream, cdiv, check_threads, check_workspace, hi_f32, ld8_ro, lo_f32,
    vec8_ok, warp_sum)
from vmmstream.kernels.base.workspace import NONE
from vmmstream.kernels.matmul.dense import gemv_mma

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only
# Batches of gemv_mma.MIN_BATCH .. MAX_BATCH sequences (K a multiple of 64) take the tensor-core kernel of
# ``gemv_mma`` when no config is given: each weight read once per step. False keeps the SIMT batch tiles.
MMA_BATCH = True


@dataclass(frozen=True)
class GemvConfig:
    threads: int = 128
    rows_per_block: int = 0  # 0: pick from N (see _auto)
    batch_tile: int = 0      # 0: pick from B


def _auto(n: int, b: int, cfg: GemvConfig):
    # Two rows per block measured best on the H200 for both 4096x14336 shapes (29.1 us vs 31.0 for four rows).
    rpb = cfg.rows_per_block or (2 if n >= 2048 else 1)
    nb = cfg.batch_tile or (1 if b == 1 else 2 if b == 2 else 4)
    return check_threads(cfg.threads), rpb, nb


@cuda.jit(device=True, inline="always")
def stage8_f32(xf, b, w0, w1, w2, w3):
    """Eight bf16 values (four packed words) into ``xf[b, 0..8)`` as fp32."""
    xf[b, 0] = lo_f32(w0)
    xf[b, 1] = hi_f32(w0)
    xf[b, 2] = lo_f32(w1)
    xf[b, 3] = hi_f32(w1)
    xf[b, 4] = lo_f32(w2)
    xf[b, 5] = hi_f32(w2)
    xf[b, 6] = lo_f32(w3)
    xf[b, 7] = hi_f32(w3)


@cuda.jit(device=True, inline="always")
def x8_f32(w0, w1, w2, w3):
    """Eight bf16 values (four packed words) as a tuple of fp32."""
    return lo_f32(w0), hi_f32(w0), lo_f32(w1), hi_f32(w1), lo_f32(w2), hi_f32(w2), lo_f32(w3), hi_f32(w3)


@cuda.jit(device=True, inline="always")
def dot8(a, xf, b):
    """The dot product of ``x8_f32``'s tuple ``a`` with ``xf[b, 0..8)``, summed left to right."""
    return (a[0] * xf[b, 0] + a[1] * xf[b, 1] + a[2] * xf[b, 2] + a[3] * xf[b, 3]
            + a[4] * xf[b, 4] + a[5] * xf[b, 5] + a[6] * xf[b, 6] + a[7] * xf[b, 7])


@functools.lru_cache(maxsize=None)
def warp_partials(na: int, nw: int):
    """The block reduction of ``na`` accumulators per thread over ``nw`` warps, as IR-inlined device functions:
    ``stash(acc, scratch)`` (warp sums into ``scratch[warp * na + j]``, then a barrier) and ``total(scratch, j)``
    (the block total of accumulator ``j``, after ``stash``)."""

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

    return stash, total


@functools.lru_cache(maxsize=None)
def _device(vec: int, nb: int, rpb: int, threads: int, pair: bool):
    """The GEMV machinery shared by every kernel here, as IR-inlined device functions:

    - ``dot_rows(wa, wb, x, row0, n_rows, b0, n_batch, k, acc)``: this thread's partial dot products of
      rows ``row0 .. row0 + rpb`` of ``wa`` (and, with ``pair``, the same rows of ``wb``, sharing each x
      load) with rows ``b0 .. b0 + nb`` of x; ``acc[m * rpb * nb + r * nb + b]`` (m = 0: wa, 1: wb);
    - ``stash(acc, scratch)``: warp sums of every accumulator into ``scratch[warp * na + j]``, then a barrier;
    - ``total(scratch, j)``: the block total of accumulator ``j`` (after ``stash``).
    """
    nw = threads // 32
    rn = rpb * nb
    na = rn * (2 if pair else 1)

    @cuda.jit(device=True, inline="always")
    def dot_rows(wa, wb, x, row0, n_rows, b0, n_batch, k, acc):
        tid = cuda.threadIdx.x
        for j in range(na):
            acc[j] = np.float32(0.0)
        if vec == 8:
            xf = cuda.local.array((nb, 8), np.float32)
            for c in range(tid * 8, k, threads * 8):
                for b in range(nb):
                    # rows past the end are clamped: loads stay unconditional, results are dropped
                    x0, x1, x2, x3 = ld8_ro(x, (min(b0 + b, n_batch - 1), c))
                    stage8_f32(xf, b, x0, x1, x2, x3)
                for r in range(rpb):
                    w0, w1, w2, w3 = ld8_ro(wa, (min(row0 + r, n_rows - 1), c))
                    a = x8_f32(w0, w1, w2, w3)
                    for b in range(nb):
                        acc[r * nb + b] += dot8(a, xf, b)
                    if pair:
                        v0, v1, v2, v3 = ld8_ro(wb, (min(row0 + r, n_rows - 1), c))
                        a = x8_f32(v0, v1, v2, v3)
                        for b in range(nb):
                            acc[rn + r * nb + b] += dot8(a, xf, b)
        else:
            xs = cuda.local.array(nb, np.float32)
            for c in range(tid, k, threads):
                for b in range(nb):
                    xs[b] = dev_bf16_to_f32(x[min(b0 + b, n_batch - 1), c])
                for r in range(rpb):
                    a = dev_bf16_to_f32(wa[min(row0 + r, n_rows - 1), c])
                    for b in range(nb):
                        acc[r * nb + b] += a * xs[b]
                    if pair:
                        e = dev_bf16_to_f32(wb[min(row0 + r, n_rows - 1), c])
                        for b in range(nb):
                            acc[rn + r * nb + b] += e * xs[b]

    stash, total = warp_partials(na, nw)

    return dot_rows, stash, total


@functools.lru_cache(maxsize=None)
def _make(vec: int, nb: int, rpb: int, threads: int, has_bias: bool, out_bf16: bool):
    rn = rpb * nb
    n_scratch = (threads // 32) * rn  # shared array shapes must be plain constants, not expressions
    dot_rows, stash, total = _device(vec, nb, rpb, threads, False)

    def gemv_kernel(w, x, bias, y, n_rows, n_batch, k, n_bt):
        # w: [N, K] bf16; x: [B, K] bf16; bias: [N] bf16 (ignored without bias); y: [B, N] bf16|f32
        # grid: ceil(N / rpb) * n_bt, n_bt = ceil(B / nb); block: threads
        tid = cuda.threadIdx.x
        row0 = (cuda.blockIdx.x // n_bt) * rpb
        b0 = (cuda.blockIdx.x % n_bt) * nb
        acc = cuda.local.array(rn, np.float32)   # acc[r * nb + b]
        dot_rows(w, w, x, row0, n_rows, b0, n_batch, k, acc)
        scratch = cuda.shared.array(n_scratch, np.float32)   # [warp, r * nb + b]
        stash(acc, scratch)
        if tid < rn:
            row = row0 + tid // nb
            bb = b0 + tid % nb
            if row < n_rows and bb < n_batch:
                t = total(scratch, tid)
                if has_bias:
                    t += dev_bf16_to_f32(bias[row])
                if out_bf16:
                    y[bb, row] = dev_f32_to_bf16(t)
                else:
                    y[bb, row] = t

    return jit(gemv_kernel)


@functools.lru_cache(maxsize=None)
def _make_multi(vec: int, nb: int, rpb: int, threads: int, has_bias: bool):
    """Up to three GEMVs over one x in one launch (q/k/v): blocks [0, blk0) take rows of w0, the next
    blk1 blocks rows of w1, the rest rows of w2; each block is exactly a ``gemv_kernel`` block of its matrix."""
    rn = rpb * nb
    n_scratch = (threads // 32) * rn
    dot_rows, stash, total = _device(vec, nb, rpb, threads, False)

    def gemv_multi_kernel(w0, w1, w2, x, bias0, bias1, bias2, y0, y1, y2, n0, n1, n2, blk0, blk1,
                          n_batch, k, n_bt):
        # w_i: [N_i, K] bf16; x: [B, K]; bias_i: [N_i] (placeholders without bias); y_i: [B, N_i] bf16
        # grid: (blk0 + blk1 + ceil(N2 / rpb)) * n_bt; blk_i = ceil(N_i / rpb), n_bt = ceil(B / nb)
        tid = cuda.threadIdx.x
        bx = cuda.blockIdx.x // n_bt
        # Each matrix gets its own call of the block body: selecting among the array arguments would
        # turn the weight loads into generic (not ld.global.nc) loads.
        if bx < blk0:
            m, n_rows, row0 = 0, n0, bx * rpb
        elif bx < blk0 + blk1:
            m, n_rows, row0 = 1, n1, (bx - blk0) * rpb
        else:
            m, n_rows, row0 = 2, n2, (bx - blk0 - blk1) * rpb
        b0 = (cuda.blockIdx.x % n_bt) * nb
        acc = cuda.local.array(rn, np.float32)
        if m == 0:
            dot_rows(w0, w0, x, row0, n_rows, b0, n_batch, k, acc)
        elif m == 1:
            dot_rows(w1, w1, x, row0, n_rows, b0, n_batch, k, acc)
        else:
            dot_rows(w2, w2, x, row0, n_rows, b0, n_batch, k, acc)
        scratch = cuda.shared.array(n_scratch, np.float32)
        stash(acc, scratch)
        if tid < rn:
            row = row0 + tid // nb
            bb = b0 + tid % nb
            if row < n_rows and bb < n_batch:
                t = total(scratch, tid)
                if m == 0:
                    if has_bias:
                        t += dev_bf16_to_f32(bias0[row])
                    y0[bb, row] = dev_f32_to_bf16(t)
                elif m == 1:
                    if has_bias:
                        t += dev_bf16_to_f32(bias1[row])
                    y1[bb, row] = dev_f32_to_bf16(t)
                else:
                    if has_bias:
                        t += dev_bf16_to_f32(bias2[row])
                    y2[bb, row] = dev_f32_to_bf16(t)

    return jit(gemv_multi_kernel)


_silu_mul = gemv_mma.silu_mul


@functools.lru_cache(maxsize=None)
def _make_gate_up(vec: int, nb: int, rpb: int, threads: int):
    """out = silu(x · Wgᵀ) * (x · Wuᵀ): each block owns the same ``rpb`` rows of Wg and Wu (one x load
    feeds both), then rounds gate and up to bf16 as the separate GEMVs would store them and applies the
    silu_mul epilogue in fp32, rounded once."""
    rn = rpb * nb
    na = 2 * rn                       # local / shared array shapes must be plain constants
    n_scratch = (threads // 32) * na
    dot_rows, stash, total = _device(vec, nb, rpb, threads, True)

    def gemv_gate_up_silu_kernel(wg, wu, x, y, n_rows, n_batch, k, n_bt):
        # wg, wu: [N, K] bf16; x: [B, K] bf16; y: [B, N] bf16
        # grid: ceil(N / rpb) * n_bt, n_bt = ceil(B / nb); block: threads
        tid = cuda.threadIdx.x
        row0 = (cuda.blockIdx.x // n_bt) * rpb
        b0 = (cuda.blockIdx.x % n_bt) * nb
        acc = cuda.local.array(na, np.float32)   # gate: acc[r * nb + b]; up: acc[rn + r * nb + b]
        dot_rows(wg, wu, x, row0, n_rows, b0, n_batch, k, acc)
        scratch = cuda.shared.array(n_scratch, np.float32)
        stash(acc, scratch)
        if tid < rn:
            row = row0 + tid // nb
            bb = b0 + tid % nb
            if row < n_rows and bb < n_batch:
                g = dev_bf16_to_f32(dev_f32_to_bf16(total(scratch, tid)))
                u = dev_bf16_to_f32(dev_f32_to_bf16(total(scratch, rn + tid)))
                y[bb, row] = dev_f32_to_bf16(_silu_mul(g, u))

    return jit(gemv_gate_up_silu_kernel)


def workspace_requirement(n: int, k: int, batch: int = 1):
    """GEMV needs no scratch (shared memory only)."""
    return NONE


def gemv(w, x, out, *, bias=None, workspace=None, stream=None, config: GemvConfig | None = None):
    """out[B, N] = x[B, K] · w[N, K]ᵀ (+ bias). x may be [K] with out [N].

    w, x, bias: bf16 (uint16) device arrays; out: uint16 (bf16 result) or float32. Never allocates.
    """
    check_workspace("gemv", workspace, workspace_requirement(w.shape[0], w.shape[1]).bytes)
    if x.ndim == 1:
        x = x.reshape(1, x.shape[0])
    if out.ndim == 1:
        out = out.reshape(1, out.shape[0])
    n, k = w.shape
    b = x.shape[0]
    if x.shape[1] != k or out.shape != (b, n) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"gemv shapes: w {w.shape}, x {x.shape}, out {out.shape}, "
                         f"bias {None if bias is None else bias.shape}")
    if config is None and MMA_BATCH and gemv_mma.usable(w, x):
        gemv_mma.launch(w, x, out, bias, as_stream(stream))
        return
    threads, rpb, nb = _auto(n, b, config or GemvConfig())
    if threads < rpb * nb:
        raise ValueError("gemv: threads per block must cover rows_per_block * batch_tile")
    vec = 8 if vec8_ok(w, x) else 1
    kern = _make(vec, nb, rpb, threads, bias is not None, out.dtype == np.uint16)
    nbt = cdiv(b, nb)
    kern[cdiv(n, rpb) * nbt, threads, as_stream(stream)](w, x, x if bias is None else bias, out, n, b, k, nbt)


def _as2d(a):
    return a.reshape(1, a.shape[0]) if a.ndim == 1 else a


def gemv_multi(ws, x, outs, *, biases=None, workspace=None, stream=None, config: GemvConfig | None = None):
    """outs[i][B, N_i] = x[B, K] · ws[i][N_i, K]ᵀ (+ biases[i]) for 2 or 3 matrices, in one launch.

    The q/k/v projections of a decode step: one grid covers the rows of every matrix, each block owns
    ``rows_per_block`` rows of one of them (chosen from its block index) and runs the ``gemv`` block body.
    bf16 (uint16) device arrays; outs must be bf16. x may be [K] with outs [N_i]. Never allocates.
    """
    ws, outs = list(ws), list(outs)
    if len(ws) not in (2, 3) or len(outs) != len(ws) or (biases is not None and len(biases) != len(ws)):
        raise ValueError(f"gemv_multi takes 2 or 3 matrices with as many outputs (and biases), got "
                         f"{len(ws)} / {len(outs)} / {None if biases is None else len(biases)}")
    check_workspace("gemv_multi", workspace, 0)
    x = _as2d(x)
    outs = [_as2d(o) for o in outs]
    b, k = x.shape
    for i, (w, o) in enumerate(zip(ws, outs)):
        n = w.shape[0]
        if w.shape[1] != k or o.shape != (b, n) or o.dtype != np.uint16 or \
                (biases is not None and biases[i].shape != (n,)):
            raise ValueError(f"gemv_multi shapes: w[{i}] {w.shape}, x {x.shape}, out[{i}] {o.shape} "
                             f"{o.dtype}, bias {None if biases is None else biases[i].shape}")
    if config is None and MMA_BATCH and all(gemv_mma.usable(w, x) for w in ws):
        if len(ws) == 2:
            ws, outs = ws + [ws[1]], outs + [outs[1]]
            biases = None if biases is None else list(biases) + [biases[1]]
            gemv_mma.launch_multi(ws, x, outs, biases, as_stream(stream), n2=0)
        else:
            gemv_mma.launch_multi(ws, x, outs, biases, as_stream(stream))
        return
    ns = [int(w.shape[0]) for w in ws]
    threads, rpb, nb = _auto(sum(ns), b, config or GemvConfig())
    if threads < rpb * nb:
        raise ValueError("gemv_multi: threads per block must cover rows_per_block * batch_tile")
    blk = [cdiv(n, rpb) for n in ns]
    if len(ws) == 2:   # an empty third matrix: no block selects it
        ws, outs, ns, blk = ws + [ws[1]], outs + [outs[1]], ns + [0], blk + [0]
        biases = None if biases is None else list(biases) + [biases[1]]
    vec = 8 if vec8_ok(*ws, x) else 1
    kern = _make_multi(vec, nb, rpb, threads, biases is not None)
    bs = [x, x, x] if biases is None else list(biases)
    nbt = cdiv(b, nb)
    kern[sum(blk) * nbt, threads, as_stream(stream)](
        ws[0], ws[1], ws[2], x, bs[0], bs[1], bs[2], outs[0], outs[1], outs[2], ns[0], ns[1], ns[2],
        blk[0], blk[1], b, k, nbt)


def gemv_gate_up_silu(w_gate, w_up, x, out, *, workspace=None, stream=None, config: GemvConfig | None = None):
    """out[B, N] = silu(x · w_gateᵀ) * (x · w_upᵀ), bf16, in one launch (gate GEMV + up GEMV + silu_mul).

    Each block computes the same rows of both matrices (one x load feeds both), rounds gate and up to
    bf16 as the separate GEMVs would store them, then applies silu·mul in fp32 and rounds once
    (``reference_gate_up_silu``). ``rows_per_block`` counts rows of each matrix (default 1: two rows in
    flight per thread, like ``gemv``'s two-row default). x may be [K] with out [N]. Never allocates.
    """
    check_workspace("gemv_gate_up_silu", workspace, 0)
    x, out = _as2d(x), _as2d(out)
    n, k = w_gate.shape
    b = x.shape[0]
    if w_up.shape != (n, k) or x.shape[1] != k or out.shape != (b, n) or out.dtype != np.uint16:
        raise ValueError(f"gemv_gate_up_silu shapes: w_gate {w_gate.shape}, w_up {w_up.shape}, x {x.shape}, "
                         f"out {out.shape} {out.dtype}")
    if config is None and MMA_BATCH and gemv_mma.usable(w_gate, x) and gemv_mma.usable(w_up, x):
        gemv_mma.launch_gate_up(w_gate, w_up, x, out, as_stream(stream))
        return
    cfg = config or GemvConfig()
    threads, _, nb = _auto(n, b, cfg)
    rpb = cfg.rows_per_block or 1
    if threads < rpb * nb:
        raise ValueError("gemv_gate_up_silu: threads per block must cover rows_per_block * batch_tile")
    vec = 8 if vec8_ok(w_gate, w_up, x) else 1
    nbt = cdiv(b, nb)
    _make_gate_up(vec, nb, rpb, threads)[cdiv(n, rpb) * nbt, threads, as_stream(stream)](
        w_gate, w_up, x, out, n, b, k, nbt)


def reference(w, x, bias=None) -> np.ndarray:
    """fp32 result of the bf16 inputs (accumulated in fp64): [B, N] or [N] like x."""
    wf = bf16_to_f32(w).astype(np.float64)
    xf = bf16_to_f32(x).astype(np.float64)
    y = xf @ wf.T
    if bias is not None:
        y = y + bf16_to_f32(bias)
    return y.astype(np.float32)


def reference_multi(ws, x, biases=None) -> list:
    """``reference`` of each matrix (fp32, unrounded; the kernel stores them rounded to bf16)."""
    return [reference(w, x, None if biases is None else biases[i]) for i, w in enumerate(ws)]


def reference_gate_up_silu(w_gate, w_up, x) -> np.ndarray:
    """bf16 bits of silu(gate) * up, where gate and up are the GEMV results rounded to bf16 (what the
    separate gate / up GEMVs store), and silu·mul is ``elementwise.reference_silu_mul`` (one rounding).
    Equal, bit for bit, to the unfused host chain gemv -> gemv -> silu_mul."""
    from vmmstream.kernels.ops.elementwise import reference_silu_mul
    return reference_silu_mul(f32_to_bf16(reference(w_gate, x)), f32_to_bf16(reference(w_up, x)))


def bytes_moved(n: int, k: int, batch: int = 1, *, bias: bool = False, out_itemsize: int = 2,
                batch_tile: int = 0) -> int:
    """HBM bytes: W once per batch tile, x, bias, out."""
    nb = batch_tile or (1 if batch == 1 else 2 if batch == 2 else 4)
    return 2 * n * k * cdiv(batch, nb) + 2 * batch * k + out_itemsize * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    return 2 * batch * n * k


def bytes_moved_multi(ns, k: int, batch: int = 1, *, bias: bool = False, batch_tile: int = 0) -> int:
    """HBM bytes of ``gemv_multi``: every matrix once per batch tile, x once, bf16 outs (and biases)."""
    nb = batch_tile or (1 if batch == 1 else 2 if batch == 2 else 4)
    n = sum(int(v) for v in ns)
    return 2 * n * k * cdiv(batch, nb) + 2 * batch * k + 2 * batch * n + (2 * n if bias else 0)


def flops_multi(ns, k: int, batch: int = 1) -> int:
    return 2 * batch * sum(int(v) for v in ns) * k


def bytes_moved_gate_up_silu(n: int, k: int, batch: int = 1, *, batch_tile: int = 0) -> int:
    """HBM bytes of ``gemv_gate_up_silu``: both matrices once per batch tile, x, one bf16 out (the
    separate path also writes gate and up and reads them back: 6 * batch * n bytes more)."""
    nb = batch_tile or (1 if batch == 1 else 2 if batch == 2 else 4)
    return 4 * n * k * cdiv(batch, nb) + 2 * batch * k + 2 * batch * n


def flops_gate_up_silu(n: int, k: int, batch: int = 1) -> int:
    return 4 * batch * n * k + 4 * batch * n


def _sig(has_bias: bool, out: str) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    return f"void(uint16[:, ::1], uint16[:, ::1], {bias_t}, {out}[:, ::1], int64, int64, int64, int64)"


# What a Llama/Mistral/Qwen2 decode launches: 16-byte path with bf16 out, Qwen2's bias, fp32 logits;
# batch tiles 2 and 4 (B = 2, B = 3..4 and larger); the scalar fallback.
SIGNATURES = [
    (_make(8, 1, rpb, 128, hb, ob).py_func, _sig(hb, "uint16" if ob else "float32"))
    for rpb in (1, 2, 4) for hb, ob in ((False, True), (True, True), (False, False))
] + [
    (_make(8, nb, rpb, 128, False, True).py_func, _sig(False, "uint16")) for nb in (2, 4) for rpb in (2, 4)
] + [(_make(1, 1, 1, 128, False, True).py_func, _sig(False, "uint16"))]


def _sig_multi(has_bias: bool) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    w, y = "uint16[:, ::1]", "uint16[:, ::1]"
    return f"void({w}, {w}, {w}, {w}, {bias_t}, {bias_t}, {bias_t}, {y}, {y}, {y}, " + ", ".join(["int64"] * 8) + ")"


_SIG_GATE_UP = "void(uint16[:, ::1], uint16[:, ::1], uint16[:, ::1], uint16[:, ::1], int64, int64, int64, int64)"

# The fused decode launches: q/k/v in one grid (with and without Qwen2's bias; two rows per block for the
# 3072 + 1024 + 1024 rows of the 3B preset, one for small models), gate/up/silu (one and two rows of each
# matrix per block); the scalar fallbacks.
SIGNATURES += [
    (_make_multi(8, 1, rpb, 128, hb).py_func, _sig_multi(hb)) for rpb in (1, 2) for hb in (False, True)
] + [(_make_multi(1, 1, 1, 128, False).py_func, _sig_multi(False))] + [
    (_make_gate_up(vec, 1, rpb, 128).py_func, _SIG_GATE_UP) for vec, rpb in ((8, 1), (8, 2), (1, 1))
]
