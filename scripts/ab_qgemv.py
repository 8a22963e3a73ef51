"""Variants of the tensor-core quantized GEMV side by side, 1x4096 . [14336, 4096]: each module named in argv[2]
(comma-separated, under vmmstream.kernels: copies of ``qgemv_mma.py`` with one change each) timed three times,
MXFP4 full and compute side (all blocks on the same 16 rows, as in ``diag_qgemv.py``), int4 full.

    python scripts/ab_qgemv.py OUT.json qgemv_mma,qgemv_mma_variant
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from test_bench_dense_kernels import capture, device_seconds, nb  # noqa: E402

from vmmstream.kernels import mma_helpers as mh, qgemv  # noqa: E402
from vmmstream.kernels.quant import quantize_int4, quantize_mxfp4  # noqa: E402

H, I = 4096, 14336


def main(out, modules):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((I, H)) * 0.02).astype(np.float32)
    x = nb(torch.randn(1, H, device="cuda", dtype=torch.bfloat16))
    y = nb(torch.empty(1, I, device="cuda", dtype=torch.bfloat16))
    src = torch.zeros(16 * 1024 * 1024, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    t = device_seconds(capture(lambda s: dst.copy_(src)))
    print(f"copy 32 MiB {t * 1e6:.2f} us", flush=True)
    rows = []
    for kind, qw in (("mxfp4", quantize_mxfp4(w)), ("int4", quantize_int4(w))):
        kid = qgemv.INT4 if kind == "int4" else qgemv.MXFP4
        parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
        zr = parts[2] if kind == "int4" else parts[1]
        flat = [a.reshape(a.shape[0] * a.shape[1]) for a in (parts[0], parts[1], zr)]
        for mode in ("full", "compute") if kind == "mxfp4" else ("full",):
            for m in modules:
                kern = importlib.import_module(f"vmmstream.kernels.{m}").make(kid, False, 1)
                n_rows = 16 if mode == "compute" else I

                def fn(s):
                    kern[(I // 16, 1), mh.THREADS, s](*flat, x, x, y, n_rows, 1, H)
                ts = [device_seconds(capture(fn)) * 1e6 for _ in range(3)]
                print(f"{kind} {mode:8s} {m:14s} " + " ".join(f"{t:.2f}" for t in ts) + " us", flush=True)
                rows.append(dict(kind=kind, mode=mode, module=m, us=ts))
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
