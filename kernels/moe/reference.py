"""NumPy references of the MoE launches (``route.py``, ``experts.py``, ``combine.py``) and of the whole
sparse MoE block: fp64 sums, rounded to bf16 where the kernels store bf16."""

from __future__ import annotations

import numpy as np

from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.moe.route import MIXTRAL, _row_tile, _scoring
from vmmstream.kernels.matmul.quant.formats import dequantize_int4, dequantize_mxfp4


# ------------------------------------------------------------------------------------------ reference

def _as_f32(a) -> np.ndarray:
    a = np.asarray(a)
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def reference_router(logits, top_k: int, *, scoring: str = "mixtral", norm_topk_prob=None):
    """(ids int32 [T, k], weights fp32 [T, k]): stable sort (ties -> lower index; NaN as -inf), fp64 softmax
    by the architecture's definition (see ``route.py``)."""
    mode, renorm = _scoring(scoring, norm_topk_prob)
    x = _as_f32(logits).astype(np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    ids = np.argsort(-x, axis=1, kind="stable")[:, :top_k]
    sel = np.take_along_axis(x, ids, axis=1)
    m = sel[:, :1]
    if mode == MIXTRAL:
        p = np.exp(sel - m)
        w = p / p.sum(axis=1, keepdims=True)
    else:
        w = np.exp(sel - m) / np.exp(x - m).sum(axis=1, keepdims=True)
        if renorm:
            w = w / w.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


def reference_group(topk_ids, num_experts: int, row_tile: int = 0) -> dict:
    """What ``group_by_expert`` writes: counts, offsets, perm (stable by pair index), tile_expert, tile_row,
    n_tiles (int32 NumPy arrays; ``n_tiles`` an int). ``row_tile`` 0: from T, as the launch picks it."""
    ids = np.asarray(topk_ids, np.int32)
    r = _row_tile(ids.shape[0], row_tile)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[valid], minlength=num_experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    order = np.nonzero(valid)[0]
    perm = order[np.argsort(flat[order], kind="stable")].astype(np.int32)
    te, tr = [], []
    for e in range(num_experts):
        for r0 in range(offsets[e], offsets[e + 1], r):
            te.append(e)
            tr.append(r0)
    return {"counts": counts, "offsets": offsets, "perm": perm, "tile_expert": np.array(te, np.int32),
            "tile_row": np.array(tr, np.int32), "n_tiles": len(te), "row_tile": r}


def _reference_experts(x, topk_ids, wg, wu, wd):
    """(y fp32 [T, k, H], h bf16 [T, k, I]); wg/wu/wd(e) -> fp32 weight matrices of expert e."""
    from vmmstream.kernels.ops.elementwise import reference_silu_mul
    xf = bf16_to_f32(x).astype(np.float64)
    ids = np.asarray(topk_ids)
    t, k = ids.shape
    y = h = None
    for e in np.unique(ids):
        ts, ss = np.nonzero(ids == e)
        g = f32_to_bf16((xf[ts] @ wg(e).astype(np.float64).T).astype(np.float32))
        u = f32_to_bf16((xf[ts] @ wu(e).astype(np.float64).T).astype(np.float32))
        he = reference_silu_mul(g, u)
        ye = bf16_to_f32(he).astype(np.float64) @ wd(e).astype(np.float64).T
        if y is None:
            y = np.zeros((t, k, ye.shape[1]), np.float32)
            h = np.zeros((t, k, he.shape[1]), np.uint16)
        y[ts, ss] = ye
        h[ts, ss] = he
    return y, h


def reference_experts(x, topk_ids, w_gate, w_up, w_down, *, return_h: bool = False):
    """y fp32 [T, k, H] of bf16 experts: gate/up in fp64 rounded to bf16, h = silu·mul rounded once
    (= ``gemv.reference_gate_up_silu`` per routed row), down in fp64 (unrounded).
    ``return_h``: (y, h bf16 [T, k, I])."""
    y, h = _reference_experts(x, topk_ids, lambda e: bf16_to_f32(w_gate[e]), lambda e: bf16_to_f32(w_up[e]),
                              lambda e: bf16_to_f32(w_down[e]))
    return (y, h) if return_h else y


def reference_experts_int4(x, topk_ids, gate, up, down, *, return_h: bool = False):
    """``reference_experts`` of int4 experts (``dequantize_int4`` per expert)."""
    y, h = _reference_experts(x, topk_ids, *(lambda e, w=w: dequantize_int4(w[0][e], w[1][e], w[2][e])
                                              for w in (gate, up, down)))
    return (y, h) if return_h else y


def reference_experts_mxfp4(x, topk_ids, gate, up, down, *, return_h: bool = False):
    """``reference_experts`` of MXFP4 experts (``dequantize_mxfp4`` per expert)."""
    y, h = _reference_experts(x, topk_ids, *(lambda e, w=w: dequantize_mxfp4(w[0][e], w[1][e])
                                              for w in (gate, up, down)))
    return (y, h) if return_h else y


def reference_combine(y, topk_weights, shared=None, shared_gate=None) -> np.ndarray:
    """fp32 [T, H] (unrounded; fp64 sums): Σ_s w[t, s]·y[t, s] (+ sigmoid(gate[t])·shared[t])."""
    yf = _as_f32(y).astype(np.float64)
    w = np.asarray(topk_weights, np.float64)
    out = np.einsum("ts,tsh->th", w, yf)
    if shared is not None:
        sv = bf16_to_f32(shared).astype(np.float64)
        if shared_gate is not None:
            g = np.asarray(shared_gate, np.float64).reshape(-1)
            sv = sv / (1.0 + np.exp(-g))[:, None]
        out = out + sv
    return out.astype(np.float32)


def reference_moe(x, w_router, w_gate, w_up, w_down, top_k: int, *, scoring: str = "mixtral",
                  norm_topk_prob=None, shared_mlp=None, w_shared_gate=None) -> np.ndarray:
    """The whole sparse MoE block as the launches compute it, fp32 [T, H] before the output rounding:
    router logits = ``gemv.reference`` (fp32), ``reference_router``, ``reference_experts`` (fp32 y),
    ``reference_combine``. ``shared_mlp`` = (w_gate [Is, H], w_up [Is, H], w_down [H, Is]) bf16: its output is
    the dense MLP's (``gemv_gate_up_silu`` then ``gemv``, rounded to bf16); ``w_shared_gate`` [1, H] bf16."""
    from vmmstream.kernels.matmul.dense import gemv
    logits = gemv.reference(w_router, x)
    ids, wts = reference_router(logits, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob)
    y = reference_experts(x, ids, w_gate, w_up, w_down)
    shared = gate = None
    if shared_mlp is not None:
        sg, su, sd = shared_mlp
        shared = f32_to_bf16(gemv.reference(sd, gemv.reference_gate_up_silu(sg, su, x)))
        if w_shared_gate is not None:
            gate = gemv.reference(w_shared_gate, x)[:, 0]
    return reference_combine(y, wts, shared, gate)
