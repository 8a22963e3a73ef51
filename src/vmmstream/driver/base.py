"""The driver seam: one interface, two backends (``cuda`` and ``host``).

Public methods here are what the rest of the package calls. Each one
1. refuses, through the capture gate, the calls that must not run during a capture (I6);
2. gives an installed fault injector the chance to fail it (tests of invariant I3);
3. counts itself (``calls`` by name), so a snapshot can say how many VMM calls were made;
4. delegates to the backend's ``_name`` method, which does the work and raises ``DriverError``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from .gate import GATE

# Driver calls that change device memory mappings or physical allocations.
VMM_CALLS = frozenset({"mem_create", "mem_release", "address_reserve", "address_free",
                       "mem_map", "mem_unmap", "mem_set_access"})
# Calls refused while a capture is open (VMM, plain allocation, pinned host allocation, synchronize).
GATED_CALLS = VMM_CALLS | {"mem_alloc", "mem_free", "host_alloc", "host_free",
                           "stream_synchronize", "event_synchronize", "synchronize",
                           "stream_create", "stream_destroy", "event_create", "event_destroy",
                           "graph_instantiate", "graph_destroy"}


@dataclass(frozen=True)
class DeviceInfo:
    backend: str
    ordinal: int
    name: str
    total_bytes: int | None
    free_bytes: int | None
    driver_version: str
    granularity: int
    compute_capability: tuple[int, int] | None


class Stream:
    """A backend stream. ``handle`` is the raw ``CUstream`` value on ``cuda``."""

    __slots__ = ("handle", "backend_obj", "name")

    def __init__(self, handle, backend_obj=None, name=""):
        self.handle = handle
        self.backend_obj = backend_obj
        self.name = name

    def __repr__(self):
        return f"Stream({self.name or hex(int(self.handle or 0))})"


class Event:
    __slots__ = ("handle", "backend_obj", "timing")

    def __init__(self, handle, backend_obj=None, timing=False):
        self.handle = handle
        self.backend_obj = backend_obj
        self.timing = timing


class Graph:
    """An instantiated, launchable graph (``CUgraphExec`` on ``cuda``; a recorded op list on ``host``)."""

    __slots__ = ("handle", "exec_handle", "ops", "node_count")

    def __init__(self, handle=None, exec_handle=None, ops=None, node_count=0):
        self.handle = handle
        self.exec_handle = exec_handle
        self.ops = ops
        self.node_count = node_count


def _forward(name: str):
    gated = name in GATED_CALLS

    def method(self, *args, **kwargs):
        if gated:
            GATE.check(f"{self.backend}.{name}")
        if self.fault_injector is not None:
            self.fault_injector(name)
        self.calls[name] += 1
        result = getattr(self, "_" + name)(*args, **kwargs)
        if self.after_call is not None:
            self.after_call(name)
        return result

    method.__name__ = name
    method.__qualname__ = f"Driver.{name}"
    return method


class Driver:
    """Base of the backends. Subclasses implement ``_<call>`` for every call in ``CALLS``."""

    backend = "abstract"
    CALLS = (
        # physical memory and virtual address space
        "mem_create", "mem_release", "address_reserve", "address_free",
        "mem_map", "mem_unmap", "mem_set_access",
        # plain allocations (legacy allocator) and pinned host memory
        "mem_alloc", "mem_free", "host_alloc", "host_free",
        # streams, events, copies
        "stream_create", "stream_destroy", "event_create", "event_destroy",
        "event_record", "event_query", "event_synchronize", "event_elapsed_ms",
        "stream_wait_event", "stream_synchronize", "synchronize",
        "memcpy_htod_async", "memcpy_dtoh_async", "memcpy_dtod_async", "memset_d8_async",
        # graphs
        "begin_capture", "end_capture", "graph_instantiate", "graph_launch", "graph_destroy",
    )

    def __init__(self):
        self.calls: Counter = Counter()
        # A callable(name) that may raise DriverError to simulate a failure of that call.
        self.fault_injector: Callable[[str], None] | None = None
        self.after_call: Callable[[str], None] | None = None     # tests: a signal after a call returned

    # Capture bracketing goes through the gate in both directions; the gate must close even when
    # the backend's end-capture call fails.
    def begin_capture(self, stream: Stream) -> None:
        GATE.check(f"{self.backend}.begin_capture (captures do not nest here)")
        if self.fault_injector is not None:
            self.fault_injector("begin_capture")
        self.calls["begin_capture"] += 1
        self._begin_capture(stream)
        GATE.enter()

    def end_capture(self, stream: Stream) -> Graph:
        try:
            self.calls["end_capture"] += 1
            return self._end_capture(stream)
        finally:
            GATE.exit()

    def vmm_call_count(self) -> int:
        return sum(n for k, n in self.calls.items() if k in VMM_CALLS)

    # -- information (never gated) --
    def device_info(self) -> DeviceInfo:
        raise NotImplementedError

    def granularity(self) -> int:
        raise NotImplementedError

    def mem_get_info(self) -> tuple[int, int]:
        raise NotImplementedError

    def close(self) -> None:
        pass


for _name in Driver.CALLS:
    if _name not in ("begin_capture", "end_capture"):
        setattr(Driver, _name, _forward(_name))
del _name
