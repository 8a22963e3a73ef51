"""Tiled GEMM for prefill: Y[M, N] = X[M, K] · W[N, K]ᵀ (+ bias[N]), bf16 in, fp32 accumulate.

W stays in checkpoint layout ([out, in]), so both operands are read along K. A 16×16 thread block
computes a (16·tm)×(16·tm) tile of Y, each thread a tm×tm micro-tile whose rows and columns are
strided by 16 (so shared-memory reads are conflict-free and the final stores coalesce). Per K step
of ``BK`` the block stages both operand tiles in shared memory as fp32, transposed to [k][row] with
one pad column; the next tile is loaded into registers while the current one is multiplied, so global
latency overlaps the FMAs. This is the plain SIMT fp32-FMA route, correct at any shape and a few tens of
TFLOP/s at best; ``gemm()`` takes the tensor-core route (``gemm_mma.py``) whenever the operands allow it.
Output is bf16 (uint16) or fp32, whatever ``out`` is.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import config, cuda
from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.env import switch
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import as_stream, cdiv, check_workspace
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only
SIM = bool(config.ENABLE_CUDASIM)
MMA, SIMT = "mma", "simt"
BK = 16
TM_DEFAULT = 4        # 64×64 tiles; 8 gives 128×128 tiles (more reuse, more registers)


@functools.lru_cache(maxsize=None)
def _make(tm: int, has_bias: bool, out_bf16: bool):
    bm = 16 * tm                 # tile edge (rows of X and of W per block)
    pad = bm + 1                 # shared row pitch: the +1 spreads the transposed stores over banks
    n_shared = BK * pad
    lpt = bm * BK // 256         # elements of each operand tile one thread stages per K step
    tt = tm * tm

    def gemm_kernel(x, w, bias, y, m, n, k):
        # x: [M, K] bf16; w: [N, K] bf16; bias: [N] bf16 (ignored without bias); y: [M, N] bf16|f32
        # grid: (ceil(N / bm), ceil(M / bm)); block: (16, 16)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * 16 + tx
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bm
        xs = cuda.shared.array(n_shared, np.float32)   # [kk][row of X tile]
        ws = cuda.shared.array(n_shared, np.float32)   # [kk][row of W tile]
        acc = cuda.local.array(tt, np.float32)
        ra = cuda.local.array(lpt, np.float32)
        rb = cuda.local.array(lpt, np.float32)
        af = cuda.local.array(tm, np.float32)
        bf = cuda.local.array(tm, np.float32)
        for i in range(tt):
            acc[i] = np.float32(0.0)
        # stage tile 0: element e = tid + l·256 of a tile is (row e // BK, k e % BK): 16 threads
        # read 32 contiguous bytes of one row
        for l in range(lpt):
            e = tid + l * 256
            r = e // BK
            kk = e % BK
            ra[l] = dev_bf16_to_f32(x[m0 + r, kk]) if m0 + r < m and kk < k else np.float32(0.0)
            rb[l] = dev_bf16_to_f32(w[n0 + r, kk]) if n0 + r < n and kk < k else np.float32(0.0)
        for k0 in range(0, k, BK):
            for l in range(lpt):
                e = tid + l * 256
                xs[(e % BK) * pad + e // BK] = ra[l]
                ws[(e % BK) * pad + e // BK] = rb[l]
            cuda.syncthreads()
            k1 = k0 + BK
            if k1 < k:  # prefetch the next K step into registers while this one is multiplied
                for l in range(lpt):
                    e = tid + l * 256
                    r = e // BK
                    kk = k1 + e % BK
                    ra[l] = dev_bf16_to_f32(x[m0 + r, kk]) if m0 + r < m and kk < k else np.float32(0.0)
                    rb[l] = dev_bf16_to_f32(w[n0 + r, kk]) if n0 + r < n and kk < k else np.float32(0.0)
            for kk in range(BK):
                for i in range(tm):
                    af[i] = xs[kk * pad + ty + 16 * i]
                    bf[i] = ws[kk * pad + tx + 16 * i]
                for i in range(tm):
                    for j in range(tm):
                        acc[i * tm + j] += af[i] * bf[j]
            cuda.syncthreads()
        for i in range(tm):
            row = m0 + ty + 16 * i
            if row < m:
                for j in range(tm):
                    col = n0 + tx + 16 * j
                    if col < n:
                        v = acc[i * tm + j]
                        if has_bias:
                            v += dev_bf16_to_f32(bias[col])
                        if out_bf16:
                            y[row, col] = dev_f32_to_bf16(v)
                        else:
                            y[row, col] = v

    return jit(gemm_kernel)


CUBLASLT = "cublaslt"
# cuBLASLt where it loads (nvmath-python installed, its library found) and a workspace is given; VMMSTREAM_CUBLASLT=0
# keeps our kernel. On the H100 it runs at torch.matmul's rate (682 / 799 TFLOP/s at M = 512 / 4096), ours at 113 /
# 125 (bench/test_bench_dense_kernels.py -k gemm_prefill).
def _prefer_cublaslt() -> bool:
    return switch("VMMSTREAM_CUBLASLT", True)


PREFER_CUBLASLT = _prefer_cublaslt()


def cublaslt_usable() -> bool:
    """Whether the cuBLASLt route is the one ``auto`` takes when given its workspace."""
    if SIM or not PREFER_CUBLASLT:
        return False
    from vmmstream.kernels.matmul.dense import cublaslt
    return cublaslt.available()


def workspace_requirement(m: int, n: int, k: int, route: str = "auto"):
    """Our kernels keep their tiles in shared memory: no workspace. The cuBLASLt route (``route`` ``cublaslt``,
    or ``auto`` where it is usable) takes a session buffer of ``cublaslt.WORKSPACE`` bytes."""
    if route == CUBLASLT or (route == "auto" and cublaslt_usable()):
        from vmmstream.kernels.matmul.dense import cublaslt
        return cublaslt.workspace_requirement(m, n, k)
    return NONE


def choose_route(x, w, out=None, workspace=None) -> str:
    """``cublaslt`` when usable (``cublaslt_usable``), the output is bf16 and its workspace is given; else ``mma``
    (tensor cores, ``gemm_mma.py``) when it is the default (``gemm_mma.DEFAULT``) and takes the operands (K a
    multiple of 32, rows 16-byte aligned), else ``simt``. The simulator runs ``simt`` unless asked: its emulated
    mma is slow."""
    from vmmstream.kernels.matmul.dense import cublaslt, gemm_mma
    if (workspace is not None and (out is None or out.dtype == np.uint16) and cublaslt_usable()
            and workspace.shape[0] * workspace.dtype.itemsize >= cublaslt.WORKSPACE):
        return CUBLASLT
    return MMA if gemm_mma.DEFAULT and not SIM and gemm_mma.usable(x, w) else SIMT


def gemm(x, w, out, *, bias=None, workspace=None, stream=None, tm: int = TM_DEFAULT, route: str = "auto"):
    """out[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]). bf16 (uint16) inputs; out uint16 (bf16) or float32.
    ``route``: ``auto`` (``choose_route``), ``cublaslt`` (needs ``workspace``), ``mma`` or ``simt`` (``tm``
    applies to ``simt`` only). ``workspace``: optional except for ``cublaslt``; ``auto`` takes cuBLASLt only
    when it is given."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or out.shape != (m, n) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"gemm shapes: x {x.shape}, w {w.shape}, out {out.shape}")
    if tm not in (1, 2, 4, 8):
        raise ValueError(f"gemm micro-tile must be 1, 2, 4 or 8, got {tm}")
    auto = route == "auto"
    if auto:
        route = choose_route(x, w, out, workspace)
    if route == CUBLASLT:
        from vmmstream.kernels.matmul.dense import cublaslt
        check_workspace("gemm", workspace, cublaslt.WORKSPACE)
        try:
            if m and n:
                cublaslt.launch(x, w, out, bias=bias, workspace=workspace, stream=stream)
            return
        except cublaslt.Unsupported:       # nothing enqueued: auto takes our kernels for this shape
            if not auto:
                raise
            route = choose_route(x, w)
    if route == MMA:
        from vmmstream.kernels.matmul.dense import gemm_mma
        if not gemm_mma.usable(x, w):
            raise ValueError(f"gemm route 'mma' needs K a multiple of {gemm_mma.BK} and 16-byte aligned rows; "
                             f"x {x.shape}, w {w.shape}")
        gemm_mma.launch(x, w, out, bias=bias, stream=stream)
        return
    if route != SIMT:
        raise ValueError(f"gemm route must be 'auto', 'cublaslt', 'mma' or 'simt', got {route!r}")
    kern = _make(tm, bias is not None, out.dtype == np.uint16)
    bm = 16 * tm
    if m and n:
        kern[(cdiv(n, bm), cdiv(m, bm)), (16, 16), as_stream(stream)](
            x, w, x if bias is None else bias, out, m, n, k)


def reference(x, w, bias=None) -> np.ndarray:
    """fp32 result of the bf16 inputs, accumulated in fp64."""
    y = bf16_to_f32(x).astype(np.float64) @ bf16_to_f32(w).astype(np.float64).T
    if bias is not None:
        y = y + bf16_to_f32(bias)
    return y.astype(np.float32)


def bytes_moved(m: int, n: int, k: int, *, out_itemsize: int = 2, tm: int = TM_DEFAULT) -> int:
    """DRAM-level lower bound (each operand once) plus output, whatever the route (``gemm_mma.bytes_moved``)."""
    from vmmstream.kernels.matmul.dense import gemm_mma
    return gemm_mma.bytes_moved(m, n, k, out_itemsize=out_itemsize)


def flops(m: int, n: int, k: int) -> int:
    from vmmstream.kernels.matmul.dense import gemm_mma
    return gemm_mma.flops(m, n, k)


def _sig(has_bias: bool, out: str) -> str:
    bias_t = "uint16[::1]" if has_bias else "uint16[:, ::1]"
    return f"void(uint16[:, ::1], uint16[:, ::1], {bias_t}, {out}[:, ::1], int64, int64, int64)"


SIGNATURES = [(_make(tm, hb, True).py_func, _sig(hb, "uint16")) for tm in (4, 8) for hb in (False, True)] + [
    (_make(4, False, False).py_func, _sig(False, "float32"))]
