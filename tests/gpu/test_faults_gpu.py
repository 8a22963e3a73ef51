"""The host tier's fault injection, on the CUDA backend: a failure injected at every driver call of a load, of a
generate call and of a close leaves 0 mapped, 0 owned, created == released and the device's free memory where it
was (cuMemGetInfo); ``KeyboardInterrupt`` during load, prefill and decode leaves the model usable and the memory
where it was (I2, I3, I8). Fails (never skips) without a GPU (root conftest)."""

from __future__ import annotations

import pytest

from faults import Interrupt, each_call, interrupt_after

import vmmstream
from vmmstream.errors import CapacityError, DriverError

pytestmark = pytest.mark.gpu

MiB = 1 << 20
MC = 64
PROMPT = [1, 5, 9, 33, 7, 2]


@pytest.fixture(scope="module")
def driver():
    from vmmstream.driver.cuda import CudaDriver
    return CudaDriver(0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    return make_checkpoint("small", tmp_path_factory.mktemp("small"), seed=0)


def _streaming_budget(path, gran) -> int:
    """Half the weights resident: slots, aliases and host copies all take part."""
    from vmmstream.loading import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    full = make_plan(ck.config, ck.tensors, 1 << 40, granularity=gran, max_context=MC,
                     workspace=workspace_peaks(ck.config, MC, MC, "cuda"))
    return full.floor + full.weight_bytes // 2


def _memory(driver, budget):
    from vmmstream.memory import DeviceMemory
    mem = DeviceMemory(driver, budget)
    mem.calls0 = dict(driver.calls)          # _clean counts pinned allocations from here
    return mem


def _pinned_held(mem) -> int:
    calls, c0 = mem.driver.calls, mem.calls0
    return (calls.get("host_alloc", 0) - c0.get("host_alloc", 0)) - (calls.get("host_free", 0) - c0.get("host_free", 0))


def _clean(mem):
    a = mem.authority
    assert not mem.blocks and mem.mapped_bytes == 0
    assert not any(l.granted or l.committed for l in a.leases.values())
    assert _pinned_held(mem) == 0                     # pinned host memory: every allocation since freed again


@pytest.fixture(scope="module")
def warm(driver, small):
    """Compile and load every kernel once, so the free-memory checks below see budget memory only."""
    mem = _memory(driver, _streaming_budget(small, driver.granularity()))
    with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
        want = m.generate(PROMPT, 8)
    mem.close()
    driver.synchronize()
    return want


@pytest.mark.parametrize("kind", ["driver-error", "interrupt", "interrupt-after"])
def test_i3_a_fault_at_every_driver_call_of_a_load_leaves_nothing(driver, small, warm, fail_at, kind):
    budget = _streaming_budget(small, driver.granularity())
    driver.synchronize()
    free0, _ = driver.mem_get_info()
    mem = _memory(driver, budget)
    make = {"driver-error": fail_at, "interrupt": Interrupt, "interrupt-after": interrupt_after}[kind]

    def after(_):
        _clean(mem)
    failed, m = each_call(driver, make, lambda: vmmstream.load_model(small, memory=mem, max_context=MC), after)
    assert failed > 50
    assert m.generate(PROMPT, 8) == warm             # and it loads and runs afterwards
    m.close()
    _clean(mem)
    mem.close()
    assert mem.pool.created == mem.pool.released      # I2
    driver.synchronize()
    assert free0 - driver.mem_get_info()[0] <= 8 * MiB


@pytest.mark.parametrize("kind", ["driver-error", "interrupt", "interrupt-after"])
def test_a_fault_at_every_driver_call_of_generate_leaves_the_model_usable(driver, small, warm, fail_at, kind):
    """Prefill and decode interrupted or failed at every call: the model still answers as before, and its
    memory is what it held before the call (the step workspace released, I8)."""
    mem = _memory(driver, _streaming_budget(small, driver.granularity()))
    with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
        m.generate(PROMPT, 8)
        held = dict(mem.snapshot()["by_holder"])
        make = {"driver-error": fail_at, "interrupt": Interrupt, "interrupt-after": interrupt_after}[kind]

        def after(_):
            driver.synchronize()
            mem.collect()
            assert dict(mem.snapshot()["by_holder"]) == held
        failed, out = each_call(driver, make, lambda: m.generate(PROMPT, 8), after)
        assert failed > 0 and out == warm
        assert m.generate(PROMPT, 8) == warm
    _clean(mem)
    mem.close()
    assert mem.pool.created == mem.pool.released


def test_a_driver_failure_in_close_still_releases_the_rest(driver, small, warm, fail_at):
    """Close with its n-th call failing: the error is raised after every other release was attempted; a second
    close and the memory's own close leave created == released."""
    budget = _streaming_budget(small, driver.granularity())
    n = 1
    while True:
        mem = _memory(driver, budget)
        m = vmmstream.load_model(small, memory=mem, max_context=MC)
        inj = fail_at(n)
        driver.fault_injector = inj
        try:
            m.close()
        except DriverError:
            assert inj.fired
        finally:
            driver.fault_injector = None
        m.close()
        mem.close()
        assert mem.pool.created == mem.pool.released and mem.mapped_bytes == 0
        # every pinned buffer freed, except the one whose free was the failing call (never freed twice)
        assert _pinned_held(mem) == (1 if inj.fired == "host_free" else 0), inj.fired
        if inj.fired is None:
            break
        n += 1
    assert n > 10


def test_capacity_refusals_on_cuda_change_nothing(driver, small, warm):
    mem = _memory(driver, 4 * MiB)
    with pytest.raises(CapacityError):
        vmmstream.load_model(small, memory=mem, max_context=MC)
    _clean(mem)
    mem.close()
