"""What a plain launch of a 31 MB batch-1 GEMV can reach on this device, and the MXFP4 kernel against it:
1x4096 . [14336, 4096], every figure a graph of 20 launches timed by CUDA events, median of interleaved rounds.

- the copy ceiling (torch ``copy_`` of 256 MiB, read + write counted) and a copy moving the GEMV's byte count;
- an empty kernel in the GEMV's two launch shapes (128 blocks of 896 threads, 896 of 128): the launch floor;
- a plain streaming read of the GEMV's byte count (one wave of 128-thread blocks, ``U`` 16-byte loads in flight
  per thread): what a kernel that only reads these bytes takes;
- the ``mma`` kernels with and without ``early_y``, MXFP4 at 7 row tiles and 1, int4 at 7: full, the MXFP4
  compute side (every block reads the same 16 rows), memory side (probe) and neither (compute + probe);
- MXFP4 with W through a per-warp cp.async ring of 5 groups (the general loop, one row tile), with the
  driver's default shared memory carveout and with the largest.

    python scripts/floor_qgemv.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from numba import cuda, uint32

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from test_bench_dense_kernels import capture, interleaved_seconds, nb  # noqa: E402

from vmmstream.kernels import mma_helpers as mh, qgemv, qgemv_mma  # noqa: E402
from vmmstream.kernels.dtypes import bf16_to_f32  # noqa: E402
from vmmstream.kernels.qgemv import _ld16_ro  # noqa: E402
from vmmstream.kernels.quant import quantize_int4, quantize_mxfp4  # noqa: E402

H, I = 4096, 14336
ROUNDS = int(os.environ.get("FLOOR_ROUNDS", "7"))


@cuda.jit
def empty(y):
    if cuda.threadIdx.x == 100000:
        y[0] = 1


def make_reader(U):
    @cuda.jit
    def read(buf, n16, y):
        # buf: uint8 [n16 * 16]; thread i reads 16-byte chunks i, i + T, ... U at a time
        T = uint32(cuda.gridDim.x * cuda.blockDim.x)
        i = uint32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
        acc = uint32(0)
        while i < uint32(n16):
            for u in range(U):
                j = i + uint32(u) * T
                if j < uint32(n16):
                    a, b, c, d = _ld16_ro(buf, j * uint32(16))
                    acc ^= a ^ b ^ c ^ d
            i += uint32(U) * T
        if acc == uint32(0x12345678):
            y[0] = acc
    return read


def _resources(kern):
    """Registers per thread and static shared memory per block of a kernel compiled for one signature."""
    def one(v):
        return next(iter(v.values())) if isinstance(v, dict) else v
    return dict(regs=int(one(kern.get_regs_per_thread())), smem=int(one(kern.get_shared_mem_per_block())))


def main(out):
    torch.manual_seed(0)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((I, H)) * 0.02).astype(np.float32)
    x = nb(torch.randn(1, H, device="cuda", dtype=torch.bfloat16))
    graphs = {}            # name -> (graph, bytes, launches)
    keep = []              # every captured launch's arguments: a graph holds pointers, not the arrays

    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").random_(0, 255)
    big2 = torch.empty_like(big)
    graphs["copy 256 MiB (ceiling)"] = (capture(lambda s: big2.copy_(big), n=5), 2 * big.numel(), 5)

    qm, qi = quantize_mxfp4(w), quantize_int4(w)
    nbytes = {"mxfp4": sum(a.nbytes for a in qm) + 2 * H + 2 * I, "int4": sum(a.nbytes for a in qi) + 2 * H + 2 * I}
    # a copy moving the GEMV's byte count (half read, half written: the bench's "copy of the same bytes")
    src = torch.empty(nbytes["mxfp4"] // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    graphs["copy moving the MXFP4 GEMV's bytes"] = (capture(lambda s: dst.copy_(src)), 2 * src.numel(), 20)
    rbuf = torch.empty(nbytes["mxfp4"] // 16 * 16, dtype=torch.uint8, device="cuda").random_(0, 255)
    ybuf = cuda.device_array(4, np.uint32)
    for grid, thr in ((128, 896), (896, 128)):
        graphs[f"empty kernel {grid} x {thr}"] = (capture(lambda s, g=grid, t=thr: empty[g, t, s](ybuf)), 0, 20)
    sb = nb(rbuf)
    for U in (2, 4, 8):
        rd = make_reader(U)
        graphs[f"plain read, {U} x 16 B in flight per thread, {sms * 7} x 128"] = (
            capture(lambda s, r=rd: r[sms * 7, 128, s](sb, rbuf.numel() // 16, ybuf)), rbuf.numel(), 20)

    outs, info, ring_outs = {}, {}, {}
    for kind, qw in (("mxfp4", qm), ("int4", qi)):
        kid = qgemv.MXFP4 if kind == "mxfp4" else qgemv.INT4
        parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
        zr = parts[2] if kind == "int4" else parts[1]
        flat = [a.reshape(a.shape[0] * a.shape[1]) for a in (parts[0], parts[1], zr)]
        for rt in ((7, 1) if kind == "mxfp4" else (7,)):
            for ey in (False, True):
                modes = ["full", "compute"] if kind == "mxfp4" else ["full"]
                if kind == "mxfp4" and rt == 1 and not ey:
                    modes += ["probe", "compute+probe"]
                for mode in modes:
                    probe = "probe" in mode
                    kern = qgemv_mma.make(kid, False, 1, probe=probe, row_tiles=rt, early_y=ey)
                    y = nb(torch.empty(1, I, device="cuda", dtype=torch.bfloat16))
                    args = (*flat, x, x, y, 16 if "compute" in mode else I, 1, H)
                    grid = (-(-I // (16 * rt)), 1)

                    def fn(s, kern=kern, args=args, grid=grid, rt=rt):
                        kern[grid, mh.THREADS * rt, s](*args)
                    name = f"{kind} rt {rt}{' early_y' if ey else ''} {mode}"
                    graphs[name] = (capture(fn), nbytes[kind], 20)
                    keep.append(args)
                    info[name] = _resources(kern)
                    if mode == "full":
                        outs[name] = y
                    print("captured", name, flush=True)
        if kind == "mxfp4":   # W through a per-warp cp.async ring (the general loop), default and max carveout
            for st in (5,):
                for cv in (None, "maxshared"):
                    kern = qgemv_mma.make(kid, False, 1, stages=st, carveout=cv)
                    y = nb(torch.empty(1, I, device="cuda", dtype=torch.bfloat16))
                    args = (*flat, x, x, y, I, 1, H)

                    def fn(s, kern=kern, args=args):
                        kern[(I // 16, 1), mh.THREADS, s](*args)
                    name = f"mxfp4 cp.async ring {st}, carveout {cv or 'default'} full"
                    graphs[name] = (capture(fn), nbytes[kind], 20)
                    keep.append(args)
                    info[name] = _resources(kern)
                    ring_outs[name] = y
                    print("captured", name, info[name], flush=True)
    # the same bits with and without early_y
    same = {}
    for name, y in outs.items():
        if "early_y" in name:
            base = outs[name.replace(" early_y", "")]
            same[name] = bool(np.array_equal(y.copy_to_host(), base.copy_to_host()))
    ref = outs["mxfp4 rt 1 full"].copy_to_host()
    for name, y in ring_outs.items():   # the general loop sums in another order: near, not the same bits
        d = np.abs(bf16_to_f32(y.copy_to_host()) - bf16_to_f32(ref)).max()
        same[name + " max abs diff vs rt 1"] = float(d)
    print("early_y bit-equal:", same, flush=True)

    times = interleaved_seconds({k: (g, n) for k, (g, _, n) in graphs.items()}, ROUNDS)
    ceil = 2 * big.numel() / float(np.median(times["copy 256 MiB (ceiling)"])) / 1e9
    rows = []
    dev = torch.cuda.get_device_name()
    print(f"\n{dev}, {sms} SMs; copy ceiling {ceil:.0f} GB/s; {ROUNDS} rounds")
    for k, (_, b, _) in graphs.items():
        t = float(np.median(times[k]))
        r = dict(name=k, **info.get(k, {}), us=t * 1e6, us_min=min(times[k]) * 1e6, us_max=max(times[k]) * 1e6, bytes=b,
                 gbps=b / t / 1e9 if b else None, of_ceiling=b / t / 1e9 / ceil if b else None)
        rows.append(r)
        extra = f"{r['gbps']:7.0f} GB/s  {r['of_ceiling']:.3f}" if b else ""
        print(f"{k:60s} {t * 1e6:7.2f} us  [{r['us_min']:.2f}-{r['us_max']:.2f}]  {extra}")
    with open(out, "w") as f:
        json.dump(dict(device=dev, sms=sms, ceiling_gbps=ceil, rounds=ROUNDS, checks=same, rows=rows),
                  f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
