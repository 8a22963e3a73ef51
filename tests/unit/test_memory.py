"""Authority, pool, arenas and fences on the host backend (real mappings)."""

import ctypes

import numpy as np
import pytest

from vmmstream.driver import GATE
from vmmstream.errors import CapacityError, CaptureError, VmmstreamError
from vmmstream.memory import DeviceMemory

G = 64 << 10


def view(va, n):
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(va))


def test_allocate_charges_the_role_and_holder(mem):
    b = mem.allocate(3 * G - 5, role="kv_cache", holder="m1")
    assert b.size == 3 * G and b.state == "own"
    s = mem.snapshot()
    assert s["by_role"]["kv_cache"] == 3 * G and s["by_holder"] == {"m1": 3 * G}
    assert s["committed"] == 3 * G == s["mapped"]
    view(b.va, b.size)[:] = 9               # the memory is really there and writable


def test_i9_capacity_error_names_the_numbers_and_changes_nothing(mem):
    mem.allocate(30 * G, role="weights_resident", holder="m1")
    before = mem.snapshot()
    with pytest.raises(CapacityError) as e:
        mem.allocate(3 * G, role="kv_cache", holder="m2")
    err = e.value
    assert isinstance(err, MemoryError)
    assert (err.requested, err.budget, err.in_use, err.role) == (3 * G, 32 * G, 30 * G, "kv_cache")
    for word in ("budget", "in use", "kv_cache", "raise the budget"):
        assert word in str(err)
    after = mem.snapshot()
    for k in ("committed", "mapped", "leases", "handles", "arenas"):
        assert after[k] == before[k], k


def test_freed_handles_are_reused_and_stay_charged(mem):
    a = mem.allocate(2 * G, role="activations", holder="h")
    mem.free(a, [])
    s = mem.snapshot()
    assert s["retained"] == 2 * G and s["committed"] == 2 * G and s["by_role"]["activations"] == 0
    b = mem.allocate(2 * G, role="activations", holder="h")
    s = mem.snapshot()
    assert s["handles"]["created"] == 1 and s["handles"]["reused"] == 1 and s["retained"] == 0
    mem.free(b, [])


def test_retention_is_bounded(mem):
    blocks = [mem.allocate(G, role="activations", holder="h") for _ in range(8)]
    for b in blocks:
        mem.free(b, [])
    assert mem.authority.retained <= mem.pool.max_retained == 4 * G
    assert mem.pool.released == 4


def test_grant_uses_headroom_then_unassigned_then_retained(mem):
    lease = mem.authority.lease("m", "kv_cache")
    mem.authority.grant(lease, 4 * G)                 # pre-granted headroom, nothing committed
    assert mem.authority.committed == 0 and mem.authority.reserved == 4 * G
    kv = mem.allocate(4 * G, role="kv_cache", holder="m")   # comes out of the headroom
    assert lease.granted == 4 * G and lease.committed == 4 * G
    junk = [mem.allocate(G, role="activations", holder="x") for _ in range(4)]
    for j in junk:
        mem.free(j, [])
    assert mem.authority.retained == 4 * G
    # 28 G is now reserved (24 G unassigned + 4 G idle): the grant must trim the idle handles to fit.
    big = mem.allocate(28 * G, role="weights_resident", holder="w")
    assert mem.authority.retained == 0 and mem.authority.committed == 32 * G
    mem.free(big, [])
    mem.free(kv, [])


class Evictor:
    """A holder that gives memory back on request, as the weight residency does."""

    def __init__(self, mem, blocks):
        self.mem, self.blocks = mem, blocks
        self.calls = 0

    def reclaimable(self):
        return sum(b.size for b in self.blocks)

    def reclaim(self, nbytes):
        self.calls += 1
        freed = 0
        while self.blocks and freed < nbytes:
            b = self.blocks.pop()
            self.mem.free(b, [])
            freed += b.size
        self.mem.pool.trim()
        return freed


def test_grant_reclaims_from_registered_holders_last(mem):
    weights = [mem.allocate(4 * G, role="weights_resident", holder="w") for _ in range(7)]
    ev = Evictor(mem, weights)
    mem.authority.register_reclaimer("w", ev)
    kv = mem.allocate(8 * G, role="kv_cache", holder="m")
    assert ev.calls == 1 and len(weights) == 6          # 4 G unassigned + one 4 G block reclaimed
    assert mem.authority.committed <= mem.authority.budget
    with pytest.raises(CapacityError):
        mem.allocate(64 * G, role="kv_cache", holder="m")    # even all reclaim cannot cover it...
    assert len(weights) == 6                                  # ...so nothing was evicted for nothing (I9)
    mem.free(kv, [])


def test_i4_block_va_stable_when_backing_changes(mem):
    b = mem.allocate(2 * G, role="weight_slots", holder="h")
    va = b.va
    view(va, b.size)[:] = 3
    mem.unmap(b, [])
    mem.back(b)
    assert b.va == va and b.state == "own"
    other = mem.allocate(2 * G, role="weight_slots", holder="h")
    view(other.va, other.size)[:] = 8
    mem.unmap(b, [])
    mem.alias(b, other)
    assert b.va == va and (view(va, b.size) == 8).all()


def test_alias_is_charged_once_and_must_be_unmapped_first(mem):
    slot = mem.allocate(2 * G, role="weight_slots", holder="h")
    t1 = mem.reserve(2 * G, role="weight_slots", holder="h", arena="weights")
    t2 = mem.reserve(2 * G, role="weight_slots", holder="h", arena="weights")
    mem.alias(t1, slot)
    mem.alias(t2, slot)
    assert mem.authority.committed == 2 * G and mem.mapped_bytes == 6 * G
    view(slot.va, 16)[:] = 5
    assert (view(t1.va, 16) == 5).all() and (view(t2.va, 16) == 5).all()
    with pytest.raises(VmmstreamError, match="aliased"):
        mem.unmap(slot, [])
    with pytest.raises(VmmstreamError):
        mem.alias(t1, slot)                   # already backed
    mem.free(t1, [])
    mem.free(t2, [])
    mem.free(slot, [])
    mem.close()
    assert mem.snapshot()["handles"]["owned_bytes"] == 0


class SlowEvents:
    """Make the host backend's events incomplete until ``done`` is set, like work in flight on a GPU."""

    def __init__(self, driver):
        self.done = False
        driver._event_query = lambda ev: self.done
        driver._event_synchronize = lambda ev: setattr(self, "done", True)


def test_i5_release_waits_for_fences(mem, host_driver):
    slow = SlowEvents(host_driver)
    s = host_driver.stream_create()
    mem.track_stream(s)
    b = mem.allocate(2 * G, role="activations", holder="h")
    mem.free(b)
    assert b.state == "releasing" and host_driver.calls["mem_unmap"] == 0
    assert mem.authority.committed == 2 * G           # still charged while in flight (I1 stays honest)
    mem.collect()
    assert host_driver.calls["mem_unmap"] == 0
    slow.done = True
    mem.collect()
    assert b.state == "freed" and host_driver.calls["mem_unmap"] == 1


def test_back_waits_for_a_pending_unmap(mem, host_driver):
    slow = SlowEvents(host_driver)
    s = host_driver.stream_create()
    mem.track_stream(s)
    b = mem.allocate(G, role="weight_slots", holder="h")
    mem.unmap(b)
    assert b.state == "releasing"
    mem.back(b)                                # drains the fence (synchronizes), then maps
    assert slow.done and b.state == "own"


def test_i6_pool_refuses_during_capture(mem, host_driver):
    s = host_driver.stream_create()
    b = mem.allocate(G, role="activations", holder="h")
    host_driver.begin_capture(s)
    try:
        with pytest.raises(CaptureError):
            mem.allocate(G, role="activations", holder="h")
        with pytest.raises(CaptureError):
            mem.unmap(b, [])
        mem.free(b, [])                         # a free (e.g. from a finalizer) is parked, not refused
        assert b.state == "own"
    finally:
        host_driver.end_capture(s)
    mem.collect()
    assert b.state == "freed"


def test_i2_close_releases_everything(host_driver):
    mem = DeviceMemory(host_driver, 32 * G, max_retained=8 * G)
    a = mem.allocate(3 * G, role="activations", holder="h")
    t = mem.reserve(3 * G, role="weight_slots", holder="h", arena="weights")
    mem.alias(t, a)
    mem.allocate(G, role="kv_cache", holder="h")
    mem.free(mem.allocate(G, role="kv_cache", holder="h"), [])
    mem.close()
    mem.close()                                 # idempotent
    s = mem.snapshot()
    assert s["mapped"] == 0 and s["handles"]["owned_bytes"] == 0 and s["committed"] == 0
    assert s["handles"]["created"] == s["handles"]["released"]
    assert host_driver.live() == {"handles": 0, "reservations": 0, "mappings": 0, "allocs": 0, "host_allocs": 0}
    with pytest.raises(VmmstreamError, match="closed"):
        mem.allocate(G, role="activations", holder="h")


def test_legacy_allocator_keeps_the_ledger_without_vmm(host_driver):
    mem = DeviceMemory(host_driver, 8 * G, legacy=True)
    b = mem.allocate(3 * G, role="weights_resident", holder="m")
    view(b.va, b.size)[:] = 1
    s = mem.snapshot()
    assert s["allocator"] == "legacy" and s["vmm_calls_total"] == 0 and s["plain_allocs"] == 1
    assert s["by_role"]["weights_resident"] == 3 * G
    with pytest.raises(VmmstreamError, match="LEGACY"):
        mem.reserve(G, role="weight_slots", holder="m")
    with pytest.raises(CapacityError, match="VMMSTREAM_LEGACY_ALLOCATOR"):
        mem.allocate(6 * G, role="weights_resident", holder="m")
    mem.free(b, [])
    mem.close()
    assert host_driver.live()["allocs"] == 0


def test_report_is_readable(mem):
    mem.allocate(G, role="kv_cache", holder="h")
    text = mem.report()
    for word in ("budget", "committed", "kv_cache", "handles", "vmm calls"):
        assert word in text


def test_shared_device_memory_per_process(monkeypatch):
    from vmmstream import memory
    from vmmstream.errors import BudgetError
    monkeypatch.setattr(memory, "_by_device", {})
    a = memory.device_memory("64MiB", backend="host")
    assert memory.device_memory(backend="host") is a
    assert memory.device_memory("64MiB", backend="host") is a
    with pytest.raises(BudgetError, match="already has a budget"):
        memory.device_memory("128MiB", backend="host")
    assert a.authority.budget_source.kind == "explicit"
    a.close()
    b = memory.device_memory(backend="host")
    assert b is not a and b.authority.budget_source.kind in ("inferred", "env")
    b.close()


def test_alias_maps_whole_handles_only(mem):
    """CUDA refuses a partial cuMemMap (CUDA_ERROR_NOT_SUPPORTED on the H200); so do we, up front."""
    slot = mem.allocate(4 * G, role="weight_slots", holder="h")
    for size in (2 * G, 8 * G):
        other = mem.reserve(size, role="weight_slots", holder="h", arena="weights")
        with pytest.raises(VmmstreamError, match="cannot map"):
            mem.alias(other, slot)
        assert other.state == "unbacked"


def test_host_driver_refuses_partial_handle_maps(host_driver):
    from vmmstream.errors import DriverError
    h = host_driver.mem_create(2 * G)
    r = host_driver.address_reserve(2 * G)
    with pytest.raises(DriverError, match="NOT_SUPPORTED"):
        host_driver.mem_map(r, G, h)
