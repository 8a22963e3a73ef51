"""A pool self-check that proves, on the backend at hand, what the package relies on:

allocation inside the budget, aliasing (a write through one VA is read through another), a VA that
stays put while a different handle is mapped behind it (I4), and a clean teardown (I2).
"""

from __future__ import annotations

import numpy as np

from .driver import open_driver
from .memory import DeviceMemory


def _write(mem, stream, va, data: np.ndarray):
    mem.driver.memcpy_htod_async(va, data.ctypes.data, data.nbytes, stream)
    mem.driver.stream_synchronize(stream)


def _read(mem, stream, va, nbytes) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    mem.driver.memcpy_dtoh_async(out.ctypes.data, va, nbytes, stream)
    mem.driver.stream_synchronize(stream)
    return out


def run(backend: str | None = None) -> dict:
    """Run the checks on a private ``DeviceMemory`` (it never touches the process's shared one)."""
    driver = open_driver(backend)
    g = driver.granularity()
    checks: dict[str, bool] = {}
    mem = DeviceMemory(driver, 8 * g, budget_source=("explicit", "self-check"))
    stream = driver.stream_create("selfcheck")
    mem.track_stream(stream)
    try:
        a = mem.allocate(g, role="activations", holder="selfcheck")
        b = mem.reserve(g, role="weight_slots", holder="selfcheck", arena="weights")
        mem.alias(b, a)
        pattern = (np.arange(g, dtype=np.uint64) % 251).astype(np.uint8)
        _write(mem, stream, a.va, pattern)
        checks["alias: write via one VA, read via the other"] = bool(
            np.array_equal(_read(mem, stream, b.va, g), pattern))
        va_before = b.va
        mem.unmap(b)
        mem.synchronize()
        mem.back(b)
        other = (255 - pattern).astype(np.uint8)
        _write(mem, stream, b.va, other)
        checks["remap: same VA, new handle, new contents"] = bool(
            b.va == va_before and np.array_equal(_read(mem, stream, b.va, g), other)
            and np.array_equal(_read(mem, stream, a.va, g), pattern))
        checks["budget: committed <= budget"] = mem.authority.committed <= mem.authority.budget
        mem.free(b)
        mem.free(a)
        mem.synchronize()
        mem.close()
        snap = mem.snapshot()
        checks["teardown: 0 mapped, 0 owned, created == released"] = (
            snap["mapped"] == 0 and snap["handles"]["owned_bytes"] == 0
            and snap["handles"]["created"] == snap["handles"]["released"])
    finally:
        if not mem.closed:
            mem.close()
        driver.stream_destroy(stream)
        driver.close()
    return {"ok": all(checks.values()), "checks": checks, "vmm_calls": snap["vmm_calls_total"]}
