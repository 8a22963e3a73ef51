"""Helpers shared by the simulator tests."""

from __future__ import annotations

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import f32_to_bf16

HALF_ULP = 2.0 ** -8     # bf16 round to nearest: |round(v) - v| <= 2^-8 |v|


def bf16(rng, shape, scale=1.0):
    """bf16 bits (uint16) of N(0, scale²) values."""
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))
