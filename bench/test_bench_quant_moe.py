"""Quantized GEMVs and the MoE layer on the GPU, against the peers measured in the same run.

- int4 GEMV 1×4096 · [14336, 4096] (group 128) vs torch's tinygemm ``_weight_int4pack_mm`` (group 128, inner
  k-tiles 8): ratio = ours / torch time, bar ≤ 1.0 (GPU.md: 18.6 µs).
- MXFP4 GEMV, same shape: GB/s of the bytes it reads ÷ the device copy bandwidth of this run, bar ≥ 0.70.
- MoE decode layer, 8 experts top-2, hidden 4096, expert 14336, bf16: router GEMV + top-k + grouping + expert
  FFN + combine vs a torch loop over the routed experts (router linear, softmax/top-k, per-expert
  ``F.linear`` gate/up/down, weighted sum): ratio = ours / torch time, bar ≤ 0.70. The torch loop reads the
  routing on the host (``.tolist()``), as a per-expert loop does, so it is timed eagerly with CUDA events;
  ours is timed as a captured graph. Both move the same expert bytes (2 experts × 3 × 4096 × 14336 × 2 B).

Timing and helpers as in test_bench_dense_kernels.py (CUDA graph of N calls, CUDA events, median).
"""

from __future__ import annotations

import numpy as np
import pytest

from test_bench_dense_kernels import _torch, capture, copy_ceiling, device_seconds, nb, record  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

H, I, E, K = 4096, 14336, 8, 2
INT4_BAR, MX_BAR, MOE_BAR = 1.0, 0.70, 0.70
# (route, prefetch, cp.async stages, row tiles per block): the scalar route and the tensor-core route at each
# depth; "mma" the default, blocks of ``auto_row_tiles`` 16-row tiles (7 at N 14336 on 132 SMs) sharing one
# staging of x, "mma-rt1" one tile per block
_R = [("simt", True, 0, 1), ("mma", True, 0, 0), ("mma", True, 0, 1), ("mma", False, 0, 1), ("mma", True, 3, 1),
      ("mma", True, 4, 1), ("mma", True, 5, 1)]
_IDS = ["simt", "mma", "mma-rt1", "mma-noprefetch", "mma-cpasync3", "mma-cpasync4", "mma-cpasync5"]
ROUTES = pytest.mark.parametrize("route,prefetch,stages,row_tiles", _R, ids=_IDS)
# MXFP4 at batch 1: the default ("auto": the int8 tensor-core route, kernels/matmul/quant/gemv_imma.py, the bar's figure),
# the bf16 routes above, and the opt-in f16 tensor-core route (kernels/matmul/quant/gemv_mx16.py)
MX_ROUTES = pytest.mark.parametrize("route,prefetch,stages,row_tiles",
                                    [("auto", True, 0, 0)] + _R + [("mx16", True, 0, 1)],
                                    ids=["default"] + _IDS + ["mx16"])


def _quantized(kind, seed=0):
    from vmmstream.kernels.matmul.quant.formats import quantize_int4, quantize_mxfp4
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((I, H)) * 0.02).astype(np.float32)
    return w, (quantize_int4(w) if kind == "int4" else quantize_mxfp4(w))


@ROUTES
def test_bench_qgemv_int4_vs_tinygemm(benchmark, copy_ceiling, route, prefetch, stages, row_tiles):
    torch = _torch()
    from vmmstream.kernels.matmul.quant import gemv as qgemv
    _, qw = _quantized("int4")
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    parts = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in qw]
    dparts = [nb(p) for p in parts]
    cfg = qgemv.QgemvConfig(route=route, mma_prefetch=prefetch, mma_stages=stages, mma_row_tiles=row_tiles)
    t = device_seconds(capture(lambda s: qgemv.qgemv_int4(*dparts, nb(x), nb(out), stream=s, config=cfg)), benchmark)
    # tinygemm: the same nibbles repacked its way, bf16 scale-and-zero [K/128, N, 2]
    wp = torch._convert_weight_to_int4pack(parts[0], 8)
    sz = torch.randn(H // 128, I, 2, device="cuda", dtype=torch.bfloat16)
    t_tg = device_seconds(capture(lambda s: torch._weight_int4pack_mm(x, wp, 128, sz)))
    nbytes = qgemv.bytes_moved(I, H, kind="int4")
    info = record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=copy_ceiling["torch_gbps"], ratio=t / t_tg,
                  bar=INT4_BAR, op="le", tinygemm_us=t_tg * 1e6)
    benchmark.extra_info.update(route=route, mma_prefetch=prefetch, mma_stages=stages, mma_row_tiles=row_tiles)
    print(f"\nqgemv int4 ({route}, row tiles {row_tiles or 'auto'}) {info['device_us']:.1f} us vs tinygemm "
          f"{t_tg * 1e6:.1f} us: ratio {t / t_tg:.3f}")


@MX_ROUTES
def test_bench_qgemv_mxfp4_bandwidth(benchmark, copy_ceiling, route, prefetch, stages, row_tiles):
    _mxfp4_bandwidth(benchmark, copy_ceiling, route, prefetch, stages, row_tiles, pdl=False)


@pytest.mark.parametrize("route", ["auto", "mma"], ids=["default", "mma"])
def test_bench_qgemv_mxfp4_bandwidth_pdl(benchmark, copy_ceiling, route):
    """The default route (as the decode launches it) and the bf16 mma route with programmatic dependent launch:
    each of the graph's 20 GEMVs loads its first groups of W while the one before it finishes. A chained figure
    (the GEMVs follow one another, as gate and up projections do), not the single-launch one above."""
    _mxfp4_bandwidth(benchmark, copy_ceiling, route, True, 0, 0, pdl=True)


def test_bench_qgemv_mxfp4_bandwidth_early_y(benchmark, copy_ceiling):
    """The mma route's batch-1 loop with ``mma_early_y``: two groups of W in flight from the start (a plain
    launch, comparable with the single-launch figures above)."""
    _mxfp4_bandwidth(benchmark, copy_ceiling, "mma", True, 0, 0, pdl=False, early_y=True)


def test_bench_qgemv_mxfp4_bandwidth_one_chain(benchmark, copy_ceiling):
    """The default's blocks with the loop of 2026-12-05: one mma dependency chain per group and x staged after
    W's first loads (``mma_split=False, mma_x_first=False``), for the gain of the two in the same run."""
    _mxfp4_bandwidth(benchmark, copy_ceiling, "mma", True, 0, 0, pdl=False, split=False, x_first=False)


@pytest.mark.parametrize("batch", [2, 4, 8])
def test_bench_qgemv_mxfp4_batch(benchmark, copy_ceiling, batch):
    """MXFP4 GEMV at batch 2, 4 and 8, the default route (the bf16 mma route: one pass over W for up to 8
    columns of x), against torch ``F.linear`` on the dequantized bf16 weight at the same batch (4 times the
    bytes of W). No bar: GB/s of the bytes it reads ÷ the copy bandwidth of this run, and the time of batch 1
    (the default, int8 route) in the same run."""
    torch = _torch()
    from vmmstream.kernels.matmul.quant import gemv as qgemv, gemv_mma as qgemv_mma
    from vmmstream.kernels.matmul.quant.formats import dequantize_mxfp4
    _, qw = _quantized("mxfp4")
    dparts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
    x = torch.randn(batch, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, I, device="cuda", dtype=torch.bfloat16)
    t = device_seconds(capture(lambda s: qgemv.qgemv_mxfp4(*dparts, nb(x), nb(out), stream=s)), benchmark)
    out1 = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    t1 = device_seconds(capture(lambda s: qgemv.qgemv_mxfp4(*dparts, nb(x[:1]), nb(out1), stream=s)))
    wd = torch.from_numpy(dequantize_mxfp4(*qw)).to("cuda", torch.bfloat16)
    t_lin = device_seconds(capture(lambda s: torch.nn.functional.linear(x, wd)))
    nbytes = qgemv.bytes_moved(I, H, batch, kind="mxfp4", batch_tile=qgemv_mma.COLS)  # one pass per 8 columns
    ceil = copy_ceiling["torch_gbps"]
    info = record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=ceil, ratio=nbytes / t / 1e9 / ceil,
                  batch=batch, batch1_us=t1 * 1e6, torch_bf16_linear_us=t_lin * 1e6)
    print(f"\nqgemv mxfp4 batch {batch} (default route) {info['device_us']:.2f} us, {info['GB/s']:.0f} GB/s = "
          f"{info['ratio']:.3f} of copy; batch 1 {t1 * 1e6:.2f} us; torch F.linear bf16 {t_lin * 1e6:.2f} us")


@pytest.mark.parametrize("kind", ["int4", "mxfp4"])
@pytest.mark.parametrize("batch,col_tiles", [(16, 1), (16, 2), (32, 1), (32, 2), (32, 4)])
def test_bench_qgemv_batch_column_tiles(benchmark, copy_ceiling, kind, batch, col_tiles):
    """The mma route at batch 16 and 32 with 1, 2 or 4 column tiles of 8 per block (``mma_col_tiles``: each group
    of W decoded once for 8 · tiles columns instead of once per 8), beside torch ``F.linear`` on the dequantized
    bf16 weight at the same batch. Decides the default (1 until measured)."""
    torch = _torch()
    from vmmstream.kernels.matmul.quant import gemv as qgemv
    from vmmstream.kernels.matmul.quant.formats import dequantize_int4, dequantize_mxfp4
    _, qw = _quantized(kind)
    dparts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
    x = torch.randn(batch, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, I, device="cuda", dtype=torch.bfloat16)
    cfg = qgemv.QgemvConfig(route="mma", mma_col_tiles=col_tiles)
    fn = qgemv.qgemv_int4 if kind == "int4" else qgemv.qgemv_mxfp4
    t = device_seconds(capture(lambda s: fn(*dparts, nb(x), nb(out), stream=s, config=cfg)), benchmark)
    wd = torch.from_numpy((dequantize_int4 if kind == "int4" else dequantize_mxfp4)(*qw)).to("cuda", torch.bfloat16)
    t_lin = device_seconds(capture(lambda s: torch.nn.functional.linear(x, wd)))
    nbytes = qgemv.bytes_moved(I, H, 1, kind=kind)         # W once: what a step needs to read
    ceil = copy_ceiling["torch_gbps"]
    info = record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=ceil, ratio=nbytes / t / 1e9 / ceil,
                  kind=kind, batch=batch, col_tiles=col_tiles, torch_bf16_linear_us=t_lin * 1e6)
    print(f"\nqgemv {kind} batch {batch}, {col_tiles} column tile(s) a block: {info['device_us']:.2f} us "
          f"({info['ratio']:.3f} of copy for W once); torch F.linear bf16 {t_lin * 1e6:.2f} us")


def _mxfp4_bandwidth(benchmark, copy_ceiling, route, prefetch, stages, row_tiles, pdl, early_y=False, split=None,
                     x_first=None):
    torch = _torch()
    from vmmstream.kernels.matmul.quant import gemv as qgemv
    _, qw = _quantized("mxfp4")
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    dparts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
    cfg = qgemv.QgemvConfig(route=route, mma_prefetch=prefetch, mma_stages=stages, mma_row_tiles=row_tiles,
                            pdl=pdl, mma_early_y=early_y, mma_split=split, mma_x_first=x_first)
    t = device_seconds(capture(lambda s: qgemv.qgemv_mxfp4(*dparts, nb(x), nb(out), stream=s, config=cfg)), benchmark)
    benchmark.extra_info.update(route=route, mma_prefetch=prefetch, mma_stages=stages, mma_row_tiles=row_tiles,
                                pdl=pdl, mma_early_y=early_y, mma_split=split, mma_x_first=x_first)
    nbytes = qgemv.bytes_moved(I, H, kind="mxfp4")
    ceil = copy_ceiling["torch_gbps"]
    # context, not the bar: a device copy of this GEMV's byte count (read + write counted, as the ceiling)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = device_seconds(capture(lambda s: dst.copy_(src)))
    info = record(benchmark, seconds=t, nbytes=nbytes, ceiling_gbps=ceil, ratio=nbytes / t / 1e9 / ceil,
                  bar=MX_BAR, op="ge", same_bytes_copy_GBps=nbytes / t_copy / 1e9, same_bytes_copy_us=t_copy * 1e6)
    print(f"\nqgemv mxfp4 ({route}, row tiles {row_tiles or 'auto'}{', pdl' if pdl else ''}"
          f"{', early_y' if early_y else ''}{', one chain, x after W' if split is False else ''}) "
          f"{info['device_us']:.2f} us, {info['GB/s']:.0f} GB/s = {info['ratio']:.3f} of copy (same bytes: "
          f"copy {t_copy * 1e6:.2f} us)")


def test_bench_moe_decode_layer_vs_torch_loop(benchmark):
    torch = _torch()
    F = torch.nn.functional
    from vmmstream.kernels.matmul.dense import gemv
    from vmmstream.kernels import moe
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=g)
    wr = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    wg = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    wu = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    wd = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    logits = torch.empty(1, E, device="cuda", dtype=torch.float32)
    ids = torch.empty(1, K, device="cuda", dtype=torch.int32)
    wts = torch.empty(1, K, device="cuda", dtype=torch.float32)
    y = torch.empty(1, K, H, device="cuda", dtype=torch.float32)
    out = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(moe.workspace_requirement(1, K, E, I).bytes, device="cuda", dtype=torch.uint8)
    a = {n: nb(v) for n, v in dict(x=x, wr=wr, wg=wg, wu=wu, wd=wd, logits=logits, ids=ids, wts=wts, y=y,
                                   out=out, ws=ws).items()}

    def ours(s):
        gemv.gemv(a["wr"], a["x"], a["logits"], stream=s)
        moe.router_topk(a["logits"], a["ids"], a["wts"], scoring="mixtral", stream=s)
        moe.group_by_expert(a["ids"], workspace=a["ws"], num_experts=E, stream=s)
        moe.expert_ffn(a["x"], a["wg"], a["wu"], a["wd"], a["y"], workspace=a["ws"], stream=s)
        moe.combine(a["y"], a["wts"], a["out"], stream=s)
    t = device_seconds(capture(ours), benchmark)

    def torch_loop():
        p = torch.softmax(F.linear(x, wr).float(), dim=-1)
        w, sel = torch.topk(p, K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        acc = torch.zeros(1, H, device="cuda", dtype=torch.float32)
        for j, e in enumerate(sel[0].tolist()):
            h = F.silu(F.linear(x, wg[e])) * F.linear(x, wu[e])
            acc += w[0, j] * F.linear(h, wd[e]).float()
        return acc.to(torch.bfloat16)
    ref = torch_loop()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        torch_loop()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    t_torch = float(np.median(times))
    err = (out.float() - ref.float()).abs().max().item()
    nbytes = K * 3 * H * I * 2
    info = record(benchmark, seconds=t, nbytes=nbytes, ratio=t / t_torch, bar=MOE_BAR, op="le",
                  torch_loop_us=t_torch * 1e6, max_abs_err_vs_torch=err)
    assert err < 0.05 * ref.float().abs().max().item() + 1e-3, f"MoE layer disagrees with the torch loop by {err}"
    print(f"\nmoe decode layer {info['device_us']:.1f} us ({info['GB/s']:.0f} GB/s) vs torch loop "
          f"{t_torch * 1e6:.1f} us: ratio {t / t_torch:.3f}")
