"""Embedding gather: out[T, H] = table[ids[T], :] for a bf16 table [V, H] and int32 token ids.

The table may live in device memory or in host-mapped pinned memory (``cuMemHostAlloc`` with
DEVICEMAP, seen by the kernel through its device pointer): to the kernel both are just a device
array, and only the rows a step needs cross PCIe (DESIGN §4: embedding tables are never streamed
whole). The ids are a device array, so a captured decode graph gathers whatever token the previous
replay sampled.

One block per token, 16-byte loads and stores along the row; plain (coherent) loads, since the
read-only cache path buys nothing for data read once and the table may be host memory. An id outside
[0, V) writes a zero row instead of faulting (the reference raises instead).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import as_stream, check_threads, check_workspace, ld8, st8, vec8_ok
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only


@functools.lru_cache(maxsize=None)
def _make(vec: int, threads: int):
    def embedding_kernel(table, ids, out, n_rows, h):
        # table: [V, H] bf16 (device or host-mapped); ids: [T] int32; out: [T, H] bf16
        # grid: T; block: threads
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        row = ids[t]
        valid = row >= 0 and row < n_rows
        if vec == 8:
            for c in range(tid * 8, h, threads * 8):
                if valid:
                    w0, w1, w2, w3 = ld8(table, (row, c))
                    st8(out, (t, c), w0, w1, w2, w3)
                else:
                    st8(out, (t, c), np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
        else:
            for c in range(tid, h, threads):
                if valid:
                    out[t, c] = table[row, c]
                else:
                    out[t, c] = np.uint16(0)

    return jit(embedding_kernel)


def workspace_requirement(tokens: int, hidden: int):
    return NONE


def embedding(table, ids, out, *, workspace=None, stream=None, threads: int = 128):
    """out[T, H] = table[ids]; table bf16 [V, H] (device or host-mapped), ids int32 [T], out bf16 [T, H]."""
    check_workspace("embedding", workspace, 0)
    v, h = table.shape
    t = ids.shape[0]
    if out.shape != (t, h) or ids.ndim != 1:
        raise ValueError(f"embedding shapes: table {table.shape}, ids {ids.shape}, out {out.shape}")
    vec = 8 if vec8_ok(table, out) else 1
    if t:
        _make(vec, check_threads(threads))[t, threads, as_stream(stream)](table, ids, out, v, h)


def reference(table, ids) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise IndexError("token id outside the embedding table")
    return np.asarray(table)[ids]


def bytes_moved(tokens: int, hidden: int) -> int:
    """Rows read (over PCIe when the table is host-mapped) and written, plus the ids."""
    return 4 * tokens * hidden + 4 * tokens


def flops(tokens: int, hidden: int) -> int:
    return 0


SIGNATURES = [(_make(v, 128).py_func, "void(uint16[:, ::1], int32[::1], uint16[:, ::1], int64, int64)")
              for v in (8, 1)]
