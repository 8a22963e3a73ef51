"""Elementwise bf16 ops of the decoder layer: SiLU·mul (the MLP gate) and the residual add.

    silu_mul:     out[T, I] = silu(gate) * up,   silu(g) = g / (1 + exp(-g))
    residual_add: out[T, C] = a + b              (out may be a or b)

Each thread handles 8 elements with 16-byte loads and stores (one flat index over T × C/8, so any
row count fills the GPU); unaligned or odd-width views fall back to one element per thread.
``gate`` and ``up`` may be the two halves of a fused [T, 2I] gate_up buffer (``silu_mul_fused``):
strided rows are fine as long as each half starts on a 16-byte boundary (I % 8 == 0).
fp32 math, one rounding; HF rounds silu(gate) to bf16 before the product (≤ ~1 ulp apart).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import bf16_to_f32, dev_bf16_to_f32, dev_f32_to_bf16, f32_to_bf16
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import (as_stream, cdiv, check_threads, check_workspace, hi_f32, ld8, lo_f32,
    pack2, st8, vec8_ok)
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only
SILU_MUL, ADD = 0, 1


@cuda.jit(device=True, inline="always")
def _op(kind, a, b):
    if kind == SILU_MUL:
        return a / (np.float32(1.0) + math.exp(-a)) * b
    return a + b


@cuda.jit(device=True, inline="always")
def _op_word(kind, a, b):
    return pack2(_op(kind, lo_f32(a), lo_f32(b)), _op(kind, hi_f32(a), hi_f32(b)))


@functools.lru_cache(maxsize=None)
def _make(kind: int, vec: int):
    def binary_kernel(a, b, out, n_cols, total):
        # a, b, out: [T, C] bf16 (rows may be strided); one work item = `vec` elements of one row
        # grid: ceil(total / threads); total = T * C / vec
        item = cuda.grid(1)
        if item < total:
            per_row = n_cols // vec
            t = item // per_row
            c = (item - t * per_row) * vec
            if vec == 8:
                a0, a1, a2, a3 = ld8(a, (t, c))
                b0, b1, b2, b3 = ld8(b, (t, c))
                st8(out, (t, c), _op_word(kind, a0, b0), _op_word(kind, a1, b1),
                    _op_word(kind, a2, b2), _op_word(kind, a3, b3))
            else:
                out[t, c] = dev_f32_to_bf16(_op(kind, dev_bf16_to_f32(a[t, c]), dev_bf16_to_f32(b[t, c])))

    return jit(binary_kernel)


def workspace_requirement(tokens: int, cols: int):
    return NONE


def _launch(name, kind, a, b, out, workspace, stream, threads):
    check_workspace(name, workspace, 0)
    if a.ndim == 1:
        a, b, out = (v.reshape(1, v.shape[0]) for v in (a, b, out))
    t, c = a.shape
    if b.shape != (t, c) or out.shape != (t, c):
        raise ValueError(f"{name} shapes: {a.shape}, {b.shape} -> {out.shape}")
    vec = 8 if vec8_ok(a, b, out) else 1
    total = t * c // vec
    threads = check_threads(threads)
    if total:
        _make(kind, vec)[cdiv(total, threads), threads, as_stream(stream)](a, b, out, c, total)


def silu_mul(gate, up, out, *, workspace=None, stream=None, threads: int = 256):
    """out[T, I] = silu(gate) * up; bf16 (uint16) device arrays, [T, I] or [I]."""
    _launch("silu_mul", SILU_MUL, gate, up, out, workspace, stream, threads)


def silu_mul_fused(gate_up, out, *, workspace=None, stream=None, threads: int = 256):
    """out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] for a fused [T, 2I] gate_up buffer."""
    i = gate_up.shape[1] // 2
    silu_mul(gate_up[:, :i], gate_up[:, i:], out, workspace=workspace, stream=stream, threads=threads)


def residual_add(a, b, out, *, workspace=None, stream=None, threads: int = 256):
    """out = a + b (bf16, fp32 add, one rounding); out may alias a or b."""
    _launch("residual_add", ADD, a, b, out, workspace, stream, threads)


def reference_silu_mul(gate, up) -> np.ndarray:
    g = bf16_to_f32(gate).astype(np.float64)
    return f32_to_bf16((g / (1.0 + np.exp(-g)) * bf16_to_f32(up)).astype(np.float32))


def reference_residual_add(a, b) -> np.ndarray:
    return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b))


def reference(kind: str, a, b) -> np.ndarray:
    return {"silu_mul": reference_silu_mul, "residual_add": reference_residual_add}[kind](a, b)


def bytes_moved(tokens: int, cols: int) -> int:
    """Two bf16 inputs read, one written (both ops)."""
    return 6 * tokens * cols


def flops(tokens: int, cols: int, kind: str = "silu_mul") -> int:
    return tokens * cols * (4 if kind == "silu_mul" else 1)


_SIG = "void(uint16[:, ::1], uint16[:, ::1], uint16[:, ::1], int64, int64)"
_SIG_HALVES = "void(uint16[:, :], uint16[:, :], uint16[:, ::1], int64, int64)"  # halves of gate_up
SIGNATURES = [(_make(k, v).py_func, _SIG) for k in (SILU_MUL, ADD) for v in (8, 1)] + [
    (_make(SILU_MUL, 8).py_func, _SIG_HALVES)]
