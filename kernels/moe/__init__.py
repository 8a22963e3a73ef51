"""Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE) for decode and prefill: router top-k, grouping of the
routed (token, slot) pairs by expert, the experts' SwiGLU FFN over those groups, and the weighted combine.

One MoE layer is four launches (plus the dense ops around them: the router logits are a ``gemv`` with fp32
out, a Qwen2-MoE shared expert is ``gemv_gate_up_silu`` + ``gemv`` and its gate logit a one-row ``gemv``)::

    router_topk(logits, topk_ids, topk_weights)          logits [T, E] -> ids [T, k] int32, weights [T, k] fp32
    group_by_expert(topk_ids, workspace=ws)              ids -> counts, offsets, perm, tiles   (in ws)
    expert_ffn[_int4|_mxfp4](x, wg, wu, wd, y, workspace=ws)   -> y [T, k, H] (fp32 or bf16), h [T*k, I] (in ws)
    combine(y, topk_weights, out, shared=, shared_gate=) -> out [T, H]

Layouts (bf16 is uint16 bits throughout)
    x [T, H] bf16. Expert weights stacked per expert in checkpoint layout ([out, in]): ``w_gate``, ``w_up``
    [E, I, H], ``w_down`` [E, H, I], bf16; the two halves of a fused [E, 2I, H] gate_up tensor may be passed
    as views. Quantized experts use ``kernels/matmul/quant/formats.py``'s layouts per expert, stacked on a leading E axis
    (``quantize_experts``): int4 ``(packed u8 [E, N, K/2], scales [E, N, K/128], zeros [E, N, K/128])`` with
    fp16 or fp32 scales/zeros, MXFP4 ``(packed u8 [E, N, K/2], scales u8 [E, N, K/32])``.
    ``y[t, s]`` is the output of the expert in slot s of token t; ``out`` is bf16 or fp32, whatever it is.

Where each part is (each module's docstring says what its kernels do; this one re-exports them all and holds
the bytes / flops formulas and the compile signatures)
    ``route.py``: ``router_topk``, ``group_by_expert`` and the workspace layout (``workspace_requirement``,
        ``routing_views``, ``h_view``);
    ``experts.py``: ``expert_ffn``, ``expert_ffn_int4``, ``expert_ffn_mxfp4``, ``quantize_experts``;
    ``combine.py``: ``combine``;
    ``reference.py``: the NumPy references (``reference_router``, ``reference_group``,
        ``reference_experts[_int4|_mxfp4]``, ``reference_combine``, ``reference_moe``).

Workspace (``workspace_requirement``, ``step`` lifetime): one view holds the routing (counts, offsets, perm,
tiles; int32) and, for the expert launches, h. ``group_by_expert`` fills the routing part, the expert launch
reads it and writes h, so the two take the same view; size it with ``op='experts'`` (``op='group'``: the
routing part only). Router and combine need none. Launches never allocate or synchronize (CAPTURE_SAFE).

Limits: E <= 128, k <= 8 (router), H and I multiples of 8 with 16-byte aligned rows for bf16 experts
(there is no scalar path), multiples of 128 (int4) or 32 (MXFP4) for quantized ones. Prefill runs the same
GEMV-style kernels tile by tile (weights re-read from L2 per tile of 4 rows): correct, not a tensor-core
grouped GEMM. Expert-parallel sharding is not handled.
"""

from __future__ import annotations

from vmmstream.kernels.moe.combine import _make_combine, combine
from vmmstream.kernels.moe import experts_mma  # noqa: F401  (moe.experts_mma.MMA: the tensor-core switch)
from vmmstream.kernels.moe.experts import (INT4, MXFP4, SMEM_X, MoeConfig, _make_down, _make_gate_up, _make_q,
    expert_ffn, expert_ffn_int4, expert_ffn_mxfp4, quantize_experts)
from vmmstream.kernels.moe.experts_mma import _make_down_mma, _make_gate_up_mma, mma_row_tile
from vmmstream.kernels.moe.reference import (reference_combine, reference_experts, reference_experts_int4,
    reference_experts_mxfp4, reference_group, reference_moe, reference_router)
from vmmstream.kernels.moe.route import (MAX_EXPERTS, MAX_TOPK, MIXTRAL, QWEN, SCORING, Routing, _layout,
    _make_group, _make_router, _row_tile, group_by_expert, h_view, max_tiles, router_topk, routing_views,
    workspace_requirement)
from vmmstream.kernels.matmul.quant.formats import INT4_GROUP, MX_BLOCK

__all__ = [
    "CAPTURE_SAFE", "SIGNATURES", "bytes_moved", "flops",
    "MAX_EXPERTS", "MAX_TOPK", "MIXTRAL", "QWEN", "SCORING", "INT4", "MXFP4", "SMEM_X", "MoeConfig",
    "Routing", "max_tiles", "workspace_requirement", "routing_views", "h_view", "router_topk", "group_by_expert",
    "expert_ffn", "expert_ffn_int4", "expert_ffn_mxfp4", "mma_row_tile", "quantize_experts", "combine",
    "reference_router", "reference_group", "reference_experts", "reference_experts_int4",
    "reference_experts_mxfp4", "reference_combine", "reference_moe", "_layout",
]

CAPTURE_SAFE = True   # no allocation, no synchronize, device arrays only


# ------------------------------------------------------------------------------------- bytes / flops

def _weight_bytes(hidden: int, inter: int, kind: str, scale_itemsize: int) -> int:
    """Bytes of one expert's three matrices."""
    n = 3 * hidden * inter
    if kind == "bf16":
        return 2 * n
    if kind == "int4":
        return n // 2 + 2 * (n // INT4_GROUP) * scale_itemsize
    if kind == "mxfp4":
        return n // 2 + n // MX_BLOCK
    raise ValueError(f"unknown kind {kind!r}")


def bytes_moved(tokens: int, top_k: int, num_experts: int, hidden: int = 0, intermediate: int = 0, *,
                op: str = "experts", kind: str = "bf16", active_experts: int | None = None,
                logits_itemsize: int = 4, y_itemsize: int = 4, out_itemsize: int = 2,
                scale_itemsize: int = 2, shared: bool = False) -> int:
    """HBM bytes of one op. experts: the routed experts' weights once (``active_experts``, default the most
    T*k pairs can hit), x, h written and read back (bf16), y; router: logits in, ids and weights out;
    group: ids in, routing out; combine: y, weights, out (+ shared output and gate)."""
    p = tokens * top_k
    if op == "router":
        return tokens * num_experts * logits_itemsize + 8 * p
    if op == "group":
        r = _row_tile(tokens)
        return 4 * p + 4 * (2 * num_experts + 1) + 4 * p + 8 * max_tiles(p, num_experts, r) + 4
    if op == "experts":
        act = min(num_experts, p) if active_experts is None else active_experts
        return (act * _weight_bytes(hidden, intermediate, kind, scale_itemsize) + 2 * tokens * hidden
                + 2 * 2 * p * intermediate + y_itemsize * p * hidden)
    if op == "combine":
        return (y_itemsize * p * hidden + 4 * p + out_itemsize * tokens * hidden
                + ((2 * tokens * hidden + 4 * tokens) if shared else 0))
    raise ValueError(f"unknown moe op {op!r}")


def flops(tokens: int, top_k: int, num_experts: int, hidden: int = 0, intermediate: int = 0, *,
          op: str = "experts") -> int:
    p = tokens * top_k
    if op == "router":
        return 3 * tokens * num_experts
    if op == "group":
        return 0
    if op == "experts":
        return 6 * p * hidden * intermediate + 4 * p * intermediate
    if op == "combine":
        return 2 * p * hidden
    raise ValueError(f"unknown moe op {op!r}")


# -------------------------------------------------------------------------------------- signatures

_R = "int32[::1]"
_ROUTE = ", ".join([_R] * 5)   # perm, offsets, tile_expert, tile_row, n_tiles
_I64 = "int64"


def _sig_router(t: str) -> str:
    return f"void({t}[:, ::1], int32[:, ::1], float32[:, ::1], int64, int64, int64)"


_SIG_GROUP = f"void(int32[:, ::1], {', '.join([_R] * 6)}, int64, int64, int64, int64)"
_SIG_GATE_UP = f"void(uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, ::1], {_ROUTE}, uint16[:, ::1], " \
               "int64, int64, int64, int64)"


_SIG_GATE_UP_MMA = f"void(uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, ::1], {_ROUTE}, uint16[:, ::1], " \
                   "int64, int64, int64)"


def _sig_down(y: str) -> str:
    return f"void(uint16[:, :, ::1], uint16[:, ::1], {_ROUTE}, {y}[:, :, ::1], int64, int64, int64, int64)"


def _sig_q(kind: int, scale_t: str, pair: bool, y: str) -> str:
    s = f"{scale_t}[:, :, ::1]"
    w = f"uint8[:, :, ::1], {s}, {s}"
    out = "uint16[:, ::1]" if pair else f"{y}[:, :, ::1]"
    return f"void({w}, {w}, uint16[:, ::1], {_ROUTE}, {out}, int64, int64, int64, int64)"


def _sig_combine(y: str, out: str, has_shared: bool, has_gate: bool) -> str:
    sh = "uint16[:, ::1]" if has_shared else "float32[:, ::1]"
    g = "float32[::1]" if has_gate else "float32[:, ::1]"
    return f"void({y}[:, :, ::1], float32[:, ::1], {out}[:, ::1], {sh}, {g}, int64, int64, int64)"


# Router: fp32 and bf16 logits, each scoring; grouping at the default block; bf16 experts at the row tiles
# T = 1, 2, >= 3 pick (gate/up one row of each matrix per block; down two rows for H >= 2048, one below),
# y fp32 and bf16; int4 (fp16 and fp32 scales) and MXFP4 experts, both launches, row tiles 1 and 4;
# combine plain, with a shared expert, with a gated shared expert, fp32 out.
SIGNATURES = [
    (_make_router(bf, mode, rn).py_func, _sig_router("uint16" if bf else "float32"))
    for bf in (False, True) for mode, rn in ((MIXTRAL, True), (QWEN, True), (QWEN, False))
] + [(_make_group(256).py_func, _SIG_GROUP)] + [
    (_make_gate_up(nb, 1, 128).py_func, _SIG_GATE_UP) for nb in (1, 2, 4)
] + [
    (_make_down(nb, rpb, 128, ob).py_func, _sig_down("uint16" if ob else "float32"))
    for nb, rpb, ob in ((1, 2, False), (1, 2, True), (4, 2, False), (1, 1, False))
] + [(_make_gate_up_mma().py_func, _SIG_GATE_UP_MMA)] + [
    (_make_down_mma(ob).py_func, f"void(uint16[:, :, ::1], uint16[:, ::1], {_ROUTE}, {y}[:, :, ::1], int64, int64, "
                                 "int64)") for ob, y in ((False, "float32"), (True, "uint16"))
] + [
    (_make_q(INT4, pair, nb, 2, 128, SMEM_X // nb, False).py_func, _sig_q(INT4, st, pair, "float32"))
    for pair in (True, False) for nb, st in ((1, "float16"), (4, "float16"), (1, "float32"))
] + [
    (_make_q(MXFP4, pair, nb, 2, 128, SMEM_X // nb, ob).py_func,
     _sig_q(MXFP4, "uint8", pair, "uint16" if ob else "float32"))
    for pair, nb, ob in ((True, 1, False), (True, 4, False), (False, 1, False), (False, 4, False), (False, 1, True))
] + [
    (_make_combine(yb, ob, sh, g).py_func, _sig_combine("uint16" if yb else "float32", "uint16" if ob else "float32",
                                                       sh, g))
    for yb, ob, sh, g in ((False, True, False, False), (False, True, True, True), (False, True, True, False),
                          (True, True, False, False), (False, False, False, False))
]
