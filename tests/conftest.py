"""Test tiers: ``unit`` (no GPU; the host backend makes real mappings), ``sim`` (Numba simulator),
``gpu`` (a CUDA device; a selected gpu test without one FAILS, it never skips)."""

from __future__ import annotations

import os

import pytest

from vmmstream.errors import DriverError

GRAN = 64 << 10   # a small host granularity keeps the host tests light; the logic is size-independent


def pytest_collection_modifyitems(config, items):
    # A test with no tier marker is a unit test.
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("unit", "sim", "gpu")):
            item.add_marker(pytest.mark.unit)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu"):
        from vmmstream.driver.cuda import cuda_usable
        ok, why = cuda_usable()
        if not ok:
            pytest.fail(f"gpu test selected but no usable CUDA device: {why}", pytrace=False)


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


def pytest_configure(config):
    # Property tests: CI asks for at least 2,000 examples (HYPOTHESIS_PROFILE=ci).
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover
        return
    settings.register_profile("ci", max_examples=2000, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=200, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
