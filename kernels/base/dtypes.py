"""bf16 storage as uint16 bit patterns, fp32 arithmetic: host conversions and device helpers.

Device code reads a bf16 as its uint16 bits and widens it with a shift; it narrows fp32 to bf16
with round-to-nearest-even, like the host conversion, so kernels and references agree bit for bit
on the stored values.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda


def f32_to_bf16(x) -> np.ndarray:
    """fp32 (or anything castable) -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def bf16_to_f32(b) -> np.ndarray:
    """bf16 bit patterns (uint16) -> fp32, exact."""
    b = np.ascontiguousarray(b, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """fp32 values rounded through bf16 and back (what a bf16 store then load gives)."""
    return bf16_to_f32(f32_to_bf16(x))


if config.ENABLE_CUDASIM:  # the simulator has no libdevice: reinterpret through NumPy
    @cuda.jit(device=True)
    def dev_bf16_to_f32(u):
        return np.array([np.uint32(u) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def dev_f32_to_bf16(f):
        return f32_to_bf16(np.array([f], dtype=np.float32))[0]

    @cuda.jit(device=True)
    def as_f32(u):
        return np.array([np.uint32(u)], dtype=np.uint32).view(np.float32)[0]
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def dev_bf16_to_f32(u):
        return libdevice.int_as_float(np.int32(np.uint32(u) << np.uint32(16)))

    @cuda.jit(device=True, inline=True)
    def as_f32(u):
        """The float32 whose bits are the uint32 ``u``."""
        return libdevice.int_as_float(np.int32(np.uint32(u)))

    @cuda.jit(device=True, inline=True)
    def dev_f32_to_bf16(f):
        bits = np.uint32(libdevice.float_as_int(f))
        if f != f:  # NaN
            return np.uint16(0x7FC0)
        bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return np.uint16(bits >> np.uint32(16))


