"""Row tiles per block for the batch-1 tensor-core quantized GEMV (``QgemvConfig.mma_row_tiles``), int4 and
MXFP4, at the decode shapes of an 8B Llama: each (N, K) timed at 1 tile per block and at ``auto_row_tiles``
(at N 14336 also 2, 3, 4 and 7), next to a device copy of the same byte count; every output is compared bit
for bit with the 1-tile one. CUDA graphs of 20 launches, CUDA events, median of the rounds.

    python bench/tools/sweep_row_tiles.py [int4,mxfp4]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_bench_dense_kernels import _torch, capture, device_seconds, nb  # noqa: E402

from vmmstream.kernels.matmul.quant import gemv as qgemv
from vmmstream.kernels.matmul.quant import gemv_mma as qgemv_mma  # noqa: E402
from vmmstream.kernels.matmul.quant.formats import quantize_int4, quantize_mxfp4  # noqa: E402

SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096), (1024, 4096)]


def main(kinds):
    torch = _torch()
    print(f"{torch.cuda.get_device_name()}, {qgemv_mma._sm_count()} SMs", flush=True)
    for kind in kinds:
        fn = qgemv.qgemv_int4 if kind == "int4" else qgemv.qgemv_mxfp4
        for n, k in SHAPES:
            w = (np.random.default_rng(0).standard_normal((n, k)) * 0.02).astype(np.float32)
            qw = quantize_int4(w) if kind == "int4" else quantize_mxfp4(w)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
            nbytes = sum(a.nbytes for a in qw) + 2 * k + 2 * n
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            t_copy = device_seconds(capture(lambda s: dst.copy_(src)))
            auto = qgemv_mma.auto_row_tiles(n)
            ref = None
            for rt in sorted({1, auto} | ({2, 3, 4, 7} if n == 14336 else set())):
                cfg = qgemv.QgemvConfig(route="mma", mma_row_tiles=rt)
                t = device_seconds(capture(lambda s: fn(*parts, nb(x), nb(out), stream=s, config=cfg)))
                got = out.cpu()
                ref = got if ref is None else ref
                same = bool(torch.equal(got, ref))
                print(f"{kind} N={n} K={k} row_tiles={rt}{' (auto)' if rt == auto else ''}: {t * 1e6:.2f} us, "
                      f"{nbytes / t / 1e9:.0f} GB/s; copy of the same bytes {t_copy * 1e6:.2f} us; "
                      f"bits equal to row_tiles=1: {same}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["int4", "mxfp4"])
