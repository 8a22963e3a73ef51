"""Attention kernels against torch SDPA measured in the same run (32 query / 8 KV heads, d=128).

- decode, S = 4096 and 32768 (full length): GB/s of K+V read, SDPA's GB/s, and the ratio (target >= 0.8
  at 32768; GPU.md anchor: SDPA 40.5 us = 3.3 TB/s);
- causal prefill, S = 2048 and 8192, 32 heads: TFLOP/s (causal count, ~2 S^2 D H), SDPA's TFLOP/s and
  the ratio (GPU.md anchor: SDPA 0.90 ms = 613 TFLOP/s at 8192), per route.

Both sides are timed the same way: ``REPS`` calls captured into one CUDA graph (so Python launch cost,
~40 us per Numba launch, is not what is measured), one replay between two CUDA events, synchronized
inside the timed call; compile, module load and capture happen before timing. If capture fails, the
timing falls back to events around direct launches and ``extra_info["timing"]`` says so.
Needs torch (on the GPU machine) for SDPA, the graph and the tensors shared with Numba.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.kernels.attention import decode as ad, prefill as ap
from vmmstream.kernels.base.launch import as_stream

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128
import torch  # noqa: E402  (on the GPU machine; this module is gpu-only)
F = torch.nn.functional


def nb(t):
    """A Numba view of a torch bf16 (or uint8) tensor's memory, as uint16 (uint8) bit patterns."""
    if t.dtype == torch.uint8:
        return cuda.as_cuda_array(t, sync=False)
    try:
        return cuda.as_cuda_array(t.view(torch.uint16), sync=False)
    except Exception:   # a torch without uint16 in __cuda_array_interface__
        return cuda.as_cuda_array(t.view(torch.int16), sync=False).view(np.uint16)


def timer(fn, reps):
    """Returns (timed, how): ``timed()`` replays ``reps`` captured calls of ``fn`` and gives ms per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                    # compile + load outside capture and timing
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run, how = graph.replay, f"CUDA graph of {reps} calls, CUDA events around one replay"
    except Exception as e:     # noqa: BLE001 - report, then time direct launches
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
        how = f"events around {reps} direct launches (capture failed: {type(e).__name__})"

    def timed():
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    return timed, how


def measure(benchmark, fn, reps, rounds=5):
    timed, how = timer(fn, reps)
    times = []
    benchmark.pedantic(lambda: times.append(timed()), rounds=rounds, iterations=1, warmup_rounds=1)
    return min(times), how


def sdpa_ms(q, k, v, causal, reps):
    """SDPA in its native layout [B, H, S, D], GQA via enable_gqa; best of a few replays."""
    timed, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), reps)
    return min(timed() for _ in range(5))


# ---------------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("scatter", [False, True], ids=["butterfly", "scatter-sum"])
@pytest.mark.parametrize("flat", [False, True], ids=["offsets", "flat-loads"])
@pytest.mark.parametrize("S", [4096, 32768])
def test_bench_decode(benchmark, monkeypatch, S, flat, scatter):
    # FLAT_LOADS addresses K/V by a running element offset (128 registers instead of 168); SCATTER_SUM sums the
    # scores over a lane group by reduce-scatter + all-gather (about half the shuffles). Every pairing is measured.
    monkeypatch.setattr(ad, "FLAT_LOADS", flat)
    monkeypatch.setattr(ad, "SCATTER_SUM", scatter)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, HQ, D, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(S, HKV, D, device=dev, generator=g).to(torch.bfloat16)      # our cache layout
    v = torch.randn(S, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(1, HQ, D, device=dev, dtype=torch.bfloat16)
    lens = torch.full((1,), S, device=dev, dtype=torch.int32)
    ws = torch.empty(ad.workspace_requirement(1, HQ, HKV, D, S).bytes, device=dev, dtype=torch.uint8)
    args = [nb(q), nb(k), nb(v), cuda.as_cuda_array(lens, sync=False), nb(out), nb(ws)]

    def ours():
        ad.launch(*args, stream=as_stream(torch.cuda.current_stream()))

    ms, how = measure(benchmark, ours, reps=20)
    # SDPA: q [1, Hq, 1, D], k/v [1, Hkv, S, D] contiguous (its preferred layout)
    kt, vt = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (k, v))
    sdpa = sdpa_ms(q.unsqueeze(2), kt, vt, False, reps=20)
    kv_bytes = 2 * S * HKV * D * 2
    gbps, sdpa_gbps = kv_bytes / (ms * 1e-3) / 1e9, kv_bytes / (sdpa * 1e-3) / 1e9
    chunk, splits = ad.plan(1, HKV, S, HQ // HKV)
    benchmark.extra_info.update({
        "S": S, "heads": f"{HQ}q/{HKV}kv", "head_dim": D, "splits": splits, "chunk": chunk,
        "us": ms * 1e3, "kv_bytes": kv_bytes, "bytes_moved": ad.bytes_moved(1, HQ, HKV, D, [S], S),
        "gbps_kv": gbps, "sdpa_us": sdpa * 1e3, "sdpa_gbps_kv": sdpa_gbps, "ratio_to_sdpa": gbps / sdpa_gbps,
        "target_ratio": 0.8, "timing": how, "flat_loads": flat, "scatter_sum": scatter,
    })


# --------------------------------------------------------------------------------------- prefill

def prefill_inputs(S, hq, hkv, d, route):
    """q [S, hq, d], k / v [S, hkv, d] (seeded bf16), out, and the route's workspace (None when it takes none)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(S, hq, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(S, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(S, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    req = ap.workspace_requirement(S, hq, hkv, d, route=route)
    ws = torch.empty(req.bytes, device=dev, dtype=torch.uint8) if req.bytes else None
    return q, k, v, torch.empty_like(q), req, ws


@pytest.mark.parametrize("S,route", [(2048, ap.FUSED_MMA_ASYNC), (8192, ap.FUSED_MMA_ASYNC),
                                     (2048, ap.CUDNN), (8192, ap.CUDNN), (1024, ap.CUDNN), (4096, ap.CUDNN),
                                     (1024, ap.FUSED_MMA_ASYNC), (4096, ap.FUSED_MMA_ASYNC),
                                     (2048, ap.FUSED_MMA), (8192, ap.FUSED_MMA), (2048, ap.FUSED),
                                     (8192, ap.FUSED), (2048, ap.MATERIALIZED)])
def test_bench_prefill(benchmark, S, route):
    """``cudnn``: cuDNN's SDPA (``vmmstream[cudnn]``) on our layout, its workspace passed as the session's."""
    q, k, v, out, req, ws = prefill_inputs(S, HQ, HKV, D, route)
    args = [nb(q), nb(k), nb(v), nb(out), None if ws is None or route == ap.CUDNN else nb(ws)]
    kw = {"session_workspace": nb(ws)} if route == ap.CUDNN else {}

    def ours():
        ap.launch(*args, route=route, stream=as_stream(torch.cuda.current_stream()), **kw)

    reps = 3 if route in (ap.FUSED_MMA, ap.FUSED_MMA_ASYNC, ap.CUDNN) else 1
    ms, how = measure(benchmark, ours, reps=reps, rounds=3)
    qt, kt, vt = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (q, k, v))
    sdpa = sdpa_ms(qt, kt, vt, True, reps=3)
    flops = ap.flops(S, HQ, D)
    tflops, sdpa_tflops = flops / (ms * 1e-3) / 1e12, flops / (sdpa * 1e-3) / 1e12
    benchmark.extra_info.update({
        "S": S, "route": route, "heads": f"{HQ}q/{HKV}kv", "head_dim": D, "ms": ms, "flops": flops,
        "tflops": tflops, "bytes_moved": ap.bytes_moved(S, HQ, HKV, D, route=route),
        "workspace_bytes": req.bytes, "sdpa_ms": sdpa, "sdpa_tflops": sdpa_tflops,
        "ratio_to_sdpa": tflops / sdpa_tflops, "timing": how,
    })
    print(f"\nprefill {route} S={S}: {tflops:.0f} TFLOP/s, SDPA {sdpa_tflops:.0f}, ratio {tflops / sdpa_tflops:.2f}")


ASYNC_SHAPES = {"base": (64, 4, False, None), "qs32": (32, 4, True, None), "qs32cap": (32, 4, True, 168),
                "w8x64": (64, 8, False, None), "w8x32": (32, 8, False, None), "cap168": (64, 4, False, 168),
                "db32": (32, 4, False, None, True), "db32cap": (32, 4, False, 168, True)}


@pytest.mark.parametrize("shape", list(ASYNC_SHAPES))
@pytest.mark.parametrize("S", [2048, 8192])
def test_bench_prefill_async_shape(benchmark, monkeypatch, S, shape):
    """The async route's block shapes at head dim 128 (keys per tile, warps, Q from shared memory, register cap,
    K / V double-buffered),
    beside SDPA, each output checked against SDPA's: which one becomes ``ASYNC_SHAPE[128]``."""
    monkeypatch.setitem(ap.ASYNC_SHAPE, D, ASYNC_SHAPES[shape])
    route = ap.FUSED_MMA_ASYNC
    q, k, v, out, req, ws = prefill_inputs(S, HQ, HKV, D, route)
    args = [nb(q), nb(k), nb(v), nb(out), None]
    ms, how = measure(benchmark, lambda: ap.launch(*args, route=route, stream=as_stream(torch.cuda.current_stream())),
                      reps=3, rounds=3)
    qt, kt, vt = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    err = (out.permute(1, 0, 2).float() - ref[0].float()).abs().max().item()
    assert err < 2e-2, f"{shape}: max error {err} against SDPA"
    sdpa = sdpa_ms(qt, kt, vt, True, reps=3)
    flops = ap.flops(S, HQ, D)
    tflops, sdpa_tflops = flops / (ms * 1e-3) / 1e12, flops / (sdpa * 1e-3) / 1e12
    benchmark.extra_info.update({
        "S": S, "shape": shape, "block": ASYNC_SHAPES[shape], "head_dim": D, "ms": ms, "tflops": tflops,
        "sdpa_tflops": sdpa_tflops, "ratio_to_sdpa": tflops / sdpa_tflops, "max_err": err, "timing": how})
    print(f"\nasync {shape} S={S}: {tflops:.0f} TFLOP/s, SDPA {sdpa_tflops:.0f}, ratio {tflops / sdpa_tflops:.2f}")


# ------------------------------------------------------------------------ other head dims and groups

@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (32, 8, 96), (32, 8, 80), (16, 8, 256), (32, 1, 128), (64, 4, 128)],
                         ids=["d128", "d96", "d80", "d256", "mqa32", "g16"])
def test_bench_decode_shapes(benchmark, hq, hkv, d, S=8192):
    """Decode at the head dims and query groups real families use (padded lanes for 80 / 96; head groups of 8
    for multi-query and 16 per KV head), beside SDPA on the same shapes; d128 is the reference shape."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, hq, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(S, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(S, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(1, hq, d, device=dev, dtype=torch.bfloat16)
    lens = torch.full((1,), S, device=dev, dtype=torch.int32)
    ws = torch.empty(ad.workspace_requirement(1, hq, hkv, d, S).bytes, device=dev, dtype=torch.uint8)
    args = [nb(q), nb(k), nb(v), cuda.as_cuda_array(lens, sync=False), nb(out), nb(ws)]
    ms, how = measure(benchmark, lambda: ad.launch(*args, stream=as_stream(torch.cuda.current_stream())), reps=20)
    kt, vt = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (k, v))
    sdpa = sdpa_ms(q.unsqueeze(2), kt, vt, False, reps=20)
    kv_bytes = 2 * S * hkv * d * 2
    benchmark.extra_info.update({
        "S": S, "heads": f"{hq}q/{hkv}kv", "head_dim": d, "us": ms * 1e3, "gbps_kv": kv_bytes / (ms * 1e-3) / 1e9,
        "sdpa_us": sdpa * 1e3, "sdpa_gbps_kv": kv_bytes / (sdpa * 1e-3) / 1e9, "ratio_to_sdpa": sdpa / ms,
        "timing": how})


@pytest.mark.parametrize("d", [128, 96, 80, 256])
def test_bench_prefill_shapes(benchmark, d, S=2048, hq=32, hkv=8):
    """Prefill at other head dims on the route ``choose_route`` takes (tensor cores up to 128, materialized at
    256), beside SDPA."""
    route = ap.choose_route(S, hq, hkv, d)
    q, k, v, out, req, ws = prefill_inputs(S, hq, hkv, d, route)
    args = [nb(q), nb(k), nb(v), nb(out), None if ws is None else nb(ws)]
    ms, how = measure(benchmark, lambda: ap.launch(*args, route=route, stream=as_stream(torch.cuda.current_stream())),
                      reps=3, rounds=3)
    qt, kt, vt = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (q, k, v))
    sdpa = sdpa_ms(qt, kt, vt, True, reps=3)
    flops = ap.flops(S, hq, d)
    benchmark.extra_info.update({
        "S": S, "route": route, "heads": f"{hq}q/{hkv}kv", "head_dim": d, "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12, "sdpa_ms": sdpa, "sdpa_tflops": flops / (sdpa * 1e-3) / 1e12,
        "ratio_to_sdpa": sdpa / ms, "timing": how})
