"""Shared pieces of the GPU tier: a Numba stream per module (a non-default stream, as the package uses)."""

import pytest


@pytest.fixture(scope="module")
def stream():
    from numba import cuda
    return cuda.stream()
