"""Test tiers for tests/ and bench/: ``unit`` (no GPU; the host backend makes real mappings), ``sim``
(Numba simulator), ``gpu`` (a CUDA device). A selected gpu test without a usable device FAILS; it never skips."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:     # a test with no tier marker is a unit test
        if not any(item.get_closest_marker(m) for m in ("unit", "sim", "gpu")):
            item.add_marker(pytest.mark.unit)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu"):
        from vmmstream.driver.cuda import cuda_usable
        ok, why = cuda_usable()
        if not ok:
            pytest.fail(f"gpu test selected but no usable CUDA device: {why}", pytrace=False)


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


def pytest_sessionstart(session):
    # The simulator replaces numba.cuda process-wide; a gpu test under it would test nothing real.
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and "gpu" in (session.config.option.markexpr or "") \
            and "not gpu" not in (session.config.option.markexpr or ""):
        raise pytest.UsageError("NUMBA_ENABLE_CUDASIM=1 is set: the gpu tier must run without the simulator")
