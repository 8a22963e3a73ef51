"""Device-scalar bookkeeping of a captured decode step (DESIGN §6).

After the sampler wrote ``next_ids``, one tiny kernel, per sequence b:
    input_ids[b] = next_ids[b]                 # the next step embeds the sampled token
    out_tokens[b, seq_lens[b]] = next_ids[b]   # optional: append to the sequence buffer (dropped if full)
    positions[b] += 1; seq_lens[b] += 1
Everything lives in device memory, so the graph replays without any host round trip and the next
replay reads the advanced scalars.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import as_stream, cdiv, check_workspace
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only
_THREADS = 32


def _advance(next_ids, input_ids, positions, seq_lens, n):
    # next_ids, input_ids, positions, seq_lens: [B] int32
    b = cuda.grid(1)
    if b < n:
        input_ids[b] = next_ids[b]
        positions[b] += 1
        seq_lens[b] += 1


def _advance_append(next_ids, input_ids, positions, seq_lens, out_tokens, n):
    # out_tokens: [B, L] int32, the token is written at the sequence length before the increment
    b = cuda.grid(1)
    if b < n:
        tok = next_ids[b]
        input_ids[b] = tok
        at = seq_lens[b]
        if at >= 0 and at < out_tokens.shape[1]:
            out_tokens[b, at] = tok
        positions[b] += 1
        seq_lens[b] = at + 1


_advance_kernel = jit(_advance)
_advance_append_kernel = jit(_advance_append)


def workspace_requirement(batch: int):
    return NONE


def advance(next_ids, input_ids, positions, seq_lens, *, out_tokens=None, workspace=None, stream=None):
    """Write the sampled tokens into the input slots, append them, bump positions and lengths.

    All int32 device arrays: next_ids, input_ids, positions, seq_lens [B]; out_tokens [B, L].
    """
    check_workspace("advance", workspace, 0)
    n = next_ids.shape[0]
    for a in (input_ids, positions, seq_lens):
        if a.shape != (n,):
            raise ValueError(f"advance: expected [{n}] arrays, got {a.shape}")
    grid, s = (cdiv(n, _THREADS), _THREADS), as_stream(stream)
    if out_tokens is None:
        _advance_kernel[grid[0], grid[1], s](next_ids, input_ids, positions, seq_lens, n)
    else:
        if out_tokens.shape[0] != n:
            raise ValueError(f"advance: out_tokens {out_tokens.shape} for batch {n}")
        _advance_append_kernel[grid[0], grid[1], s](next_ids, input_ids, positions, seq_lens, out_tokens, n)


def reference(next_ids, input_ids, positions, seq_lens, out_tokens=None):
    """NumPy twin; returns new copies (input_ids, positions, seq_lens[, out_tokens])."""
    next_ids = np.asarray(next_ids, np.int32)
    inp, pos, lens = next_ids.copy(), np.asarray(positions, np.int32) + 1, np.asarray(seq_lens, np.int32)
    res = None
    if out_tokens is not None:
        res = np.array(out_tokens, np.int32, copy=True)
        for b, at in enumerate(lens):
            if 0 <= at < res.shape[1]:
                res[b, at] = next_ids[b]
    lens = lens + 1
    return (inp, pos, lens) if res is None else (inp, pos, lens, res)


def bytes_moved(batch: int, *, append: bool = False) -> int:
    return 4 * batch * (7 + (1 if append else 0))


def flops(batch: int) -> int:
    return 0


SIGNATURES = [
    (_advance, "void(int32[::1], int32[::1], int32[::1], int32[::1], int64)"),
    (_advance_append, "void(int32[::1], int32[::1], int32[::1], int32[::1], int32[:, ::1], int64)"),
]
