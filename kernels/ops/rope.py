"""Rotary position embedding, applied in place to q [T, Hq, D] and k [T, Hkv, D] (bf16).

HF "rotate_half" convention over the first R = 2 · len(inv_freq) dims of a head (R = D, or less with a partial
rotary factor): element i < R/2 pairs with i + R/2, with the angle pos · inv_freq[i], and cos, sin are
multiplied by ``scale`` (transformers' ``attention_scaling``: 1, or longrope's attention factor):
    x[i]       <- x[i] · cos - x[i + R/2] · sin
    x[i + R/2] <- x[i + R/2] · cos + x[i] · sin
dims R..D-1 pass unchanged. Positions come from a device int32 array, so a captured decode graph reads the
current position from device memory at replay. ``inv_freq`` is computed once on the host (default RoPE, linear
and Llama-3 scaling here; the model layer also computes longrope's, following transformers' semantics) and
passed as a device fp32 array.

One block per token: its threads first compute cos/sin of the R/2 angles into shared memory (once per
token, not per head), then rotate every head of q and k 8 pairs at a time (two 16-byte loads, two
16-byte stores per 8 pairs). cos/sin are fp32 and the result is rounded to bf16 once; HF rounds cos/sin
and each product to bf16, so results differ from HF by about one bf16 ulp.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda
from vmmstream.kernels.base.dtypes import (
    bf16_to_f32,
    dev_bf16_to_f32,
    dev_f32_to_bf16,
    f32_to_bf16,
)
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import (
    SIM,
    as_stream,
    check_threads,
    check_workspace,
    hi_f32,
    ld8,
    lo_f32,
    pack2,
    st8,
    vec8_ok,
)
from vmmstream.kernels.base.rope_table import base_powers, llama3_scaled
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only
MAX_HALF = 256       # head_dim up to 512


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> np.ndarray:
    """inv_freq [head_dim // 2] fp32 for rope_type default, linear or llama3 (transformers semantics).

    Computed in fp32 like transformers (arange -> float, base ** (i / dim)), so the values match its
    buffers to the last bit or so.
    """
    dim = int(head_dim)
    if dim % 2:
        raise ValueError(f"head_dim must be even, got {dim}")
    inv = (np.float32(1.0) / base_powers(dim, theta)).astype(np.float32)
    scaling = dict(rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        return llama3_scaled(inv, scaling)
    raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3 are)")


if SIM:
    def _sincos(a):
        return np.float32(math.sin(a)), np.float32(math.cos(a))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def _sincos(a):
        # one range reduction for both (libdevice sincosf, full-range accurate like sinf/cosf)
        return libdevice.sincosf(a)


@cuda.jit(device=True, inline="always")
def _rot_words(a, b, c0, s0, c1, s1):
    """Rotate two pairs: words a (elements i, i+1) and b (elements i+D/2, i+1+D/2)."""
    a0 = lo_f32(a)
    a1 = hi_f32(a)
    b0 = lo_f32(b)
    b1 = hi_f32(b)
    return (pack2(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1),
            pack2(b0 * c0 + a0 * s0, b1 * c1 + a1 * s1))


@cuda.jit(device=True, inline="always")
def _rot8_words(arr, t, h, j, half, cs, sn):
    """arr[t, h, j : j+8] rotated with arr[t, h, half+j : half+j+8]: the 8 result words (4 + 4), rounded."""
    a0, a1, a2, a3 = ld8(arr, (t, h, j))
    b0, b1, b2, b3 = ld8(arr, (t, h, half + j))
    a0, b0 = _rot_words(a0, b0, cs[j], sn[j], cs[j + 1], sn[j + 1])
    a1, b1 = _rot_words(a1, b1, cs[j + 2], sn[j + 2], cs[j + 3], sn[j + 3])
    a2, b2 = _rot_words(a2, b2, cs[j + 4], sn[j + 4], cs[j + 5], sn[j + 5])
    a3, b3 = _rot_words(a3, b3, cs[j + 6], sn[j + 6], cs[j + 7], sn[j + 7])
    return a0, a1, a2, a3, b0, b1, b2, b3


@cuda.jit(device=True, inline="always")
def _rot8(arr, t, h, j, half, cs, sn):
    # arr[t, h, j : j+8] pairs with arr[t, h, half+j : half+j+8]
    a0, a1, a2, a3, b0, b1, b2, b3 = _rot8_words(arr, t, h, j, half, cs, sn)
    st8(arr, (t, h, j), a0, a1, a2, a3)
    st8(arr, (t, h, half + j), b0, b1, b2, b3)


@cuda.jit(device=True, inline="always")
def _rot1(arr, t, h, i, half, cs, sn):
    x1 = dev_bf16_to_f32(arr[t, h, i])
    x2 = dev_bf16_to_f32(arr[t, h, half + i])
    arr[t, h, i] = dev_f32_to_bf16(x1 * cs[i] - x2 * sn[i])
    arr[t, h, half + i] = dev_f32_to_bf16(x2 * cs[i] + x1 * sn[i])


@functools.lru_cache(maxsize=None)
def _make(vec: int, threads: int):
    def rope_kernel(q, k, positions, inv_freq, half, scale):
        # q: [T, Hq, D] bf16, k: [T, Hkv, D] bf16, both in place; positions: [T] int32;
        # inv_freq: [half] fp32 (half = R/2 <= D/2); scale: on cos and sin. grid: T; block: threads
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        cs = cuda.shared.array(MAX_HALF, np.float32)
        sn = cuda.shared.array(MAX_HALF, np.float32)
        pos = np.float32(positions[t])
        for i in range(tid, half, threads):
            s, c = _sincos(pos * inv_freq[i])
            sn[i] = s * scale
            cs[i] = c * scale
        cuda.syncthreads()
        hq = q.shape[1]
        per_head = half // vec
        for it in range(tid, (hq + k.shape[1]) * per_head, threads):
            h = it // per_head
            j = (it - h * per_head) * vec
            if vec == 8:
                if h < hq:
                    _rot8(q, t, h, j, half, cs, sn)
                else:
                    _rot8(k, t, h - hq, j, half, cs, sn)
            else:
                if h < hq:
                    _rot1(q, t, h, j, half, cs, sn)
                else:
                    _rot1(k, t, h - hq, j, half, cs, sn)

    return jit(rope_kernel)


@cuda.jit(device=True, inline="always")
def _rot8_to(arr, t, h, j, half, cs, sn, dst, p):
    """``_rot8``, also storing the rotated words at dst[p, h] (the KV cache row of position p)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _rot8_words(arr, t, h, j, half, cs, sn)
    st8(arr, (t, h, j), a0, a1, a2, a3)
    st8(arr, (t, h, half + j), b0, b1, b2, b3)
    if p >= 0:
        st8(dst, (p, h, j), a0, a1, a2, a3)
        st8(dst, (p, h, half + j), b0, b1, b2, b3)


@cuda.jit(device=True, inline="always")
def _rot1_to(arr, t, h, i, half, cs, sn, dst, p):
    x1 = dev_bf16_to_f32(arr[t, h, i])
    x2 = dev_bf16_to_f32(arr[t, h, half + i])
    y1 = dev_f32_to_bf16(x1 * cs[i] - x2 * sn[i])
    y2 = dev_f32_to_bf16(x2 * cs[i] + x1 * sn[i])
    arr[t, h, i] = y1
    arr[t, h, half + i] = y2
    if p >= 0:
        dst[p, h, i] = y1
        dst[p, h, half + i] = y2


@functools.lru_cache(maxsize=None)
def _make_append(vec: int, threads: int):
    def rope_append_kernel(q, k, v, ck, cv, positions, rows, inv_freq, half, scale):
        # q: [T, Hq, D], k, v: [T, Hkv, D] bf16 (q and k rotated in place, dims < 2 * half) at positions[t]; ck,
        # cv: [S, Hkv, D] cache rows (strided); rotated k and v go to row rows[t] when it is in [0, S) (one
        # sequence: rows is positions; a batch: each sequence's rows are its own range of a flat cache).
        # grid: T; block: threads
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        cs = cuda.shared.array(MAX_HALF, np.float32)
        sn = cuda.shared.array(MAX_HALF, np.float32)
        pos = np.float32(positions[t])
        p = rows[t]
        if p >= ck.shape[0]:
            p = -1
        for i in range(tid, half, threads):
            s, c = _sincos(pos * inv_freq[i])
            sn[i] = s * scale
            cs[i] = c * scale
        cuda.syncthreads()
        hq, hkv = q.shape[1], k.shape[1]
        per_head = half // vec
        for it in range(tid, (hq + hkv) * per_head, threads):
            h = it // per_head
            j = (it - h * per_head) * vec
            if vec == 8:
                if h < hq:
                    _rot8(q, t, h, j, half, cs, sn)
                else:
                    _rot8_to(k, t, h - hq, j, half, cs, sn, ck, p)
            else:
                if h < hq:
                    _rot1(q, t, h, j, half, cs, sn)
                else:
                    _rot1_to(k, t, h - hq, j, half, cs, sn, ck, p)
        if p >= 0:
            d = v.shape[2]
            per_row = d // vec
            for it in range(tid, hkv * per_row, threads):
                h = it // per_row
                j = (it - h * per_row) * vec
                if vec == 8:
                    w0, w1, w2, w3 = ld8(v, (t, h, j))
                    st8(cv, (p, h, j), w0, w1, w2, w3)
                else:
                    cv[p, h, j] = v[t, h, j]
            # k's unrotated dims (a partial rotary factor): copied as they are; no thread writes them above
            rot = 2 * half
            per_tail = (d - rot) // vec
            for it in range(tid, hkv * per_tail, threads):
                h = it // per_tail
                j = rot + (it - h * per_tail) * vec
                if vec == 8:
                    w0, w1, w2, w3 = ld8(k, (t, h, j))
                    st8(ck, (p, h, j), w0, w1, w2, w3)
                else:
                    ck[p, h, j] = k[t, h, j]

    return jit(rope_append_kernel)


def workspace_requirement(tokens: int, q_heads: int, kv_heads: int, head_dim: int):
    """RoPE needs no scratch (cos/sin live in shared memory)."""
    return NONE


def _rotary_half(inv_freq, d: int) -> int:
    """R/2: the pairs ``inv_freq`` rotates, 1 <= R/2 <= D/2 and <= MAX_HALF (else -1)."""
    half = inv_freq.shape[0] if len(inv_freq.shape) == 1 else -1
    return half if 1 <= half <= min(d // 2, MAX_HALF) else -1


def apply_rope(q, k, positions, inv_freq, *, scale: float = 1.0, workspace=None, stream=None, threads: int = 128):
    """Rotate the first 2 · len(inv_freq) dims of q [T, Hq, D] and k [T, Hkv, D] (bf16, in place) at positions [T]
    (int32 device array), cos and sin times ``scale``."""
    t, hq, d = q.shape
    check_workspace("rope", workspace, workspace_requirement(t, hq, k.shape[1], d).bytes)
    half = _rotary_half(inv_freq, d)
    if d % 2 or k.shape[0] != t or k.shape[2] != d or positions.shape != (t,) or half < 0:
        raise ValueError(f"rope shapes: q {q.shape}, k {k.shape}, positions {positions.shape}, "
                         f"inv_freq {inv_freq.shape} (head_dim even, <= {2 * MAX_HALF}; 1 to head_dim / 2 "
                         "frequencies)")
    # 8-pair groups need R/2 % 8 == 0 and 16-byte aligned halves
    vec = 8 if half % 8 == 0 and vec8_ok(q, k) else 1
    _make(vec, check_threads(threads))[t, threads, as_stream(stream)](q, k, positions, inv_freq, half,
                                                                     np.float32(scale))


def apply_rope_append_kv(q, k, v, ck, cv, positions, inv_freq, *, rows=None, scale: float = 1.0, workspace=None,
                         stream=None, threads: int = 128):
    """``apply_rope`` on q and k, then rotated k and v written to the cache rows ``rows[t]`` (default
    ``positions[t]``; ck, cv: [S, Hkv, D], rows may be strided; a row outside [0, S) writes nothing), in one
    launch: what a decode step did with a RoPE launch and a KV-append launch. ``rows`` (int32 [T]) places each
    token of a batch in its own sequence's range of a flat cache."""
    rows = positions if rows is None else rows
    t, hq, d = q.shape
    check_workspace("rope_append_kv", workspace, workspace_requirement(t, hq, k.shape[1], d).bytes)
    half = _rotary_half(inv_freq, d)
    hkv = k.shape[1]
    if (d % 2 or tuple(k.shape) != (t, hkv, d) or tuple(v.shape) != (t, hkv, d) or positions.shape != (t,)
            or half < 0 or ck.shape[1:] != (hkv, d) or tuple(cv.shape) != tuple(ck.shape) or rows.shape != (t,)):
        raise ValueError(f"rope_append_kv shapes: q {q.shape}, k {k.shape}, v {v.shape}, cache {ck.shape} / "
                         f"{cv.shape}, positions {positions.shape}, inv_freq {inv_freq.shape}")
    # 8-wide groups: the rotated halves, v's rows and k's unrotated tail all in whole 16-byte words
    vec = 8 if half % 8 == 0 and d % 8 == 0 and vec8_ok(q, k, v, ck, cv) else 1
    _make_append(vec, check_threads(threads))[t, threads, as_stream(stream)](q, k, v, ck, cv, positions, rows,
                                                                            inv_freq, half, np.float32(scale))


def reference_append_kv(q, k, v, ck, cv, positions, inv_freq, scale: float = 1.0, rows=None):
    """NumPy twin of ``apply_rope_append_kv``: returns (q', k', ck', cv') as new arrays."""
    qr, kr = reference(q, positions, inv_freq, scale), reference(k, positions, inv_freq, scale)
    ck, cv = np.array(ck), np.array(cv)
    for t, p in enumerate(np.asarray(positions if rows is None else rows)):
        if 0 <= p < ck.shape[0]:
            ck[p] = kr[t]
            cv[p] = v[t]
    return qr, kr, ck, cv


def reference(x, positions, inv_freq, scale: float = 1.0) -> np.ndarray:
    """x [T, H, D] bf16 bits -> bf16 bits, the first 2 · len(inv_freq) dims rotated, the rest as they are; fp32
    angles and cos/sin times ``scale`` (like the kernel), fp64 products."""
    xf = bf16_to_f32(x).astype(np.float64)
    inv = np.asarray(inv_freq, np.float32)
    half = inv.shape[0]
    ang = np.asarray(positions).astype(np.float32)[:, None] * inv[None, :]
    c = (np.cos(ang).astype(np.float32) * np.float32(scale)).astype(np.float64)[:, None, :]
    s = (np.sin(ang).astype(np.float32) * np.float32(scale)).astype(np.float64)[:, None, :]
    x1, x2, tail = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, tail], axis=-1)
    return f32_to_bf16(out.astype(np.float32))


def bytes_moved(tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """q and k read and written once, plus positions and inv_freq."""
    return 4 * tokens * (q_heads + kv_heads) * head_dim + 4 * tokens + 2 * head_dim


def flops(tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    return 3 * tokens * (q_heads + kv_heads) * head_dim


_SIG = "void(uint16[:, :, ::1], uint16[:, :, ::1], int32[::1], float32[::1], int64, float32)"
_SIG_STRIDED = "void(uint16[:, :, :], uint16[:, :, :], int32[::1], float32[::1], int64, float32)"  # views of qkv
_SIG_APPEND = ("void(uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, :, :], uint16[:, :, :], "
               "int32[::1], int32[::1], float32[::1], int64, float32)")
SIGNATURES = [(_make(8, 128).py_func, _SIG), (_make(8, 128).py_func, _SIG_STRIDED),
              (_make(1, 128).py_func, _SIG), (_make_append(8, 128).py_func, _SIG_APPEND),
              (_make_append(1, 128).py_func, _SIG_APPEND)]
