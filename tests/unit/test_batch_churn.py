"""A batch's KV pages under churn, on the host backend: sequences join, grow and leave in any order (hypothesis
state machine) and I1 holds at every point — committed bytes never above the budget, the KV cache's committed
pages exactly those of the live sequences — no VMM call inside a decode step, and a thousand sequences later
nothing is left mapped, held or reserved beyond what the model held before them."""

from __future__ import annotations

import pytest
from hf_oracle import build_reference
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_oracle import COMMON, G

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.execution.batch import BatchDecoder
from vmmstream.memory import DeviceMemory

pytestmark = pytest.mark.unit

MC = 64
SLOTS = 3


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    out = tmp_path_factory.mktemp("churn")
    build_reference("llama", 0, out, COMMON, [1, 2], 1)
    from vmmstream.loading import plan_walked
    from vmmstream.model import open_checkpoint
    ck = open_checkpoint(out)
    full = plan_walked(ck.config, ck.tensors, 1 << 40, backend="host", granularity=G, max_context=MC, batch=SLOTS)
    budget = full.floor + full.weight_bytes // 2                    # weights stream too
    drv = HostDriver(granularity=G, total_bytes=1 << 30)
    mem = DeviceMemory(drv, budget)
    m = vmmstream.load_model(out, memory=mem, max_context=MC, max_batch=SLOTS)
    yield m, mem, drv
    m.close()
    mem.close()


class Churn(RuleBasedStateMachine):
    model = memory = driver = None

    def __init__(self):
        super().__init__()
        m = self.model
        self.dec = BatchDecoder(m.engine, m.placement.batch_kv)
        self.kv = m.placement.batch_kv
        for s in range(SLOTS):                 # start from nothing mapped
            self.kv.release(s)
        self.live = []

    @precondition(lambda self: self.dec.free_slots() > 0)
    @rule(n=st.integers(1, 20), new=st.integers(1, 30))
    def join(self, n, new):
        seq = self.dec.add([3 + i % 50 for i in range(n)], new)
        if not seq.done:
            self.live.append(seq)

    @precondition(lambda self: bool(self.dec.active()))
    @rule(k=st.integers(1, 6))
    def steps(self, k):
        d = self.driver
        for _ in range(k):
            before = d.vmm_call_count()
            out = self.dec.step()
            if not any(q.done for q, _ in out):           # pages were committed at the join: a step maps none;
                assert d.vmm_call_count() == before      # only a sequence that ends unmaps its pages
        self.live = [q for q in self.live if not q.done]

    @precondition(lambda self: bool(self.live))
    @rule(i=st.integers(0, SLOTS - 1))
    def leave(self, i):
        q = self.live.pop(i % len(self.live))
        self.dec.finish(q)

    @invariant()
    def pages_are_the_live_sequences_and_within_budget(self):
        a = self.memory.authority
        assert a.committed <= a.budget
        want = sum(self.kv.pages_for(q.n + q.m) for q in self.live)
        assert self.kv.committed() == want

    def teardown(self):
        self.dec.close()
        assert self.kv.committed() == 0


def test_kv_pages_follow_the_sequences_under_churn(loaded):
    Churn.model, Churn.memory, Churn.driver = loaded
    Churn.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
    Churn.TestCase().runTest()


def test_a_thousand_sequences_leave_nothing_behind(loaded):
    m, mem, drv = loaded
    kv = m.placement.batch_kv
    dec = BatchDecoder(m.engine, kv)
    for s in range(SLOTS):
        kv.release(s)
    mem.synchronize()
    live0, blocks0, committed0 = drv.live(), len(mem.blocks), mem.authority.committed
    started = 0
    while started < 1000 or dec.active():
        while started < 1000 and dec.free_slots():        # joins between steps, as slots free
            dec.add([5 + started % 40, 7, 9][: 1 + started % 3], 1 + started % 4)
            started += 1
        dec.step()
    dec.close()
    mem.synchronize()
    assert drv.live() == live0 and len(mem.blocks) == blocks0 and mem.authority.committed == committed0
    assert kv.committed() == 0

