"""MoE kernels on a real GPU at real shapes, on a non-default stream, against their NumPy references:
router + grouping + expert SwiGLU FFN (bf16, int4, MXFP4) + combine at Mixtral-8x7B decode shapes and at the
Mixtral-shaped 4.7B preset's prefill shapes; the routed-expert gather from the pool and from host-mapped
pinned memory; a captured MoE decode (router -> group -> experts -> combine) replayed against eager launches.
Fails (never skips) without a GPU (root conftest). Tolerances: tests/moe_checks.py with the GEMV tests'
real-shape accumulation slack (3e-5 · Σ|xᵢ·wᵢ|).
"""

from __future__ import annotations

import numpy as np
import pytest

from vmmstream.kernels import moe
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import dequantize_int4, dequantize_mxfp4, quantize_int4, quantize_mxfp4

from gpuutil import HALF_ULP, captured, get, to_dev
from moe_checks import check_experts, check_routing, kernel_h

pytestmark = pytest.mark.gpu

SLACK = 3e-5


def bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)))


def expert_stacks(rng, e, h, i, routed, kind):
    """[E, I, H] gate, up and [E, H, I] down stacks with random weights for the ``routed`` experts only (the
    kernels read no others; the rest stay zero): bf16 bits, or quantized stacks (kind 'int4' | 'mxfp4'), and
    {expert: fp32 weight as the kernels see it} for the routed experts."""
    shapes = ((i, h), (i, h), (h, i))
    stacks, deq = [], []
    for shape in shapes:
        w = {ex: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02) for ex in routed}
        if kind == "bf16":
            st = np.zeros((e, *shape), np.uint16)
            for ex, v in w.items():
                st[ex] = f32_to_bf16(v)
            stacks.append(st)
            deq.append({ex: bf16_to_f32(st[ex]) for ex in routed})
            continue
        q = {ex: (quantize_int4(v) if kind == "int4" else quantize_mxfp4(v)) for ex, v in w.items()}
        first = next(iter(q.values()))
        st = type(first)(*(np.zeros((e, *a.shape), a.dtype) for a in first))
        for ex, qe in q.items():
            for full, part in zip(st, qe):
                full[ex] = part
        stacks.append(st)
        deq.append({ex: (dequantize_int4(*qe) if kind == "int4" else dequantize_mxfp4(*qe)) for ex, qe in q.items()})
    return stacks, deq


def run_chain(stream, x, logits, weights, kind, e, k, i, y_dtype=np.float32, row_tile=0):
    from numba import cuda
    t, h = x.shape
    ids = cuda.device_array((t, k), np.int32, stream=stream)
    wts = cuda.device_array((t, k), np.float32, stream=stream)
    moe.router_topk(to_dev(logits, stream), ids, wts, scoring="mixtral", stream=stream)
    ws = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8, stream=stream)
    rt = moe.group_by_expert(ids, workspace=ws, num_experts=e, row_tile=row_tile, stream=stream)
    y = cuda.device_array((t, k, h), y_dtype, stream=stream)
    dx = to_dev(x, stream)
    if kind == "bf16":
        moe.expert_ffn(dx, *(to_dev(w, stream) for w in weights), y, workspace=ws, row_tile=row_tile,
                       stream=stream)
    else:
        fn = moe.expert_ffn_int4 if kind == "int4" else moe.expert_ffn_mxfp4
        fn(dx, *(tuple(to_dev(a, stream) for a in w) for w in weights), y, workspace=ws, stream=stream)
    out = cuda.device_array((t, h), np.uint16, stream=stream)
    moe.combine(y, wts, out, stream=stream)
    stream.synchronize()
    return ids, wts, ws, rt, y, out


@pytest.mark.parametrize("kind", ["bf16", "int4", "mxfp4"])
@pytest.mark.parametrize("t,e,k,h,i", [
    (1, 8, 2, 4096, 14336),      # Mixtral 8x7B decode
    (8, 8, 2, 2048, 5632),       # the 4.7B preset, a prefill of 8 tokens
])
def test_moe_chain_at_real_shapes(stream, kind, t, e, k, h, i):
    rng = np.random.default_rng(t * 31 + len(kind))
    x = bf16(rng, (t, h))
    logits = rng.standard_normal((t, e), dtype=np.float32) * np.float32(3.0)
    rid, rw = moe.reference_router(logits, k, scoring="mixtral")
    weights, deq = expert_stacks(rng, e, h, i, sorted(set(rid.reshape(-1).tolist())), kind)
    ids, wts, ws, rt, y, out = run_chain(stream, x, logits, weights, kind, e, k, i)
    np.testing.assert_array_equal(get(ids, stream), rid)
    np.testing.assert_allclose(get(wts, stream), rw, rtol=1e-5, atol=1e-6)
    check_routing(rt, moe.reference_group(rid, e))
    y_got = get(y, stream)
    if kind == "bf16":
        _, h_ref = moe.reference_experts(x, rid, *weights, return_h=True)
    elif kind == "int4":
        _, h_ref = moe.reference_experts_int4(x, rid, *weights, return_h=True)
    else:
        _, h_ref = moe.reference_experts_mxfp4(x, rid, *weights, return_h=True)
    check_experts(x, rid, *deq, kernel_h(ws, rt, t, k, e, i), y_got, h_ref, SLACK)
    want = moe.reference_combine(y_got, rw).astype(np.float64)
    slack = 1e-6 * np.einsum("ts,tsh->th", np.abs(rw), np.abs(y_got)) + 1e-7
    got = bf16_to_f32(get(out, stream)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 2 * HALF_ULP * np.abs(want) + slack)


def test_expert_gather_from_pool_and_host_mapped_memory(stream):
    """The 4.7B preset's expert unit (gate, up, down of one expert: 69 MB), 8 experts in host-mapped pinned
    memory, 3 of them also in a device pool: the routed pair (one resident, one not) lands in the slots."""
    from numba import cuda
    from vmmstream.kernels.moe import gather as eg
    rng = np.random.default_rng(5)
    e, unit = 8, 3 * 5632 * 2048 * 2
    host = cuda.mapped_array((e, unit), np.uint8)
    host[:] = rng.integers(0, 256, (e, unit), dtype=np.uint8)
    pool_h = rng.integers(0, 256, (3, unit), dtype=np.uint8)
    loc = np.full(e, -1, np.int32)
    loc[[6, 1, 3]] = [0, 1, 2]
    ids = np.array([[3, 5]], np.int32)                       # expert 3 from the pool, expert 5 from the host
    slots = np.zeros((2, unit), np.uint8)
    counts, stats = np.zeros(e, np.int64), np.zeros(3, np.int64)
    want = eg.reference(ids, loc, pool_h, np.asarray(host), slots, counts, stats)
    d = [to_dev(a, stream) for a in (ids, loc, pool_h)]
    d_slots, d_counts, d_stats = (to_dev(a, stream) for a in (slots, counts, stats))
    mapped = to_dev(np.full((1, 2), -1, np.int32), stream)
    eg.gather(d[0], d[1], d[2], host, d_slots, mapped, d_counts, d_stats, stream=stream)
    got = (get(d_slots, stream), get(mapped, stream), get(d_counts, stream), get(d_stats, stream))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert list(got[3]) == [1, 1, unit]


def test_captured_moe_decode_replays_match_eager(stream):
    """router -> group -> expert FFN -> combine for one token, captured once (global capture mode: no
    allocation or synchronize inside) and replayed with new router logits written into the captured input:
    every replay's output equals an eager launch on the same inputs, bit for bit."""
    from numba import cuda
    rng = np.random.default_rng(17)
    t, e, k, h, i = 1, 8, 2, 2048, 5632
    x = bf16(rng, (t, h))
    weights, _ = expert_stacks(rng, e, h, i, range(e), "bf16")
    dw = [to_dev(w, stream) for w in weights]
    dx, dlog = to_dev(x, stream), cuda.device_array((t, e), np.float32, stream=stream)
    ids = cuda.device_array((t, k), np.int32, stream=stream)
    wts = cuda.device_array((t, k), np.float32, stream=stream)
    ws = cuda.device_array(moe.workspace_requirement(t, k, e, i).bytes, np.uint8, stream=stream)
    y = cuda.device_array((t, k, h), np.float32, stream=stream)
    out = cuda.device_array((t, h), np.uint16, stream=stream)

    def step():
        moe.router_topk(dlog, ids, wts, scoring="mixtral", stream=stream)
        moe.group_by_expert(ids, workspace=ws, num_experts=e, stream=stream)
        moe.expert_ffn(dx, *dw, y, workspace=ws, stream=stream)
        moe.combine(y, wts, out, stream=stream)

    all_logits = [rng.standard_normal((t, e), dtype=np.float32) * np.float32(3.0) for _ in range(4)]
    eager = []
    for lg in all_logits:                     # eager launches (compile and warm up too)
        dlog.copy_to_device(lg, stream=stream)
        step()
        eager.append((get(ids, stream).copy(), get(out, stream).copy()))
    assert len({tuple(a.reshape(-1)) for a, _ in eager}) > 1      # the logits route to different experts
    with captured(stream, step) as replay:
        for lg, (want_ids, want_out) in zip(all_logits, eager):
            dlog.copy_to_device(lg, stream=stream)
            replay()
            np.testing.assert_array_equal(get(ids, stream), want_ids)
            np.testing.assert_array_equal(get(out, stream), want_out)


@pytest.mark.parametrize("t,y_dtype", [(32, np.float32), (16, np.uint16), (9, np.float32)])
def test_moe_tensor_core_experts_at_the_presets_shape(stream, monkeypatch, t, y_dtype):
    """``moe.experts_mma.MMA``: a batch's routed experts through the tensor-core kernels (tiles of 8 rows), the 4.7B
    preset's shapes; h and y against the reference with the SIMT kernels' slack."""
    monkeypatch.setattr(moe.experts_mma, "MMA", True)
    e, k, h, i = 8, 2, 2048, 5632
    assert moe.mma_row_tile(t, h, i) == 8
    rng = np.random.default_rng(t * 7 + 3)
    x = bf16(rng, (t, h))
    logits = rng.standard_normal((t, e), dtype=np.float32) * np.float32(3.0)
    rid, rw = moe.reference_router(logits, k, scoring="mixtral")
    weights, deq = expert_stacks(rng, e, h, i, sorted(set(rid.reshape(-1).tolist())), "bf16")
    ids, wts, ws, rt, y, out = run_chain(stream, x, logits, weights, "bf16", e, k, i, y_dtype, row_tile=8)
    check_routing(rt, moe.reference_group(rid, e, row_tile=8))
    _, h_ref = moe.reference_experts(x, rid, *weights, return_h=True)
    check_experts(x, rid, *deq, kernel_h(ws, rt, t, k, e, i), get(y, stream), h_ref, SLACK)
