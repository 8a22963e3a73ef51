"""Device helpers shared by the attention kernels: packed-bf16 words, tensor-core mma, reductions.

Numba has no tensor-core API, so ``mma_bf16_16816`` emits the PTX instruction
``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` as LLVM inline assembly through a Numba
``intrinsic``: no CUDA C++ file, no NVRTC at run time, and it compiles with ``compile_ptx`` on a
machine without a GPU. ``pack_bf16x2`` uses ``cvt.rn.bf16x2.f32`` the same way.

Every helper has a simulator twin with the same arguments, so a kernel's index arithmetic runs in
the Numba simulator too. The simulator has no warp shuffles and cannot run inline assembly, so its
twins exchange values through a per-block shared ``scratch`` array and ``syncthreads`` (every thread
of the block must call them together: the kernels do, their control flow around them is uniform).
On the GPU the scratch arguments are ignored; kernels size them with ``SIM_*`` constants that are 1
outside the simulator.

Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16", bf16), lane = 4*g + t:
  A 16x16 row-major, 4 regs of 2 bf16: a0 (row g, k 2t..2t+1), a1 (row g+8, same k),
                                       a2 (row g, k 2t+8..2t+9), a3 (row g+8, k 2t+8..2t+9)
  B 16x8 "col", 2 regs of 2 bf16:      b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g)
  C/D 16x8 fp32, 4 regs:               c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same cols)
The lower 16 bits of a register hold the element with the lower k (or column) index.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda

from vmmstream.kernels.base.dtypes import dev_f32_to_bf16
from vmmstream.kernels.base.jit import jit



def kernel(launch_bounds, max_registers=None, carveout=None):
    """``cuda.jit`` for a kernel with launch bounds, optionally a register cap per thread and a shared memory
    carveout preference (``"maxshared"``, a percentage; the simulator's ``jit`` takes none of them)."""
    if config.ENABLE_CUDASIM:
        return cuda.jit
    kw = {} if max_registers is None else {"max_registers": max_registers}
    if carveout is not None:
        kw["shared_memory_carveout"] = carveout
    return jit(launch_bounds=launch_bounds, **kw)


@cuda.jit(device=True, inline="always")
def block_reduce(red, v, use_max):
    """Max (``use_max``) or sum of ``v`` over the whole block, returned to every thread; a tree through the
    shared ``red[blockDim.x]`` (blockDim.x a power of two). No shuffles, so the simulator runs it as is."""
    tid = cuda.threadIdx.x
    red[tid] = v
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            red[tid] = max(red[tid], red[tid + step]) if use_max else red[tid] + red[tid + step]
        cuda.syncthreads()
        step //= 2
    r = red[0]
    cuda.syncthreads()
    return r


WARPS = 4                 # warps per block of the mma kernels (the scratch arrays are sized for it)
THREADS = 32 * WARPS

if config.ENABLE_CUDASIM:
    SIM_MMA_SCRATCH = (THREADS, 14)  # per thread: a0..a3, b0, b1, c0..c3 in, d0..d3 out (float64 holds all)
    SIM_RED_SCRATCH = THREADS        # per-thread value for the emulated quad reductions

    def _f32(bits):
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True, inline="always")
    def bf16_lo(w):
        """fp32 value of the low bf16 of a packed uint32 word."""
        return _f32(np.uint32(np.uint32(w) << np.uint32(16)))

    @cuda.jit(device=True, inline="always")
    def bf16_hi(w):
        """fp32 value of the high bf16 of a packed uint32 word."""
        return _f32(np.uint32(np.uint32(w) & np.uint32(0xFFFF0000)))

    @cuda.jit(device=True, inline="always")
    def pack_bf16x2(lo, hi):
        """Two fp32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        return np.uint32(dev_f32_to_bf16(lo)) | (np.uint32(dev_f32_to_bf16(hi)) << np.uint32(16))

    @cuda.jit(device=True, inline="always")
    def fma_bf16x2(a, b, c):
        """Packed bf16 a * b + c per half (each half rounded to bf16), as ``fma.rn.bf16x2``."""
        lo = bf16_lo(a) * bf16_lo(b) + bf16_lo(c)
        hi = bf16_hi(a) * bf16_hi(b) + bf16_hi(c)
        return pack_bf16x2(lo, hi)

    # Where each lane's fragment registers sit in the 16x16 A, 16x8 B and 16x8 C tiles (layouts above):
    # index [lane, register, half] for A and B, [lane, register] for C.
    _g, _t = (np.arange(32) >> 2)[:, None, None], (np.arange(32) & 3)[:, None, None]
    _r4, _r2, _e = np.arange(4)[None, :, None], np.arange(2)[None, :, None], np.arange(2)[None, None, :]
    _A_ROW = np.broadcast_to(_g + 8 * (_r4 & 1), (32, 4, 2))
    _A_COL = np.broadcast_to(2 * _t + 8 * (_r4 >> 1) + _e, (32, 4, 2))
    _B_K = np.broadcast_to(2 * _t + 8 * _r2 + _e, (32, 2, 2))
    _B_N = np.broadcast_to(_g, (32, 2, 2))
    _C_ROW, _C_COL = _g[:, :, 0] + 8 * (_r4[:, :, 0] >> 1), 2 * _t[:, :, 0] + (_r4[:, :, 0] & 1)

    def _halves(words):
        w = np.asarray(words, dtype=np.float64).astype(np.uint32)
        lo = (w << np.uint32(16)).view(np.float32)
        hi = (w & np.uint32(0xFFFF0000)).view(np.float32)
        return np.stack([lo, hi], axis=-1).astype(np.float64)

    def _warp_mma(frags, halves):
        """frags: [32 lanes, 10] = a0..a3, b0, b1, c0..c3 of one warp -> [32, 4] d0..d3; ``halves`` decodes
        the packed A and B words (bf16 or f16 pairs)."""
        a, b, c = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        a[_A_ROW, _A_COL] = halves(frags[:, 0:4])
        b[_B_K, _B_N] = halves(frags[:, 4:6])
        c[_C_ROW, _C_COL] = frags[:, 6:10]
        return (a @ b + c).astype(np.float32)[_C_ROW, _C_COL]

    def _sim_mma(halves):
        """The emulated warp-wide D = A @ B + C on 16x16 A, 16x8 B (pairs decoded by ``halves``), fp32 C/D
        (layouts above): the lanes publish their registers, lane 0 multiplies the warp's tiles, each lane
        reads its D."""
        @cuda.jit(device=True, inline="always")
        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
            tid = cuda.threadIdx.x
            for i, r in enumerate((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
                scratch[tid, i] = r
            cuda.syncthreads()
            if tid % 32 == 0:
                scratch[tid:tid + 32, 10:14] = _warp_mma(scratch[tid:tid + 32, 0:10], halves)
            cuda.syncthreads()
            # No trailing barrier: lane 0 overwrites this row's d only after the next call's first barrier,
            # which this thread reaches only after reading d here.
            d = [np.float32(scratch[tid, 10 + i]) for i in range(4)]
            return d[0], d[1], d[2], d[3]

        return mma

    mma_bf16_16816 = _sim_mma(_halves)

    @cuda.jit(device=True, inline="always")
    def _quad(v, scratch, use_max):
        tid = cuda.threadIdx.x
        scratch[tid] = v
        cuda.syncthreads()
        q = tid & ~3
        vals = [scratch[q + i] for i in range(4)]
        cuda.syncthreads()
        return np.float32(max(vals)) if use_max else np.float32(vals[0] + vals[1] + vals[2] + vals[3])

    @cuda.jit(device=True, inline="always")
    def quad_max(v, scratch):
        """Max of ``v`` over the 4 lanes 4g..4g+3 (the lanes holding one row of an mma C fragment)."""
        return _quad(v, scratch, True)

    @cuda.jit(device=True, inline="always")
    def quad_sum(v, scratch):
        """Sum of ``v`` over the 4 lanes 4g..4g+3."""
        return _quad(v, scratch, False)

else:
    from llvmlite import ir
    from numba.cuda import libdevice, types
    from numba.cuda.extending import intrinsic

    SIM_MMA_SCRATCH = (1, 1)
    SIM_RED_SCRATCH = 1

    @cuda.jit(device=True, inline="always")
    def bf16_lo(w):
        return libdevice.int_as_float(np.int32(np.uint32(w) << np.uint32(16)))

    @cuda.jit(device=True, inline="always")
    def bf16_hi(w):
        return libdevice.int_as_float(np.int32(np.uint32(w) & np.uint32(0xFFFF0000)))

    @intrinsic
    def _cvt_bf16x2(typingctx, hi, lo):
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.IntType(32), [f32, f32])
            # cvt.rn.bf16x2.f32 d, a, b puts cvt(a) in the upper half of d and cvt(b) in the lower.
            asm = ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, list(args))

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def pack_bf16x2(lo, hi):
        return _cvt_bf16x2(np.float32(hi), np.float32(lo))

    @intrinsic
    def _fma_bf16x2(typingctx, a, b, c):
        sig = types.uint32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, list(args))

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def fma_bf16x2(a, b, c):
        return _fma_bf16x2(np.uint32(a), np.uint32(b), np.uint32(c))

    def _mma_intrinsic(ab_type):
        """``mma.sync.aligned.m16n8k16.row.col.f32.<ab>.<ab>.f32`` (A, B packed pairs of ``ab_type``)."""
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def impl(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            u, f = types.uint32, types.float32
            sig = types.UniTuple(f, 4)(u, u, u, u, u, u, f, f, f, f)

            def codegen(context, builder, sig, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                res = builder.call(asm, list(args))
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, i) for i in range(4)])

            return sig, codegen

        return impl

    _mma = _mma_intrinsic("bf16")
    _mma_f16 = _mma_intrinsic("f16")

    @cuda.jit(device=True, inline="always")
    def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _mma(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3),
                    np.uint32(b0), np.uint32(b1),
                    np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))

    @cuda.jit(device=True, inline="always")
    def quad_max(v, scratch):
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))

    @cuda.jit(device=True, inline="always")
    def quad_sum(v, scratch):
        v = v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)


# ----------------------------------------------------------------------------------------- f16 / fp8
# Helpers of the MXFP4 GEMV on f16 tensor cores (``kernels/matmul/quant/gemv_mx16.py``; PTX for sm_89 and later):
#   mma_f16_16816       ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (the bf16 fragment layouts above)
#   f16x2_of_f32        ``cvt.rn.f16x2.f32``: two fp32 -> packed f16 pair, ``lo`` in the low half
#   f16x2_of_e4m3x2     ``cvt.rn.f16x2.e4m3x2``: the two E4M3 bytes in bits 0-15 -> packed f16 pair (exact; the
#                       lower byte to the low half); ``..._hi``: the bytes in bits 16-31
# E4M3: sign, 4 exponent bits biased 7, 3 mantissa bits, subnormals; 0x7F / 0xFF NaN.

if config.ENABLE_CUDASIM:
    def _e4m3_values():
        c = np.arange(256)
        e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
        v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
        v = np.where(c & 0x80, -v, v)
        v[(c & 0x7F) == 0x7F] = np.nan
        return v

    E4M3_VALUES = _e4m3_values()

    def _f16_pack(lo, hi):
        h = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.uint32)
        return np.uint32(h[0] | (h[1] << np.uint32(16)))

    @cuda.jit(device=True, inline="always")
    def f16x2_of_f32(lo, hi):
        return _f16_pack(np.float32(lo), np.float32(hi))

    @cuda.jit(device=True, inline="always")
    def f16x2_of_e4m3x2(w):
        w = int(w)
        return _f16_pack(E4M3_VALUES[w & 0xFF], E4M3_VALUES[(w >> 8) & 0xFF])

    @cuda.jit(device=True, inline="always")
    def f16x2_of_e4m3x2_hi(w):
        w = int(w)
        return _f16_pack(E4M3_VALUES[(w >> 16) & 0xFF], E4M3_VALUES[(w >> 24) & 0xFF])

    def _f16_of(words):
        w = np.asarray(words, dtype=np.float64).astype(np.uint32)
        lo = (w & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
        hi = (w >> np.uint32(16)).astype(np.uint16).view(np.float16)
        return np.stack([lo, hi], axis=-1).astype(np.float64)

    mma_f16_16816 = _sim_mma(_f16_of)

else:
    def _asm_u32(text, n_in, in_kind="r"):
        """An intrinsic: ``n_in`` (1 or 2) uint32 (``r``) or float32 (``f``) operands -> one uint32 through
        the PTX ``text``."""
        it = types.uint32 if in_kind == "r" else types.float32

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            ity = i32 if in_kind == "r" else ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(i32, [ity] * n_in), text, "=r," + ",".join([in_kind] * n_in))
            return builder.call(asm, list(args))

        if n_in == 1:
            @intrinsic
            def one(typingctx, a):
                return types.uint32(it), codegen
            return one

        @intrinsic
        def two(typingctx, a, b):
            return types.uint32(it, it), codegen
        return two

    _cvt_f16x2 = _asm_u32("cvt.rn.f16x2.f32 $0, $1, $2;", 2, "f")      # $1 -> upper half
    _f16x2_e4m3 = _asm_u32("{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 $0, l; }", 1)
    _f16x2_e4m3_hi = _asm_u32("{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 $0, h; }", 1)

    @cuda.jit(device=True, inline="always")
    def f16x2_of_f32(lo, hi):
        return _cvt_f16x2(np.float32(hi), np.float32(lo))

    @cuda.jit(device=True, inline="always")
    def f16x2_of_e4m3x2(w):
        return _f16x2_e4m3(np.uint32(w))

    @cuda.jit(device=True, inline="always")
    def f16x2_of_e4m3x2_hi(w):
        return _f16x2_e4m3_hi(np.uint32(w))

    @cuda.jit(device=True, inline="always")
    def mma_f16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _mma_f16(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3),
                        np.uint32(b0), np.uint32(b1),
                        np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))


# ------------------------------------------------------------------------------------------------ int8
# Helpers of the batch-1 MXFP4 GEMV on integer tensor cores (``kernels/matmul/quant/gemv_imma.py``):
#   prmt(a, b, c)       ``prmt.b32`` default mode: byte i of the result is byte c[4i+2..4i] of {b, a} (a: bytes
#                       0-3, b: 4-7), or that byte's sign bit repeated over all 8 bits where c[4i+3] is set
#   imma_s8_16832       ``mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32``, D = A · B + C exactly (int32), with
#                       lane (g, t): a0 (row g, k 4t..4t+3), a1 (row g+8, same k), a2 (row g, k 4t+16..4t+19),
#                       a3 (row g+8, those k); b0 (k 4t..4t+3, col g), b1 (k 4t+16..4t+19, col g); c0, c1 (row
#                       g, cols 2t, 2t+1), c2, c3 (row g+8); the lowest byte of a register holds the lowest k.

if config.ENABLE_CUDASIM:
    def _prmt(a, b, c):
        src = int(a) | (int(b) << 32)
        c = int(c)
        out = 0
        for i in range(4):
            s = (c >> (4 * i)) & 0xF
            v = (src >> (8 * (s & 7))) & 0xFF
            if s & 8:
                v = 0xFF if v & 0x80 else 0
            out |= v << (8 * i)
        return np.uint32(out)

    @cuda.jit(device=True, inline="always")
    def prmt(a, b, c):
        return _prmt(a, b, c)

    _I8_A_ROW = np.broadcast_to((np.arange(32) >> 2)[:, None, None] + 8 * (np.arange(4) & 1)[None, :, None], (32, 4, 4))
    _I8_A_COL = np.broadcast_to(4 * (np.arange(32) & 3)[:, None, None] + 16 * (np.arange(4) >> 1)[None, :, None]
                                + np.arange(4)[None, None, :], (32, 4, 4))
    _I8_B_K = np.broadcast_to(4 * (np.arange(32) & 3)[:, None, None] + 16 * np.arange(2)[None, :, None]
                              + np.arange(4)[None, None, :], (32, 2, 4))
    _I8_B_N = np.broadcast_to((np.arange(32) >> 2)[:, None, None], (32, 2, 4))

    def _s8_bytes(words):
        w = np.asarray(words, dtype=np.float64).astype(np.int64).astype(np.uint32)
        return np.ascontiguousarray(w).view(np.int8).reshape(w.shape + (4,)).astype(np.int64)

    def _warp_imma(frags):
        a, b, c = np.zeros((16, 32), np.int64), np.zeros((32, 8), np.int64), np.zeros((16, 8), np.int64)
        a[_I8_A_ROW, _I8_A_COL] = _s8_bytes(frags[:, 0:4])
        b[_I8_B_K, _I8_B_N] = _s8_bytes(frags[:, 4:6])
        c[_C_ROW, _C_COL] = frags[:, 6:10].astype(np.int64)
        d = a @ b + c
        return ((d + 2 ** 31) % 2 ** 32 - 2 ** 31)[_C_ROW, _C_COL]

    @cuda.jit(device=True, inline="always")
    def quad_max_u32(v, scratch):
        """Max of a uint32 over the 4 lanes 4g..4g+3 (``scratch``: int32, one per thread)."""
        tid = cuda.threadIdx.x
        scratch[tid] = np.int32(np.uint32(v))
        cuda.syncthreads()
        q = tid & ~3
        r = max(np.uint32(scratch[q + i]) for i in range(4))
        cuda.syncthreads()
        return np.uint32(r)

    @cuda.jit(device=True, inline="always")
    def quad_sum_i32(v, scratch):
        """Sum of an int32 over the 4 lanes 4g..4g+3 (``scratch``: int32, one per thread)."""
        tid = cuda.threadIdx.x
        scratch[tid] = np.int32(v)
        cuda.syncthreads()
        q = tid & ~3
        r = sum(int(scratch[q + i]) for i in range(4))
        cuda.syncthreads()
        return np.int32((r + 2 ** 31) % 2 ** 32 - 2 ** 31)         # int32 arithmetic wraps

    @cuda.jit(device=True, inline="always")
    def imma_s8_16832(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        tid = cuda.threadIdx.x
        for i, r in enumerate((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
            scratch[tid, i] = r
        cuda.syncthreads()
        if tid % 32 == 0:
            scratch[tid:tid + 32, 10:14] = _warp_imma(scratch[tid:tid + 32, 0:10])
        cuda.syncthreads()
        d = [np.int32(scratch[tid, 10 + i]) for i in range(4)]
        return d[0], d[1], d[2], d[3]

else:
    @intrinsic
    def _prmt(typingctx, a, b, c):
        sig = types.uint32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, list(args))
        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def prmt(a, b, c):
        return _prmt(np.uint32(a), np.uint32(b), np.uint32(c))

    @intrinsic
    def _imma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        u, i = types.uint32, types.int32
        sig = types.UniTuple(i, 4)(u, u, u, u, u, u, i, i, i, i)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 10)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                                     "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                               "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
            res = builder.call(asm, list(args))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, k) for k in range(4)])
        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def quad_max_u32(v, scratch):
        v = np.uint32(v)
        v = max(v, np.uint32(cuda.shfl_xor_sync(0xFFFFFFFF, np.int32(v), 1)))
        return max(v, np.uint32(cuda.shfl_xor_sync(0xFFFFFFFF, np.int32(v), 2)))

    @cuda.jit(device=True, inline="always")
    def quad_sum_i32(v, scratch):
        v = np.int32(v)
        v = np.int32(v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return np.int32(v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))

    @cuda.jit(device=True, inline="always")
    def imma_s8_16832(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _imma(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3), np.uint32(b0), np.uint32(b1),
                     np.int32(c0), np.int32(c1), np.int32(c2), np.int32(c3))


# ----------------------------------------------------------------------------------------- ldmatrix
# ``ldmatrix_x4(s, i, scratch)`` / ``ldmatrix_x4_trans``: ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``.
# ``s`` is a 1-D uint32 shared array; lane l supplies word index ``i`` of row (l & 7) of matrix (l >> 3), 8 bf16
# (16 bytes, 16-byte aligned) each. Lane l = 4g + t receives, in register m:
#   x4:       words t of row g of matrix m          (elements 2t, 2t+1 of row g: an mma A or "col" B fragment
#                                                     of a matrix stored with its k index along the row)
#   x4_trans: elements (row 2t, col g) low, (row 2t+1, col g) high of matrix m (the B fragment of a matrix
#                                                     stored row-major k x n: V in P @ V)
# One instruction replaces four 32-bit shared loads. The simulator twin publishes each lane's index through
# ``scratch`` (``SIM_LDM_SCRATCH`` int64 per thread; 1 on the GPU) between barriers, so every thread of the block
# calls it together.

if config.ENABLE_CUDASIM:
    SIM_LDM_SCRATCH = THREADS

    def _ldm(s, i, scratch, trans):
        a = s._ary if hasattr(s, "_ary") else s
        tid = cuda.threadIdx.x
        scratch[tid] = int(i)
        cuda.syncthreads()
        w0 = tid & ~31
        lane = tid & 31
        g, t = lane >> 2, lane & 3
        out = []
        for m in range(4):
            if trans:
                half = 16 * (g & 1)
                lo = (int(a[int(scratch[w0 + 8 * m + 2 * t]) + (g >> 1)]) >> half) & 0xFFFF
                hi = (int(a[int(scratch[w0 + 8 * m + 2 * t + 1]) + (g >> 1)]) >> half) & 0xFFFF
                out.append(np.uint32(lo | (hi << 16)))
            else:
                out.append(np.uint32(a[int(scratch[w0 + 8 * m + g]) + t]))
        cuda.syncthreads()          # every lane has read the published indices before the next call writes
        return out[0], out[1], out[2], out[3]

    @cuda.jit(device=True, inline="always")
    def ldmatrix_x4(s, i, scratch):
        return _ldm(s, i, scratch, False)

    @cuda.jit(device=True, inline="always")
    def ldmatrix_x4_trans(s, i, scratch):
        return _ldm(s, i, scratch, True)

else:
    from vmmstream.kernels.base.launch import elem_ptr as _elem_ptr

    SIM_LDM_SCRATCH = 1

    def _ldmatrix_intrinsic(trans):
        text = ("{ .reg .u64 sa; cvta.to.shared.u64 sa, $4; "
                f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0,$1,$2,$3}}, [sa]; }}")

        @intrinsic
        def impl(typingctx, s, i):
            sig = types.UniTuple(types.uint32, 4)(s, i)

            def codegen(context, builder, sig, args):
                i32, i64 = ir.IntType(32), ir.IntType(64)
                p = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64])
                # side effects: never hoisted across the barriers that publish the tile it reads
                asm = ir.InlineAsm(fnty, text, "=r,=r,=r,=r,l,~{memory}", side_effect=True)
                res = builder.call(asm, [builder.ptrtoint(p, i64)])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, k) for k in range(4)])

            return sig, codegen

        return impl

    _ldm_x4, _ldm_x4_trans = _ldmatrix_intrinsic(False), _ldmatrix_intrinsic(True)

    @cuda.jit(device=True, inline="always")
    def ldmatrix_x4(s, i, scratch):
        return _ldm_x4(s, i)

    @cuda.jit(device=True, inline="always")
    def ldmatrix_x4_trans(s, i, scratch):
        return _ldm_x4_trans(s, i)
