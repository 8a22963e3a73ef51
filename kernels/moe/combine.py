"""MoE combine: each token's expert outputs weighted by its router weights, plus the shared expert's output
(gated or not) where the model has one; the overview and layouts are in ``moe.py``.

    combine: out[t] = Σ_s topk_weights[t, s] · y[t, s] (slot order, fp32) [+ sigmoid(shared_gate[t]) ·
        shared[t]], rounded once when out is bf16. ``shared``: the shared expert's output [T, H] bf16;
        ``shared_gate``: its gate logit x·w_gateᵀ [T] (or [T, 1]) fp32 (Qwen2-MoE), optional.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import as_stream, cdiv, check_threads, check_workspace


# -------------------------------------------------------------------------------------------- combine

@functools.lru_cache(maxsize=None)
def _make_combine(y_bf16: bool, out_bf16: bool, has_shared: bool, has_gate: bool):
    def moe_combine_kernel(y, wts, out, shared, gate, n_tokens, hidden, top_k):
        # y: [T, k, H] f32|bf16; wts: [T, k] f32; out: [T, H] bf16|f32; shared: [T, H] bf16; gate: [T] f32
        # grid: ceil(T * H / threads); one element per thread
        i = cuda.grid(1)
        if i < n_tokens * hidden:
            t = i // hidden
            c = i - t * hidden
            acc = np.float32(0.0)
            for s in range(top_k):
                if y_bf16:
                    v = dev_bf16_to_f32(y[t, s, c])
                else:
                    v = y[t, s, c]
                acc += wts[t, s] * v
            if has_shared:
                sv = dev_bf16_to_f32(shared[t, c])
                if has_gate:
                    sv = sv / (np.float32(1.0) + math.exp(-gate[t]))
                acc += sv
            if out_bf16:
                out[t, c] = dev_f32_to_bf16(acc)
            else:
                out[t, c] = acc

    return jit(moe_combine_kernel)


def combine(y, topk_weights, out, *, shared=None, shared_gate=None, workspace=None, stream=None,
            threads: int = 256):
    """out[t] = Σ_s topk_weights[t, s] · y[t, s] (+ sigmoid(shared_gate[t]) · shared[t], or + shared[t]).

    y [T, k, H] fp32|bf16; topk_weights [T, k] fp32; out [T, H] bf16|fp32; shared [T, H] bf16 (the shared
    expert's output); shared_gate [T] or [T, 1] fp32 logits (needs shared). Never allocates.
    """
    check_workspace("combine", workspace, 0)
    if y.ndim != 3 or y.dtype not in (np.float32, np.uint16):
        raise ValueError(f"combine: y must be float32 or bf16 (uint16) [T, k, H], got {y.shape} {y.dtype}")
    t, k, hidden = y.shape
    if topk_weights.shape != (t, k) or topk_weights.dtype != np.float32:
        raise ValueError(f"combine: topk_weights must be float32 {(t, k)}, got {topk_weights.shape} "
                         f"{topk_weights.dtype}")
    if out.shape != (t, hidden) or out.dtype not in (np.float32, np.uint16):
        raise ValueError(f"combine: out must be float32 or bf16 {(t, hidden)}, got {out.shape} {out.dtype}")
    if shared is not None and (shared.shape != (t, hidden) or shared.dtype != np.uint16):
        raise ValueError(f"combine: shared must be bf16 (uint16) {(t, hidden)}, got {shared.shape} {shared.dtype}")
    if shared_gate is not None:
        if shared is None:
            raise ValueError("combine: shared_gate without shared")
        if shared_gate.ndim == 2 and shared_gate.shape[1] == 1:
            shared_gate = shared_gate.reshape(shared_gate.shape[0])
        if shared_gate.shape != (t,) or shared_gate.dtype != np.float32:
            raise ValueError(f"combine: shared_gate must be float32 [T={t}] or [T, 1], got {shared_gate.shape} "
                             f"{shared_gate.dtype}")
    threads = check_threads(threads)
    total = t * hidden
    if total:
        _make_combine(y.dtype == np.uint16, out.dtype == np.uint16, shared is not None, shared_gate is not None)[
            cdiv(total, threads), threads, as_stream(stream)](
            y, topk_weights, out, topk_weights if shared is None else shared,
            topk_weights if shared_gate is None else shared_gate, t, hidden, k)
