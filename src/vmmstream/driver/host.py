"""The ``host`` backend: the driver interface emulated on Linux, for machines without a GPU.

* Virtual address space: one ``mmap(PROT_NONE, MAP_NORESERVE)`` reservation per ``address_reserve``,
  so the addresses are real and stay put.
* Physical handles: ``memfd_create`` files; mapping one is ``mmap(MAP_FIXED | MAP_SHARED)`` over the
  reservation, so one handle mapped at two VAs really aliases (a write through one is read through the other).
* Access: ``mprotect``; unmapping puts a fresh ``PROT_NONE`` reservation back in place.
* Streams are synchronous; a capture records the operations and a graph replays them in order.

It checks what CUDA checks (alignment, double mapping, unmapping a partial mapping, freeing a range that
is still mapped) so a bug that would fail on a GPU fails here too. It is not a performance path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time

from ..errors import DriverError
from .base import DeviceInfo, Driver, Event, Graph, Stream

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE

DEFAULT_GRANULARITY = 2 << 20
DEFAULT_TOTAL = 16 << 30


def _fail(call: str, result: str, detail: str = "") -> DriverError:
    return DriverError(call, result, detail)


def _mmap(call, addr, size, prot, flags, fd=-1, offset=0) -> int:
    p = _libc.mmap(addr, size, prot, flags, fd, offset)
    if p is None or p == _MAP_FAILED:
        err = ctypes.get_errno()
        raise _fail(call, "CUDA_ERROR_OUT_OF_MEMORY", f"mmap: {os.strerror(err)}")
    return p


class _HostStream:
    __slots__ = ("capture",)

    def __init__(self):
        self.capture: list | None = None


class HostDriver(Driver):
    backend = "host"

    def __init__(self, granularity: int = DEFAULT_GRANULARITY, total_bytes: int = DEFAULT_TOTAL):
        super().__init__()
        if granularity % mmap.PAGESIZE:
            raise ValueError(f"granularity must be a multiple of the page size {mmap.PAGESIZE}")
        self._gran = granularity
        self._total = total_bytes
        self._next_handle = 1
        self.handles: dict[int, tuple[int, int]] = {}        # handle -> (fd, size)
        self.reservations: dict[int, int] = {}               # va -> size
        self.mappings: dict[int, tuple[int, int, int]] = {}  # va -> (size, handle, offset)
        self.accessible: set[int] = set()                    # mapping VAs with read/write access
        self.allocs: dict[int, int] = {}                     # plain allocations: ptr -> size
        self.host_allocs: dict[int, tuple[mmap.mmap, int]] = {}
        self._physical = 0
        # Open captures (id of the op list -> streams that joined it by waiting on an event recorded in it).
        self._captures: dict[int, list] = {}

    # -- information --
    def granularity(self) -> int:
        return self._gran

    def mem_get_info(self) -> tuple[int, int]:
        return max(0, self._total - self._physical), self._total

    def device_info(self) -> DeviceInfo:
        free, total = self.mem_get_info()
        return DeviceInfo("host", 0, "host emulation (memfd + mmap)", total, free,
                          f"linux {os.uname().release}", self._gran, None)

    def live(self) -> dict:
        """What is still owned at the driver level; leak checks compare this with zero."""
        return {"handles": len(self.handles), "reservations": len(self.reservations),
                "mappings": len(self.mappings), "allocs": len(self.allocs), "host_allocs": len(self.host_allocs)}

    # -- helpers --
    def _check_aligned(self, call, *values):
        for v in values:
            if v % self._gran:
                raise _fail(call, "CUDA_ERROR_INVALID_VALUE", f"{v:#x} is not a multiple of the granularity")

    def _reservation_of(self, call, va, size) -> int:
        for base, rsize in self.reservations.items():
            if base <= va and va + size <= base + rsize:
                return base
        raise _fail(call, "CUDA_ERROR_INVALID_VALUE", f"[{va:#x}, +{size:#x}) is not inside a reservation")

    def _mappings_in(self, va, size):
        return [m for m, (msize, _, _) in self.mappings.items() if m < va + size and va < m + msize]

    # -- physical memory --
    def _mem_create(self, size: int) -> int:
        self._check_aligned("cuMemCreate", size)
        if size <= 0 or self._physical + size > self._total:
            raise _fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", f"{size} bytes")
        fd = os.memfd_create("vmmstream-handle", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            raise _fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", str(exc)) from None
        h = self._next_handle
        self._next_handle += 1
        self.handles[h] = (fd, size)
        self._physical += size
        return h

    def _mem_release(self, handle: int) -> None:
        if handle not in self.handles:
            raise _fail("cuMemRelease", "CUDA_ERROR_INVALID_VALUE", f"unknown handle {handle}")
        fd, size = self.handles.pop(handle)
        # As on CUDA, memory still mapped stays readable until unmapped; the fd is no longer needed.
        os.close(fd)
        self._physical -= size

    # -- virtual address space --
    def _address_reserve(self, size: int, alignment: int = 0) -> int:
        self._check_aligned("cuMemAddressReserve", size)
        align = max(alignment, self._gran)
        raw = _mmap("cuMemAddressReserve", None, size + align, _PROT_NONE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        base = (raw + align - 1) // align * align
        # Trim the over-reservation so the range is exactly [base, base + size).
        if base > raw:
            _libc.munmap(raw, base - raw)
        tail = raw + size + align - (base + size)
        if tail:
            _libc.munmap(base + size, tail)
        self.reservations[base] = size
        return base

    def _address_free(self, va: int, size: int) -> None:
        if self.reservations.get(va) != size:
            raise _fail("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", f"{va:#x}+{size:#x} is not a reservation")
        if self._mappings_in(va, size):
            raise _fail("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", "range still has mappings")
        del self.reservations[va]
        _libc.munmap(va, size)

    def _mem_map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        self._check_aligned("cuMemMap", va, size, offset)
        self._reservation_of("cuMemMap", va, size)
        if handle not in self.handles:
            raise _fail("cuMemMap", "CUDA_ERROR_INVALID_HANDLE", f"unknown handle {handle}")
        fd, hsize = self.handles[handle]
        if offset != 0 or size != hsize:
            # As on CUDA (seen on the H200): a handle is mapped whole, never a part of it.
            raise _fail("cuMemMap", "CUDA_ERROR_NOT_SUPPORTED", "a handle must be mapped whole (offset 0, its size)")
        if self._mappings_in(va, size):
            raise _fail("cuMemMap", "CUDA_ERROR_ALREADY_MAPPED", f"{va:#x} is already mapped")
        _mmap("cuMemMap", va, size, _PROT_NONE, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
        self.mappings[va] = (size, handle, offset)

    def _mem_set_access(self, va: int, size: int) -> None:
        covered = 0
        ms = self._mappings_in(va, size)
        for m in ms:
            msize = self.mappings[m][0]
            if m < va or m + msize > va + size:
                raise _fail("cuMemSetAccess", "CUDA_ERROR_INVALID_VALUE", "range splits a mapping")
            covered += msize
        if covered != size:
            raise _fail("cuMemSetAccess", "CUDA_ERROR_INVALID_VALUE", "range is not fully mapped")
        if _libc.mprotect(va, size, _PROT_RW) != 0:
            raise _fail("cuMemSetAccess", "CUDA_ERROR_INVALID_VALUE", os.strerror(ctypes.get_errno()))
        self.accessible.update(ms)

    def _mem_unmap(self, va: int, size: int) -> None:
        ms = self._mappings_in(va, size)
        covered = 0
        for m in ms:
            msize = self.mappings[m][0]
            if m < va or m + msize > va + size:
                raise _fail("cuMemUnmap", "CUDA_ERROR_INVALID_VALUE", "range splits a mapping")
            covered += msize
        if not ms or covered != size:
            raise _fail("cuMemUnmap", "CUDA_ERROR_INVALID_VALUE", "range is not fully mapped")
        # Put the reservation back (PROT_NONE), keeping the addresses ours.
        _mmap("cuMemUnmap", va, size, _PROT_NONE,
              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE)
        for m in ms:
            del self.mappings[m]
            self.accessible.discard(m)

    # -- plain allocations --
    def _mem_alloc(self, size: int) -> int:
        if size <= 0 or self._physical + size > self._total:
            raise _fail("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", f"{size} bytes")
        p = _mmap("cuMemAlloc", None, size, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.allocs[p] = size
        self._physical += size
        return p

    def _mem_free(self, ptr: int) -> None:
        if ptr not in self.allocs:
            raise _fail("cuMemFree", "CUDA_ERROR_INVALID_VALUE", f"{ptr:#x} is not an allocation")
        size = self.allocs.pop(ptr)
        _libc.munmap(ptr, size)
        self._physical -= size

    def _host_alloc(self, size: int) -> int:
        buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.host_allocs[ptr] = (buf, size)
        return ptr

    def _host_free(self, ptr: int) -> None:
        if ptr not in self.host_allocs:
            raise _fail("cuMemFreeHost", "CUDA_ERROR_INVALID_VALUE", f"{ptr:#x}")
        # The buffer is closed once no ctypes view into it remains; drop ours.
        self.host_allocs.pop(ptr)

    # -- streams and events: synchronous, recorded while capturing --
    def _run(self, stream: Stream, op) -> None:
        hs = stream.backend_obj if stream is not None else None
        if hs is not None and hs.capture is not None:
            hs.capture.append(op)
        else:
            op()

    def _stream_create(self, name: str = "") -> Stream:
        return Stream(0, _HostStream(), name)

    def _stream_destroy(self, stream: Stream) -> None:
        pass

    def _event_create(self, timing: bool = False) -> Event:
        return Event(0, {"t": None}, timing)

    def _event_destroy(self, event: Event) -> None:
        pass

    def _event_record(self, event: Event, stream: Stream) -> None:
        hs = stream.backend_obj if stream is not None else None
        # As on CUDA, an event recorded inside a capture lets another stream join it by waiting on it.
        event.backend_obj["capture"] = hs.capture if hs is not None else None

        def op():
            event.backend_obj["t"] = time.perf_counter()
        self._run(stream, op)

    def _event_query(self, event: Event) -> bool:
        return True  # every host operation completes before its call returns

    def _event_synchronize(self, event: Event) -> None:
        pass

    def _event_elapsed_ms(self, start: Event, end: Event) -> float:
        a, b = start.backend_obj["t"], end.backend_obj["t"]
        if a is None or b is None:
            raise _fail("cuEventElapsedTime", "CUDA_ERROR_INVALID_HANDLE", "event not recorded")
        return (b - a) * 1e3

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        cap = event.backend_obj.get("capture")
        hs = stream.backend_obj
        if cap is not None and id(cap) in self._captures and hs.capture is None:
            hs.capture = cap                       # this stream's work is now part of that capture
            self._captures[id(cap)].append(hs)

    def _stream_synchronize(self, stream: Stream) -> None:
        pass

    def _synchronize(self) -> None:
        pass

    def _memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._run(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def _memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._run(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def _memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._run(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def _memset_d8_async(self, dst: int, value: int, nbytes: int, stream: Stream) -> None:
        self._run(stream, lambda: ctypes.memset(dst, value, nbytes))

    def launch_host_func(self, stream: Stream, fn, *args) -> None:
        """Run ``fn(*args)`` in stream order (recorded while capturing). Host kernels go through here."""
        self._run(stream, lambda: fn(*args))

    # -- graphs --
    def _begin_capture(self, stream: Stream) -> None:
        hs = stream.backend_obj
        if hs.capture is not None:
            raise _fail("cuStreamBeginCapture", "CUDA_ERROR_ILLEGAL_STATE", "stream is already capturing")
        hs.capture = []
        self._captures[id(hs.capture)] = []

    def _end_capture(self, stream: Stream) -> Graph:
        hs = stream.backend_obj
        if hs.capture is None:
            raise _fail("cuStreamEndCapture", "CUDA_ERROR_ILLEGAL_STATE", "stream is not capturing")
        ops, hs.capture = hs.capture, None
        for joined in self._captures.pop(id(ops), []):
            joined.capture = None
        return Graph(ops=ops, node_count=len(ops))

    def _graph_instantiate(self, graph: Graph) -> Graph:
        return Graph(handle=graph, ops=list(graph.ops), node_count=graph.node_count)

    def _graph_launch(self, graph: Graph, stream: Stream) -> None:
        for op in graph.ops:
            self._run(stream, op)

    def _graph_destroy(self, graph: Graph) -> None:
        graph.ops = []

    def close(self) -> None:
        for m, (size, _, _) in list(self.mappings.items()):
            self._mem_unmap(m, size)
        for h in list(self.handles):
            self._mem_release(h)
        for va, size in list(self.reservations.items()):
            self._address_free(va, size)
        for p in list(self.allocs):
            self._mem_free(p)
        self.host_allocs.clear()
