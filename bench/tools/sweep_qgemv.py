"""Sweep the quantized GEMVs' launch shape on a GPU: threads per block and rows per warp, int4 and MXFP4,
and the tensor-core route with and without loading one group ahead, with W through a cp.async ring, and
its memory side alone (no decode, no mma), 1×4096 · [14336, 4096]. Each setting is timed as 20 launches captured in one CUDA graph, CUDA events around
a replay (median of 5, the benchmarks' helpers); torch's tinygemm is timed the same way. Prints one line per
setting and writes JSON to argv[1].

    python bench/tools/sweep_qgemv.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_bench_dense_kernels import capture, device_seconds, nb  # noqa: E402

from vmmstream.kernels.matmul.quant import gemv as qgemv
from vmmstream.kernels.matmul.quant import gemv_mma as qgemv_mma  # noqa: E402
from vmmstream.kernels.matmul.quant.formats import quantize_int4, quantize_mxfp4  # noqa: E402

H, I = 4096, 14336
SHAPES = [(128, 4), (128, 2), (256, 2), (256, 4), (512, 2), (128, 8), (64, 4)]


def context(nbytes):
    """What memory-bound kernels reach at this byte count in the same run: torch copy_ of the same bytes
    (read + write counted), a Numba kernel that only reads them (16-byte loads, 4 in flight per thread,
    grid-stride), and the bf16 GEMV of ``kernels/matmul/dense/gemv.py`` over a [3808, 4096] weight (31.2 MB)."""
    from numba import cuda, uint32

    from vmmstream.kernels.matmul.dense import gemv
    from vmmstream.kernels.base.launch import ld8_ro
    rows = []
    src = torch.zeros(nbytes // 2, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    t = device_seconds(capture(lambda s: dst.copy_(src)))
    rows.append(dict(kind="copy", us=t * 1e6, gbps=nbytes / t / 1e9))

    @cuda.jit
    def read_only(a, out):
        n8 = a.shape[0] // 8
        stride = cuda.gridDim.x * cuda.blockDim.x
        i = cuda.grid(1)
        acc = uint32(0)
        while i + 3 * stride < n8:
            w0 = ld8_ro(a, 8 * i)
            w1 = ld8_ro(a, 8 * (i + stride))
            w2 = ld8_ro(a, 8 * (i + 2 * stride))
            w3 = ld8_ro(a, 8 * (i + 3 * stride))
            acc ^= w0[0] ^ w1[1] ^ w2[2] ^ w3[3] ^ w0[3] ^ w1[2] ^ w2[1] ^ w3[0]
            i += 4 * stride
        while i < n8:
            w0 = ld8_ro(a, 8 * i)
            acc ^= w0[0] ^ w0[1] ^ w0[2] ^ w0[3]
            i += stride
        if acc == uint32(0x9E3779B9):           # never true for these bytes; keeps the loads
            out[0] = acc

    flag = cuda.device_array(1, np.uint32)
    a = nb(torch.randint(0, 1 << 15, (nbytes // 2,), dtype=torch.int16, device="cuda"))
    for blocks in (132 * 4, 132 * 8, 132 * 16):
        t = device_seconds(capture(lambda s: read_only[blocks, 256, s](a, flag)))
        rows.append(dict(kind="read_only", blocks=blocks, us=t * 1e6, gbps=nbytes / t / 1e9))
    n = nbytes // (2 * H)
    w = nb(torch.randn(n, H, device="cuda", dtype=torch.bfloat16))
    x = nb(torch.randn(1, H, device="cuda", dtype=torch.bfloat16))
    y = nb(torch.empty(1, n, device="cuda", dtype=torch.bfloat16))
    t = device_seconds(capture(lambda s: gemv.gemv(w, x, y, stream=s)))
    rows.append(dict(kind="bf16_gemv", n=n, us=t * 1e6, gbps=2 * n * H / t / 1e9))
    for r in rows:
        print(f"context {r['kind']:10s} {r.get('blocks', '')!s:5s} {r['us']:6.1f} us {r['gbps']:6.0f} GB/s", flush=True)
    return rows


def main(out):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((I, H)) * 0.02).astype(np.float32)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    rows = []
    wp = torch._convert_weight_to_int4pack(torch.from_numpy(quantize_int4(w)[0]).cuda(), 8)
    sz = torch.randn(H // 128, I, 2, device="cuda", dtype=torch.bfloat16)
    t_tg = device_seconds(capture(lambda s: torch._weight_int4pack_mm(x, wp, 128, sz)))
    print(f"tinygemm {t_tg * 1e6:.1f} us", flush=True)
    for kind, fn, qw in (("int4", qgemv.qgemv_int4, quantize_int4(w)), ("mxfp4", qgemv.qgemv_mxfp4, quantize_mxfp4(w))):
        parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
        nbytes = sum(a.nbytes for a in qw) + 2 * H + 2 * I
        for threads, rpw in SHAPES:
            cfg = qgemv.QgemvConfig(threads=threads, rows_per_warp=rpw, route="simt")
            t = device_seconds(capture(lambda s: fn(*parts, nb(x), nb(y), stream=s, config=cfg)))
            rows.append(dict(kind=kind, threads=threads, rows_per_warp=rpw, us=t * 1e6, gbps=nbytes / t / 1e9,
                             tinygemm_us=t_tg * 1e6))
            print(f"{kind:5s} threads {threads:3d} rows/warp {rpw}: {t * 1e6:6.1f} us {nbytes / t / 1e9:6.0f} GB/s"
                  f"  (tinygemm ratio {t / t_tg:.2f})", flush=True)
        for prefetch, l2, probe, stages in ((True, 0, False, 0), (False, 0, False, 0), (True, 0, True, 0),
                                            (True, 0, False, 3), (True, 0, False, 4), (True, 0, False, 5),
                                            (True, 0, True, 4)):
            # the tensor-core route (kernels/matmul/quant/gemv_mma.py): with and without the one-group-ahead loads, W through
            # a cp.async ring, and the probe (the same loads and loop, no decode, no mma)
            kid = qgemv.INT4 if kind == "int4" else qgemv.MXFP4
            args = (parts[0], parts[1], parts[2] if kind == "int4" else None, nb(x), nb(y), None)
            t = device_seconds(capture(lambda s: qgemv_mma.launch(kid, *args, s, prefetch, l2, probe, stages)))
            rows.append(dict(kind=kind, route="mma", mma_prefetch=prefetch, mma_l2_ahead=l2, probe=probe, mma_stages=stages,
                             us=t * 1e6, gbps=nbytes / t / 1e9, tinygemm_us=t_tg * 1e6))
            print(f"{kind:5s} route mma, prefetch {prefetch}, L2 ahead {l2}, cp.async stages {stages}"
                  f"{', PROBE (no math)' if probe else ''}: "
                  f"{t * 1e6:6.1f} us {nbytes / t / 1e9:6.0f} GB/s  (tinygemm ratio {t / t_tg:.2f})", flush=True)
    rows += context(nbytes)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
