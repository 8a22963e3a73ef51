"""Fixtures shared by the test tiers (the tiers themselves are defined in the root conftest.py)."""

from __future__ import annotations

import pytest

from vmmstream.errors import DriverError

GRAN = 64 << 10   # a small host granularity keeps the host tests light; the logic is size-independent


@pytest.fixture
def host_driver():
    from vmmstream.driver.host import HostDriver
    d = HostDriver(granularity=GRAN, total_bytes=1 << 30)
    yield d
    d.close()


@pytest.fixture
def mem(host_driver):
    from vmmstream.memory import DeviceMemory
    m = DeviceMemory(host_driver, 32 * GRAN, max_retained=4 * GRAN)
    yield m
    if not m.closed:
        host_driver.fault_injector = None
        m.close()


class FailAt:
    """Fault injector: the ``n``-th driver call (counting only ``names`` if given) raises DriverError."""

    def __init__(self, n: int, names=None):
        self.n = n
        self.names = set(names) if names else None
        self.seen = 0
        self.fired = None

    def __call__(self, name: str) -> None:
        if self.names is not None and name not in self.names:
            return
        self.seen += 1
        if self.seen == self.n and self.fired is None:
            self.fired = name
            raise DriverError(name, "CUDA_ERROR_INJECTED", "fault injection")


@pytest.fixture
def fail_at():
    return FailAt
