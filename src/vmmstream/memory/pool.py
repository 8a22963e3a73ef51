"""The physical-handle pool: ``cuMemCreate`` handles of k × granularity, reused after unmap.

Owner: the pool owns every handle it created until ``cuMemRelease``; a handle lent to a block is
still the pool's, the block only holds it (invariant I2). Idle handles are *retained* for reuse
(creating one costs ~11 µs on an H200) and stay charged to the authority; retention is bounded,
and the authority asks the pool to trim before refusing a grant.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass

from ..driver import Driver
from ..errors import DriverError
from ..interrupts import uninterruptible
from .authority import Authority, Lease
from .transaction import Transaction


@dataclass(eq=False)
class PhysicalHandle:
    handle: int
    size: int
    fresh: bool = False   # created by the acquire that returned it (rollback releases, not retains)


class PhysicalPool:
    def __init__(self, driver: Driver, authority: Authority, *, max_retained: int | None = None):
        self.driver = driver
        self.authority = authority
        self.granularity = driver.granularity()
        # Keep at most this many idle bytes; default a quarter of the budget.
        self.max_retained = authority.budget // 4 if max_retained is None else max_retained
        self._idle: OrderedDict[int, PhysicalHandle] = OrderedDict()   # handle id -> handle, oldest first
        self.live: dict[int, PhysicalHandle] = {}                      # every handle the pool owns
        self.created = 0
        self.released = 0
        self.reused = 0
        self.release_failures = 0
        authority._trim_retained = self.trim

    def round_up(self, nbytes: int) -> int:
        g = self.granularity
        return max(g, (nbytes + g - 1) // g * g)

    @property
    def retained_bytes(self) -> int:
        return sum(h.size for h in self._idle.values())

    @property
    def owned_bytes(self) -> int:
        return sum(h.size for h in self.live.values())

    @uninterruptible()
    def acquire(self, lease: Lease, size: int) -> PhysicalHandle:
        """A handle of exactly ``size`` bytes charged to ``lease``: reused if one is idle, else created."""
        assert size % self.granularity == 0 and size > 0
        for hid, h in self._idle.items():
            if h.size == size:
                del self._idle[hid]
                self.authority.take_from_retained(lease, size)
                self.reused += 1
                h.fresh = False
                return h
        with Transaction() as tx:
            granted_before = lease.granted
            self.authority.grant(lease, size)      # may trim idle handles or reclaim; refuses cleanly
            tx.on_undo(self.authority.restore_grant, lease, granted_before)
            raw = self.driver.mem_create(size)
            tx.on_undo(self.driver.mem_release, raw)
            h = PhysicalHandle(raw, size, fresh=True)
            self.authority.commit(lease, size)
        self.live[raw] = h
        self.created += 1
        return h

    @uninterruptible()
    def undo_acquire(self, lease: Lease, h: PhysicalHandle, granted_before: int) -> None:
        """Roll an ``acquire`` back exactly: a created handle is released, a reused one goes back idle."""
        if h.fresh:
            self.driver.mem_release(h.handle)
            del self.live[h.handle]
            self.released += 1
            self.authority.uncommit(lease, h.size)
        else:
            self.authority.move_to_retained(lease, h.size)
            self._idle[h.handle] = h
            self.reused -= 1
        self.authority.restore_grant(lease, granted_before)

    @uninterruptible()
    def give_back(self, lease: Lease, h: PhysicalHandle) -> None:
        """The holder is done with ``h`` (already unmapped everywhere): retain it, then trim past the bound.

        Retaining first means a failing ``cuMemRelease`` leaves the handle idle and charged, never lost. A lease
        that keeps its grant has its handle released at once instead (an idle handle would be charged twice: to
        the pool and to the grant); if that release fails the handle is retained and the grant shrinks by as much.
        """
        if lease.keeps_grant:
            self.authority.uncommit(lease, h.size, keep_grant=True)
            try:
                self._release(h)
            except BaseException as exc:   # kept idle and charged as retained, never lost; Ctrl-C goes on up
                lease.granted -= h.size
                self.authority.retained += h.size
                self._idle[h.handle] = h
                self.release_failures += 1
                if not isinstance(exc, DriverError):
                    raise
            return
        self.authority.move_to_retained(lease, h.size)
        self._idle[h.handle] = h
        excess = self.retained_bytes - self.max_retained
        if excess > 0:
            try:
                self.trim(excess)
            except DriverError as exc:
                # The caller's release succeeded; the idle handle stays owned and charged (I1, I2 hold)
                # and the next trim or close() retries it.
                self.release_failures += 1
                warnings.warn(f"vmmstream: releasing an idle handle failed, kept for retry: {exc}",
                              RuntimeWarning, stacklevel=2)

    def _release(self, h: PhysicalHandle) -> None:
        self.driver.mem_release(h.handle)
        del self.live[h.handle]
        self.released += 1

    @uninterruptible()
    def trim(self, nbytes: int | None = None) -> int:
        """Release idle handles, oldest first, until ``nbytes`` are freed (all by default)."""
        freed = 0
        while self._idle and (nbytes is None or freed < nbytes):
            hid, h = next(iter(self._idle.items()))
            self._release(h)          # on failure the handle stays idle and charged: nothing is lost
            del self._idle[hid]
            self.authority.retained -= h.size
            freed += h.size
        return freed

    @uninterruptible()
    def close(self) -> None:
        self.trim()
