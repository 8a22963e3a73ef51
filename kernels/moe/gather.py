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

A batch's decode step (``gather_round``): its tokens may route to more distinct experts than there are slots, so
the step runs ``rounds(...)`` rounds, each a gather of the next S distinct experts (ranked in ascending order on
the device) followed by the expert FFN over the slots for the pairs of that round (the others masked). The
number of rounds depends on the batch size only, so a batch's step is captured once too.

Limits: ``gather`` one token (prefill runs the experts in host-driven rounds instead), k <= the slot count;
``gather_round`` at most ``route.MAX_EXPERTS`` experts; unit bytes a multiple of 16 and 16-byte aligned rows.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from vmmstream.kernels.base.jit import jit
from vmmstream.kernels.base.launch import SIM, as_stream, check_workspace
from vmmstream.kernels.base.workspace import NONE
from vmmstream.kernels.moe.route import MAX_EXPERTS     # the router's limit: the round kernel's table of ranks

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


@cuda.jit(device=True, inline="always")
def _copy_chunk(pool, host, slots, r, e, j, c, tid, unit):
    """Chunk c of expert e's unit into slot j: from pool row r where resident (r >= 0), else from the host copy."""
    lo = c * CHUNK
    hi = min(lo + CHUNK, unit)
    for off in range(lo + 16 * tid, hi, 16 * THREADS):
        if r >= 0:
            w0, w1, w2, w3 = _ld16(pool, r, off)
        else:
            w0, w1, w2, w3 = _ld16(host, e, off)
        _st16(slots, j, off, w0, w1, w2, w3)


@cuda.jit(device=True, inline="always")
def _count(counts, stats, e, routed, r, unit):
    """Expert e's routed pairs, and its unit's copy: a hit (from the pool) or a miss (its bytes over PCIe)."""
    cuda.atomic.add(counts, e, routed)
    if r >= 0:
        cuda.atomic.add(stats, HITS, 1)
    else:
        cuda.atomic.add(stats, MISSES, 1)
        cuda.atomic.add(stats, BYTES, unit)


def _gather(ids, loc, pool, host, slots, mapped, counts, stats, unit):
    # ids, mapped: [1, k] int32; loc: [E] int32; pool: [R, U] u8 (R >= 1); host: [E, U] u8 (host-mapped);
    # slots: [S, U] u8 (S >= k); counts: [E] int64; stats: [3] int64. grid: (ceil(unit / CHUNK), k)
    c, j = cuda.blockIdx.x, cuda.blockIdx.y
    tid = cuda.threadIdx.x
    e = ids[0, j]
    r = loc[e]
    _copy_chunk(pool, host, slots, r, e, j, c, tid, unit)
    if c == 0 and tid == 0:
        mapped[0, j] = j
        _count(counts, stats, e, 1, r, unit)


_kernel = jit(_gather)

def _gather_round(ids, loc, pool, host, slots, mapped, counts, stats, unit, rnd):
    # ids, mapped: [n, k] int32; loc: [E] int32 (E <= MAX_EXPERTS); grid: (ceil(unit / CHUNK), S) for S slots.
    # Every block ranks the distinct experts of ids (ascending); round rnd takes ranks rnd*S .. rnd*S + S - 1, the
    # expert of rank rnd*S + j going to slot j.
    c, j = cuda.blockIdx.x, cuda.blockIdx.y
    ns = cuda.gridDim.y
    tid = cuda.threadIdx.x
    rank = cuda.shared.array(MAX_EXPERTS, np.int32)        # 0: not routed; else 1 + its rank
    mine = cuda.shared.array(1, np.int32)
    n, k = ids.shape
    ne = loc.shape[0]
    for e in range(tid, ne, THREADS):
        rank[e] = 0
    cuda.syncthreads()
    for p in range(tid, n * k, THREADS):
        e = ids[p // k, p % k]
        if e >= 0 and e < ne:
            rank[e] = 1
    cuda.syncthreads()
    if tid == 0:
        got, want = 0, rnd * ns + j
        mine[0] = -1
        for e in range(ne):
            if rank[e] != 0:
                if got == want:
                    mine[0] = e
                got += 1
                rank[e] = got
    cuda.syncthreads()
    if c == 0 and j == 0:      # the pairs of this round's experts to their slots, every other pair masked
        for p in range(tid, n * k, THREADS):
            e = ids[p // k, p % k]
            q = -1
            if e >= 0 and e < ne:
                q = rank[e] - 1 - rnd * ns
            mapped[p // k, p % k] = q if q >= 0 and q < ns else -1
    e = mine[0]
    if e < 0:
        return
    r = loc[e]
    _copy_chunk(pool, host, slots, r, e, j, c, tid, unit)
    if c == 0 and tid == 0:
        routed = 0
        for p in range(n * k):
            if ids[p // k, p % k] == e:
                routed += 1
        _count(counts, stats, e, routed, r, unit)


_round_kernel = jit(_gather_round)


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


def rounds(tokens: int, top_k: int, num_experts: int, n_slots: int) -> int:
    """Rounds of ``gather_round`` that cover every expert ``tokens`` tokens can route to (at most E, at most
    tokens · k distinct), ``n_slots`` experts a round: a fixed count for a batch size, so a graph can hold them."""
    return -(-min(num_experts, tokens * top_k) // n_slots)


def gather_round(ids, loc, pool, host, slots, mapped, counts, stats, rnd: int, *, workspace=None, stream=None):
    """Round ``rnd`` of a batch's gather (several tokens, so more distinct experts than slots): the distinct
    experts of ``ids`` in ascending order, ``S = slots.shape[0]`` a round; the expert of rank ``rnd * S + j`` is
    copied into slot j (from the pool where resident, else from the host copy), ``mapped`` gets each pair's slot
    where its expert is in this round and -1 elsewhere (the expert FFN skips those pairs), and each expert
    copied adds its routed pairs to ``counts`` and a hit or a miss (and its bytes) to ``stats``. Everything is
    decided on the device from ``ids`` and ``loc``, so the rounds of ``rounds(...)`` can be captured once."""
    check_workspace("expert_gather_round", workspace, 0)
    n, k = ids.shape
    e, unit = host.shape
    if (mapped.shape != (n, k) or loc.shape != (e,) or e > MAX_EXPERTS or slots.shape[0] < 1
            or slots.shape[1] != unit or pool.shape[1] != unit or counts.shape != (e,) or stats.shape[0] < 3
            or unit % 16 or rnd < 0):
        raise ValueError(f"expert_gather_round shapes: ids {ids.shape}, loc {loc.shape}, pool {pool.shape}, host "
                         f"{host.shape}, slots {slots.shape}, mapped {mapped.shape}, counts {counts.shape}, round "
                         f"{rnd} (mapped as ids, at most {MAX_EXPERTS} experts, unit bytes a multiple of 16)")
    _round_kernel[((unit + CHUNK - 1) // CHUNK, slots.shape[0]), THREADS, as_stream(stream)](
        ids, loc, pool, host, slots, mapped, counts, stats, unit, rnd)


def reference_round(ids, loc, pool, host, slots, counts, stats, rnd: int):
    """NumPy twin of ``gather_round``: returns (slots', mapped, counts', stats') as new arrays."""
    slots, counts, stats = np.array(slots), np.array(counts), np.array(stats)
    ns = slots.shape[0]
    distinct = [int(e) for e in np.unique(ids)]
    mine = distinct[rnd * ns:(rnd + 1) * ns]
    mapped = np.full(ids.shape, -1, np.int32)
    for j, e in enumerate(mine):
        r = int(loc[e])
        slots[j] = pool[r] if r >= 0 else host[e]
        mapped[ids == e] = j
        counts[e] += int((ids == e).sum())
        stats[HITS if r >= 0 else MISSES] += 1
        stats[BYTES] += 0 if r >= 0 else host.shape[1]
    return slots, mapped, counts, stats


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
SIGNATURES = [(_gather, _SIG), (_gather_round, _SIG[:-1] + ", int64)")]
