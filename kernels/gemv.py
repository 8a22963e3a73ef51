"""bf16 GEMV for decode: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias[N]), fp32 accumulation.

W stays in checkpoint layout (row-major [out, in]). Decode is memory-bound: the kernel must stream W
once at HBM speed, so
- one block owns ``rows_per_block`` consecutive rows and all its threads split K between them, so a
  small N still yields enough blocks and every block finishes at about the same time (no wave tail);
- each thread reads W 16 bytes (8 bf16) per load, one load per owned row per step, so ``rows_per_block``
  independent loads are in flight per thread; W goes through the read-only cache path (``ld.global.nc``);
- x is tiny and re-read by every block from L1/L2, also 16 bytes at a time, and shared by ``batch_tile``
  rows of x per W load (batch decode reads W once per tile of up to 4 sequences);
- partial sums are reduced with warp shuffles, then across warps through a few floats of shared memory.
Shapes that cannot be read 16 bytes at a time (K % 8, unaligned views) use a scalar path (slow, correct).
Output is bf16 (uint16) or fp32 — whatever ``out`` is; Qwen2's q/k/v bias is fused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from .dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16
from .launch import (as_stream, cdiv, check_threads, check_workspace, hi_f32, ld8_ro, lo_f32, vec8_ok,
                     warp_sum)
from .workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only


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


@functools.lru_cache(maxsize=None)
def _make(vec: int, nb: int, rpb: int, threads: int, has_bias: bool, out_bf16: bool):
    nw = threads // 32
    rn = rpb * nb
    n_scratch = nw * rn  # shared array shapes must be plain constants, not expressions

    def gemv_kernel(w, x, bias, y, n_rows, n_batch, k):
        # w: [N, K] bf16; x: [B, K] bf16; bias: [N] bf16 (ignored without bias); y: [B, N] bf16|f32
        # grid: (ceil(N / rpb), ceil(B / nb)); block: threads
        tid = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * rpb
        b0 = cuda.blockIdx.y * nb
        acc = cuda.local.array(rn, np.float32)   # acc[r * nb + b]
        for j in range(rn):
            acc[j] = np.float32(0.0)
        if vec == 8:
            xf = cuda.local.array((nb, 8), np.float32)
            for c in range(tid * 8, k, threads * 8):
                for b in range(nb):
                    # rows past the end are clamped: loads stay unconditional, results are dropped
                    x0, x1, x2, x3 = ld8_ro(x, (min(b0 + b, n_batch - 1), c))
                    xf[b, 0] = lo_f32(x0)
                    xf[b, 1] = hi_f32(x0)
                    xf[b, 2] = lo_f32(x1)
                    xf[b, 3] = hi_f32(x1)
                    xf[b, 4] = lo_f32(x2)
                    xf[b, 5] = hi_f32(x2)
                    xf[b, 6] = lo_f32(x3)
                    xf[b, 7] = hi_f32(x3)
                for r in range(rpb):
                    w0, w1, w2, w3 = ld8_ro(w, (min(row0 + r, n_rows - 1), c))
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
        else:
            xs = cuda.local.array(nb, np.float32)
            for c in range(tid, k, threads):
                for b in range(nb):
                    xs[b] = dev_bf16_to_f32(x[min(b0 + b, n_batch - 1), c])
                for r in range(rpb):
                    a = dev_bf16_to_f32(w[min(row0 + r, n_rows - 1), c])
                    for b in range(nb):
                        acc[r * nb + b] += a * xs[b]

        scratch = cuda.shared.array(n_scratch, np.float32)   # [warp, r * nb + b]
        lane = tid % 32
        wid = tid // 32
        for j in range(rn):
            s = warp_sum(acc[j])
            if lane == 0:
                scratch[wid * rn + j] = s
        cuda.syncthreads()
        if tid < rn:
            row = row0 + tid // nb
            bb = b0 + tid % nb
            if row < n_rows and bb < n_batch:
                t = scratch[tid]
                for q in range(1, nw):
                    t += scratch[q * rn + tid]
                if has_bias:
                    t += dev_bf16_to_f32(bias[row])
                if out_bf16:
                    y[bb, row] = dev_f32_to_bf16(t)
                else:
                    y[bb, row] = t

    return cuda.jit(gemv_kernel)


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
    threads, rpb, nb = _auto(n, b, config or GemvConfig())
    if threads < rpb * nb:
        raise ValueError("gemv: threads per block must cover rows_per_block * batch_tile")
    vec = 8 if vec8_ok(w, x) else 1
    kern = _make(vec, nb, rpb, threads, bias is not None, out.dtype == np.uint16)
    kern[(cdiv(n, rpb), cdiv(b, nb)), threads, as_stream(stream)](
        w, x, x if bias is None else bias, out, n, b, k)


def reference(w, x, bias=None) -> np.ndarray:
    """fp32 result of the bf16 inputs (accumulated in fp64): [B, N] or [N] like x."""
    wf = bf16_to_f32(w).astype(np.float64)
    xf = bf16_to_f32(x).astype(np.float64)
    y = xf @ wf.T
    if bias is not None:
        y = y + bf16_to_f32(bias)
    return y.astype(np.float32)


def bytes_moved(n: int, k: int, batch: int = 1, *, bias: bool = False, out_itemsize: int = 2,
                batch_tile: int = 0) -> int:
    """HBM bytes: W once per batch tile, x, bias, out."""
    nb = batch_tile or (1 if batch == 1 else 2 if batch == 2 else 4)
    return 2 * n * k * cdiv(batch, nb) + 2 * batch * k + out_itemsize * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    return 2 * batch * n * k


def _sig(has_bias: bool, out: str) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    return f"void(uint16[:, ::1], uint16[:, ::1], {bias_t}, {out}[:, ::1], int64, int64, int64)"


# What a Llama/Mistral/Qwen2 decode launches: 16-byte path with bf16 out, Qwen2's bias, fp32 logits;
# batch tiles 2 and 4 (B = 2, B = 3..4 and larger); the scalar fallback.
SIGNATURES = [
    (_make(8, 1, rpb, 128, hb, ob).py_func, _sig(hb, "uint16" if ob else "float32"))
    for rpb in (1, 2, 4) for hb, ob in ((False, True), (True, True), (False, False))
] + [
    (_make(8, nb, rpb, 128, False, True).py_func, _sig(False, "uint16")) for nb in (2, 4) for rpb in (2, 4)
] + [(_make(1, 1, 1, 128, False, True).py_func, _sig(False, "uint16"))]
