"""The host backend emulates what the package relies on from CUDA, with real mappings."""

import ctypes

import numpy as np
import pytest

from vmmstream.errors import CaptureError, DriverError
from vmmstream.driver import GATE

G = 64 << 10


def view(va, n):
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(va))


def mapped(d, va, h, n=G):
    d.mem_map(va, n, h, 0)
    d.mem_set_access(va, n)


def test_one_handle_at_two_vas_aliases(host_driver):
    d = host_driver
    h = d.mem_create(G)
    r = d.address_reserve(2 * G)
    mapped(d, r, h)
    mapped(d, r + G, h)
    view(r, G)[:] = 42
    assert (view(r + G, G) == 42).all()
    view(r + G, G)[5] = 7
    assert view(r, G)[5] == 7
    d.mem_unmap(r, G)
    d.mem_unmap(r + G, G)
    d.mem_release(h)
    d.address_free(r, 2 * G)
    assert d.live() == {"handles": 0, "reservations": 0, "mappings": 0, "allocs": 0, "host_allocs": 0}


def test_i4_va_stable_across_remap_host(host_driver):
    d = host_driver
    a, b = d.mem_create(G), d.mem_create(G)
    r = d.address_reserve(G)
    mapped(d, r, a)
    view(r, G)[:] = 1
    d.mem_unmap(r, G)
    mapped(d, r, b)
    assert (view(r, G) == 0).all()          # other handle, other contents, same VA
    view(r, G)[:] = 2
    d.mem_unmap(r, G)
    mapped(d, r, a)
    assert (view(r, G) == 1).all()          # the first handle kept its bytes
    d.mem_unmap(r, G)
    for h in (a, b):
        d.mem_release(h)
    d.address_free(r, G)


@pytest.mark.parametrize("case", ["double_map", "unaligned", "outside", "partial_unmap", "free_mapped",
                                  "bad_handle", "access_unmapped"])
def test_host_refuses_what_cuda_refuses(host_driver, case):
    d = host_driver
    h = d.mem_create(2 * G)
    r = d.address_reserve(4 * G)
    d.mem_map(r, 2 * G, h)
    with pytest.raises(DriverError):
        if case == "double_map":
            d.mem_map(r + G, 2 * G, h)
        elif case == "unaligned":
            d.mem_map(r + 2 * G + 4096, G, h)
        elif case == "outside":
            d.mem_map(r + 4 * G, G, h)
        elif case == "partial_unmap":
            d.mem_unmap(r, G)
        elif case == "free_mapped":
            d.address_free(r, 4 * G)
        elif case == "bad_handle":
            d.mem_map(r + 2 * G, G, 12345)
        elif case == "access_unmapped":
            d.mem_set_access(r, 3 * G)


def test_out_of_device_memory_is_a_driver_error():
    from vmmstream.driver.host import HostDriver
    d = HostDriver(granularity=G, total_bytes=4 * G)
    d.mem_create(4 * G)
    with pytest.raises(DriverError, match="OUT_OF_MEMORY"):
        d.mem_create(G)
    d.close()


def test_capture_records_and_replays_in_order(host_driver):
    d = host_driver
    s = d.stream_create()
    host = np.zeros(16, np.uint8)
    dev = d.mem_alloc(G)
    src = np.arange(16, dtype=np.uint8)
    d.begin_capture(s)
    d.memcpy_htod_async(dev, src.ctypes.data, 16, s)
    d.launch_host_func(s, lambda: view(dev, 16).__imul__(2))
    d.memcpy_dtoh_async(host.ctypes.data, dev, 16, s)
    g = d.end_capture(s)
    assert (host == 0).all()                 # nothing ran during capture
    ex = d.graph_instantiate(g)
    d.graph_launch(ex, s)
    assert (host == src * 2).all()
    src[:] = 1                               # a replay reads the source again
    d.graph_launch(ex, s)
    assert (host == 2).all()
    d.mem_free(dev)


def test_i6_gate_refuses_vmm_and_sync_during_capture_and_capture_survives(host_driver):
    d = host_driver
    s = d.stream_create()
    d.begin_capture(s)
    try:
        for call in (lambda: d.mem_create(G), lambda: d.address_reserve(G), lambda: d.mem_alloc(G),
                     lambda: d.stream_synchronize(s), lambda: d.synchronize()):
            with pytest.raises(CaptureError):
                call()
        assert d.calls["mem_create"] == 0    # refused before the driver saw it
    finally:
        g = d.end_capture(s)
    assert not GATE.open
    d.graph_launch(d.graph_instantiate(g), s)


def test_gate_closes_even_when_end_capture_fails(host_driver):
    d = host_driver
    s = d.stream_create()
    d.begin_capture(s)
    d.fault_injector = None
    s.backend_obj.capture = None             # make the backend's end fail
    with pytest.raises(DriverError):
        d.end_capture(s)
    assert not GATE.open
