"""Helpers shared by the GPU kernel tests."""

from __future__ import annotations

import numpy as np

HALF_ULP = 2.0 ** -8     # bf16 round to nearest: |round(v) - v| <= 2^-8 |v|


def to_dev(a, stream):
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(a), stream=stream)


def get(d, stream):
    """Copy back and wait for the stream."""
    out = d.copy_to_host(stream=stream)
    stream.synchronize()
    return out
