"""Numba External Memory Management plugin: Numba's own allocations come from the governed pool.

    from numba import cuda
    from vmmstream.numba_plugin import VmmstreamMemoryManager
    cuda.set_memory_manager(VmmstreamMemoryManager)

or, before Numba initialises CUDA, ``NUMBA_CUDA_MEMORY_MANAGER=vmmstream.numba_plugin``.
``device_array`` / ``to_device`` then draw from the process's ``DeviceMemory`` under the role
``activations`` and holder ``numba``, inside the budget. Frees are fenced: the pages are unmapped
only after work queued on the package's streams and the legacy default stream has finished.
"""

from __future__ import annotations

import ctypes

from numba.cuda.cudadrv.driver import HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer

from .memory import device_memory

HOLDER = "numba"


class VmmstreamMemoryManager(HostOnlyCUDAMemoryManager):
    def __init__(self, *args, context=None, **kwargs):
        # Numba instantiates the class once with context=None just to read interface_version.
        super().__init__(*args, context=context, **kwargs)
        self._mem = None

    def initialize(self):
        self._memory()

    def _memory(self):
        if self._mem is None or self._mem.closed:
            self._mem = device_memory(backend="cuda")
        return self._mem

    def _fence_streams(self, mem):
        streams = list(mem.streams)
        legacy = getattr(mem.driver, "legacy_stream", None)
        if legacy is not None:
            streams.append(legacy())
        return streams

    def memalloc(self, size):
        mem = self._memory()
        block = mem.allocate(max(int(size), 1), role="activations", holder=HOLDER, arena="activations")

        def finalize(mem=mem, block=block, plugin=self):
            if not mem.closed:
                mem.free(block, plugin._fence_streams(mem))

        return MemoryPointer(self.context, ctypes.c_void_p(block.va), size, finalizer=finalize)

    def get_memory_info(self):
        a = self._memory().authority
        return MemoryInfo(free=max(0, a.budget - a.committed), total=a.budget)

    def get_ipc_handle(self, memory):
        raise NotImplementedError("vmmstream pool memory cannot be shared over IPC")

    @property
    def interface_version(self):
        return 1


# NUMBA_CUDA_MEMORY_MANAGER=vmmstream.numba_plugin looks for this name.
_numba_memory_manager = VmmstreamMemoryManager
