"""The one kernel of the execution layer: append a step's K and V rows to the cache at the device positions.

Part of the launch adapter (``ops``); imported only on the ``cuda`` backend (the host backend does the same
with NumPy in ``ops.HostOps.kv_append``).
"""

from __future__ import annotations

from numba import cuda


def _kv_append(k, v, ck, cv, positions, h, d, n):
    # k, v: [T, Hkv, D] bf16; ck, cv: [S_max, Hkv, D] (strided rows of the position-major cache);
    # positions: [T] int32 on the device, so a captured step writes wherever the position is now.
    # grid: ceil(T * Hkv * D / 256) blocks of 256
    i = cuda.grid(1)
    if i < n:
        t = i // (h * d)
        r = i - t * h * d
        hh = r // d
        e = r - hh * d
        p = positions[t]
        if p >= 0 and p < ck.shape[0]:
            ck[p, hh, e] = k[t, hh, e]
            cv[p, hh, e] = v[t, hh, e]


kv_append_kernel = cuda.jit(_kv_append)
