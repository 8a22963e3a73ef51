"""Page-in bandwidth from pinned host memory into pool VAs, against the pinned host-to-device ceiling
measured in the same run, and the cost of map / set-access / unmap.

On a GPU (VMMSTREAM_BACKEND unset or cuda): copies are timed with CUDA events. Without one this runs on
the host backend as a one-pass smoke (``--benchmark-disable``) so the code cannot rot; its figures
mean nothing there.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from vmmstream.driver import open_driver
from vmmstream.memory import DeviceMemory

MiB = 1 << 20
SIZES_MIB = [2, 8, 32, 64, 128, 256]
REPEATS = 8            # copies per timed call; bytes / event time gives GB/s


@pytest.fixture(scope="module")
def rig():
    driver = open_driver()          # cuda when a device is usable, else host
    budget = 1 << 30
    mem = DeviceMemory(driver, budget)
    stream = driver.stream_create("bench")
    mem.track_stream(stream)
    host = driver.host_alloc(256 * MiB)                  # pinned (cuMemHostAlloc) on cuda
    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (256 * MiB)).from_address(host))[:] = 1
    start, end = driver.event_create(timing=True), driver.event_create(timing=True)
    plain = driver.mem_alloc(256 * MiB) if driver.backend == "cuda" else None
    yield {"driver": driver, "mem": mem, "stream": stream, "host": host, "events": (start, end), "plain": plain}
    if plain is not None:
        driver.mem_free(plain)
    driver.host_free(host)
    mem.close()
    driver.stream_destroy(stream)


def _copy_gbps(rig, dst: int, nbytes: int) -> float:
    """Bytes ÷ device time of REPEATS host-to-device copies, timed by CUDA events."""
    d, s = rig["driver"], rig["stream"]
    start, end = rig["events"]
    d.memcpy_htod_async(dst, rig["host"], nbytes, s)       # warm
    d.event_record(start, s)
    for _ in range(REPEATS):
        d.memcpy_htod_async(dst, rig["host"], nbytes, s)
    d.event_record(end, s)
    d.event_synchronize(end)
    ms = d.event_elapsed_ms(start, end)
    return REPEATS * nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


@pytest.fixture(scope="module")
def ceiling(rig):
    """Pinned host -> plain cuMemAlloc buffer, 256 MiB copies: the H2D ceiling of this run."""
    if rig["plain"] is None:
        return float("nan")
    return max(_copy_gbps(rig, rig["plain"], 256 * MiB) for _ in range(3))


@pytest.mark.parametrize("size_mib", SIZES_MIB)
def test_page_in_bandwidth(benchmark, rig, ceiling, size_mib):
    nbytes = size_mib * MiB
    mem = rig["mem"]
    slot = mem.allocate(nbytes, role="weight_slots", holder="bench")
    tensor = mem.reserve(nbytes, role="weight_slots", holder="bench", arena="weights")
    mem.alias(tensor, slot)         # copy into a streamed tensor's own VA, aliasing the slot, as in decode
    results = []
    benchmark.pedantic(lambda: results.append(_copy_gbps(rig, tensor.va, nbytes)), rounds=5, iterations=1,
                       warmup_rounds=1)
    gbps = max(results) if results else float("nan")
    benchmark.extra_info.update({
        "backend": rig["driver"].backend, "bytes_per_copy": nbytes, "copies_per_round": REPEATS,
        "gbps_best": gbps, "gbps_median": float(np.median(results)) if results else float("nan"),
        "ceiling_gbps": ceiling, "ratio_to_ceiling": gbps / ceiling if ceiling == ceiling else float("nan"),
        "timing": "CUDA events around the copies" if rig["driver"].backend == "cuda" else "host smoke",
    })
    mem.free(tensor)
    mem.free(slot)
    mem.synchronize()


@pytest.mark.parametrize("size_mib", [2, 32, 256])
def test_map_set_access_unmap_cost(benchmark, rig, size_mib):
    """Host-side cost of the synchronous driver calls (they do not run on a stream: perf_counter)."""
    d = rig["driver"]
    mem = rig["mem"]
    nbytes = size_mib * MiB
    owner = mem.allocate(nbytes, role="weight_slots", holder="bench")
    va = mem.arena("weights").allocate(nbytes)
    times = {"map": [], "set_access": [], "unmap": []}

    def cycle():
        t0 = time.perf_counter()
        d.mem_map(va, nbytes, owner.handle.handle, 0)
        t1 = time.perf_counter()
        d.mem_set_access(va, nbytes)
        t2 = time.perf_counter()
        d.mem_unmap(va, nbytes)
        t3 = time.perf_counter()
        times["map"].append(t1 - t0)
        times["set_access"].append(t2 - t1)
        times["unmap"].append(t3 - t2)

    benchmark.pedantic(cycle, rounds=20, iterations=1, warmup_rounds=2)
    for k, v in times.items():
        benchmark.extra_info[f"{k}_us_median"] = float(np.median(v) * 1e6) if v else float("nan")
    benchmark.extra_info.update({"backend": d.backend, "bytes": nbytes, "timing": "host perf_counter, sync calls"})
    mem.arena("weights").free(va)
    mem.free(owner)
    mem.synchronize()
