"""The ``cuda`` backend: the CUDA driver API through ``cuda.bindings``.

Every call is checked; a failure raises ``DriverError`` naming the call and the ``CUresult``.
The backend works in the device's *primary* context, the one Numba uses, so pool addresses are
valid for Numba kernels and Numba's streams interoperate with ours.
"""

from __future__ import annotations

from ..errors import DriverError
from .base import DeviceInfo, Driver, Event, Graph, Stream

try:  # imported lazily by the seam; a machine without cuda.bindings simply has no cuda backend
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - depends on the machine
    cu = None


def _check(call: str, result):
    """Unpack a cuda.bindings return tuple, raising DriverError unless CUDA_SUCCESS."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise DriverError(call, getattr(err, "name", str(err)))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def cuda_usable() -> tuple[bool, str]:
    """Probe (without raising) whether a CUDA device can be used here."""
    if cu is None:
        return False, "cuda.bindings is not installed"
    try:
        err, = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return False, f"cuInit: {err.name}"
        err, n = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS or n < 1:
            return False, "no CUDA device"
    except Exception as exc:  # a broken driver install is "not usable", with the reason
        return False, f"{type(exc).__name__}: {exc}"
    return True, f"{n} device(s)"


class CudaDriver(Driver):
    backend = "cuda"

    def __init__(self, ordinal: int = 0):
        super().__init__()
        if cu is None:
            raise DriverError("import cuda.bindings", "MODULE_NOT_FOUND", "pip install cuda-bindings")
        _check("cuInit", cu.cuInit(0))
        self.ordinal = ordinal
        self.device = _check("cuDeviceGet", cu.cuDeviceGet(ordinal))
        self.context = _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.device))
        _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self.context))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]
        self._gran = int(_check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self._handles: dict[int, object] = {}
        self._closed = False

    def make_current(self) -> None:
        _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self.context))

    # -- information --
    def granularity(self) -> int:
        return self._gran

    def mem_get_info(self) -> tuple[int, int]:
        """The device's free and total bytes. Callable from any thread: one with no current context (a metrics or
        watcher thread) gets this driver's made current first; one that has a context keeps it (and is answered
        for that context's device)."""
        if not int(_check("cuCtxGetCurrent", cu.cuCtxGetCurrent())):
            self.make_current()
        free, total = _check("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free), int(total)

    def device_info(self) -> DeviceInfo:
        name = _check("cuDeviceGetName", cu.cuDeviceGetName(256, self.device))
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        free, total = self.mem_get_info()
        v = int(_check("cuDriverGetVersion", cu.cuDriverGetVersion()))
        attr = cu.CUdevice_attribute
        major = _check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device))
        minor = _check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device))
        return DeviceInfo("cuda", self.ordinal, name, total, free, f"CUDA {v // 1000}.{(v % 1000) // 10}",
                          self._gran, (int(major), int(minor)))

    # -- physical memory and VA --
    def _mem_create(self, size: int) -> int:
        h = _check("cuMemCreate", cu.cuMemCreate(size, self._prop, 0))
        key = int(h)
        self._handles[key] = h
        return key

    def _mem_release(self, handle: int) -> None:
        _check("cuMemRelease", cu.cuMemRelease(self._handles[handle]))
        del self._handles[handle]

    def _address_reserve(self, size: int, alignment: int = 0) -> int:
        return int(_check("cuMemAddressReserve", cu.cuMemAddressReserve(size, alignment, 0, 0)))

    def _address_free(self, va: int, size: int) -> None:
        _check("cuMemAddressFree", cu.cuMemAddressFree(va, size))

    def _mem_map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        _check("cuMemMap", cu.cuMemMap(va, size, offset, self._handles[handle], 0))

    def _mem_set_access(self, va: int, size: int) -> None:
        _check("cuMemSetAccess", cu.cuMemSetAccess(va, size, self._access, 1))

    def _mem_unmap(self, va: int, size: int) -> None:
        _check("cuMemUnmap", cu.cuMemUnmap(va, size))

    # -- plain allocations and pinned host memory --
    def _mem_alloc(self, size: int) -> int:
        return int(_check("cuMemAlloc", cu.cuMemAlloc(size)))

    def _mem_free(self, ptr: int) -> None:
        _check("cuMemFree", cu.cuMemFree(ptr))

    def _host_alloc(self, size: int) -> int:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        return int(_check("cuMemHostAlloc", cu.cuMemHostAlloc(size, flags)))

    def _host_free(self, ptr: int) -> None:
        _check("cuMemFreeHost", cu.cuMemFreeHost(ptr))

    def legacy_stream(self) -> Stream:
        """The legacy default stream (where Numba launches when given no stream)."""
        return Stream(0, cu.CUstream(0), "legacy-default")

    # -- streams and events --
    def _stream_create(self, name: str = "") -> Stream:
        s = _check("cuStreamCreate", cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        return Stream(int(s), s, name)

    def _stream_destroy(self, stream: Stream) -> None:
        _check("cuStreamDestroy", cu.cuStreamDestroy(stream.backend_obj))

    def _event_create(self, timing: bool = False) -> Event:
        flags = 0 if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        e = _check("cuEventCreate", cu.cuEventCreate(flags))
        return Event(int(e), e, timing)

    def _event_destroy(self, event: Event) -> None:
        _check("cuEventDestroy", cu.cuEventDestroy(event.backend_obj))

    def _event_record(self, event: Event, stream: Stream) -> None:
        _check("cuEventRecord", cu.cuEventRecord(event.backend_obj, stream.backend_obj))

    def _event_query(self, event: Event) -> bool:
        err, = cu.cuEventQuery(event.backend_obj)
        if err == cu.CUresult.CUDA_SUCCESS:
            return True
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise DriverError("cuEventQuery", err.name)

    def _event_synchronize(self, event: Event) -> None:
        _check("cuEventSynchronize", cu.cuEventSynchronize(event.backend_obj))

    def _event_elapsed_ms(self, start: Event, end: Event) -> float:
        return float(_check("cuEventElapsedTime", cu.cuEventElapsedTime(start.backend_obj, end.backend_obj)))

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        _check("cuStreamWaitEvent", cu.cuStreamWaitEvent(stream.backend_obj, event.backend_obj, 0))

    def _stream_synchronize(self, stream: Stream) -> None:
        _check("cuStreamSynchronize", cu.cuStreamSynchronize(stream.backend_obj))

    def _synchronize(self) -> None:
        _check("cuCtxSynchronize", cu.cuCtxSynchronize())

    def _memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        _check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream.backend_obj))

    def _memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        _check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream.backend_obj))

    def _memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        _check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream.backend_obj))

    def _memset_d8_async(self, dst: int, value: int, nbytes: int, stream: Stream) -> None:
        _check("cuMemsetD8Async", cu.cuMemsetD8Async(dst, value, nbytes, stream.backend_obj))

    # -- graphs --
    def _begin_capture(self, stream: Stream) -> None:
        # Thread-local mode: unsafe calls from this thread fail the capture; the gate refuses ours first.
        _check("cuStreamBeginCapture", cu.cuStreamBeginCapture(
            stream.backend_obj, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))

    def _end_capture(self, stream: Stream) -> Graph:
        g = _check("cuStreamEndCapture", cu.cuStreamEndCapture(stream.backend_obj))
        try:
            _, n = _check("cuGraphGetNodes", cu.cuGraphGetNodes(g, 0))
        except DriverError:
            n = 0
        return Graph(handle=g, node_count=int(n))

    def _graph_instantiate(self, graph: Graph) -> Graph:
        ex = _check("cuGraphInstantiate", cu.cuGraphInstantiate(graph.handle, 0))
        return Graph(handle=graph.handle, exec_handle=ex, node_count=graph.node_count)

    def _graph_launch(self, graph: Graph, stream: Stream) -> None:
        _check("cuGraphLaunch", cu.cuGraphLaunch(graph.exec_handle, stream.backend_obj))

    def _graph_destroy(self, graph: Graph) -> None:
        if graph.exec_handle is not None:
            _check("cuGraphExecDestroy", cu.cuGraphExecDestroy(graph.exec_handle))
            graph.exec_handle = None
        if graph.handle is not None:
            _check("cuGraphDestroy", cu.cuGraphDestroy(graph.handle))
            graph.handle = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            cu.cuDevicePrimaryCtxRelease(self.device)
