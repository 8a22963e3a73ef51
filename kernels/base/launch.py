"""The launch adapter of the dense kernels: streams, alignment checks, and the few device primitives
that need a simulator twin (16-byte vector loads/stores, warp shuffles, a float bit cast).

Host side:
- ``as_stream(stream)``: what a launch passes as the numba stream (``None`` -> numba's default stream).
- ``vec8_ok(*arrays)``: may a kernel move these bf16 arrays 8 elements (16 bytes) at a time?
- ``check_workspace(...)``: the workspace contract (invariant I7) for a view that may be ``None``.

Device side (identical call sites compiled and simulated):
- ``ld8`` / ``ld8_ro`` / ``st8``: 8 bf16 at once as four uint32 words (word w = elements 2w | 2w+1 << 16).
  Compiled, they are one ``ld.global[.nc].v4.u32`` / ``st.global.v4.u32``; the caller guarantees 16-byte
  alignment (``vec8_ok``). ``ld8_ro`` marks the load invariant (read-only cache path): use it only for
  memory that no thread writes during the kernel (weights, inputs that are not also outputs).
- ``ld16_ro``: 16 bytes of a uint8 array (packed 4-bit weights) as four uint32 words, read-only; the same
  instruction as ``ld8_ro`` on the GPU, a twin of its own in the simulator.
- ``ld4w`` / ``st4w``: the same 16 bytes as 4 words of a 1-D uint32 array (shared-memory staging), at an
  index that is a multiple of 4.
- ``cp_async16`` / ``cp_async_commit`` / ``cp_async_waiter(n)()``: asynchronous 16-byte copies global ->
  shared (the simulator copies at once). ``prefetch_l2``: warm L2 with the line of an element (a no-op in
  the simulator).
- ``ld1w_ro``: one word of a read-only 1-D uint32 array (``ld.global.nc``). ``u32_add`` / ``u32_mad``: index
  arithmetic in 32 bits (Numba widens uint32 operands to 64 bits, which costs carry and compare pairs in
  hot loops); ``u32_mul_hi``: the high word of a product (several right shifts summed in one IMAD.HI). ``f32_as_u32`` / ``u32_as_f32``: bit casts.
- ``lane_ptr`` / ``ptr_add`` / ``ld16_at`` / ``ld1b_at``: a thread's base address in a 1-D uint8 array held in one
  register, and read-only 16-byte and 1-byte loads at base + i * step (the simulator's "address" is the
  element offset).
- ``grid_dependency_wait`` / ``grid_dependents_launch`` (``griddepcontrol``; no-ops unless the kernel was
  launched by ``launch_pdl``, programmatic dependent launch): wait for the kernel before it on the stream to
  finish; let the next kernel's blocks start.
- ``warp_any``: a full-warp vote. ``warp_sum`` / ``warp_argmax`` / ``warp_incl_scan`` (and ``block_sum``):
  full-warp shuffle reductions
  and scans (int32/int64/float values only: that is what ``shfl.sync`` takes). The simulator has no
  warp shuffles, so their twins exchange through a block-wide barrier; every thread of the block must
  therefore call them uniformly (the kernels here never return early before a reduction, which a
  full-mask shuffle requires anyway).
- Every device helper is IR-inlined (``inline="always"``): a separately compiled device function
  asks the driver for the current device, which breaks ``compile_ptx`` on a machine without a GPU.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import config, cuda

from vmmstream.kernels.base.dtypes import dev_bf16_to_f32, dev_f32_to_bf16
from vmmstream.kernels.base.workspace import check_view

SIM = bool(config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF
# ``alignment`` of a shared array read or written 16 bytes at a time (``ld4w``, ``st4w``, ``cp_async16``): by
# default a uint32 array is aligned to 4 bytes only. The simulator's ``shared.array`` takes no alignment.
SHARED_ALIGN16 = None if SIM else 16


# ----------------------------------------------------------------------------------------------- host

_external = {}


def as_stream(stream):
    """Numba stream for a launch: ``None`` -> default stream (0); a numba stream passes through; an
    int handle or an object with ``cuda_stream`` (a torch stream) is wrapped once as an external stream."""
    if stream is None:
        return 0
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, int):
        if handle == 0:
            return 0
        s = _external.get(handle)
        if s is None:
            s = _external[handle] = cuda.external_stream(handle)
        return s
    return stream


def stream_handle(stream) -> int:
    """The CUstream handle (an int) of a Numba stream, a torch stream, an int or None (0: the default stream), for
    libraries that take one (cuBLASLt, cuDNN)."""
    if stream is None or stream == 0:
        return 0
    h = getattr(stream, "cuda_stream", None)
    if h is None:
        h = getattr(stream, "handle", stream)
        h = getattr(h, "value", h)
    return int(h or 0)


def capturing(stream) -> bool:
    """Whether ``stream`` (as ``stream_handle`` takes it) is being captured into a CUDA graph; the default stream
    (and the simulator's None) never is. A failed query counts as capturing: nothing is built or started then."""
    h = stream_handle(stream)
    if not h:
        return False
    from cuda.bindings import driver as cu
    err, status = cu.cuStreamIsCapturing(h)
    return err != cu.CUresult.CUDA_SUCCESS or status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def data_ptr(a) -> int:
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    return int(a.__array_interface__["data"][0])  # simulator: a FakeCUDAArray wraps an ndarray


def vec8_ok(*arrays) -> bool:
    """True when every array (bf16 as uint16) has a contiguous last axis whose length is a multiple of
    8, its other strides and its base address all multiples of 16 bytes: then every 8-element group
    starting at a multiple of 8 is one aligned 16-byte load."""
    for a in arrays:
        shape, strides = tuple(a.shape), tuple(a.strides)  # (the simulator's shape has no [-1])
        if shape[-1] % 8 or strides[-1] != a.dtype.itemsize:
            return False
        if any(s % 16 for s in strides[:-1]) or data_ptr(a) % 16:
            return False
    return True


def narrow(a, axis: int, start: int, count: int):
    """``a`` with axis ``axis`` cut to ``[start, start + count)``: a view of the same memory. On the GPU it is made
    from the array interface directly (Numba's slicing of a strided device array walks every element in Python);
    in the simulator it is plain slicing."""
    index = (slice(None),) * axis + (slice(start, start + count),)
    if SIM:
        return a[index]
    cai = a.__cuda_array_interface__
    shape = tuple(int(x) for x in a.shape)
    strides = tuple(int(x) for x in a.strides)
    ptr = int(cai["data"][0]) + int(start) * strides[axis]
    shape = shape[:axis] + (int(count),) + shape[axis + 1:]

    class _Cai:
        __cuda_array_interface__ = {"shape": shape, "typestr": cai["typestr"], "data": (ptr, False), "version": 3,
                                    "strides": strides}
    return cuda.as_cuda_array(_Cai(), sync=False)


def nbytes(view) -> int:
    return 0 if view is None else int(view.nbytes)


def check_workspace(kernel: str, workspace, needed: int) -> None:
    """Invariant I7: raise WorkspaceShortfall on a short (or missing) view; never allocate instead."""
    check_view(kernel, nbytes(workspace), int(needed))


def check_threads(threads: int) -> int:
    # Full-mask warp shuffles need whole warps.
    if threads <= 0 or threads % 32 or threads > 1024:
        raise ValueError(f"threads per block must be a multiple of 32 in [32, 1024], got {threads}")
    return int(threads)


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# --------------------------------------------------------------------------------------------- device

if SIM:
    def _flat(arr, idx):
        """(array, index) -> (numpy array, base tuple, last index) for a run along the last axis."""
        a = arr._ary if hasattr(arr, "_ary") else arr
        if isinstance(idx, tuple):
            return a, tuple(int(i) for i in idx[:-1]), int(idx[-1])
        return a, (), int(idx)

    def _ld8(arr, idx):
        a, base, j = _flat(arr, idx)
        v = np.asarray(a[base + (slice(j, j + 8),)], dtype=np.uint16).astype(np.uint32)
        if v.shape[0] != 8:
            raise IndexError("vector load past the end of the last axis")
        w = v[0::2] | (v[1::2] << np.uint32(16))
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])

    ld8 = ld8_ro = _ld8

    def ld16_ro(arr, idx):
        """16 bytes of a uint8 array along its last axis as four little-endian uint32 words."""
        a, base, j = _flat(arr, idx)
        v = np.ascontiguousarray(a[base + (slice(j, j + 16),)], dtype=np.uint8)
        if v.shape[0] != 16:
            raise IndexError("vector load past the end of the last axis")
        w = v.view(np.uint32)
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])

    def ld4w(arr, i):
        a = arr._ary if hasattr(arr, "_ary") else arr
        w = np.asarray(a[int(i):int(i) + 4], dtype=np.uint32)
        if a.dtype != np.uint32 or w.shape[0] != 4:
            raise IndexError("ld4w: 4 uint32 words of a 1-D uint32 array")
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])

    def prefetch_l2(arr, i):
        """No cache to warm in the simulator."""

    def cp_async16(dst, di, src, si):
        """The simulator copies at once: 16 bytes of the 1-D uint8 ``src`` at byte si (or, ``si`` a tuple, of
        any array from element ``src[si]`` along its last axis) to words di..di+3 of the 1-D uint32 ``dst``."""
        d = dst._ary if hasattr(dst, "_ary") else dst
        if isinstance(si, tuple):
            a, base, j = _flat(src, si)
            n = 16 // a.dtype.itemsize
            v = np.ascontiguousarray(a[base + (slice(j, j + n),)]).view(np.uint8)
        else:
            a = src._ary if hasattr(src, "_ary") else src
            v = np.ascontiguousarray(a[int(si):int(si) + 16], dtype=np.uint8)
        if v.shape[0] != 16 or d[int(di):int(di) + 4].shape[0] != 4:
            raise IndexError("cp_async16 past the end of an array")
        d[int(di):int(di) + 4] = v.view(np.uint32)

    def cp_async_commit():
        pass

    def cp_async_waiter(n):
        def wait():
            pass
        return wait

    def grid_dependency_wait():
        """The simulator runs launches one after another: nothing to wait for."""

    def grid_dependents_launch():
        pass

    def launch_pdl(kern, griddim, blockdim, stream, args):
        """The simulator has no programmatic dependent launch: a plain launch."""
        kern[griddim, blockdim, stream](*args)

    def st4w(arr, i, w0, w1, w2, w3):
        a = arr._ary if hasattr(arr, "_ary") else arr
        if a.dtype != np.uint32 or a[int(i):int(i) + 4].shape[0] != 4:
            raise IndexError("st4w: 4 uint32 words of a 1-D uint32 array")
        a[int(i):int(i) + 4] = np.array([w0, w1, w2, w3], dtype=np.uint32)

    def st8(arr, idx, w0, w1, w2, w3):
        a, base, j = _flat(arr, idx)
        w = np.array([w0, w1, w2, w3], dtype=np.uint32)
        v = np.empty(8, dtype=np.uint16)
        v[0::2] = (w & np.uint32(0xFFFF)).astype(np.uint16)
        v[1::2] = (w >> np.uint32(16)).astype(np.uint16)
        if a[base + (slice(j, j + 8),)].shape[0] != 8:
            raise IndexError("vector store past the end of the last axis")
        a[base + (slice(j, j + 8),)] = v

    def _warp_values(value):
        """Every lane's value, in lane order (one publish + two barriers stand in for a whole butterfly).
        Uses the simulator's BlockThread internals (thread_id, _manager, syncthreads) of numba-cuda 0.30."""
        th = threading.current_thread()
        box = th._manager.__dict__.setdefault("_vmm_warp", {})
        tid = th.thread_id
        box[tid] = value
        th.syncthreads()
        base = tid - tid % 32
        vals = [box[t] for t in range(base, base + 32) if t in box]
        th.syncthreads()
        return vals

    def warp_sum(v):
        t = type(v)
        return t(sum(_warp_values(v), t(0)))

    def warp_any(pred):
        return any(bool(p) for p in _warp_values(bool(pred)))

    def warp_argmax(v, i):
        best_v, best_i = v, i
        for ov, oi in _warp_values((v, i)):
            if ov > best_v or (ov == best_v and oi < best_i):
                best_v, best_i = ov, oi
        return best_v, best_i

    def warp_incl_scan(v):
        """Inclusive prefix sum over lanes 0..lane."""
        th = threading.current_thread()
        vals = _warp_values(v)
        t = type(v)
        return t(sum(vals[: th.thread_id % 32 + 1], t(0)))

    def f32_as_u32(f):
        return np.float32(f).view(np.uint32)

    def u32_as_f32(w):
        return np.uint32(w).view(np.float32)

    def u32_add(a, b):
        return np.uint32((int(a) + int(b)) & 0xFFFFFFFF)

    def u32_mad(a, b, c):
        return np.uint32((int(a) * int(b) + int(c)) & 0xFFFFFFFF)

    def u32_mul_hi(a, b):
        return np.uint32(int(a) * int(b) >> 32)

    def u32_pin(a):
        return np.uint32(a)

    def lane_ptr(arr, off):
        """The simulator's "address": the element offset itself (``ld16_at`` / ``ld1b_at`` read ``arr`` there)."""
        return int(off)

    def ptr_add(p, i, step):
        return int(p) + int(i) * int(step)

    def ld16_at(arr, p):
        a = arr._ary if hasattr(arr, "_ary") else arr
        if a.dtype != np.uint8 or a.ndim != 1:
            raise IndexError("ld16_at: 16 bytes of a 1-D uint8 array")
        v = np.ascontiguousarray(a[int(p):int(p) + 16])
        if v.shape[0] != 16:
            raise IndexError("vector load past the end of the array")
        w = v.view(np.uint32)
        return np.uint32(w[0]), np.uint32(w[1]), np.uint32(w[2]), np.uint32(w[3])

    def ld1b_at(arr, p):
        a = arr._ary if hasattr(arr, "_ary") else arr
        if a.dtype != np.uint8 or a.ndim != 1:
            raise IndexError("ld1b_at: a byte of a 1-D uint8 array")
        return np.uint32(a[int(p)])

    def ld1w_ro(arr, i):
        a = arr._ary if hasattr(arr, "_ary") else arr
        if a.dtype != np.uint32:
            raise IndexError("ld1w_ro: a word of a 1-D uint32 array")
        return np.uint32(a[int(i)])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.api_util import normalize_indices
    from numba.cuda.extending import intrinsic

    _V4 = ir.VectorType(ir.IntType(32), 4)

    def elem_ptr(context, builder, aryty, ary, indty, inds):
        indty, indices = normalize_indices(context, builder, indty, inds, aryty, aryty.dtype)
        a = context.make_array(aryty)(context, builder, value=ary)
        return cgutils.get_item_pointer(context, builder, aryty, a, indices, wraparound=False)

    def _make_ld8(invariant: bool):
        @intrinsic
        def impl(typingctx, arr, idx):
            sig = types.UniTuple(types.uint32, 4)(arr, idx)

            def codegen(context, builder, sig, args):
                p = elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                v = builder.load(builder.bitcast(p, _V4.as_pointer()), align=16)
                if invariant:  # lets NVPTX emit ld.global.nc (read-only data cache)
                    v.set_metadata("invariant.load", builder.module.add_metadata([]))
                words = [builder.extract_element(v, ir.Constant(ir.IntType(32), i)) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, words)

            return sig, codegen

        return impl

    ld8 = _make_ld8(False)
    ld8_ro = _make_ld8(True)
    ld16_ro = ld8_ro    # the intrinsic loads 16 bytes at the element's address, whatever the dtype
    ld4w = ld8       # the same 16-byte load, at element i of a 1-D uint32 array (shared memory too)

    @cuda.jit(device=True, inline="always")
    def st4w(arr, i, w0, w1, w2, w3):
        st8(arr, i, w0, w1, w2, w3)

    @intrinsic
    def cp_async16(typingctx, dst, di, src, si):
        """``cp.async.cg.shared.global`` of 16 bytes: src[si] (global) -> dst[di] (a shared array)."""
        sig = types.void(dst, di, src, si)

        def codegen(context, builder, sig, args):
            pd = elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            ps = elem_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            i64 = ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64, i64]),
                               "{ .reg .u64 sa; cvta.to.shared.u64 sa, $0; cp.async.cg.shared.global [sa], [$1], 16; }",
                               "l,l,~{memory}", side_effect=True)
            builder.call(asm, [builder.ptrtoint(pd, i64), builder.ptrtoint(ps, i64)])
            return context.get_dummy_value()

        return sig, codegen

    def _asm_void(text):
        @intrinsic
        def impl(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return sig, codegen

        return impl

    cp_async_commit = _asm_void("cp.async.commit_group;")
    grid_dependency_wait = _asm_void("griddepcontrol.wait;")
    grid_dependents_launch = _asm_void("griddepcontrol.launch_dependents;")

    def _core_stream(stream):
        """``stream`` (a Numba stream, 0 for the default stream, a cuda.core ``Stream``, or any object with
        ``__cuda_stream__``) as a cuda.core ``Stream`` over the same handle, borrowed: cuda.core's ``launch``
        deprecates being handed foreign stream objects."""
        from cuda.core import Stream
        if isinstance(stream, Stream):
            return stream
        if not stream:
            return Stream.from_handle(0)
        if hasattr(stream, "__cuda_stream__"):
            version, handle = stream.__cuda_stream__()
            if version != 0:
                raise TypeError(f"stream {stream!r}: __cuda_stream__ version {version}, expected 0")
            return Stream.from_handle(int(handle))
        raise TypeError(f"expected a CUDA stream (Numba or cuda.core) or 0, got {type(stream).__name__}")

    def launch_pdl(kern, griddim, blockdim, stream, args):
        """Launch the Numba kernel ``kern`` with programmatic stream serialization (cuda.core ``LaunchConfig``):
        its blocks may start while the kernel before it on ``stream`` is still running, once that one's
        blocks have all called ``grid_dependents_launch`` (or exited). Whatever the kernel reads before its
        ``grid_dependency_wait`` must not be written by that kernel. Capture-safe once ``kern`` has been
        compiled for these argument types (a first call compiles)."""
        from cuda.core import LaunchConfig, launch
        k = kern.compile(tuple(kern.typeof_pyval(a) for a in args))
        retr, kargs = [], []
        for t, v in zip(k.argument_types, args):
            k._prepare_args(t, v, stream, retr, kargs)
        cfg = LaunchConfig(grid=griddim, block=blockdim, shmem_size=0, programmatic_stream_serialization=True)
        launch(_core_stream(stream), cfg, k._codelibrary.get_cufunc().kernel, *kargs)
        for writeback in retr:             # host arrays numba copied in (as its own launch does)
            writeback()

    _WAITS = {}

    def cp_async_waiter(n):
        """A device function that waits until at most ``n`` committed cp.async groups are pending."""
        if n not in _WAITS:
            _WAITS[n] = _asm_void(f"cp.async.wait_group {int(n)};")
        return _WAITS[n]

    @intrinsic
    def prefetch_l2(typingctx, arr, idx):
        """``prefetch.global.L2`` of the line holding arr[idx]: no register, no wait."""
        sig = types.void(arr, idx)

        def codegen(context, builder, sig, args):
            p = elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            i64 = ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64]), "prefetch.global.L2 [$0];", "l",
                               side_effect=True)
            builder.call(asm, [builder.ptrtoint(p, i64)])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def st8(typingctx, arr, idx, w0, w1, w2, w3):
        sig = types.void(arr, idx, w0, w1, w2, w3)

        def codegen(context, builder, sig, args):
            p = elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = ir.Constant(_V4, ir.Undefined)
            for i in range(4):
                w = context.cast(builder, args[2 + i], sig.args[2 + i], types.uint32)
                v = builder.insert_element(v, w, ir.Constant(ir.IntType(32), i))
            builder.store(v, builder.bitcast(p, _V4.as_pointer()), align=16)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def shfl_xor(v, m):
        return cuda.shfl_xor_sync(FULL_MASK, v, m)

    @cuda.jit(device=True, inline="always")
    def f32_as_u32(f):
        return np.uint32(libdevice.float_as_int(f))

    @cuda.jit(device=True, inline="always")
    def u32_as_f32(w):
        return libdevice.int_as_float(np.int32(w))

    @intrinsic
    def u32_add(typingctx, a, b):
        """a + b in 32-bit arithmetic (wrapping), where Numba would widen uint32 operands to 64 bits."""
        sig = types.uint32(types.uint32, types.uint32)
        return sig, lambda context, builder, sig, args: builder.add(args[0], args[1])

    @intrinsic
    def u32_mad(typingctx, a, b, c):
        """a * b + c in 32-bit arithmetic (wrapping)."""
        sig = types.uint32(types.uint32, types.uint32, types.uint32)
        return sig, lambda context, builder, sig, args: builder.add(builder.mul(args[0], args[1]), args[2])

    @intrinsic
    def u32_mul_hi(typingctx, a, b):
        """The high 32 bits of the 64-bit product a * b (``mul.hi.u32``, one IMAD.HI)."""
        sig = types.uint32(types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), "mul.hi.u32 $0, $1, $2;", "=r,r,r")
            return builder.call(asm, list(args))
        return sig, codegen

    @intrinsic
    def u32_pin(typingctx, a):
        """``a`` through an opaque ``mov``: a loop-invariant value computed once before a loop stays in its
        register (the code generator would otherwise rebuild an address's parts inside the loop from the
        thread index, several instructions per iteration)."""
        sig = types.uint32(types.uint32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "mov.b32 $0, $1;", "=r,r")
            return builder.call(asm, [args[0]])
        return sig, codegen

    @intrinsic
    def lane_ptr(typingctx, arr, off):
        """The global address of element ``off`` of a 1-D array, through an opaque ``mov``: a per-thread base
        kept in one 64-bit register, so a load at ``ptr_add(p, i, step)`` is one wide multiply-add (the code
        generator would otherwise add the array's base to each load's offset in two more instructions)."""
        sig = types.uint64(arr, off)

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            a = context.make_array(sig.args[0])(context, builder, value=args[0])
            o = context.cast(builder, args[1], sig.args[1], types.intp)
            v = builder.ptrtoint(builder.gep(a.data, [o], inbounds=True), i64)
            asm = ir.InlineAsm(ir.FunctionType(i64, [i64]), "mov.b64 $0, $1;", "=l,l")
            return builder.call(asm, [v])
        return sig, codegen

    @intrinsic
    def ptr_add(typingctx, p, i, step):
        """p + i * step in 64 bits, i an unsigned 32-bit index (``mad.wide.u32``)."""
        sig = types.uint64(types.uint64, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            return builder.add(args[0], builder.mul(builder.zext(args[1], i64), builder.zext(args[2], i64)))
        return sig, codegen

    @intrinsic
    def ld16_at(typingctx, arr, p):
        """16 bytes at the global address ``p`` (from ``lane_ptr``; 16-byte aligned, read-only during the
        kernel) as four words: one ``ld.global.nc.v4.u32``, issued where it is written (a side effect to the
        optimizer, which would otherwise sink a prefetch into the branch that uses it, next to its use).
        ``arr``, the array p points into, is read by the simulator's twin only."""
        sig = types.UniTuple(types.uint32, 4)(arr, types.uint64)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", side_effect=True)
            res = builder.call(asm, [args[1]])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
        return sig, codegen

    @intrinsic
    def ld1b_at(typingctx, arr, p):
        """The byte at the global address ``p`` (read-only during the kernel), zero-extended: ``ld.global.nc.u8``."""
        sig = types.uint32(arr, types.uint64)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [ir.IntType(64)]), "ld.global.nc.u8 $0, [$1];", "=r,l",
                               side_effect=True)
            return builder.call(asm, [args[1]])
        return sig, codegen

    @intrinsic
    def ld1w_ro(typingctx, arr, idx):
        """One uint32 of a read-only 1-D uint32 array through the read-only data cache (``ld.global.nc``)."""
        sig = types.uint32(arr, idx)

        def codegen(context, builder, sig, args):
            p = elem_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = builder.load(p, align=4)
            v.set_metadata("invariant.load", builder.module.add_metadata([]))
            return v

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def warp_any(pred):
        """True in every lane if ``pred`` holds in any lane (one ``vote.any``)."""
        return cuda.any_sync(FULL_MASK, pred)

    @cuda.jit(device=True, inline="always")
    def warp_sum(v):
        """Sum over the 32 lanes, result in every lane."""
        m = 16
        while m > 0:
            v += shfl_xor(v, m)
            m //= 2
        return v

    @cuda.jit(device=True, inline="always")
    def warp_argmax(v, i):
        """(max, its smallest index) over the warp, in every lane: ties go to the lower index, like np.argmax."""
        m = 16
        while m > 0:
            ov = shfl_xor(v, m)
            oi = shfl_xor(i, m)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
            m //= 2
        return v, i

    @cuda.jit(device=True, inline="always")
    def warp_incl_scan(v):
        """Inclusive prefix sum over lanes 0..lane (Hillis-Steele with shfl.up)."""
        lane = cuda.threadIdx.x % 32
        d = 1
        while d < 32:
            u = cuda.shfl_up_sync(FULL_MASK, v, d)
            if lane >= d:
                v += u
            d *= 2
        return v


@cuda.jit(device=True, inline="always")
def lo_f32(w):
    """Low bf16 of a packed word, as fp32."""
    return dev_bf16_to_f32(np.uint32(w) & np.uint32(0xFFFF))


@cuda.jit(device=True, inline="always")
def hi_f32(w):
    """High bf16 of a packed word, as fp32."""
    return dev_bf16_to_f32(np.uint32(w) >> np.uint32(16))


@cuda.jit(device=True, inline="always")
def pack2(a, b):
    """Two fp32 -> one word holding bf16(a) | bf16(b) << 16 (round to nearest even)."""
    return np.uint32(dev_f32_to_bf16(a)) | (np.uint32(dev_f32_to_bf16(b)) << np.uint32(16))


@cuda.jit(device=True, inline="always")
def block_sum(v, scratch):
    """Sum over the block (threads a multiple of 32), result in every thread. ``scratch``: shared fp32
    with at least one slot per warp; it is free again when this returns."""
    v = warp_sum(v)
    tid = cuda.threadIdx.x
    if tid % 32 == 0:
        scratch[tid // 32] = v
    cuda.syncthreads()
    t = scratch[0]
    for w in range(1, cuda.blockDim.x // 32):
        t += scratch[w]
    cuda.syncthreads()
    return t
