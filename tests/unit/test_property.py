"""Random sequences of grant / commit / alias / unmap / release / injected failure on the host backend.

After every step: I1 (committed <= budget, and the ledger matches what is physically owned) and I2
(every handle and mapping the driver holds has exactly one owner in the pool or a block). At the end,
close() leaves nothing behind. CI runs this with HYPOTHESIS_PROFILE=ci (2,000 examples).
"""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmmstream.driver.host import HostDriver
from vmmstream.errors import CapacityError, DriverError, VmmstreamError
from vmmstream.memory import ROLES, DeviceMemory

G = 64 << 10
BUDGET = 24 * G


class OneShot:
    def __init__(self, n):
        self.n = n

    def __call__(self, name):
        self.n -= 1
        if self.n == 0:
            raise DriverError(name, "CUDA_ERROR_INJECTED", "property test")


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.driver = HostDriver(granularity=G, total_bytes=1 << 30)
        self.mem = DeviceMemory(self.driver, BUDGET, max_retained=4 * G)
        self.stream = self.driver.stream_create()
        self.mem.track_stream(self.stream)
        self.blocks = []

    def _act(self, fn):
        try:
            fn()
        except (CapacityError, DriverError):
            pass        # refusals and injected failures are expected; the invariants judge the aftermath
        finally:
            self.driver.fault_injector = None

    def _live(self):
        self.blocks = [b for b in self.blocks if b.state != "freed"]
        return self.blocks

    @rule(granules=st.integers(1, 10), role=st.sampled_from(ROLES), holder=st.sampled_from(["a", "b"]))
    def allocate(self, granules, role, holder):
        def go():
            self.blocks.append(self.mem.allocate(granules * G, role=role, holder=holder))
        self._act(go)

    @rule(granules=st.integers(1, 6))
    def reserve(self, granules):
        def go():
            self.blocks.append(self.mem.reserve(granules * G, role="weight_slots", holder="a", arena="weights"))
        self._act(go)

    @rule(granules=st.integers(0, 8), holder=st.sampled_from(["a", "b"]))
    def grant(self, granules, holder):
        self._act(lambda: self.mem.authority.grant(self.mem.authority.lease(holder, "kv_cache"), granules * G))

    @rule(holder=st.sampled_from(["a", "b"]))
    def shrink(self, holder):
        self.mem.authority.shrink(self.mem.authority.lease(holder, "kv_cache"))

    @rule(data=st.data())
    def back(self, data):
        cands = [b for b in self._live() if b.state == "unbacked"]
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        self._act(lambda: self.mem.back(b))

    @rule(data=st.data())
    def alias(self, data):
        cands = [b for b in self._live() if b.state == "unbacked"]
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        sources = [s for s in self.blocks if s.state == "own" and s.size == b.size]
        if sources:
            src = data.draw(st.sampled_from(sources))
            self._act(lambda: self.mem.alias(b, src))

    @rule(data=st.data())
    def unmap(self, data):
        cands = [b for b in self._live() if b.state in ("own", "alias")]
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        try:
            self._act(lambda: self.mem.unmap(b))
        except VmmstreamError:
            assert any(o.handle is b.handle and o.state == "alias" for o in self.blocks)

    @rule(data=st.data())
    def free(self, data):
        if not self._live():
            return
        b = data.draw(st.sampled_from(self.blocks))
        if b.state == "own" and any(o.handle is b.handle and o.state == "alias" for o in self.blocks):
            return
        self._act(lambda: self.mem.free(b))

    @rule(n=st.integers(1, 6))
    def inject_failure(self, n):
        self.driver.fault_injector = OneShot(n)

    @rule()
    def trim(self):
        self._act(lambda: self.mem.pool.trim())

    @invariant()
    def i1_committed_within_budget_and_matches_physical(self):
        a, pool = self.mem.authority, self.mem.pool
        assert a.committed <= a.budget
        assert a.reserved <= a.budget
        assert a.committed == pool.owned_bytes            # the ledger charges exactly what exists
        assert a.retained == pool.retained_bytes
        for lease in a.leases.values():
            assert 0 <= lease.committed <= lease.granted

    @invariant()
    def i2_one_owner_per_handle_and_mapping(self):
        d, pool = self.driver, self.mem.pool
        assert sorted(d.handles) == sorted(pool.live)
        assert pool.created - pool.released == len(pool.live)
        owned = [b.handle.handle for b in self.mem.blocks if b.state == "own"]
        idle = list(pool._idle)
        assert sorted(owned + idle) == sorted(pool.live)   # each handle: one block or the idle list
        mapped = {b.va: (b.size, b.handle.handle) for b in self.mem.blocks if b.state in ("own", "alias")}
        assert {va: (s, h) for va, (s, h, _) in d.mappings.items()} == mapped
        assert self.mem.mapped_bytes == sum(s for s, _ in mapped.values())

    def teardown(self):
        self.driver.fault_injector = None
        self.mem.close()
        s = self.mem.snapshot()
        assert s["mapped"] == 0 and s["handles"]["owned_bytes"] == 0
        assert s["handles"]["created"] == s["handles"]["released"]
        assert self.driver.live() == {"handles": 0, "reservations": 0, "mappings": 0, "allocs": 0,
                                      "host_allocs": 0}
        self.driver.close()


TestMemoryProperties = MemoryMachine.TestCase
