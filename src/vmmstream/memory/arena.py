"""Virtual arenas: one ``cuMemAddressReserve`` each, sub-allocated first-fit; a VA handed out never moves.

Owner: the arena owns its reservation and frees it in ``close()`` (only when empty: freeing address
space that still has mappings would be a use-after-free for whoever holds them).
"""

from __future__ import annotations

import bisect

from ..driver import Driver
from ..errors import CapacityError, VmmstreamError


class VirtualArena:
    def __init__(self, driver: Driver, name: str, size: int):
        g = driver.granularity()
        self.driver = driver
        self.name = name
        self.granularity = g
        self.size = (size + g - 1) // g * g
        self.base = driver.address_reserve(self.size, g)
        self._free: list[tuple[int, int]] = [(0, self.size)]   # sorted (offset, length)
        self._used: dict[int, int] = {}                          # offset -> length
        self.closed = False

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(self, nbytes: int) -> int:
        """A VA range of ``nbytes`` rounded up to the granularity (pure bookkeeping: no driver call)."""
        if self.closed:
            raise VmmstreamError(f"arena {self.name!r} is closed")
        n = max(self.granularity, (nbytes + self.granularity - 1) // self.granularity * self.granularity)
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + n, length - n)
                self._used[off] = n
                return self.base + off
        raise CapacityError(
            f"arena {self.name!r} has no free virtual range of {n} bytes (reserved {self.size}, used {self.used_bytes}); "
            "this is address space, not memory: reserve a larger arena", requested=n, budget=self.size,
            in_use=self.used_bytes, role=self.name)

    def free(self, va: int) -> None:
        off = va - self.base
        n = self._used.pop(off)
        i = bisect.bisect(self._free, (off, n))
        self._free.insert(i, (off, n))
        # Coalesce with the neighbours so large ranges come back.
        if i + 1 < len(self._free) and off + n == self._free[i + 1][0]:
            self._free[i] = (off, n + self._free[i + 1][1])
            self._free.pop(i + 1)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            self._free.pop(i)

    def contains(self, va: int) -> bool:
        return self.base <= va < self.base + self.size

    def close(self) -> None:
        if self.closed:
            return
        if self._used:
            raise VmmstreamError(f"arena {self.name!r} still has {len(self._used)} live ranges")
        self.driver.address_free(self.base, self.size)
        self.closed = True
