"""Dense decoder kernels on the GPU: time, bytes, GB/s, and the ratio to the bar each one must meet.

- GEMV 1×4096 · 4096×14336 (W [14336, 4096]) vs ``torch.nn.functional.linear`` in bf16:
  ratio = ours / torch time, bar ≤ 1.15 (torch: ~32.7 µs, ~3.6 TB/s on the H200).
- RMSNorm (plain and fused with the residual) and RoPE at hidden 4096 vs the device copy bandwidth
  measured in the same run (torch ``copy_`` of 256 MiB; a Numba 16-byte copy kernel is reported too):
  ratio = ours / copy GB/s, bar ≥ 0.70.
- SiLU·mul, prefill GEMM, argmax and sampling: figures only.

Timing (I11): every measured op is captured ``N_PER_GRAPH`` times into one CUDA graph (torch.cuda.graph,
global capture mode — the decode path itself), and CUDA events around a replay give device time per
launch. A Numba launch costs ~40 µs of host time, more than a 33 µs GEMV, so timing eager launches
would measure the host; the graph removes that for ours and torch's alike. Working sets are larger
than the 50 MB L2, so replays do not hit in cache. Marked ``gpu``: deselect with ``-m "not gpu"``.
"""

from __future__ import annotations

import numpy as np
import pytest

from vmmstream.kernels.ops import elementwise
from vmmstream.kernels.matmul.dense import gemm, gemv
from vmmstream.kernels.ops import norm, rope, sampling

pytestmark = pytest.mark.gpu

H, I, V, HQ, HKV, D = 4096, 14336, 32000, 32, 8, 128
N_PER_GRAPH = 20
ROUNDS = 10
GEMV_BAR, BW_BAR = 1.15, 0.70


# ------------------------------------------------------------------------------------------ timing

def _torch():
    import torch
    if not torch.cuda.is_available():
        pytest.fail("benchmarks need a CUDA device", pytrace=False)
    return torch


def nb(t):
    """A torch tensor as a Numba device array (zero copy); bf16 tensors as their uint16 bits."""
    from numba import cuda
    torch = _torch()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = cuda.as_cuda_array(t.detach(), sync=False)
    return a.view(np.uint16) if a.dtype == np.int16 else a


def capture(fn, n=N_PER_GRAPH):
    """fn(stream) launched n times into one CUDA graph (warmed up first, outside the capture)."""
    from numba import cuda
    torch = _torch()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn(cuda.external_stream(side.cuda_stream))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        for _ in range(n):
            fn(s)
    torch.cuda.synchronize()
    return g


def device_seconds(g, benchmark=None, n=N_PER_GRAPH, rounds=ROUNDS):
    """Median device seconds per launch over ``rounds`` graph replays, timed by CUDA events."""
    torch = _torch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []

    def once():
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / n)

    g.replay()
    torch.cuda.synchronize()
    if benchmark is None:
        for _ in range(rounds):
            once()
    else:
        benchmark.pedantic(once, rounds=rounds, iterations=1, warmup_rounds=1)
    return float(np.median(times))


def interleaved_seconds(graphs, rounds):
    """{name: (graph, launches)} -> {name: [device seconds per launch, one per round]}: every graph replayed
    once first, then ``rounds`` rounds of one replay each in turn, timed by CUDA events (drift in clocks or
    temperature falls on all of them alike)."""
    torch = _torch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {k: [] for k in graphs}
    for g, _ in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for key, (g, n) in graphs.items():
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) * 1e-3 / n)
    return times


@pytest.fixture(scope="module")
def copy_ceiling():
    """Device copy bandwidth of this run (read + write counted): torch copy_, and a Numba copy kernel."""
    torch = _torch()
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t_torch = device_seconds(capture(lambda s: dst.copy_(src), n=5), n=5)
    # a pure 16-byte copy in Numba: the gather kernel with table row i -> out row i, 8 KiB per row
    from vmmstream.kernels.ops import embedding
    s16, d16 = nb(src.view(torch.bfloat16)), nb(dst.view(torch.bfloat16))
    rows = s16.shape[0] // 4096
    table, out = s16.reshape(rows, 4096), d16.reshape(rows, 4096)
    ids = nb(torch.arange(rows, dtype=torch.int32, device="cuda"))
    t_nb = device_seconds(capture(lambda s: embedding.embedding(table, ids, out, stream=s), n=5), n=5)
    return {"torch_gbps": 2 * n / t_torch / 1e9, "numba_gbps": 2 * n / t_nb / 1e9}


def record(benchmark, *, seconds, nbytes, ceiling_gbps=None, ratio=None, bar=None, op="le", **more):
    gbps = nbytes / seconds / 1e9
    info = {"device_us": seconds * 1e6, "bytes": nbytes, "GB/s": gbps}
    if ceiling_gbps is not None:
        info["ceiling GB/s"] = ceiling_gbps
    if ratio is not None:
        info["ratio"] = ratio
        if bar is not None:      # some kernels have no bar of their own: report, don't judge
            info["bar"] = bar
            info["meets_bar"] = bool(ratio <= bar if op == "le" else ratio >= bar)
    info.update(more)
    benchmark.extra_info.update(info)
    return info


# ------------------------------------------------------------------------------------------- GEMV

GEMV_CONFIGS = {
    "auto": None,
    "rpb2": gemv.GemvConfig(rows_per_block=2),
    "rpb4-t256": gemv.GemvConfig(threads=256, rows_per_block=4),
    "rpb8": gemv.GemvConfig(rows_per_block=8),
}


@pytest.fixture(scope="module")
def gemv_data():
    torch = _torch()
    torch.manual_seed(0)
    w = torch.randn(I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    t_torch = device_seconds(capture(lambda s: torch.nn.functional.linear(x, w)))
    return w, x, t_torch


@pytest.mark.parametrize("cfg", list(GEMV_CONFIGS))
def test_bench_gemv_decode_vs_torch(benchmark, gemv_data, copy_ceiling, cfg):
    torch = _torch()
    w, x, t_torch = gemv_data
    out = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    dw, dx, dout = nb(w), nb(x), nb(out)
    g = capture(lambda s: gemv.gemv(dw, dx, dout, stream=s, config=GEMV_CONFIGS[cfg]))
    t = device_seconds(g, benchmark)
    ref = torch.nn.functional.linear(x, w).float()
    err = (out.float() - ref).abs().max().item()
    info = record(benchmark, seconds=t, nbytes=gemv.bytes_moved(I, H), ceiling_gbps=copy_ceiling["torch_gbps"],
                  ratio=t / t_torch, bar=GEMV_BAR, op="le", torch_us=t_torch * 1e6,
                  torch_GBps=gemv.bytes_moved(I, H) / t_torch / 1e9, config=cfg, max_abs_err_vs_torch=err)
    assert err < 0.05, f"GEMV disagrees with torch by {err}"
    print(f"\ngemv[{cfg}] {info['device_us']:.1f} us ({info['GB/s']:.0f} GB/s), torch {t_torch * 1e6:.1f} us, "
          f"ratio {info['ratio']:.3f} (bar <= {GEMV_BAR})")


@pytest.mark.parametrize("b,route", [(1, "simt"), (8, "simt"), (8, "mma"), (16, "simt"), (16, "mma"),
                                     (32, "simt"), (32, "mma")])
def test_bench_gemv_batch(benchmark, copy_ceiling, monkeypatch, b, route):
    """A decode step of B sequences through the 4096 x 14336 projection: the SIMT batch tiles against the
    tensor-core kernel (``gemv_mma``), W bytes ÷ time beside the copy ceiling and torch's linear of the same B."""
    torch = _torch()
    monkeypatch.setattr(gemv, "MMA_BATCH", route == "mma")
    torch.manual_seed(0)
    w = torch.randn(I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(b, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(b, I, device="cuda", dtype=torch.bfloat16)
    t_torch = device_seconds(capture(lambda s: torch.nn.functional.linear(x, w)))
    dw, dx, dout = nb(w), nb(x), nb(out)
    t = device_seconds(capture(lambda s: gemv.gemv(dw, dx, dout, stream=s)), benchmark)
    err = (out.float() - torch.nn.functional.linear(x, w).float()).abs().max().item()
    info = record(benchmark, seconds=t, nbytes=2 * I * H + 2 * b * (H + I), ceiling_gbps=copy_ceiling["torch_gbps"],
                  ratio=t / t_torch, op="report", torch_us=t_torch * 1e6, batch=b, route=route,
                  tflops=2 * b * I * H / t / 1e12, max_abs_err_vs_torch=err)
    assert err < 0.05, f"batched GEMV disagrees with torch by {err}"
    print(f"\ngemv B={b} {route}: {info['device_us']:.1f} us ({info['GB/s']:.0f} GB/s of W), torch {t_torch * 1e6:.1f} us")


def test_bench_gemv_down_proj(benchmark, copy_ceiling):
    torch = _torch()
    w = torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, I, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
    t_torch = device_seconds(capture(lambda s: torch.nn.functional.linear(x, w)))
    dw, dx, dout = nb(w), nb(x), nb(out)
    t = device_seconds(capture(lambda s: gemv.gemv(dw, dx, dout, stream=s)), benchmark)
    record(benchmark, seconds=t, nbytes=gemv.bytes_moved(H, I), ceiling_gbps=copy_ceiling["torch_gbps"],
           ratio=t / t_torch, bar=GEMV_BAR, op="le", torch_us=t_torch * 1e6)


# ------------------------------------------------------------------------------ bandwidth-bound ops

T_BW = 16384    # rows at hidden 4096: 128 MiB per bf16 activation, well past the L2


@pytest.mark.parametrize("fused", [False, True])
def test_bench_rmsnorm(benchmark, copy_ceiling, fused):
    torch = _torch()
    x = torch.randn(T_BW, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(T_BW, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    dx, dr, dw, dout = nb(x), nb(r), nb(w), nb(out)
    t = device_seconds(capture(lambda s: norm.rmsnorm(dx, dw, dout, eps=1e-5, residual=dr if fused else None,
                                                      stream=s)), benchmark)
    nbytes = norm.bytes_moved(T_BW, H, fused=fused)
    ceil = copy_ceiling["torch_gbps"]
    record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=ceil, ratio=nbytes / t / 1e9 / ceil, bar=BW_BAR,
           op="ge", numba_copy_GBps=copy_ceiling["numba_gbps"], tokens=T_BW)


def test_bench_rope(benchmark, copy_ceiling):
    torch = _torch()
    q = torch.randn(T_BW, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T_BW, HKV, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(T_BW, device="cuda", dtype=torch.int32)
    inv = torch.from_numpy(rope.rope_inv_freq(D, 500000.0)).cuda()
    dq, dk, dpos, dinv = nb(q), nb(k), nb(pos), nb(inv)
    t = device_seconds(capture(lambda s: rope.apply_rope(dq, dk, dpos, dinv, stream=s)), benchmark)
    nbytes = rope.bytes_moved(T_BW, HQ, HKV, D)
    ceil = copy_ceiling["torch_gbps"]
    record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=ceil, ratio=nbytes / t / 1e9 / ceil, bar=BW_BAR,
           op="ge", numba_copy_GBps=copy_ceiling["numba_gbps"], tokens=T_BW)


def test_bench_silu_mul(benchmark, copy_ceiling):
    torch = _torch()
    t_rows = 2048
    gu = torch.randn(t_rows, 2 * I, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(t_rows, I, device="cuda", dtype=torch.bfloat16)
    dgu, dout = nb(gu), nb(out)
    t = device_seconds(capture(lambda s: elementwise.silu_mul_fused(dgu, dout, stream=s)), benchmark)
    nbytes = elementwise.bytes_moved(t_rows, I)
    ceil = copy_ceiling["torch_gbps"]
    record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=ceil, ratio=nbytes / t / 1e9 / ceil)


# ------------------------------------------------------------------------------- prefill and decode

@pytest.mark.parametrize("route,m", [("cublaslt", 16), ("cublaslt", 512), ("cublaslt", 4096), ("mma", 16),
                                     ("mma", 512), ("mma", 4096), ("simt", 16), ("simt", 512)])
def test_bench_gemm_prefill(benchmark, route, m):
    """Prefill GEMM x[M, 4096] · W[14336, 4096]ᵀ: TFLOP/s of the tensor-core and SIMT routes, and torch.matmul
    (cuBLAS) on the same operands in the same run. (SIMT at M = 4096 would take seconds; M = 512 states its rate.)"""
    torch = _torch()
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    out = torch.empty(m, I, device="cuda", dtype=torch.bfloat16)
    t_torch = device_seconds(capture(lambda s: torch.matmul(x, w.t(), out=out), n=3), n=3, rounds=5)
    dx, dw, dout = nb(x), nb(w), nb(out)
    from vmmstream.kernels.matmul.dense import cublaslt
    ws = nb(torch.empty(cublaslt.WORKSPACE, device="cuda", dtype=torch.uint8)) if route == "cublaslt" else None
    t = device_seconds(capture(lambda s: gemm.gemm(dx, dw, dout, stream=s, route=route, workspace=ws), n=3),
                       benchmark, n=3, rounds=5)
    fl = gemm.flops(m, I, H)
    nbytes = gemm.bytes_moved(m, I, H)
    record(benchmark, seconds=t, nbytes=nbytes, TFLOPs=fl / t / 1e12, torch_TFLOPs=fl / t_torch / 1e12,
           GBps=nbytes / t / 1e9, ratio_time_vs_torch=t / t_torch)


@pytest.mark.parametrize("fmt,route,m", [("mxfp4", "mma", 512), ("mxfp4", "mma", 4096), ("int4", "mma", 512),
                                          ("mxfp4", "in_register", 512)])
def test_bench_qgemm_prefill(benchmark, fmt, route, m):
    """Quantized prefill GEMM x[M, 4096] · W[14336, 4096]ᵀ, W int4 / MXFP4: TFLOP/s beside torch.matmul on the
    bf16 weight in the same run."""
    torch = _torch()
    from vmmstream.kernels.matmul.quant import gemm as qgemm
    from vmmstream.kernels.matmul.quant.formats import quantize_int4, quantize_mxfp4
    rng = np.random.default_rng(0)
    wf = (rng.standard_normal((I, H), dtype=np.float32) * np.float32(0.02))
    qw = quantize_int4(wf) if fmt == "int4" else quantize_mxfp4(wf)
    parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    w = torch.from_numpy(wf).to("cuda", torch.bfloat16)
    out = torch.empty(m, I, device="cuda", dtype=torch.bfloat16)
    t_torch = device_seconds(capture(lambda s: torch.matmul(x, w.t(), out=out), n=3), n=3, rounds=5)
    dx, dout = nb(x), nb(out)
    launch = qgemm.qgemm_int4 if fmt == "int4" else qgemm.qgemm_mxfp4
    t = device_seconds(capture(lambda s: launch(*parts, dx, dout, route=route, stream=s), n=3), benchmark, n=3,
                       rounds=5)
    fl = 2 * m * I * H
    record(benchmark, seconds=t, nbytes=qgemm.bytes_moved(m, I, H, fmt, route), TFLOPs=fl / t / 1e12,
           torch_bf16_TFLOPs=fl / t_torch / 1e12, ratio_time_vs_torch=t / t_torch)


@pytest.mark.parametrize("route", ["greedy", "sample"])
def test_bench_token_selection(benchmark, route):
    torch = _torch()
    from numba import cuda
    logits = torch.randn(1, V, device="cuda", dtype=torch.float32) * 3
    out = torch.empty(1, device="cuda", dtype=torch.int32)
    dl, dout = nb(logits), nb(out)
    ws = cuda.device_array(sampling.workspace_requirement(1, V).bytes, np.uint8)
    st = cuda.to_device(sampling.make_rng_state(1))
    if route == "greedy":
        fn = lambda s: sampling.argmax(dl, dout, workspace=ws, stream=s)   # noqa: E731
    else:
        fn = lambda s: sampling.sample(dl, dout, st, temperature=0.8, top_k=50, top_p=0.9, stream=s)  # noqa: E731
    t = device_seconds(capture(fn), benchmark)
    record(benchmark, seconds=t, nbytes=sampling.bytes_moved(1, V, route=route, top_k=50, top_p=0.9))
