"""Governed device memory: one authority per (process, device), one no-spill VMM pool."""

from __future__ import annotations

import threading

from ..budget import parse_budget
from ..config import BUDGET, LEGACY_ALLOCATOR
from ..driver import open_driver
from ..errors import BudgetError
from .authority import ROLES, Authority, Lease  # noqa: F401
from .device import Block, DeviceMemory  # noqa: F401

_lock = threading.Lock()
_by_device: dict[tuple[str, int], DeviceMemory] = {}


def resolve_budget(budget, driver) -> tuple[int, tuple[str, str]]:
    """Budget in bytes and where it came from: explicit argument, ``VMMSTREAM_BUDGET``, or inferred ('auto')."""
    if budget is not None:
        source = ("explicit", str(budget))
    elif BUDGET.is_set():
        budget, source = BUDGET.get(), ("env", f"VMMSTREAM_BUDGET={BUDGET.get()}")
    else:
        budget, source = "auto", ("inferred", "auto: 0.9 x free device memory")
    free, total = driver.mem_get_info()
    return parse_budget(budget, total, device_free=free), source


def device_memory(budget=None, *, device: int = 0, backend: str | None = None,
                  for_model: bool = False) -> DeviceMemory:
    """The process's ``DeviceMemory`` for ``device``, created on first use.

    Models loaded in one process share it. A later call that names a different budget is an error
    rather than a silent second authority. ``for_model``: made for a model load, it closes with the last model
    on it (``DeviceMemory.closes_with_models``), decided here under the registry's lock.
    """
    with _lock:
        for (bk, dev), mem in list(_by_device.items()):
            if dev == device and mem.closed:
                del _by_device[(bk, dev)]
        existing = [m for (bk, dev), m in _by_device.items() if dev == device]
        if existing:
            mem = existing[0]
            if budget is not None:
                want, _ = resolve_budget(budget, mem.driver)
                if want != mem.authority.budget:
                    raise BudgetError(f"device {device} already has a budget of {mem.authority.budget} bytes "
                                      f"in this process; asked for {want}. Close it first or use the same budget.")
            return mem
        driver = open_driver(backend, device)
        nbytes, source = resolve_budget(budget, driver)
        mem = DeviceMemory(driver, nbytes, budget_source=source, legacy=LEGACY_ALLOCATOR.get())
        mem.closes_with_models = for_model
        _by_device[(driver.backend, device)] = mem
        return mem
