"""Sweep the quantized GEMVs' launch shape on a GPU: threads per block and rows per warp, int4 and MXFP4,
and the tensor-core route at 1, 2, 4 and 8 groups loaded at once, 1×4096 · [14336, 4096]. Each setting is timed as 20 launches captured in one CUDA graph, CUDA events around
a replay (median of 5, the benchmarks' helpers); torch's tinygemm is timed the same way. Prints one line per
setting and writes JSON to argv[1].

    python scripts/sweep_qgemv.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from test_bench_dense_kernels import capture, device_seconds, nb  # noqa: E402

from vmmstream.kernels import qgemv  # noqa: E402
from vmmstream.kernels.quant import quantize_int4, quantize_mxfp4  # noqa: E402

H, I = 4096, 14336
SHAPES = [(128, 4), (128, 2), (256, 2), (256, 4), (512, 2), (128, 8), (64, 4)]


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
        for steps in (1, 2, 4, 8):               # the tensor-core route (kernels/qgemv_mma.py), groups loaded at once
            cfg = qgemv.QgemvConfig(route="mma", mma_steps=steps)
            t = device_seconds(capture(lambda s: fn(*parts, nb(x), nb(y), stream=s, config=cfg)))
            rows.append(dict(kind=kind, route="mma", mma_steps=steps, us=t * 1e6, gbps=nbytes / t / 1e9,
                             tinygemm_us=t_tg * 1e6))
            print(f"{kind:5s} route mma, {steps} groups at once: {t * 1e6:6.1f} us {nbytes / t / 1e9:6.0f} GB/s"
                  f"  (tinygemm ratio {t / t_tg:.2f})", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
