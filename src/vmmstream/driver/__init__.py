"""The driver seam: ``cuda`` (cuda.bindings driver API) and ``host`` (Linux memfd + mmap emulation)."""

from __future__ import annotations

from ..config import BACKEND
from ..errors import VmmstreamError
from .base import GATED_CALLS, VMM_CALLS, DeviceInfo, Driver, Event, Graph, Stream  # noqa: F401
from .gate import GATE  # noqa: F401


def resolve_backend(name: str | None = None) -> str:
    """``cuda``, ``host`` or ``auto`` (the argument, else ``VMMSTREAM_BACKEND``) -> a concrete backend."""
    choice = (name or BACKEND.get()).lower()
    if choice not in ("cuda", "host", "auto"):
        raise VmmstreamError(f"unknown backend {name!r}; use cuda, host or auto")
    if choice == "auto":
        from .cuda import cuda_usable
        ok, _ = cuda_usable()
        return "cuda" if ok else "host"
    return choice


def open_driver(backend: str | None = None, ordinal: int = 0, **host_options) -> Driver:
    """Open a driver for ``backend`` (see ``resolve_backend``)."""
    name = resolve_backend(backend)
    if name == "cuda":
        from .cuda import CudaDriver, cuda_usable
        ok, why = cuda_usable()
        if not ok:   # e.g. no libcuda: say so, instead of a loader error from deep inside cuda.bindings
            raise VmmstreamError(f"the cuda backend cannot start here ({why}); use backend='host' (or "
                                 "VMMSTREAM_BACKEND=host) on a machine without a usable NVIDIA driver")
        return CudaDriver(ordinal)
    from .host import HostDriver
    return HostDriver(**host_options)
