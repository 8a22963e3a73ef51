"""Ctrl-C anywhere: ``KeyboardInterrupt`` raised at every driver call of a load, of a generate call (prefill and
decode) and of a close, on the host backend; a driver failure at every call of a generate. Afterwards the memory
is as it was (I2, I3, I8) and the model, where it was loaded, still gives the same answer. The GPU tier runs the
same loops on the CUDA backend (tests/gpu/test_faults_gpu.py)."""

from __future__ import annotations

import pytest

from faults import Interrupt, each_call, interrupt_after

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory

pytestmark = pytest.mark.unit

G = 64 << 10
MC = 64
PROMPT = [1, 7, 42, 3, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


def _budget(path) -> int:
    """Half the weights resident: slots, aliases and host copies all take part."""
    from vmmstream.loading import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    p = make_plan(ck.config, ck.tensors, 1 << 40, granularity=G, max_context=MC,
                  workspace=workspace_peaks(ck.config, MC, MC))
    return p.floor + p.weight_bytes // 2


def _memory(path):
    return DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), _budget(path))


def _clean(mem):
    assert not mem.blocks and mem.mapped_bytes == 0 and not mem.driver.host_allocs
    assert not any(l.granted or l.committed for l in mem.authority.leases.values())


@pytest.mark.parametrize("when", ["before", "after"])
def test_ctrl_c_at_every_driver_call_of_a_load_leaves_nothing(tiny, when):
    mem = _memory(tiny)
    make = Interrupt if when == "before" else interrupt_after
    failed, m = each_call(mem.driver, make, lambda: vmmstream.load_model(tiny, memory=mem, max_context=MC),
                          lambda _: _clean(mem))
    assert failed > 100 and m.plan.strategy == "streamed"
    want = m.generate(PROMPT, 12)
    m.close()
    _clean(mem)
    mem.close()
    assert mem.pool.created == mem.pool.released                         # I2
    assert want == _alone(tiny)


@pytest.mark.parametrize("kind", ["interrupt", "interrupt-after", "driver-error"])
def test_a_fault_at_every_driver_call_of_generate_leaves_the_model_usable(tiny, fail_at, kind):
    mem = _memory(tiny)
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        want = m.generate(PROMPT, 12)
        held = dict(mem.snapshot()["by_holder"])

        def after(_):
            mem.collect()
            assert dict(mem.snapshot()["by_holder"]) == held              # the step workspace went back (I8)
        make = {"interrupt": Interrupt, "interrupt-after": interrupt_after, "driver-error": fail_at}[kind]
        failed, out = each_call(mem.driver, make, lambda: m.generate(PROMPT, 12), after)
        assert failed > 20 and out == want
        assert m.generate(PROMPT, 12, temperature=0.7, seed=3) == m.generate(PROMPT, 12, temperature=0.7, seed=3)
    _clean(mem)
    mem.close()
    assert mem.pool.created == mem.pool.released


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_ctrl_c_at_every_driver_call_of_close_still_releases_everything(tiny, after):
    n = 1
    while True:
        mem = _memory(tiny)
        m = vmmstream.load_model(tiny, memory=mem, max_context=MC)
        inj = Interrupt(n, after=after)
        inj.install(mem.driver)
        try:
            m.close()
        except KeyboardInterrupt:
            assert inj.fired
        finally:
            mem.driver.fault_injector = mem.driver.after_call = None
        m.close()
        mem.close()
        assert mem.pool.created == mem.pool.released and mem.mapped_bytes == 0 and not mem.driver.host_allocs
        if inj.fired is None:
            break
        n += 1
    assert n > 10


_WANT: list = []


def _alone(path):
    if not _WANT:
        mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), 1 << 28)
        with vmmstream.load_model(path, memory=mem, max_context=MC) as m:
            _WANT.append(m.generate(PROMPT, 12))
        mem.close()
    return _WANT[0]
