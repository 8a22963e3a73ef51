"""Variants of the tensor-core quantized GEMV (``qgemv_mma.make`` options) timed side by side in one process:
each a CUDA graph of 20 launches, CUDA events, the median of interleaved rounds, next to the copy ceiling and a
copy of the same byte count measured in the same run. Outputs of variants of one weight set are compared with
the first variant's (max abs difference).

    python scripts/variants_qgemv.py OUT.json 'NAME:{"row_tiles": 1}' 'NAME2:{"row_tiles": 1, "split": True}' ...

A spec is NAME:DICT, DICT a Python literal of ``make`` keyword arguments plus, consumed here, ``kind``
("mxfp4" | "int4", default mxfp4), ``k`` (default 4096; N is 14336), ``mode`` ("full" | "compute": every
block on the same 16 rows, the loads L1 hits) and ``route`` ("mma", the default, or "imma": MXFP4 on the integer
tensor cores, ``qgemv_imma.make``, whose only option is ``row_tiles``).
"""
from __future__ import annotations

import ast
import json
import os
import sys

import numpy as np
import torch
from numba import cuda

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from test_bench_dense_kernels import capture, interleaved_seconds, nb  # noqa: E402

from vmmstream.kernels import mma_helpers as mh, qgemv, qgemv_imma, qgemv_mma  # noqa: E402
from vmmstream.kernels.dtypes import bf16_to_f32  # noqa: E402
from vmmstream.kernels.quant import quantize_int4, quantize_mxfp4  # noqa: E402

N, H = 14336, 4096
ROUNDS = int(os.environ.get("VARIANT_ROUNDS", "9"))


def parse(spec):
    name, _, kw = spec.partition(":")
    kw = ast.literal_eval(kw) if kw else {}
    if not isinstance(kw, dict):
        raise SystemExit(f"{spec!r}: expected NAME:DICT")
    return name, kw


def main(out, specs):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, H)) * 0.02).astype(np.float32)
    xt = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    weights, graphs, keep, outs, nbytes = {}, {}, [], {}, {}
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").random_(0, 255)
    big2 = torch.empty_like(big)
    graphs["copy 256 MiB (ceiling)"] = (capture(lambda s: big2.copy_(big), n=5), 2 * big.numel(), 5)
    for spec in specs:
        name, kw = parse(spec)
        kind, k, mode = kw.pop("kind", "mxfp4"), int(kw.pop("k", H)), kw.pop("mode", "full")
        route = kw.pop("route", "mma")
        if (kind, k) not in weights:
            qw = (quantize_mxfp4 if kind == "mxfp4" else quantize_int4)(np.ascontiguousarray(w[:, :k]))
            parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
            zr = parts[2] if kind == "int4" else parts[1]
            weights[kind, k] = [a.reshape(a.shape[0] * a.shape[1]) for a in (parts[0], parts[1], zr)]
            if kind == "mxfp4":
                weights["imma", k] = weights[kind, k][:2]
            nbytes[kind, k] = sum(a.nbytes for a in qw) + 2 * k + 2 * N
            if kind == "mxfp4" and k == H:   # a device copy of this GEMV's byte count (half read, half written)
                src = torch.empty(nbytes[kind, k] // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
                dst = torch.empty_like(src)
                graphs["copy of the MXFP4 GEMV's bytes"] = (capture(lambda s: dst.copy_(src)), 2 * src.numel(), 20)
        rt = kw.get("row_tiles", 1)
        x = nb(xt[:, :k].contiguous())
        y = nb(torch.empty(1, N, device="cuda", dtype=torch.bfloat16))
        if route == "imma":
            kern = qgemv_imma.make(False, rt)
            args = (*weights["imma", k], x, x.reshape(k), y, 16 if mode == "compute" else N, k)
        else:
            kern = qgemv_mma.make(qgemv.MXFP4 if kind == "mxfp4" else qgemv.INT4, False, 1, **kw)
            args = (*weights[kind, k], x, x, y, 16 if mode == "compute" else N, 1, k)
        grid = (-(-N // (16 * rt)), 1)

        def fn(s, kern=kern, args=args, grid=grid, rt=rt):
            kern[grid, mh.THREADS * rt, s](*args)
        graphs[name] = (capture(fn), nbytes[kind, k], 20)
        keep.append((args, x))
        if mode == "full":
            outs.setdefault((kind, k), []).append((name, y))
        print("captured", name, kind, k, mode, kw, flush=True)
    diffs = {}
    for group in outs.values():
        ref = bf16_to_f32(group[0][1].copy_to_host())
        for name, y in group[1:]:
            diffs[f"{name} vs {group[0][0]}"] = float(np.abs(bf16_to_f32(y.copy_to_host()) - ref).max())
    print("max abs diff:", diffs, flush=True)

    times = interleaved_seconds({k: (g, n) for k, (g, _, n) in graphs.items()}, ROUNDS)
    ceil = 2 * big.numel() / float(np.median(times["copy 256 MiB (ceiling)"])) / 1e9
    dev = torch.cuda.get_device_name()
    print(f"\n{dev}, {cuda.get_current_device().MULTIPROCESSOR_COUNT} SMs; copy ceiling {ceil:.0f} GB/s; "
          f"{ROUNDS} rounds")
    rows = []
    for key, (_, b, _) in graphs.items():
        t = float(np.median(times[key]))
        r = dict(name=key, us=t * 1e6, us_min=min(times[key]) * 1e6, us_max=max(times[key]) * 1e6, bytes=b,
                 gbps=b / t / 1e9, of_ceiling=b / t / 1e9 / ceil)
        rows.append(r)
        print(f"{key:44s} {r['us']:7.2f} us  [{r['us_min']:.2f}-{r['us_max']:.2f}]  {r['gbps']:7.0f} GB/s  "
              f"{r['of_ceiling']:.3f}")
    with open(out, "w") as f:
        json.dump(dict(device=dev, ceiling_gbps=ceil, rounds=ROUNDS, diffs=diffs, rows=rows), f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
