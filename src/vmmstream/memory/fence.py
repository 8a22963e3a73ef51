"""Event-fenced release (invariant I5): unmap or release only after the device is done with the memory.

A release records an event on every stream that may have used the memory and runs once all of them
have completed. Until then the bytes stay charged, so I1 holds while work drains. A release asked
for while a capture is open is parked and fenced after the capture closes (I6).
"""

from __future__ import annotations

from collections import deque

from ..driver import GATE, Driver, Stream
from ..interrupts import uninterruptible


class FenceQueue:
    def __init__(self, driver: Driver):
        self.driver = driver
        self._pending: deque = deque()          # (events, action), in submission order
        self._parked: list = []                 # (streams, action) asked for during a capture
        self._spare_events: list = []
        self.fenced = 0
        self.completed = 0

    def __len__(self) -> int:
        return len(self._pending) + len(self._parked)

    def _event(self):
        return self._spare_events.pop() if self._spare_events else self.driver.event_create()

    def defer(self, streams: list[Stream], action):
        """Queue ``action()`` to run (from ``collect``) once work already queued on ``streams`` has finished.

        Returns a ticket for ``cancel``, or None when parked because a capture is open.
        """
        if GATE.open:
            self._parked.append((list(streams), action))
            return None
        events = []
        try:
            for s in streams:
                ev = self._event()
                events.append(ev)
                self.driver.event_record(ev, s)
        except BaseException:
            self._spare_events.extend(events)   # nothing queued; keep the events for next time
            raise
        entry = (events, action)
        self._pending.append(entry)
        self.fenced += 1
        return entry

    def cancel(self, entry) -> bool:
        """Withdraw a deferred action that has not run yet; True if it was still pending."""
        for i, e in enumerate(self._pending):
            if e is entry:
                del self._pending[i]
                self._spare_events.extend(entry[0])
                return True
        return False

    def park(self, action) -> None:
        """Run ``action()`` once no capture is open (from ``collect``); used by finalizers."""
        self._parked.append(([], action))

    @uninterruptible()
    def collect(self) -> int:
        """Run every action whose fence has passed, in order; return how many ran."""
        if GATE.open:
            return 0
        parked, self._parked = self._parked, []
        for streams, action in parked:
            self.defer(streams, action)
        return self._run_ready()

    def _run_ready(self) -> int:
        ran = 0
        while self._pending:
            events, action = self._pending[0]
            if not all(self.driver.event_query(e) for e in events):
                break
            self._pending.popleft()
            try:
                action()
            finally:
                self._spare_events.extend(events)
            ran += 1
            self.completed += 1
        return ran

    @uninterruptible()
    def drain(self) -> None:
        """Wait for every fence (refused during a capture), then run the actions."""
        self.collect()
        while self._pending:
            events, _ = self._pending[0]
            for e in events:
                self.driver.event_synchronize(e)
            self.collect()

    @uninterruptible()
    def close(self) -> None:
        self.drain()
        for e in self._spare_events:
            self.driver.event_destroy(e)
        self._spare_events.clear()
