"""Gather the routed experts of one MoE layer into the expert slots, driven by the routing on the device.

An expert *unit* is one expert's gate, up and down weights in one byte range of ``unit`` bytes (parts
256-byte aligned; any dtype, bf16 or quantized — this kernel moves bytes). Resident units live in
``pool [R, U]`` (device), every unit has a pinned host copy in ``host [E, U]`` (this layer's units, host-mapped:
read by the kernel over PCIe, zero-copy). For the decode step (one token, k distinct routed experts):

    slot j <- the unit of expert e = ids[0, j]:  pool[loc[e]] when loc[e] >= 0 (device to device), else host[e]
    mapped[0, j] = j                             (the expert FFN then runs over the k slots as its "experts")
    counts[e] += 1; stats: hits / misses / bytes copied from the host

so the copy is part of the captured decode graph and only routed experts move (I-sized bytes per routed expert,
never the layer's other experts). A block (c, j) copies chunk c (``CHUNK`` bytes, 16-byte loads and stores) of
slot j; block (0, j) also writes the mapping and the counters (atomics). ``loc`` is read when the kernel runs:
re-choosing the resident set rewrites it and the pool, and the captured graph stays valid.

Limits: one token (decode; prefill runs the experts in host-driven rounds instead), k <= the slot count, unit
bytes a multiple of 16 and 16-byte aligned rows.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import SIM, as_stream, check_workspace
from vmmstream.kernels.base.workspace import NONE

CAPTURE_SAFE = True      # device arrays only (the host copy is host-mapped memory), no allocation, no sync
CHUNK = 256 << 10         # bytes per block: 264 blocks for two 66 MiB units, loads in flight on every SM
THREADS = 256
HITS, MISSES, BYTES = 0, 1, 2

if SIM:
    def _ld16(arr, r, off):
        a = arr._ary if hasattr(arr, "_ary") else arr
        w = np.ascontiguousarray(a[r, off:off + 16]).view(np.uint32)
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])

    def _st16(arr, r, off, w0, w1, w2, w3):
        a = arr._ary if hasattr(arr, "_ary") else arr
        a[r, off:off + 16] = np.array([w0, w1, w2, w3], np.uint32).view(np.uint8)
else:
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    _V4 = ir.VectorType(ir.IntType(32), 4)

    def _ptr(context, builder, aty, arr, r, off):
        a = context.make_array(aty)(context, builder, value=arr)
        stride = builder.extract_value(a.strides, 0)
        base = builder.ptrtoint(a.data, ir.IntType(64))
        r = context.cast(builder, r, types.intp, types.intp)
        addr = builder.add(base, builder.add(builder.mul(r, stride), off))
        return builder.inttoptr(addr, _V4.as_pointer())

    @intrinsic
    def _ld16(typingctx, arr, r, off):
        """16 bytes at byte ``off`` of row ``r`` of a uint8 [rows, U] array (``ld.global.v4.u32``)."""
        sig = types.UniTuple(types.uint32, 4)(arr, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            p = _ptr(context, builder, sig.args[0], args[0], args[1], args[2])
            v = builder.load(p, align=16)
            words = [builder.extract_element(v, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, words)
        return sig, codegen

    @intrinsic
    def _st16(typingctx, arr, r, off, w0, w1, w2, w3):
        sig = types.void(arr, types.intp, types.intp, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            p = _ptr(context, builder, sig.args[0], args[0], args[1], args[2])
            v = ir.Constant(_V4, ir.Undefined)
            for i in range(4):
                v = builder.insert_element(v, args[3 + i], ir.Constant(ir.IntType(32), i))
            builder.store(v, p, align=16)
            return context.get_dummy_value()
        return sig, codegen


def _gather(ids, loc, pool, host, slots, mapped, counts, stats, unit):
    # ids, mapped: [1, k] int32; loc: [E] int32; pool: [R, U] u8 (R >= 1); host: [E, U] u8 (host-mapped);
    # slots: [S, U] u8 (S >= k); counts: [E] int64; stats: [3] int64. grid: (ceil(unit / CHUNK), k)
    c, j = cuda.blockIdx.x, cuda.blockIdx.y
    tid = cuda.threadIdx.x
    e = ids[0, j]
    r = loc[e]
    lo = c * CHUNK
    hi = min(lo + CHUNK, unit)
    for off in range(lo + 16 * tid, hi, 16 * THREADS):
        if r >= 0:
            w0, w1, w2, w3 = _ld16(pool, r, off)
        else:
            w0, w1, w2, w3 = _ld16(host, e, off)
        _st16(slots, j, off, w0, w1, w2, w3)
    if c == 0 and tid == 0:
        mapped[0, j] = j
        cuda.atomic.add(counts, e, 1)
        if r >= 0:
            cuda.atomic.add(stats, HITS, 1)
        else:
            cuda.atomic.add(stats, MISSES, 1)
            cuda.atomic.add(stats, BYTES, unit)


_kernel = jit(_gather)


def workspace_requirement(top_k: int, unit: int):
    """No scratch: the slots are weight slots, the mapping an activation."""
    return NONE


def gather(ids, loc, pool, host, slots, mapped, counts, stats, *, workspace=None, stream=None):
    """Copy the units of the experts ``ids[0, :]`` routes to into ``slots[0:k]`` (see the module docstring)."""
    check_workspace("expert_gather", workspace, 0)
    t, k = ids.shape
    e, unit = host.shape
    if (t != 1 or mapped.shape != (1, k) or loc.shape != (e,) or slots.shape[0] < k or slots.shape[1] != unit
            or pool.shape[1] != unit or counts.shape != (e,) or stats.shape[0] < 3 or unit % 16):
        raise ValueError(f"expert_gather shapes: ids {ids.shape}, loc {loc.shape}, pool {pool.shape}, host "
                         f"{host.shape}, slots {slots.shape}, mapped {mapped.shape}, counts {counts.shape} "
                         "(one token, k <= slots, unit bytes a multiple of 16)")
    _kernel[((unit + CHUNK - 1) // CHUNK, k), THREADS, as_stream(stream)](
        ids, loc, pool, host, slots, mapped, counts, stats, unit)


def reference(ids, loc, pool, host, slots, counts, stats):
    """NumPy twin: returns (slots', mapped, counts', stats') as new arrays."""
    slots, counts, stats = np.array(slots), np.array(counts), np.array(stats)
    k = ids.shape[1]
    mapped = np.arange(k, dtype=np.int32)[None, :]
    for j in range(k):
        e = int(ids[0, j])
        r = int(loc[e])
        slots[j] = pool[r] if r >= 0 else host[e]
        counts[e] += 1
        stats[HITS if r >= 0 else MISSES] += 1
        stats[BYTES] += 0 if r >= 0 else host.shape[1]
    return slots, mapped, counts, stats


def bytes_moved(top_k: int, unit: int, misses: int) -> int:
    """Bytes written to the slots (k units) and read: resident units from HBM, the misses over PCIe."""
    return 2 * top_k * unit


def flops(*_) -> int:
    return 0


_SIG = ("void(int32[:, ::1], int32[::1], uint8[:, ::1], uint8[:, ::1], uint8[:, ::1], int32[:, ::1], int64[::1], "
        "int64[::1], int64)")
SIGNATURES = [(_gather, _SIG)]
