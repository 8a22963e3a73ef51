"""Tensor-core rate of the two bf16 instructions a batch-1 GEMV can feed from registers, on this device:
``mma.sync.aligned.m16n8k16`` (one warp, 16 rows, ``mma_helpers.mma_bf16_16816``) against Hopper's
``wgmma.mma_async.sync.aligned.m64n8k16`` with A from registers (one warpgroup of 4 warps, 64 rows; sm_90a).
Each A fragment is the same per warp in both, so the GEMV's decode would carry over; what differs is the rate.

1. Correctness: one warpgroup multiplies a random A (64 x 16) by a random B (16 x 8) both ways, B for ``wgmma``
   in shared memory as two 8 x 8 core matrices without swizzle. The descriptor's two strides (leading: between
   the core matrices along K; stride: along N) are tried both ways round; the matching one is reported.
2. Rate: also ``mma.sync.m16n8k16`` f16 with f16 accumulation, and ``mma.sync.m16n8k32`` s8 (IMMA.16832).
   Blocks of 4 warpgroups, ``U`` independent accumulators per warp (``mma.sync``) or per warpgroup
   (``wgmma``), ``ITERS`` steps, one launch timed with CUDA events; reported as m16n8k16 steps per SM and cycle
   (a ``wgmma`` m64n8k16 counts 4, an int8 ``m16n8k32`` 2: the products of A per instruction), and as the time the MXFP4 GEMV's N·K/256 steps at 14336 x 4096 take at
   that rate across the device.

    python scripts/mma_rate.py OUT.json
"""
from __future__ import annotations

import json
import sys

import numpy as np
from llvmlite import ir
from numba import cuda, float32, types, uint64
from numba.core.extending import intrinsic

from vmmstream.kernels import mma_helpers as mh
from vmmstream.kernels.dtypes import bf16_to_f32, f32_to_bf16

U = 4                 # independent accumulators
ITERS = 4096
WARPS = 16            # per block: 4 warpgroups


@intrinsic
def wgmma_m64n8k16(typingctx, d0, d1, d2, d3, a0, a1, a2, a3, desc):
    """``wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16``: D (4 fp32 of the thread) += A (4 registers of
    bf16 pairs, the m16n8k16 A fragment of the thread's warp, rows 16 w .. 16 w + 15 of the warpgroup) times
    B (16 x 8, shared memory, ``desc``). Asynchronous: ``wg_fence`` before, ``wg_commit_wait`` before D is read."""
    sig = types.UniTuple(types.float32, 4)(d0, d1, d2, d3, a0, a1, a2, a3, desc)

    def codegen(context, builder, sig, args):
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [f32] * 4 + [i32] * 4 + [i64])
        asm = ir.InlineAsm(fnty, "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                                 "{$0, $1, $2, $3}, {$8, $9, $10, $11}, $12, 1, 1, 1, 0;",
                           "=f,=f,=f,=f,0,1,2,3,r,r,r,r,l", side_effect=True)
        to = [types.float32] * 4 + [types.uint32] * 4 + [types.uint64]
        vals = [context.cast(builder, v, a, b) for v, a, b in zip(args, sig.args, to)]
        res = builder.call(asm, vals)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
    return sig, codegen


def _mma_asm(text, out_t, in_t, n_out):
    """One ``mma.sync`` whose D is tied to C: ``n_out`` outputs of ``out_t``, A (4 u32), B (2 u32), C."""
    @intrinsic
    def fn(typingctx, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1):
        sig = types.UniTuple(out_t, 4)(c0, c1, c2, c3, a0, a1, a2, a3, b0, b1)

        def codegen(context, builder, sig, args):
            lt = ir.FloatType() if out_t == types.float32 else ir.IntType(32)
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([lt] * 4), [lt] * 4 + [i32] * 6)
            oc = "f" if out_t == types.float32 else "r"
            asm = ir.InlineAsm(fnty, text, ",".join([f"={oc}"] * 4 + ["0", "1", "2", "3"] + ["r"] * 6))
            to = [out_t] * 4 + [types.uint32] * 6
            vals = [context.cast(builder, v, a, b) for v, a, b in zip(args, sig.args, to)]
            res = builder.call(asm, vals)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
        return sig, codegen
    return fn


# int8 m16n8k32 (IMMA.16832, 512 products of A per instruction) and f16 m16n8k16 with f16 accumulation
# (D two registers: the four outputs are D0, D1 and two ignored copies of C)
imma_s8 = _mma_asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                   "{$8, $9}, {$0, $1, $2, $3};", types.int32, None, 4)
hmma_f16acc = _mma_asm("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {$0, $1}, {$4, $5, $6, $7}, "
                       "{$8, $9}, {$0, $1};", types.int32, None, 2)


def _void_asm(text, clobber=""):
    @intrinsic
    def fn(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, clobber, side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    return fn


wg_fence = _void_asm("wgmma.fence.sync.aligned;", "~{memory}")
wg_commit_wait = _void_asm("wgmma.commit_group.sync.aligned; wgmma.wait_group.sync.aligned 0;", "~{memory}")


@intrinsic
def shared_addr(typingctx, arr):
    """The shared-window address of a shared array's first element."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, value=args[0])
        i64 = ir.IntType(64)
        asm = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
        return builder.call(asm, [builder.ptrtoint(a.data, i64)])
    return types.uint64(arr), codegen


@cuda.jit(device=True, inline="always")
def b_desc(addr, lbo, sbo):
    """Shared-memory matrix descriptor, no swizzle: address, leading and stride byte offsets, each >> 4."""
    return ((addr & uint64(0x3FFFF)) >> uint64(4)) | (uint64(lbo >> 4) << uint64(16)) | (uint64(sbo >> 4) << uint64(32))


@cuda.jit
def check_kernel(afrag, bfrag, bsm, lbo, sbo, out_mma, out_wg):
    # afrag [128, 4] u32: thread's A registers; bfrag [32, 2] u32: a warp's B registers (m16n8k16);
    # bsm [128] u16: B as two 8 x 8 core matrices (n rows of 8 k each); out_* [128, 4] f32: the thread's D
    tid = cuda.threadIdx.x
    lane = tid % 32
    a0, a1, a2, a3 = afrag[tid, 0], afrag[tid, 1], afrag[tid, 2], afrag[tid, 3]
    d0, d1, d2, d3 = mh.mma_bf16_16816(a0, a1, a2, a3, bfrag[lane, 0], bfrag[lane, 1], float32(0), float32(0),
                                      float32(0), float32(0), 0)
    out_mma[tid, 0], out_mma[tid, 1], out_mma[tid, 2], out_mma[tid, 3] = d0, d1, d2, d3
    bs = cuda.shared.array(128, np.uint16, alignment=16)
    bs[tid] = bsm[tid]
    cuda.syncthreads()
    desc = b_desc(shared_addr(bs), lbo, sbo)
    wg_fence()
    e0, e1, e2, e3 = wgmma_m64n8k16(float32(0), float32(0), float32(0), float32(0), a0, a1, a2, a3, desc)
    wg_commit_wait()
    out_wg[tid, 0], out_wg[tid, 1], out_wg[tid, 2], out_wg[tid, 3] = e0, e1, e2, e3


@cuda.jit(launch_bounds=(32 * WARPS, 1))
def rate_mma(afrag, bfrag, out, iters):
    tid = cuda.threadIdx.x
    lane = tid % 32
    a0, a1, a2, a3 = afrag[lane, 0], afrag[lane, 1], afrag[lane, 2], afrag[lane, 3]
    b0, b1 = bfrag[lane, 0], bfrag[lane, 1]
    p0 = p1 = p2 = p3 = q0 = q1 = q2 = q3 = float32(0)
    r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = float32(0)
    for _ in range(iters):
        p0, p1, p2, p3 = mh.mma_bf16_16816(a0, a1, a2, a3, b0, b1, p0, p1, p2, p3, 0)
        q0, q1, q2, q3 = mh.mma_bf16_16816(a0, a1, a2, a3, b0, b1, q0, q1, q2, q3, 0)
        r0, r1, r2, r3 = mh.mma_bf16_16816(a0, a1, a2, a3, b0, b1, r0, r1, r2, r3, 0)
        s0, s1, s2, s3 = mh.mma_bf16_16816(a0, a1, a2, a3, b0, b1, s0, s1, s2, s3, 0)
    out[cuda.blockIdx.x * cuda.blockDim.x + tid] = p0 + p1 + p2 + p3 + q0 + q1 + q2 + q3 + r0 + r1 + r2 + r3 \
        + s0 + s1 + s2 + s3


@cuda.jit(launch_bounds=(32 * WARPS, 1))
def rate_wgmma(afrag, bsm, lbo, sbo, out, iters):
    tid = cuda.threadIdx.x
    a0, a1, a2, a3 = afrag[tid % 128, 0], afrag[tid % 128, 1], afrag[tid % 128, 2], afrag[tid % 128, 3]
    bs = cuda.shared.array(128, np.uint16, alignment=16)
    if tid < 128:
        bs[tid] = bsm[tid]
    cuda.syncthreads()
    desc = b_desc(shared_addr(bs), lbo, sbo)
    p0 = p1 = p2 = p3 = q0 = q1 = q2 = q3 = float32(0)
    r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = float32(0)
    for _ in range(iters // 4):        # one pipeline stage: 4 steps on each of the U accumulators, then a wait
        wg_fence()
        for _ in range(4):
            p0, p1, p2, p3 = wgmma_m64n8k16(p0, p1, p2, p3, a0, a1, a2, a3, desc)
            q0, q1, q2, q3 = wgmma_m64n8k16(q0, q1, q2, q3, a0, a1, a2, a3, desc)
            r0, r1, r2, r3 = wgmma_m64n8k16(r0, r1, r2, r3, a0, a1, a2, a3, desc)
            s0, s1, s2, s3 = wgmma_m64n8k16(s0, s1, s2, s3, a0, a1, a2, a3, desc)
        wg_commit_wait()
    out[cuda.blockIdx.x * cuda.blockDim.x + tid] = p0 + p1 + p2 + p3 + q0 + q1 + q2 + q3 + r0 + r1 + r2 + r3 \
        + s0 + s1 + s2 + s3


def _rate_kernel(mma, zero):
    @cuda.jit(launch_bounds=(32 * WARPS, 1))
    def rate(afrag, bfrag, out, iters):
        tid = cuda.threadIdx.x
        lane = tid % 32
        a0, a1, a2, a3 = afrag[lane, 0], afrag[lane, 1], afrag[lane, 2], afrag[lane, 3]
        b0, b1 = bfrag[lane, 0], bfrag[lane, 1]
        p0 = p1 = p2 = p3 = q0 = q1 = q2 = q3 = zero
        r0 = r1 = r2 = r3 = s0 = s1 = s2 = s3 = zero
        for _ in range(iters):
            p0, p1, p2, p3 = mma(p0, p1, p2, p3, a0, a1, a2, a3, b0, b1)
            q0, q1, q2, q3 = mma(q0, q1, q2, q3, a0, a1, a2, a3, b0, b1)
            r0, r1, r2, r3 = mma(r0, r1, r2, r3, a0, a1, a2, a3, b0, b1)
            s0, s1, s2, s3 = mma(s0, s1, s2, s3, a0, a1, a2, a3, b0, b1)
        out[cuda.blockIdx.x * cuda.blockDim.x + tid] = float32(p0 + p1 + p2 + p3 + q0 + q1 + q2 + q3 + r0 + r1
                                                              + r2 + r3 + s0 + s1 + s2 + s3)
    return rate


rate_imma = _rate_kernel(imma_s8, np.int32(0))
rate_f16acc = _rate_kernel(hmma_f16acc, np.int32(0))


def fragments(a, b):
    """A (64 x 16) and B (16 x 8) bf16 bits -> each thread's m16n8k16 A registers (warp w: rows 16 w ..),
    each lane's B registers, and B^T as two 8 x 8 core matrices (k 0-7, then k 8-15; n rows of 8 k)."""
    af = np.zeros((128, 4), np.uint32)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        r = 16 * w + g
        for i, (row, k) in enumerate(((r, 2 * t), (r + 8, 2 * t), (r, 2 * t + 8), (r + 8, 2 * t + 8))):
            af[tid, i] = int(a[row, k]) | (int(a[row, k + 1]) << 16)
    bf = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i, k in enumerate((2 * t, 2 * t + 8)):
            bf[lane, i] = int(b[k, g]) | (int(b[k + 1, g]) << 16)
    bsm = np.concatenate([b[0:8, :].T.reshape(-1), b[8:16, :].T.reshape(-1)]).astype(np.uint16)
    return af, bf, bsm


def d_matrix(d):
    """Each thread's 4 D values -> the 64 x 8 product (warp w: rows 16 w ..)."""
    out = np.zeros((64, 8), np.float32)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        r = 16 * w + g
        out[r, 2 * t], out[r, 2 * t + 1], out[r + 8, 2 * t], out[r + 8, 2 * t + 1] = d[tid]
    return out


def main(path):
    rng = np.random.default_rng(0)
    a = f32_to_bf16(rng.standard_normal((64, 16)).astype(np.float32))
    b = f32_to_bf16(rng.standard_normal((16, 8)).astype(np.float32))
    want = bf16_to_f32(a).astype(np.float64) @ bf16_to_f32(b).astype(np.float64)
    af, bf, bsm = fragments(a, b)
    d_af, d_bf, d_bsm = cuda.to_device(af), cuda.to_device(bf), cuda.to_device(bsm)
    dev = cuda.get_current_device().name
    res = {"device": dev.decode() if isinstance(dev, bytes) else str(dev)}
    good = None
    for lbo, sbo in ((128, 256), (256, 128)):
        om, ow = cuda.device_array((128, 4), np.float32), cuda.device_array((128, 4), np.float32)
        check_kernel[1, 128](d_af, d_bf, d_bsm, lbo, sbo, om, ow)
        em = float(np.abs(d_matrix(om.copy_to_host()) - want).max())
        ew = float(np.abs(d_matrix(ow.copy_to_host()) - want).max())
        res[f"check lbo {lbo} sbo {sbo}"] = {"mma.sync max err": em, "wgmma max err": ew}
        print(f"lbo {lbo} sbo {sbo}: mma.sync err {em:.2e}, wgmma err {ew:.2e}", flush=True)
        if ew < 1e-3:
            good = (lbo, sbo)
            break                          # the other order reads past the 256 bytes of B: an illegal address
    if good is None:
        print("no descriptor matched: the wgmma rate below uses B in an unchecked layout", flush=True)
        good = (128, 256)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    clock_khz = cuda.get_current_device().CLOCK_RATE
    blocks = sms
    out = cuda.device_array(blocks * 32 * WARPS, np.float32)
    for name, launch, steps in (
            ("mma.sync m16n8k16", lambda it: rate_mma[blocks, 32 * WARPS](d_af, d_bf, out, it), WARPS * U),
            ("wgmma m64n8k16 (x4)", lambda it: rate_wgmma[blocks, 32 * WARPS](d_af, d_bsm, good[0], good[1], out, it),
             (WARPS // 4) * U * 4),
            ("mma.sync f16, f16 acc", lambda it: rate_f16acc[blocks, 32 * WARPS](d_af, d_bf, out, it), WARPS * U),
            ("mma.sync s8 m16n8k32 (x2)", lambda it: rate_imma[blocks, 32 * WARPS](d_af, d_bf, out, it),
             WARPS * U * 2)):
        launch(16)                                        # compile, warm up
        cuda.synchronize()
        times = []
        for _ in range(5):
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            launch(ITERS)
            e1.record()
            e1.synchronize()
            times.append(cuda.event_elapsed_time(e0, e1) * 1e-3)
        t = float(np.median(times))
        per_sm_us = steps * ITERS / t / 1e6                # m16n8k16 steps per SM and microsecond
        per_cycle = per_sm_us / (clock_khz / 1e3)
        gemv_us = 14336 * 4096 / 256 / (per_sm_us * sms)
        res[name] = {"seconds": t, "steps_per_sm_us": per_sm_us, "steps_per_sm_cycle_at_max_clock": per_cycle,
                     "gemv_14336x4096_tensor_us": gemv_us}
        print(f"{name:22s} {per_sm_us:8.1f} m16n8k16 steps per SM and us ({per_cycle:.3f} per cycle at "
              f"{clock_khz / 1e3:.0f} MHz); the GEMV's {14336 * 4096 // 256} steps: {gemv_us:.2f} us", flush=True)
    res["descriptor"] = {"lbo": good[0], "sbo": good[1]}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
