"""Attention kernels on a real GPU at model shapes (32 query / 8 KV heads, d=128) against the NumPy
references: every prefill route, a prefill chunk at an offset into a longer cache, decode with device
lengths below S_max, decode replayed from one captured graph at several lengths, and the workspace
contract (invariant I7) on device memory. Fails (never skips) without a GPU.

Tolerances, on bf16 outputs against an fp64 reference from the same bf16 inputs: one bf16 output
rounding (2^-8 relative) plus an absolute slack of 2e-3 for the fp32-FMA routes and decode (fp32
accumulation over up to 32768 keys) and 1e-2 for ``fused_mma`` (P is rounded to bf16 before P @ V,
as in FlashAttention). References are computed on a subset of heads, spread over the KV groups.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.errors import WorkspaceShortfall
from vmmstream.kernels import NONE, Lifetime
from vmmstream.kernels.attention import decode as ad, prefill as ap
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.base.workspace import align_up

pytestmark = pytest.mark.gpu

HALF_ULP = 2.0 ** -8
HQ, HKV, D = 32, 8, 128
HEADS = [0, 9, 18, 31]          # query heads checked against the reference: KV heads 0, 2, 4, 7


def bf16(rng, shape):
    return f32_to_bf16(rng.standard_normal(shape, dtype=np.float32))


def assert_bf16_close(got_bits, ref, abs_tol):
    got = bf16_to_f32(got_bits).astype(np.float64)
    err = np.abs(got - ref)
    bound = HALF_ULP * np.abs(ref) + abs_tol
    assert np.isfinite(got).all(), "non-finite output"
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g} (max err {err.max():.3g})"


@pytest.fixture(scope="module")
def stream():
    return cuda.stream()


def prefill_case(stream, T, Hq, Hkv, Dh, start_pos, route, S=None, heads=None, seed=0):
    """Run a prefill and return (out bits for ``heads``, reference for ``heads``)."""
    rng = np.random.default_rng(seed)
    S = S or start_pos + T
    q, k, v = bf16(rng, (T, Hq, Dh)), bf16(rng, (S, Hkv, Dh)), bf16(rng, (S, Hkv, Dh))
    req = ap.workspace_requirement(T, Hq, Hkv, Dh, start_pos=start_pos, route=route)
    ws = cuda.device_array(req.bytes, np.uint8) if req.bytes else None
    out = cuda.to_device(np.full_like(q, 0x7FC0))      # NaN: every element must be written
    if route == ap.CUDNN:          # the route's workspace is the session's (passed as such)
        ap.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, None, start_pos=start_pos,
                  route=route, stream=stream, session_workspace=ws)
    else:
        ap.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, ws,
                  start_pos=start_pos, route=route, stream=stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    heads = list(range(Hq)) if heads is None else heads
    kvh = [h // (Hq // Hkv) for h in heads]
    ref = ap.reference(q[:, heads], k[:, kvh], v[:, kvh], start_pos=start_pos)
    return got[:, heads], ref


# --------------------------------------------------------------------------------------- prefill

def _need_cudnn():
    """The cuDNN route is optional (``vmmstream[cudnn]``): a GPU run without it fails here, saying why."""
    from vmmstream.kernels.attention import cudnn_sdpa
    assert cudnn_sdpa.available(), f"cuDNN route not loadable (pip install 'vmmstream[cudnn]'): " \
                                   f"{cudnn_sdpa.unavailable_reason()}"


@pytest.mark.parametrize("T,Hq,Hkv,Dh,start_pos,S", [
    (2048, HQ, HKV, D, 0, 2048),      # the bench shape
    (512, HQ, HKV, D, 1536, 4096),    # a chunk at an offset into a longer cache (bottom-right diagonal)
    (999, 16, 4, 64, 37, 1100),       # head dim 64, a ragged length, rows past the keys in the cache
])
def test_prefill_cudnn_route(stream, T, Hq, Hkv, Dh, start_pos, S):
    """cuDNN's SDPA reading our [T, H, D] q and [S, Hkv, D] cache by strides gives the reference, like our
    tensor-core routes (P in bf16: the same 1e-2 slack)."""
    _need_cudnn()
    assert ap.workspace_requirement(T, Hq, Hkv, Dh, route=ap.CUDNN).lifetime == Lifetime.SESSION
    heads = [h for h in HEADS if h < Hq]
    got, ref = prefill_case(stream, T, Hq, Hkv, Dh, start_pos, ap.CUDNN, S=S, heads=heads, seed=5)
    assert_bf16_close(got, ref, 1e-2)


def test_prefill_cudnn_chosen_for_long_prompts_and_captured(monkeypatch):
    """``choose_route`` takes cuDNN for a 2,048-token prompt when a session workspace is given (our kernel
    without one, or for a short prompt); the launch, captured in a CUDA graph after an eager one, replays the
    reference for new q; a shape first met inside a capture runs our kernel instead (nothing built there)."""
    import torch
    from vmmstream.kernels.attention import cudnn_sdpa
    from vmmstream.kernels.base.launch import as_stream
    _need_cudnn()
    monkeypatch.setattr(ap, "PREFER_CUDNN", True)        # VMMSTREAM_CUDNN=1 (opt-in)
    T = 2048
    ws = cuda.device_array(cudnn_sdpa.WORKSPACE, np.uint8)
    assert ap.choose_route(T, HQ, HKV, D, session_workspace_bytes=ws.nbytes) == ap.CUDNN
    assert ap.choose_route(T, HQ, HKV, D) == ap.FUSED_MMA_ASYNC
    assert ap.choose_route(64, HQ, HKV, D, session_workspace_bytes=ws.nbytes) == ap.FUSED_MMA_ASYNC
    rng = np.random.default_rng(6)
    q, k, v = bf16(rng, (T, HQ, D)), bf16(rng, (T, HKV, D)), bf16(rng, (T, HKV, D))
    dq, dk, dv = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
    out = cuda.device_array((T, HQ, D), np.uint16)
    side = torch.cuda.Stream()
    run = lambda: ap.launch(dq, dk, dv, out, None, stream=as_stream(side), session_workspace=ws)  # noqa: E731
    with torch.cuda.stream(side):
        run()                                       # eager: builds the graph
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        run()
    q2 = bf16(rng, (T, HQ, D))
    dq.copy_to_device(q2)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    kvh = [h // (HQ // HKV) for h in HEADS]
    assert_bf16_close(out.copy_to_host()[:, HEADS], ap.reference(q2[:, HEADS], k[:, kvh], v[:, kvh]), 1e-2)
    # a new shape (queries from position 1: 2,049 keys) met first inside a capture: cuDNN refuses it there, our
    # kernel is captured instead, and the replay is right
    k3, v3 = bf16(rng, (T + 1, HKV, D)), bf16(rng, (T + 1, HKV, D))
    dk3, dv3 = cuda.to_device(k3), cuda.to_device(v3)
    with torch.cuda.stream(side):                   # our kernel compiled and loaded outside the capture
        ap.launch(dq, dk3, dv3, out, None, start_pos=1, route=ap.FUSED_MMA_ASYNC, stream=as_stream(side))
    side.synchronize()
    kept = len(cudnn_sdpa._state["graphs"])
    refused, real = [], cudnn_sdpa.launch

    def spy(*a, **kw):
        try:
            return real(*a, **kw)
        except cudnn_sdpa.Unsupported as e:
            refused.append(str(e))
            raise
    monkeypatch.setattr(cudnn_sdpa, "launch", spy)
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2, stream=side):
        ap.launch(dq, dk3, dv3, out, None, start_pos=1, stream=as_stream(side), session_workspace=ws)
    assert len(refused) == 1 and "capture" in refused[0]
    assert len(cudnn_sdpa._state["graphs"]) == kept        # nothing built inside the capture
    graph2.replay()
    torch.cuda.synchronize()
    assert_bf16_close(out.copy_to_host()[:, HEADS],
                      ap.reference(q2[:, HEADS], k3[:, kvh], v3[:, kvh], start_pos=1), 1e-2)


def test_prefill_cudnn_route_reads_a_models_strided_cache(stream):
    """A model's KV cache is position-major over every layer: layer l's K rows are a whole position's row apart.
    cuDNN must read them through those strides (a contiguous assumption read other layers' rows)."""
    _need_cudnn()
    from vmmstream.kernels.attention import cudnn_sdpa
    T, sp, layers, layer = 768, 1400, 4, 2
    rng = np.random.default_rng(8)
    q = bf16(rng, (T, HQ, D))
    cache = bf16(rng, (sp + T + 5, layers, 2, HKV, D))
    dcache = cuda.to_device(cache)
    dk, dv = dcache[:, layer, 0], dcache[:, layer, 1]
    out = cuda.to_device(np.full_like(q, 0x7FC0))
    ws = cuda.device_array(cudnn_sdpa.WORKSPACE, np.uint8)
    ap.launch(cuda.to_device(q), dk, dv, out, None, start_pos=sp, route=ap.CUDNN, stream=stream,
              session_workspace=ws)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    kvh = [h // (HQ // HKV) for h in HEADS]
    k, v = cache[:, layer, 0], cache[:, layer, 1]
    assert_bf16_close(got[:, HEADS], ap.reference(q[:, HEADS], k[:, kvh], v[:, kvh], start_pos=sp), 1e-2)


@pytest.mark.parametrize("T,start_pos", [(2100, 0), (2304, 0), (3001, 0), (700, 2900)])
def test_prefill_cudnn_length_buckets_use_only_the_real_rows(stream, monkeypatch, T, start_pos):
    """``PADDED``: the call runs its length bucket's graph with the real lengths in device memory. The rows past
    T of q and the cache rows past the keys are NaN (in a model they hold anything): the output's real rows must
    still be the reference's, on a model's strided cache, and two lengths of one bucket share one graph."""
    _need_cudnn()
    from vmmstream.kernels.attention import cudnn_sdpa
    monkeypatch.setattr(cudnn_sdpa, "PADDED", True)
    n_keys = start_pos + T
    tb, kb = cudnn_sdpa.bucket(T), cudnn_sdpa.bucket(n_keys)
    layers, layer = 3, 1
    rng = np.random.default_rng(11)
    q = np.full((tb, HQ, D), 0x7FC0, np.uint16)
    q[:T] = bf16(rng, (T, HQ, D))
    cache = np.full((kb + 8, layers, 2, HKV, D), 0x7FC0, np.uint16)
    cache[:n_keys] = bf16(rng, (n_keys, layers, 2, HKV, D))
    dcache = cuda.to_device(cache)
    dk, dv = dcache[:, layer, 0], dcache[:, layer, 1]
    dq, out = cuda.to_device(q), cuda.to_device(np.full_like(q, 0x7FC0))
    ws = cuda.device_array(cudnn_sdpa.WORKSPACE, np.uint8)
    before = len(cudnn_sdpa._state.get("graphs", {}))
    for rows in (T, T - 1):                       # two lengths, one bucket (the second is checked below)
        ap.launch(dq[:rows], dk, dv, out[:rows], None, start_pos=start_pos, route=ap.CUDNN, stream=stream,
                  session_workspace=ws, spare_rows=tb - rows, spare_keys=kb + 8 - (start_pos + rows))
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    graphs = cudnn_sdpa._state["graphs"]
    assert len(graphs) - before <= 1 and any(k[:2] == (tb, kb) and k[-1] for k in graphs)
    kvh = [h // (HQ // HKV) for h in HEADS]
    k, v = cache[:, layer, 0], cache[:, layer, 1]
    ref = ap.reference(q[:T - 1][:, HEADS], k[:, kvh], v[:, kvh], start_pos=start_pos)
    assert_bf16_close(got[:T - 1, HEADS], ref, 1e-2)


@pytest.mark.parametrize("route,tol", [(ap.FUSED_MMA_ASYNC, 1e-2), (ap.FUSED_MMA, 1e-2), (ap.FUSED, 2e-3)])
def test_prefill_fused_real_shape(stream, route, tol):
    assert ap.workspace_requirement(2048, HQ, HKV, D, route=route) == NONE
    got, ref = prefill_case(stream, 2048, HQ, HKV, D, 0, route, heads=HEADS)
    assert_bf16_close(got, ref, tol)


@pytest.mark.parametrize("route,tol", [(ap.FUSED_MMA_ASYNC, 1e-2), (ap.FUSED_MMA, 1e-2), (ap.FUSED, 2e-3)])
def test_prefill_chunk_at_offset_into_longer_cache(stream, route, tol):
    # queries at positions [1536, 2048) attend to cache [0, 1536 + i]; the cache holds 4096 rows
    got, ref = prefill_case(stream, 512, HQ, HKV, D, 1536, route, S=4096, heads=HEADS, seed=1)
    assert_bf16_close(got, ref, tol)


@pytest.mark.parametrize("route,tol", [(ap.FUSED_MMA_ASYNC, 1e-2), (ap.FUSED_MMA, 1e-2), (ap.FUSED, 2e-3)])
def test_prefill_head_dim_64_ragged_length(stream, route, tol):
    got, ref = prefill_case(stream, 999, 16, 4, 64, 37, route, seed=2)
    assert_bf16_close(got, ref, tol)


@pytest.mark.parametrize("Dh", [80, 96, 112, 48])
def test_prefill_tensor_cores_at_other_head_dims(stream, Dh):
    """The tensor-core route takes any head_dim that is a multiple of 16 up to 128 (partial load rounds)."""
    assert ap.choose_route(999, 16, 4, Dh, start_pos=37) == (ap.FUSED_MMA_ASYNC if Dh == 96 else ap.FUSED_MMA)
    got, ref = prefill_case(stream, 999, 16, 4, Dh, 37, ap.FUSED_MMA, seed=4)
    assert_bf16_close(got, ref, 1e-2)


@pytest.mark.parametrize("Dh", [128, 96])
def test_i7_prefill_materialized_on_device(stream, Dh):
    T, sp = 300, 45
    req = ap.workspace_requirement(T, HQ, HKV, Dh, start_pos=sp, route=ap.MATERIALIZED)
    assert req.lifetime == Lifetime.STEP and req.bytes == align_up(HQ * T * (sp + T) * 4)
    got, ref = prefill_case(stream, T, HQ, HKV, Dh, sp, ap.MATERIALIZED, heads=HEADS, seed=3)
    assert_bf16_close(got, ref, 2e-3)
    # a view one byte short is refused before anything is launched; the output stays untouched
    q = cuda.to_device(np.zeros((T, HQ, Dh), np.uint16))
    kv = cuda.to_device(np.zeros((sp + T, HKV, Dh), np.uint16))
    out = cuda.to_device(np.full((T, HQ, Dh), 7, np.uint16))
    short = cuda.device_array(req.bytes - 1, np.uint8)
    with pytest.raises(WorkspaceShortfall) as e:
        ap.launch(q, kv, kv, out, short, start_pos=sp, route=ap.MATERIALIZED, stream=stream)
    assert (e.value.needed, e.value.given) == (req.bytes, req.bytes - 1)
    assert (out.copy_to_host() == 7).all()


# ---------------------------------------------------------------------------------------- decode

def decode_case(stream, B, Hkv, Dh, S_max, lengths, seed=0, Hq=HQ):
    HQ = Hq
    rng = np.random.default_rng(seed)
    q = bf16(rng, (B, HQ, Dh))
    k, v = bf16(rng, (B, S_max, Hkv, Dh)), bf16(rng, (B, S_max, Hkv, Dh))
    req = ad.workspace_requirement(B, HQ, Hkv, Dh, S_max)
    assert req.lifetime == Lifetime.SESSION
    ws = cuda.to_device(np.full(req.bytes, 0xFF, np.uint8))   # stale NaN partials must not leak in
    out = cuda.to_device(np.full((B, HQ, Dh), 0x7FC0, np.uint16))
    lens = np.asarray(lengths, np.int32)
    dk, dv = (cuda.to_device(x[0] if B == 1 else x) for x in (k, v))   # B == 1: [S_max, Hkv, D] cache
    ad.launch(cuda.to_device(q), dk, dv, cuda.to_device(lens), out, ws, stream=stream)
    got = out.copy_to_host(stream=stream)
    stream.synchronize()
    return got, ad.reference(q, k, v, lens)


@pytest.mark.parametrize("S_max,length", [(4096, 3001), (32768, 30001), (32768, 1), (32768, 32768)])
def test_decode_real_shape(stream, S_max, length):
    got, ref = decode_case(stream, 1, HKV, D, S_max, [length])
    assert_bf16_close(got, ref, 2e-3)


def test_decode_batch_head_dim_64(stream):
    got, ref = decode_case(stream, 3, 4, 64, 4096, [5, 4000, 4096], seed=1)
    assert_bf16_close(got, ref, 2e-3)


@pytest.mark.parametrize("Hq,Hkv", [(32, 1), (64, 4)])
def test_decode_multi_query_and_wide_groups(stream, Hq, Hkv):
    """More than 8 query heads per KV head: launched in head groups (32 on one KV head; 16 per KV head)."""
    got, ref = decode_case(stream, 1, Hkv, 128, 8192, [6001], seed=3, Hq=Hq)
    assert_bf16_close(got, ref, 2e-3)


@pytest.mark.parametrize("Dh", [256, 80, 96, 112, 32])
def test_decode_other_head_dims(stream, Dh):
    """head_dim 256 (one lane group per warp), 80 / 96 / 112 (10 / 12 / 14 live lanes of 16), 32."""
    got, ref = decode_case(stream, 2, HQ // 4, Dh, 8192, [1, 7001], seed=2)
    assert_bf16_close(got, ref, 2e-3)


@pytest.mark.parametrize("B,Hkv,Dh,S_max,lengths", [(1, HKV, D, 32768, [30001]), (3, 4, 64, 4096, [5, 4000, 4096])])
def test_decode_flat_loads_variant(stream, monkeypatch, B, Hkv, Dh, S_max, lengths):
    # the running-offset K/V loads (FLAT_LOADS, 128 registers instead of 168): same results
    monkeypatch.setattr(ad, "FLAT_LOADS", True)
    got, ref = decode_case(stream, B, Hkv, Dh, S_max, lengths, seed=5)
    assert_bf16_close(got, ref, 2e-3)


def test_i7_decode_short_view_on_device(stream):
    req = ad.workspace_requirement(1, HQ, HKV, D, 4096)
    q = cuda.to_device(np.zeros((1, HQ, D), np.uint16))
    kv = cuda.to_device(np.zeros((4096, HKV, D), np.uint16))
    lens = cuda.to_device(np.array([10], np.int32))
    with pytest.raises(WorkspaceShortfall):
        ad.launch(q, kv, kv, lens, q, cuda.device_array(req.bytes - 256, np.uint8), stream=stream)


def test_decode_one_captured_graph_serves_every_length():
    """Capture the two decode kernels once (at S_max), then change only the device-held length and
    replay: each replay must match the reference at that length (DESIGN §6)."""
    import torch
    from vmmstream.kernels.base.launch import as_stream
    S_max = 8192
    rng = np.random.default_rng(4)
    q, k, v = bf16(rng, (1, HQ, D)), bf16(rng, (S_max, HKV, D)), bf16(rng, (S_max, HKV, D))
    dq, dk, dv = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
    lens = cuda.to_device(np.array([1], np.int32))
    out = cuda.device_array((1, HQ, D), np.uint16)
    ws = cuda.device_array(ad.workspace_requirement(1, HQ, HKV, D, S_max).bytes, np.uint8)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ad.launch(dq, dk, dv, lens, out, ws, stream=as_stream(side))    # warm-up: compile and load
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ad.launch(dq, dk, dv, lens, out, ws, stream=as_stream(torch.cuda.current_stream()))
    for n in (17, 4097, 8192, 1):
        lens.copy_to_device(np.array([n], np.int32))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        assert_bf16_close(out.copy_to_host(), ad.reference(q, k, v, [n]), 2e-3)
