"""MoE kernels (router top-k, grouping by expert, expert SwiGLU FFN in bf16 / int4 / MXFP4, combine) in the
Numba CUDA simulator, at small odd shapes, against their NumPy references.

Simulator cost is mostly the warp-shuffle twins (two block barriers each, ~3 ms per 32-thread block), and
the expert kernels call one per accumulator: so blocks are one warp, H and I are small, and each expert
case routes only a few tiles.

Tolerances: the expert kernels accumulate in fp32 (slack 1e-5 · Σ|xᵢ·wᵢ|, as the GEMV tests); gate and up
are rounded to bf16 before silu·mul, so h is checked against the exact silu(G)·U with that rounding
propagated (as the dense gate/up test), and y against h as the kernel stored it (tight).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.errors import WorkspaceShortfall
from vmmstream.kernels import NONE, Lifetime, moe
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import dequantize_int4, dequantize_mxfp4

from moe_checks import check_experts, check_routing, kernel_h
from simutil import HALF_ULP, bf16, dev

pytestmark = pytest.mark.sim


def distinct_ids(rng, t, k, e):
    """Top-k-like ids: k distinct experts per token."""
    return np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)


# ------------------------------------------------------------------------------------------ router

@pytest.mark.parametrize("t,e,k,as_bf16,scoring,norm,threads", [
    (1, 4, 1, False, "mixtral", None, 32),
    (3, 8, 2, True, "qwen2_moe", False, 64),      # two tokens per block, one warp past the last token
    (5, 6, 2, False, "qwen3_moe", True, 32),
    (3, 128, 8, False, "mixtral", None, 32),      # E = 128 (4 logits per lane), k = 8
    (5, 37, 3, True, "qwen2_moe", True, 64),      # odd E, bf16 logits
])
def test_router_matches_reference(t, e, k, as_bf16, scoring, norm, threads):
    rng = np.random.default_rng(t * e + k)
    x = (rng.standard_normal((t, e)) * 2).astype(np.float32)
    logits = f32_to_bf16(x) if as_bf16 else x
    ids, wts = cuda.device_array((t, k), np.int32), cuda.device_array((t, k), np.float32)
    moe.router_topk(dev(logits), ids, wts, scoring=scoring, norm_topk_prob=norm, threads=threads)
    rid, rw = moe.reference_router(logits, k, scoring=scoring, norm_topk_prob=norm)
    np.testing.assert_array_equal(ids.copy_to_host(), rid)
    np.testing.assert_allclose(wts.copy_to_host(), rw, rtol=1e-5, atol=1e-7)
    xf = bf16_to_f32(logits) if as_bf16 else x
    want = np.argsort(-xf, axis=1, kind="stable")[:, :k]   # what the ids mean, independently of the reference
    np.testing.assert_array_equal(rid, want)


def test_router_ties_go_to_the_lower_expert():
    e, k = 6, 2
    x = np.array([[0, 0, 0, 0, 0, 0],                 # all equal: experts 0 and 1, equal weights
                  [1, 3, 3, 0, 3, 2],                 # three-way tie at the top: 1 and 2
                  [5, 1, 5, -np.inf, -np.inf, 1],     # tie at the top, -inf experts never chosen
                  [np.nan, 2, np.nan, 2, 0, 1],       # NaN counts as -inf; tie 1 / 3
                  [-np.inf, -np.inf, -np.inf, -np.inf, 7, -np.inf]], np.float32)   # one finite: 4, then 0
    want_ids = np.array([[0, 1], [1, 2], [0, 2], [1, 3], [4, 0]], np.int32)
    for logits in (x, f32_to_bf16(x)):
        for scoring, norm in (("mixtral", None), ("qwen2_moe", False), ("qwen3_moe", True)):
            ids, wts = cuda.device_array((5, k), np.int32), cuda.device_array((5, k), np.float32)
            moe.router_topk(dev(logits), ids, wts, scoring=scoring, norm_topk_prob=norm, threads=64)
            rid, rw = moe.reference_router(logits, k, scoring=scoring, norm_topk_prob=norm)
            np.testing.assert_array_equal(rid, want_ids)
            np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
            np.testing.assert_allclose(wts.copy_to_host(), rw, rtol=1e-6, atol=0)
            w = wts.copy_to_host()
            assert w[0, 0] == w[0, 1] and w[1, 0] == w[1, 1] and w[2, 0] == w[2, 1]
            assert w[4, 1] == 0.0                      # a -inf expert has zero weight
    assert e == x.shape[1]
    # E > 32: equal logits inside one lane (experts l, l + 32, l + 64) and across lanes
    x2 = np.zeros((2, 70), np.float32)
    x2[1, [5, 37, 69]] = 2.0
    x2[1, 40] = 1.0
    ids, wts = cuda.device_array((2, 4), np.int32), cuda.device_array((2, 4), np.float32)
    moe.router_topk(dev(x2), ids, wts, threads=32)
    np.testing.assert_array_equal(ids.copy_to_host(), [[0, 1, 2, 3], [5, 37, 69, 40]])
    np.testing.assert_array_equal(moe.reference_router(x2, 4)[0], ids.copy_to_host())


def test_router_mixtral_vs_qwen_renormalisation():
    rng = np.random.default_rng(4)
    t, e, k = 5, 8, 2
    x = rng.standard_normal((t, e)).astype(np.float32) * 2
    got = {}
    for scoring, norm in (("mixtral", None), ("qwen2_moe", True), ("qwen2_moe", False), ("qwen3_moe", False)):
        ids, wts = cuda.device_array((t, k), np.int32), cuda.device_array((t, k), np.float32)
        moe.router_topk(dev(x), ids, wts, scoring=scoring, norm_topk_prob=norm, threads=32)
        got[scoring, norm] = ids.copy_to_host(), wts.copy_to_host()
    ids = got["mixtral", None][0]
    for v in got.values():
        np.testing.assert_array_equal(v[0], ids)      # the same experts whatever the weighting
    xd = x.astype(np.float64)
    sel = np.take_along_axis(xd, ids, 1)
    soft_all = np.exp(sel - xd.max(1, keepdims=True)) / np.exp(xd - xd.max(1, keepdims=True)).sum(1, keepdims=True)
    soft_topk = np.exp(sel - sel[:, :1]) / np.exp(sel - sel[:, :1]).sum(1, keepdims=True)
    np.testing.assert_allclose(got["mixtral", None][1], soft_topk, rtol=1e-5)          # softmax over the top k
    np.testing.assert_allclose(got["qwen2_moe", True][1], soft_topk, rtol=1e-5)        # top-k of softmax, renormalised
    np.testing.assert_allclose(got["qwen2_moe", False][1], soft_all, rtol=1e-5)        # not renormalised
    np.testing.assert_array_equal(got["qwen3_moe", False][1], got["qwen2_moe", False][1])
    np.testing.assert_allclose(got["mixtral", None][1].sum(1), 1.0, rtol=1e-6)
    assert np.all(got["qwen2_moe", False][1].sum(1) < 0.999)


def test_router_rejects_bad_arguments():
    logits = cuda.device_array((2, 8), np.float32)
    ids, wts = cuda.device_array((2, 2), np.int32), cuda.device_array((2, 2), np.float32)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        moe.router_topk(logits, ids, wts, scoring="qwen2_moe")
    with pytest.raises(ValueError, match="Mixtral always renormalises"):
        moe.router_topk(logits, ids, wts, scoring="mixtral", norm_topk_prob=False)
    with pytest.raises(ValueError, match="unknown router scoring"):
        moe.router_topk(logits, ids, wts, scoring="deepseek")
    with pytest.raises(ValueError, match="k = 9"):
        moe.router_topk(cuda.device_array((2, 16), np.float32), cuda.device_array((2, 9), np.int32),
                        cuda.device_array((2, 9), np.float32))
    with pytest.raises(ValueError, match="E = 129"):
        moe.router_topk(cuda.device_array((2, 129), np.float32), ids, wts)
    with pytest.raises(ValueError, match="topk_weights"):
        moe.router_topk(logits, ids, cuda.device_array((2, 2), np.float64))
    with pytest.raises(ValueError, match="topk_ids"):
        moe.router_topk(logits, cuda.device_array((2, 2), np.int64), wts)


# ---------------------------------------------------------------------------------------- grouping

@pytest.mark.parametrize("t,k,e,threads,row_tile,skew", [
    (1, 2, 4, 32, 0, False),
    (3, 2, 6, 32, 0, False),
    (5, 1, 8, 32, 0, False),
    (37, 2, 8, 64, 0, False),     # 74 pairs: two chunks of 64, two warps
    (7, 3, 5, 32, 2, True),       # every token routed to expert 4: a run of 7 rows, tiles of 2
])
def test_group_by_expert_matches_reference(t, k, e, threads, row_tile, skew):
    rng = np.random.default_rng(t * k * e)
    ids = distinct_ids(rng, t, k, e)
    if skew:
        ids[:, 0] = e - 1
        ids[:, 1:] = np.array([rng.permutation(e - 1)[:k - 1] for _ in range(t)])
    req = moe.workspace_requirement(t, k, e, op="group", row_tile=row_tile)
    ws = cuda.device_array(req.bytes, np.uint8)
    rt = moe.group_by_expert(dev(ids), workspace=ws, num_experts=e, row_tile=row_tile, threads=threads)
    ref = moe.reference_group(ids, e, row_tile)
    check_routing(rt, ref)
    # the order within an expert is by token, then slot: the perm is increasing inside each expert's run
    perm, off = ref["perm"], ref["offsets"]
    for x in range(e):
        run = perm[off[x]:off[x + 1]]
        assert np.all(np.diff(run) > 0) and np.all(ids.reshape(-1)[run] == x)
    # a second launch over a dirty workspace gives the same routing (deterministic, nothing accumulated)
    rt2 = moe.group_by_expert(dev(ids), workspace=ws, num_experts=e, row_tile=row_tile, threads=threads)
    check_routing(rt2, ref)


# ----------------------------------------------------------------------------------------- experts

@pytest.mark.parametrize("t,e,k,h,i,y_dtype,scoring,norm,rpb", [
    (1, 4, 2, 16, 24, np.float32, "mixtral", None, 5),   # decode: two tiles of one row; clamped last rows
    (3, 6, 2, 16, 8, np.uint16, "qwen2_moe", False, 8),  # row tile 4, the last expert shared by tokens 0, 2
    (5, 8, 1, 8, 16, np.float32, "qwen3_moe", True, 3),
    (1, 3, 1, 264, 8, np.float32, "mixtral", None, 8),   # H > 8 · 32: the strided K loop of gate/up
])
def test_moe_chain_bf16(t, e, k, h, i, y_dtype, scoring, norm, rpb):
    """router -> group -> expert_ffn -> combine, each stage against its reference."""
    rng = np.random.default_rng(t * 100 + e * 10 + k)
    x = bf16(rng, (t, h))
    wg, wu, wd = bf16(rng, (e, i, h), 0.3), bf16(rng, (e, i, h), 0.3), bf16(rng, (e, h, i), 0.3)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[:, -1] += 4.0        # the last expert is the first choice of every token but token 1: a tile of
    if t > 1:                   # several rows, and a permutation that is not the identity (y goes by perm)
        logits[1, -1] -= 8.0
    ids, wts = cuda.device_array((t, k), np.int32), cuda.device_array((t, k), np.float32)
    moe.router_topk(dev(logits), ids, wts, scoring=scoring, norm_topk_prob=norm, threads=32)
    rid, rw = moe.reference_router(logits, k, scoring=scoring, norm_topk_prob=norm)
    np.testing.assert_array_equal(ids.copy_to_host(), rid)

    req = moe.workspace_requirement(t, k, e, i)
    assert req.lifetime is Lifetime.STEP
    ws = cuda.device_array(req.bytes, np.uint8)
    rt = moe.group_by_expert(ids, workspace=ws, num_experts=e, threads=32)
    check_routing(rt, moe.reference_group(rid, e))

    y = cuda.device_array((t, k, h), y_dtype)
    moe.expert_ffn(dev(x), dev(wg), dev(wu), dev(wd), y, workspace=ws,
                   config=moe.MoeConfig(threads=32, rows_per_block=rpb))
    y_got = y.copy_to_host()
    y_ref, h_ref = moe.reference_experts(x, rid, wg, wu, wd, return_h=True)
    check_experts(x, rid, bf16_to_f32(wg), bf16_to_f32(wu), bf16_to_f32(wd), kernel_h(ws, rt, t, k, e, i),
                  y_got, h_ref)

    out = cuda.device_array((t, h), np.uint16)
    moe.combine(y, wts, out, threads=32)
    yf = bf16_to_f32(y_got) if y_dtype == np.uint16 else y_got
    w = wts.copy_to_host()
    want = moe.reference_combine(y_got, w).astype(np.float64)
    slack = 1e-6 * np.einsum("ts,tsh->th", np.abs(w), np.abs(yf)) + 1e-7
    got = bf16_to_f32(out.copy_to_host()).astype(np.float64)
    assert np.all(np.abs(got - want) <= 2 * HALF_ULP * np.abs(want) + slack)
    # and the whole block against the end-to-end reference (bf16 roundings of h and out apart)
    full = moe.reference_combine(y_ref, rw)
    assert np.max(np.abs(got - full)) <= 0.02 * np.max(np.abs(full))


@pytest.mark.parametrize("y_dtype", [np.float32, np.uint16])
def test_expert_ffn_tensor_core_tiles(monkeypatch, y_dtype):
    """``moe.experts_mma.MMA``: tiles of 8 grouped rows through ``gemv_mma``'s block body (16 weight rows a block, K in
    chunks of 64): an expert with more than 8 rows (two tiles, the second partial), experts with one row, a
    permutation that is not the identity; h and y against the reference, like the SIMT kernels' (the same checks)."""
    monkeypatch.setattr(moe.experts_mma, "MMA", True)
    rng = np.random.default_rng(31)
    t, k, e, h, i = 12, 2, 4, 128, 64
    assert moe.mma_row_tile(t, h, i) == 8 and moe.mma_row_tile(t, h, 72) == 0 and moe.mma_row_tile(4, h, i) == 0
    x = bf16(rng, (t, h))
    wg, wu, wd = bf16(rng, (e, i, h), 0.3), bf16(rng, (e, i, h), 0.3), bf16(rng, (e, h, i), 0.3)
    rid = np.stack([np.full(t, 3), rng.integers(0, 3, t)], axis=1).astype(np.int32)   # expert 3: 12 rows
    rid[5, 1], rid[9, 1] = 0, 1
    rid[rng.permutation(t)[:4]] = rid[rng.permutation(t)[:4]][:, ::-1]                  # slots swapped
    ws = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8)
    rt = moe.group_by_expert(dev(rid), workspace=ws, num_experts=e, row_tile=8, threads=32)
    check_routing(rt, moe.reference_group(rid, e, row_tile=8))
    y = cuda.device_array((t, k, h), y_dtype)
    moe.expert_ffn(dev(x), dev(wg), dev(wu), dev(wd), y, workspace=ws, row_tile=8)
    y_got = y.copy_to_host()
    _, h_ref = moe.reference_experts(x, rid, wg, wu, wd, return_h=True)
    check_experts(x, rid, bf16_to_f32(wg), bf16_to_f32(wu), bf16_to_f32(wd), kernel_h(ws, rt, t, k, e, i),
                  y_got, h_ref)


def test_expert_ffn_int4_shared_expert_tile():
    """Two tokens routed to the same expert: one tile of two rows (each weight chunk feeds both), K staged
    in two shared-memory passes."""
    rng = np.random.default_rng(21)
    t, k, e, h, i = 2, 1, 4, 128, 128
    x = bf16(rng, (t, h))
    q = [moe.quantize_experts((rng.standard_normal(s) * 0.1).astype(np.float32), "int4")
         for s in ((e, i, h), (e, i, h), (e, h, i))]
    ids = np.array([[2], [2]], np.int32)
    ws = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8)
    rt = moe.group_by_expert(dev(ids), workspace=ws, num_experts=e, threads=32)
    assert int(rt.n_tiles.copy_to_host()[0]) == 1 and rt.row_tile == 2
    y = cuda.device_array((t, k, h), np.float32)
    moe.expert_ffn_int4(dev(x), *(tuple(dev(a) for a in w) for w in q), y, workspace=ws,
                        config=moe.MoeConfig(threads=32, rows_per_warp=8, tile_k=64))
    y_ref, h_ref = moe.reference_experts_int4(x, ids, *q, return_h=True)
    deq = [np.stack([dequantize_int4(w.packed[j], w.scales[j], w.zeros[j]) for j in range(e)]) for w in q]
    check_experts(x, ids, *deq, kernel_h(ws, rt, t, k, e, i), y.copy_to_host(), h_ref)


@pytest.mark.parametrize("y_dtype", [np.float32, np.uint16])
def test_expert_ffn_mxfp4_decode(y_dtype):
    rng = np.random.default_rng(22)
    t, k, e, h, i = 1, 2, 4, 32, 64
    x = bf16(rng, (t, h))
    q = [moe.quantize_experts((rng.standard_normal(s) * 0.1).astype(np.float32), "mxfp4")
         for s in ((e, i, h), (e, i, h), (e, h, i))]
    ids = np.array([[3, 0]], np.int32)           # perm [1, 0]: y is placed through it
    ws = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8)
    rt = moe.group_by_expert(dev(ids), workspace=ws, num_experts=e, threads=32)
    y = cuda.device_array((t, k, h), y_dtype)
    moe.expert_ffn_mxfp4(dev(x), *(tuple(dev(a) for a in w) for w in q), y, workspace=ws,
                         config=moe.MoeConfig(threads=32, rows_per_warp=4))
    y_ref, h_ref = moe.reference_experts_mxfp4(x, ids, *q, return_h=True)
    deq = [np.stack([dequantize_mxfp4(w.packed[j], w.scales[j]) for j in range(e)]) for w in q]
    check_experts(x, ids, *deq, kernel_h(ws, rt, t, k, e, i), y.copy_to_host(), h_ref)


def test_expert_ffn_rejects_bad_shapes():
    rng = np.random.default_rng(5)
    t, k, e, h, i = 1, 2, 4, 16, 24
    x, y = dev(bf16(rng, (t, h))), cuda.device_array((t, k, h), np.float32)
    wg, wu, wd = dev(bf16(rng, (e, i, h))), dev(bf16(rng, (e, i, h))), dev(bf16(rng, (e, h, i)))
    ws = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8)
    with pytest.raises(ValueError, match="w_down"):
        moe.expert_ffn(x, wg, wu, dev(bf16(rng, (e, i, h))), y, workspace=ws)
    with pytest.raises(ValueError, match="y must"):
        moe.expert_ffn(x, wg, wu, wd, cuda.device_array((t, k, h + 1), np.float32), workspace=ws)
    with pytest.raises(ValueError, match="x must"):
        moe.expert_ffn(dev(bf16(rng, (t, h + 8))), wg, wu, wd, y, workspace=ws)
    h2 = 12                                       # not a multiple of 8: no 16-byte path
    ws2 = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8)
    with pytest.raises(ValueError, match="multiples of 8"):
        moe.expert_ffn(dev(bf16(rng, (t, h2))), dev(bf16(rng, (e, i, h2))), dev(bf16(rng, (e, i, h2))),
                       dev(bf16(rng, (e, h2, i))), cuda.device_array((t, k, h2), np.float32), workspace=ws2)
    qg = moe.quantize_experts((rng.standard_normal((e, 128, 128)) * 0.1).astype(np.float32), "int4")
    x128, y128 = dev(bf16(rng, (t, 128))), cuda.device_array((t, k, 128), np.float32)
    ws3 = cuda.device_array(moe.workspace_requirement(t, k, e, 128).bytes, np.uint8)
    dq = tuple(dev(a) for a in qg)
    with pytest.raises(ValueError, match="scales"):
        moe.expert_ffn_int4(x128, dq, (dq[0], dev(qg.scales[:, :64]), dq[2]), dq, y128, workspace=ws3)
    with pytest.raises(ValueError, match="tuple of 3"):
        moe.expert_ffn_int4(x128, dq, dq[:2], dq, y128, workspace=ws3)
    with pytest.raises(ValueError, match="uint8 E8M0"):
        moe.expert_ffn_mxfp4(x128, (dq[0], dev(np.zeros((e, 128, 4), np.float16))), (dq[0], dq[1][:, :, :4]),
                             (dq[0], dq[1][:, :, :4]), y128, workspace=ws3)


# ----------------------------------------------------------------------------------------- combine

@pytest.mark.parametrize("t,k,h,y_dtype,out_dtype,shared,gate", [
    (1, 2, 24, np.float32, np.uint16, False, None),
    (3, 1, 13, np.uint16, np.float32, True, None),
    (5, 2, 7, np.float32, np.uint16, True, "T"),
    (3, 2, 9, np.float32, np.float32, True, "T1"),     # gate logits as a [T, 1] gemv output
])
def test_combine_matches_reference(t, k, h, y_dtype, out_dtype, shared, gate):
    rng = np.random.default_rng(t * k * h)
    y = rng.standard_normal((t, k, h)).astype(np.float32)
    if y_dtype == np.uint16:
        y = f32_to_bf16(y)
    w = rng.random((t, k)).astype(np.float32)
    sh = bf16(rng, (t, h)) if shared else None
    g = (rng.standard_normal(t) * 3).astype(np.float32) if gate else None
    out = cuda.device_array((t, h), out_dtype)
    moe.combine(dev(y), dev(w), out, shared=None if sh is None else dev(sh),
                shared_gate=None if g is None else dev(g.reshape(t, 1) if gate == "T1" else g), threads=32)
    ref = moe.reference_combine(y, w, sh, g).astype(np.float64)
    yf = bf16_to_f32(y) if y_dtype == np.uint16 else y
    slack = 1e-6 * (np.einsum("ts,tsh->th", w, np.abs(yf)) + (0 if sh is None else np.abs(bf16_to_f32(sh)))) + 1e-7
    got = out.copy_to_host()
    if out_dtype == np.uint16:
        got = bf16_to_f32(got)
        slack = slack + 2 * HALF_ULP * np.abs(ref)
    assert np.all(np.abs(got - ref) <= slack)
    if shared and gate is None:                     # ungated: the shared expert is added as is
        np.testing.assert_allclose(ref, moe.reference_combine(y, w) + bf16_to_f32(sh), rtol=1e-6, atol=1e-6)


def test_combine_rejects_bad_shapes():
    y, w = cuda.device_array((2, 2, 8), np.float32), cuda.device_array((2, 2), np.float32)
    out = cuda.device_array((2, 8), np.uint16)
    with pytest.raises(ValueError, match="shared_gate without shared"):
        moe.combine(y, w, out, shared_gate=cuda.device_array(2, np.float32))
    with pytest.raises(ValueError, match="topk_weights"):
        moe.combine(y, cuda.device_array((2, 3), np.float32), out)
    with pytest.raises(ValueError, match="out must"):
        moe.combine(y, w, cuda.device_array((2, 9), np.uint16))
    with pytest.raises(ValueError, match="shared_gate must"):
        moe.combine(y, w, out, shared=cuda.device_array((2, 8), np.uint16),
                    shared_gate=cuda.device_array(3, np.float32))


# --------------------------------------------------------------------------------------- workspace

@pytest.mark.parametrize("t,k,e,i", [(1, 2, 8, 14336), (3, 2, 6, 24), (5, 1, 8, 16), (512, 8, 128, 768)])
def test_workspace_requirement_is_the_layout_total(t, k, e, i):
    r, mt, lay = moe._layout(t, k, e, i)
    req = moe.workspace_requirement(t, k, e, i)
    assert req.bytes == lay.total and req.lifetime is Lifetime.STEP
    assert lay.sizes["h"] == 2 * t * k * i and lay.sizes["perm"] == 4 * t * k
    assert mt == moe.max_tiles(t * k, e, r)
    group = moe.workspace_requirement(t, k, e, i, op="group")
    assert group.bytes == moe._layout(t, k, e, 0)[2].total == lay.offsets["h"]
    assert moe.workspace_requirement(t, k, e, op="router") == NONE
    assert moe.workspace_requirement(t, k, e, op="combine") == NONE
    assert moe.CAPTURE_SAFE is True and moe.SIGNATURES
    with pytest.raises(ValueError, match="unknown moe op"):
        moe.workspace_requirement(t, k, e, op="gather")


def test_max_tiles_bounds_every_routing():
    rng = np.random.default_rng(9)
    for _ in range(200):
        t, e = int(rng.integers(1, 40)), int(rng.integers(1, 20))
        k = int(rng.integers(1, min(e, 8) + 1))
        ids = distinct_ids(rng, t, k, e)
        ref = moe.reference_group(ids, e)
        assert ref["n_tiles"] <= moe.max_tiles(t * k, e, ref["row_tile"])


def test_workspace_shortfall():
    rng = np.random.default_rng(6)
    t, k, e, h, i = 3, 2, 6, 16, 24
    ids = dev(distinct_ids(rng, t, k, e))
    group = moe.workspace_requirement(t, k, e, op="group")
    for ws in (None, cuda.device_array(group.bytes - 1, np.uint8)):
        with pytest.raises(WorkspaceShortfall) as exc:
            moe.group_by_expert(ids, workspace=ws, num_experts=e)
        assert exc.value.needed == group.bytes
    full = moe.workspace_requirement(t, k, e, i)
    x, y = dev(bf16(rng, (t, h))), cuda.device_array((t, k, h), np.float32)
    wg, wd = dev(bf16(rng, (e, i, h))), dev(bf16(rng, (e, h, i)))
    short = cuda.device_array(group.bytes, np.uint8)      # the routing fits, h does not
    for ws in (None, short, cuda.device_array(full.bytes - 1, np.uint8)):
        with pytest.raises(WorkspaceShortfall) as exc:
            moe.expert_ffn(x, wg, wg, wd, y, workspace=ws)
        assert exc.value.needed == full.bytes
    q = moe.quantize_experts(np.zeros((e, 128, 128), np.float32), "mxfp4")
    dq = tuple(dev(a) for a in q)
    need = moe.workspace_requirement(1, k, e, 128).bytes
    with pytest.raises(WorkspaceShortfall) as exc:
        moe.expert_ffn_mxfp4(dev(bf16(rng, (1, 128))), dq, dq, dq, cuda.device_array((1, k, 128), np.float32),
                             workspace=cuda.device_array(need - 256, np.uint8))
    assert exc.value.needed == need
    # the ops that need none accept any view, and no view
    moe.combine(y, cuda.device_array((t, k), np.float32), cuda.device_array((t, h), np.uint16),
                workspace=cuda.device_array(0, np.uint8), threads=32)
