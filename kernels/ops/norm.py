"""RMSNorm over the hidden axis, bf16 in and out, fp32 math; optionally fused with the residual add.

    out[t] = x[t] / sqrt(mean(x[t]²) + eps) * weight                       (plain)
    residual[t] <- bf16(residual[t] + x[t]);  out[t] = norm(residual[t])      (fused, residual=...)

One block per row: pass 1 reads the row (16 bytes per load) and sums squares, a block reduction gives
the scale, pass 2 reads the row again — from L1/L2, it was just read — and writes ``out``. HBM sees
each byte once. The fused form writes the bf16 sum into ``residual`` in pass 1 and normalises that
rounded sum, so it equals ``residual_add`` followed by ``rmsnorm`` bit for bit.

Numerics: HF's LlamaRMSNorm rounds the normalised value to bf16 before multiplying by the weight; here
``x * scale * weight`` is rounded once. The two differ by at most about one bf16 ulp.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16, f32_to_bf16, round_bf16
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import (as_stream, block_sum, check_threads, check_workspace, hi_f32, ld8, ld8_ro,
    lo_f32, pack2, st8, vec8_ok)
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only


@cuda.jit(device=True, inline="always")
def _sq4(w0, w1, w2, w3):
    a = lo_f32(w0)
    b = hi_f32(w0)
    c = lo_f32(w1)
    d = hi_f32(w1)
    e = lo_f32(w2)
    f = hi_f32(w2)
    g = lo_f32(w3)
    h = hi_f32(w3)
    return a * a + b * b + c * c + d * d + e * e + f * f + g * g + h * h


@cuda.jit(device=True, inline="always")
def _add_word(a, b):
    return pack2(lo_f32(a) + lo_f32(b), hi_f32(a) + hi_f32(b))


@cuda.jit(device=True, inline="always")
def _scale_word(a, g, s):
    return pack2(lo_f32(a) * s * lo_f32(g), hi_f32(a) * s * hi_f32(g))


@functools.lru_cache(maxsize=None)
def _make(vec: int, threads: int, fused: bool):
    def rmsnorm_kernel(x, res, weight, out, eps, h):
        # x: [T, H] bf16; res: [T, H] bf16 residual stream (updated when fused; else unused);
        # weight: [H] bf16; out: [T, H] bf16 (may alias x). grid: T; block: threads
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(32, np.float32)
        ss = np.float32(0.0)
        if vec == 8:
            for c in range(tid * 8, h, threads * 8):
                x0, x1, x2, x3 = ld8(x, (t, c))
                if fused:
                    r0, r1, r2, r3 = ld8(res, (t, c))
                    x0 = _add_word(x0, r0)
                    x1 = _add_word(x1, r1)
                    x2 = _add_word(x2, r2)
                    x3 = _add_word(x3, r3)
                    st8(res, (t, c), x0, x1, x2, x3)
                ss += _sq4(x0, x1, x2, x3)
        else:
            for c in range(tid, h, threads):
                v = dev_bf16_to_f32(x[t, c])
                if fused:
                    s16 = dev_f32_to_bf16(v + dev_bf16_to_f32(res[t, c]))
                    res[t, c] = s16
                    v = dev_bf16_to_f32(s16)
                ss += v * v
        total = block_sum(ss, scratch)
        scale = np.float32(1.0) / math.sqrt(total / np.float32(h) + eps)
        # pass 2: the same thread re-reads the same elements it read (or wrote) in pass 1
        if vec == 8:
            for c in range(tid * 8, h, threads * 8):
                if fused:
                    x0, x1, x2, x3 = ld8(res, (t, c))
                else:
                    x0, x1, x2, x3 = ld8(x, (t, c))
                g0, g1, g2, g3 = ld8_ro(weight, c)
                st8(out, (t, c), _scale_word(x0, g0, scale), _scale_word(x1, g1, scale),
                    _scale_word(x2, g2, scale), _scale_word(x3, g3, scale))
        else:
            for c in range(tid, h, threads):
                if fused:
                    v = dev_bf16_to_f32(res[t, c])
                else:
                    v = dev_bf16_to_f32(x[t, c])
                out[t, c] = dev_f32_to_bf16(v * scale * dev_bf16_to_f32(weight[c]))

    return jit(rmsnorm_kernel)


def workspace_requirement(tokens: int, hidden: int):
    """RMSNorm needs no scratch (a few floats of shared memory)."""
    return NONE


def rmsnorm(x, weight, out, *, eps: float, residual=None, workspace=None, stream=None, threads: int = 128):
    """out[T, H] = RMSNorm(x)·weight; with ``residual``: residual += x (bf16) first, then normalise it.

    x, weight, out, residual: bf16 (uint16) device arrays, x/out/residual [T, H], weight [H].
    ``out`` may be ``x``. Never allocates.
    """
    check_workspace("rmsnorm", workspace, workspace_requirement(*x.shape).bytes)
    t, h = x.shape
    if out.shape != (t, h) or weight.shape != (h,) or (residual is not None and residual.shape != (t, h)):
        raise ValueError(f"rmsnorm shapes: x {x.shape}, weight {weight.shape}, out {out.shape}")
    fused = residual is not None
    arrays = (x, weight, out) + ((residual,) if fused else ())
    vec = 8 if vec8_ok(*arrays) else 1
    kern = _make(vec, check_threads(threads), fused)
    kern[t, threads, as_stream(stream)](x, residual if fused else x, weight, out, np.float32(eps), h)


def reference(x, weight, eps: float, residual=None):
    """-> out (bf16 bits), or (out, new_residual) with ``residual``. fp64 statistics, one rounding."""
    xf = bf16_to_f32(x)
    new_res = None
    if residual is not None:
        xf = round_bf16(xf + bf16_to_f32(residual))   # the fp32 sum, rounded like the kernel
        new_res = f32_to_bf16(xf)
    xd = xf.astype(np.float64)
    scale = 1.0 / np.sqrt((xd * xd).mean(axis=-1, keepdims=True) + eps)
    out = f32_to_bf16((xd * scale * bf16_to_f32(weight)).astype(np.float32))
    return out if residual is None else (out, new_res)


def bytes_moved(tokens: int, hidden: int, *, fused: bool = False) -> int:
    """x read + out written (+ residual read and written), weight once."""
    return 2 * tokens * hidden * (4 if fused else 2) + 2 * hidden


def flops(tokens: int, hidden: int, *, fused: bool = False) -> int:
    return tokens * hidden * (4 + (1 if fused else 0))


_SIG = "void(uint16[:, ::1], uint16[:, ::1], uint16[::1], uint16[:, ::1], float32, int64)"
SIGNATURES = [(_make(vec, 128, fused).py_func, _SIG) for vec in (8, 1) for fused in (False, True)]
