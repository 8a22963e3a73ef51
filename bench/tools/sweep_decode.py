"""Sweep decode attention's pass-1 settings on a GPU: warps per block, keys per stream step, prefetch,
launch-bounds minimum, load addressing, score summation, keys per block. Each configuration is timed as
20 calls (pass 1 + pass 2) captured in one CUDA graph, CUDA events around a replay, best of 5; torch SDPA
is timed the same way in the same run. Prints one line per configuration and writes JSON to argv[1].

    python bench/tools/sweep_decode.py OUT.json [S ...]
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import torch
from numba import cuda, float32

from vmmstream.kernels.attention import decode as ad
from vmmstream.kernels.base.launch import as_stream

HQ, HKV, D, REPS = 32, 8, 128, 20
F = torch.nn.functional

# (W, U, PF, MINB, FLAT, RS, chunk)
CONFIGS = [
    (4, 4, True, 0, False, False, 1024),
    (4, 4, True, 0, True, False, 1024),
    (4, 4, True, 0, True, False, 512),
    (4, 4, True, 0, False, True, 1024),
    (4, 4, True, 0, True, True, 1024),
    (4, 4, True, 0, True, True, 512),
    (4, 4, True, 0, True, True, 672),
    (4, 4, True, 4, True, True, 512),
    (4, 4, True, 3, True, True, 672),
    (8, 4, True, 0, True, True, 1024),
    (4, 2, True, 0, True, True, 512),
    (4, 8, True, 0, True, True, 1024),
    (4, 4, False, 0, True, True, 512),
    (2, 4, True, 0, True, True, 512),
    (4, 4, True, 0, True, True, 256),
]


def nb(t):
    return cuda.as_cuda_array(t.view(torch.int16), sync=False).view(np.uint16)


def graph_ms(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / REPS)
    return best


def main():
    out_path = sys.argv[1]
    sizes = [int(x) for x in sys.argv[2:]] or [32768, 4096]
    rows = []
    for S in sizes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(S, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(S, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
        lens = torch.full((1,), S, device="cuda", dtype=torch.int32)
        kt, vt = (x.permute(1, 0, 2).unsqueeze(0).contiguous() for x in (k, v))
        sdpa = graph_ms(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), kt, vt, enable_gqa=True))
        kv_bytes = 2 * S * HKV * D * 2
        ref = F.scaled_dot_product_attention(q.unsqueeze(2).float(), kt.float(), vt.float(),
                                             enable_gqa=True).squeeze(2)
        print(f"S={S}: SDPA {sdpa * 1e3:.1f} us = {kv_bytes / sdpa / 1e6:.0f} GB/s", flush=True)
        for W, U, PF, MINB, FLAT, RS, chunk in CONFIGS:
            ns = -(-S // chunk)
            pm = torch.empty(1, HQ, ns, device="cuda", dtype=torch.float32)
            pl = torch.empty_like(pm)
            po = torch.empty(1, HQ, ns, D, device="cuda", dtype=torch.float32)
            o = torch.empty(1, HQ, D, device="cuda", dtype=torch.bfloat16)
            split = ad._make_split(HQ // HKV, D, W, U, PF, MINB, FLAT, RS)
            comb = ad._make_combine(D)
            a = [nb(q), nb(k.unsqueeze(0)), nb(v.unsqueeze(0)), cuda.as_cuda_array(lens, sync=False)]
            p = [cuda.as_cuda_array(x, sync=False) for x in (pm, pl, po)]
            scale = float32(1.0 / math.sqrt(D))

            def run():
                st = as_stream(torch.cuda.current_stream())
                split[(ns, HKV, 1), 32 * W, st](*a, *p, chunk, scale)
                comb[(HQ, 1), ad.C_THREADS, st](*p, a[3], nb(o), chunk)
            try:
                ms = graph_ms(run)
                err = float((o.float() - ref).abs().max())
                regs = None
                try:
                    regs = int(next(iter(split.get_regs_per_thread().values())))
                except Exception:       # noqa: BLE001
                    pass
            except Exception as e:      # noqa: BLE001 - report and go on
                print(f"  W{W} U{U} PF{int(PF)} MINB{MINB} FLAT{int(FLAT)} RS{int(RS)} @{chunk}: {e!r}", flush=True)
                continue
            row = dict(S=S, W=W, U=U, PF=PF, MINB=MINB, FLAT=FLAT, RS=RS, chunk=chunk, splits=ns, us=ms * 1e3,
                       gbps=kv_bytes / ms / 1e6, sdpa_us=sdpa * 1e3, ratio=sdpa / ms, regs=regs, max_err=err)
            rows.append(row)
            print(f"  W{W} U{U} PF{int(PF)} MINB{MINB} FLAT{int(FLAT)} RS{int(RS)} @{chunk:5d} ({ns:3d} splits,"
                  f" {regs} regs): {ms * 1e3:6.1f} us  {row['gbps']:5.0f} GB/s  ratio {row['ratio']:.3f}"
                  f"  err {err:.2e}", flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
