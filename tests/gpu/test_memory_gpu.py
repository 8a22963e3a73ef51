"""The memory core on a real GPU: aliasing, stable VAs under remap, graphs, the capture gate, the
Numba plugin, the budget against cuMemGetInfo, rollback. Fails (never skips) without a GPU."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vmmstream.errors import CapacityError, CaptureError, DriverError

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def driver():
    from vmmstream.driver.cuda import CudaDriver
    d = CudaDriver(0)
    yield d


@pytest.fixture
def mem(driver):
    from vmmstream.memory import DeviceMemory
    m = DeviceMemory(driver, 256 * MiB, max_retained=16 * MiB)
    s = driver.stream_create("test")
    m.track_stream(s)
    m.test_stream = s
    yield m
    driver.fault_injector = None
    m.close()
    assert m.snapshot()["handles"]["owned_bytes"] == 0
    driver.stream_destroy(s)


def h2d(mem, va, arr):
    mem.driver.memcpy_htod_async(va, arr.ctypes.data, arr.nbytes, mem.test_stream)
    mem.driver.stream_synchronize(mem.test_stream)


def d2h(mem, va, n, dtype=np.uint8):
    out = np.empty(n, dtype)
    mem.driver.memcpy_dtoh_async(out.ctypes.data, va, out.nbytes, mem.test_stream)
    mem.driver.stream_synchronize(mem.test_stream)
    return out


def as_device_array(va, n, dtype):
    from numba import cuda

    class View:
        __cuda_array_interface__ = {"shape": (n,), "typestr": np.dtype(dtype).str, "data": (va, False),
                                    "version": 3, "strides": None}
    return cuda.as_cuda_array(View(), sync=False)


def test_granularity_is_queried(driver):
    g = driver.granularity()
    assert g >= 64 << 10 and g & (g - 1) == 0
    assert driver.device_info().compute_capability >= (7, 0)


def test_alias_one_handle_two_vas_gpu(mem):
    g = mem.granularity
    a = mem.allocate(4 * g, role="weight_slots", holder="t")
    b = mem.reserve(4 * g, role="weight_slots", holder="t", arena="weights")
    mem.alias(b, a)
    data = np.random.default_rng(0).integers(0, 255, 4 * g, dtype=np.uint8)
    h2d(mem, a.va, data)
    assert np.array_equal(d2h(mem, b.va, 4 * g), data)
    assert mem.authority.committed == 4 * g        # charged once


def test_i4_va_stable_across_remap_gpu(mem):
    g = mem.granularity
    t = mem.allocate(g, role="weight_slots", holder="t")
    va = t.va
    h2d(mem, va, np.full(g, 1, np.uint8))
    other = mem.allocate(g, role="weight_slots", holder="t")
    h2d(mem, other.va, np.full(g, 7, np.uint8))
    mem.unmap(t)
    mem.alias(t, other)
    assert t.va == va and (d2h(mem, va, g) == 7).all()


def test_graph_replay_reads_new_handle_after_remap(mem):
    """Capture a Numba kernel reading a pool VA; remap a different handle there; replay; new result."""
    from numba import cuda

    @cuda.jit
    def scale(src, dst, k):
        i = cuda.grid(1)
        if i < src.size:
            dst[i] = src[i] * k

    g = mem.granularity
    n = g // 4
    d = mem.driver
    src_blk = mem.allocate(g, role="weights_resident", holder="t")
    dst_blk = mem.allocate(g, role="activations", holder="t")
    first = mem.allocate(g, role="weights_resident", holder="t")
    second = mem.allocate(g, role="weights_resident", holder="t")
    h2d(mem, first.va, np.arange(n, dtype=np.float32))
    h2d(mem, second.va, np.full(n, 3.0, np.float32))
    mem.unmap(src_blk)
    mem.synchronize()
    mem.alias(src_blk, first)
    src, dst = as_device_array(src_blk.va, n, np.float32), as_device_array(dst_blk.va, n, np.float32)
    nstream = cuda.external_stream(mem.test_stream.handle)
    scale[(n + 255) // 256, 256, nstream](src, dst, np.float32(2.0))     # warm-up: compile + load
    d.stream_synchronize(mem.test_stream)
    d.begin_capture(mem.test_stream)
    scale[(n + 255) // 256, 256, nstream](src, dst, np.float32(2.0))
    graph = d.graph_instantiate(d.end_capture(mem.test_stream))
    d.memset_d8_async(dst_blk.va, 0, g, mem.test_stream)
    d.graph_launch(graph, mem.test_stream)
    assert np.array_equal(d2h(mem, dst_blk.va, n, np.float32), np.arange(n, dtype=np.float32) * 2)
    mem.unmap(src_blk)
    mem.synchronize()
    mem.alias(src_blk, second)                   # same VA, different physical handle
    d.graph_launch(graph, mem.test_stream)
    assert (d2h(mem, dst_blk.va, n, np.float32) == 6.0).all()
    d.graph_destroy(graph)
    mem.unmap(src_blk)
    mem.synchronize()


def test_i6_capture_gate_refuses_vmm_call_and_capture_stays_valid(mem):
    g = mem.granularity
    d = mem.driver
    blk = mem.allocate(g, role="activations", holder="t")
    d.begin_capture(mem.test_stream)
    try:
        with pytest.raises(CaptureError):
            mem.allocate(g, role="activations", holder="t")
        with pytest.raises(CaptureError):
            d.mem_create(g)
        with pytest.raises(CaptureError):
            d.stream_synchronize(mem.test_stream)
        d.memset_d8_async(blk.va, 5, g, mem.test_stream)
    finally:
        graph = d.graph_instantiate(d.end_capture(mem.test_stream))   # still a valid capture
    d.memset_d8_async(blk.va, 0, g, mem.test_stream)
    d.graph_launch(graph, mem.test_stream)
    assert (d2h(mem, blk.va, g) == 5).all()
    d.graph_destroy(graph)


def test_i1_budget_is_a_hard_cap_cross_checked_with_cumemgetinfo(driver):
    from vmmstream.memory import DeviceMemory
    budget = 64 * MiB
    driver.synchronize()
    free0, _ = driver.mem_get_info()
    m = DeviceMemory(driver, budget, max_retained=0)
    blocks = []
    with pytest.raises(CapacityError) as e:
        while True:
            blocks.append(m.allocate(6 * MiB, role="kv_cache", holder="t"))
    assert m.authority.committed <= budget and e.value.budget == budget
    free1, _ = driver.mem_get_info()
    used = free0 - free1
    # The device saw what the ledger charged (plus at most a few MiB of driver bookkeeping), never more than the budget.
    assert m.authority.committed <= used <= budget + 8 * MiB, (used, m.authority.committed)
    m.close()
    assert free0 - driver.mem_get_info()[0] <= 8 * MiB


def test_i3_rollback_on_the_gpu(driver, fail_at):
    from vmmstream.memory import DeviceMemory
    m = DeviceMemory(driver, 64 * MiB)
    m.arena("activations")
    for i in range(1, 4):          # mem_create, mem_map, mem_set_access
        before = (m.authority.committed, m.mapped_bytes, len(m.pool.live))
        driver.fault_injector = fail_at(i)
        with pytest.raises(DriverError):
            m.allocate(4 * MiB, role="activations", holder="t")
        driver.fault_injector = None
        assert (m.authority.committed, m.mapped_bytes, len(m.pool.live)) == before
    m.close()
    s = m.snapshot()
    assert s["handles"]["created"] == s["handles"]["released"] and s["mapped"] == 0


def test_numba_plugin_allocations_show_in_the_ledger():
    """Run in a fresh process: the plugin must be set before Numba creates its context."""
    code = r"""
import json, numpy as np
from numba import cuda
from vmmstream.memory import device_memory
mem = device_memory("512MiB", backend="cuda")
a = cuda.device_array(3 << 20, dtype=np.uint8)
b = cuda.to_device(np.arange(1000, dtype=np.float32))
snap1 = mem.snapshot()
ok = bool((b.copy_to_host() == np.arange(1000, dtype=np.float32)).all())
info = cuda.current_context().get_memory_info()
del a, b
import gc; gc.collect()
mem.synchronize()
snap2 = mem.snapshot()
print(json.dumps({"held": snap1["by_holder"].get("numba", 0), "after": snap2["by_holder"].get("numba", 0),
                  "ok": ok, "total": info.total, "budget": mem.authority.budget}))
"""
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="vmmstream.numba_plugin")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"]
    assert r["held"] >= (3 << 20) + 4000        # both Numba allocations are in the ledger, role activations
    assert r["after"] == 0                       # and freed (fenced) once Numba dropped them
    assert r["total"] == r["budget"]             # Numba sees the budget as the device's size


def test_legacy_allocator_on_the_gpu(driver):
    """VMMSTREAM_LEGACY_ALLOCATOR=1: plain cuMemAlloc under the same ledger and budget; no VMM call."""
    from vmmstream.memory import DeviceMemory
    from vmmstream.errors import VmmstreamError
    m = DeviceMemory(driver, 32 * MiB, legacy=True)
    s = driver.stream_create("legacy")
    vmm_before = driver.vmm_call_count()
    b = m.allocate(5 * MiB, role="weights_resident", holder="t")
    data = np.arange(5 * MiB, dtype=np.uint64).astype(np.uint8)
    driver.memcpy_htod_async(b.va, data.ctypes.data, data.nbytes, s)
    out = np.empty_like(data)
    driver.memcpy_dtoh_async(out.ctypes.data, b.va, out.nbytes, s)
    driver.stream_synchronize(s)
    assert np.array_equal(out, data)
    with pytest.raises(CapacityError, match="VMMSTREAM_LEGACY_ALLOCATOR"):
        m.allocate(30 * MiB, role="weights_resident", holder="t")
    with pytest.raises(VmmstreamError):
        m.reserve(MiB, role="weight_slots", holder="t")
    snap = m.snapshot()
    assert snap["allocator"] == "legacy" and driver.vmm_call_count() == vmm_before
    m.close()
    driver.stream_destroy(s)
