"""The device memory authority: one budget, one ledger of leases by role and holder (DESIGN §3).

Accounting (all in bytes):

* ``lease.committed``: physical bytes currently backing the holder's memory of that role;
* ``lease.granted``  : what the holder may commit without asking again (``granted >= committed``);
* ``retained``       : physical handles the pool keeps for reuse, charged to no lease but still charged;
* ``reserved = Σ granted + retained <= budget`` always, hence ``committed <= budget`` (invariant I1).

Growth is a transactional grant: own headroom, then unassigned capacity, then the pool's retained
handles, then reclaim from registered holders; it is planned first and refused with ``CapacityError``
before anything changes when the total cannot be met (I9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..budget import format_bytes
from ..errors import CapacityError

ROLES = ("weights_resident", "weight_slots", "kv_cache", "workspace_step", "workspace_session", "activations")


@dataclass
class Lease:
    holder: str
    role: str
    granted: int = 0
    committed: int = 0
    peak: int = 0
    # A grant made for a holder's life (a model's admitted plan): freeing memory of this lease gives the
    # physical bytes back but keeps the grant, so memory freed between steps (the step workspace) can always be
    # taken again, whatever other holders were granted meanwhile.
    keeps_grant: bool = False

    @property
    def headroom(self) -> int:
        return self.granted - self.committed


class Reclaimer(Protocol):
    """A holder that can give memory back on request (e.g. the weight residency evicting to streaming)."""

    def reclaimable(self) -> int: ...

    def reclaim(self, nbytes: int) -> int: ...  # returns bytes actually given back (shrinks its grants)


@dataclass
class _Source:
    kind: str      # "explicit", "env", "inferred"
    detail: str


@dataclass
class Authority:
    budget: int
    budget_source: _Source = field(default_factory=lambda: _Source("explicit", ""))
    device_total: int | None = None
    legacy: bool = False

    def __post_init__(self):
        if self.budget <= 0:
            raise ValueError("budget must be positive")
        self.leases: dict[tuple[str, str], Lease] = {}
        self.retained = 0
        self.peak_committed = 0
        self._reclaimers: dict[str, Reclaimer] = {}
        self._trim_retained: Callable[[int], int] | None = None  # set by the pool
        self.refusals = 0

    # -- totals --
    @property
    def committed(self) -> int:
        return sum(l.committed for l in self.leases.values()) + self.retained

    @property
    def reserved(self) -> int:
        return sum(l.granted for l in self.leases.values()) + self.retained

    @property
    def unassigned(self) -> int:
        return self.budget - self.reserved

    def lease(self, holder: str, role: str) -> Lease:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        key = (holder, role)
        if key not in self.leases:
            self.leases[key] = Lease(holder, role)
        return self.leases[key]

    def register_reclaimer(self, holder: str, reclaimer: Reclaimer) -> None:
        self._reclaimers[holder] = reclaimer

    def unregister_reclaimer(self, holder: str) -> None:
        self._reclaimers.pop(holder, None)

    # -- grants --
    def grant(self, lease: Lease, nbytes: int) -> None:
        """Make sure ``lease`` has ``nbytes`` of headroom, or raise CapacityError with nothing changed."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        need = nbytes - lease.headroom
        if need <= 0:
            return
        # Plan: can the sources together cover it? Decide before touching anything (I9).
        others = {h: r for h, r in self._reclaimers.items() if h != lease.holder}
        reclaimable = {h: max(0, int(r.reclaimable())) for h, r in others.items()}
        available = max(0, self.unassigned) + self.retained + sum(reclaimable.values())
        if need > available:
            self.refusals += 1
            raise self._refusal(lease, nbytes)
        # Execute: unassigned first, then the pool's idle handles, then other holders.
        if need > self.unassigned and self._trim_retained is not None:
            self._trim_retained(need - self.unassigned)
        for holder, amount in reclaimable.items():
            if need <= self.unassigned:
                break
            others[holder].reclaim(min(amount, need - self.unassigned))
        if need > self.unassigned:
            self.refusals += 1
            raise self._refusal(lease, nbytes)
        lease.granted += need

    def shrink(self, lease: Lease, nbytes: int | None = None) -> None:
        """Give back unused grant (all headroom by default)."""
        give = lease.headroom if nbytes is None else min(nbytes, lease.headroom)
        lease.granted -= give

    def restore_grant(self, lease: Lease, granted: int) -> None:
        """Undo a grant (rollback): never below what is committed."""
        lease.granted = max(lease.committed, granted)

    def _refusal(self, lease: Lease, nbytes: int) -> CapacityError:
        in_use = self.committed
        hint = ("set VMMSTREAM_LEGACY_ALLOCATOR=0 to stream weights, or raise the budget"
                if self.legacy else
                "raise the budget, lower max_context or batch, or let more weights stream")
        return CapacityError(
            f"cannot grant {format_bytes(nbytes)} to {lease.holder}/{lease.role}: budget {format_bytes(self.budget)} "
            f"({self.budget_source.kind}{': ' + self.budget_source.detail if self.budget_source.detail else ''}), "
            f"in use {format_bytes(in_use)}, reserved {format_bytes(self.reserved)}; {hint}",
            requested=nbytes, budget=self.budget, in_use=in_use, role=lease.role, holder=lease.holder)

    # -- commitment (called by the pool when physical bytes change hands) --
    def commit(self, lease: Lease, nbytes: int) -> None:
        if nbytes > lease.headroom:
            raise AssertionError(f"commit of {nbytes} beyond the grant of {lease.holder}/{lease.role}")
        lease.committed += nbytes
        lease.peak = max(lease.peak, lease.committed)
        self._note_peak()

    def uncommit(self, lease: Lease, nbytes: int, *, keep_grant: bool = False) -> None:
        if nbytes > lease.committed:
            raise AssertionError("uncommit beyond what is committed")
        lease.committed -= nbytes
        if not keep_grant:
            lease.granted -= nbytes

    def move_to_retained(self, lease: Lease, nbytes: int) -> None:
        """A freed handle goes to the pool: its bytes stay charged, now as retained."""
        self.uncommit(lease, nbytes)
        self.retained += nbytes

    def take_from_retained(self, lease: Lease, nbytes: int) -> None:
        """A retained handle is reused for ``lease``. Bytes the lease was already granted (admission grants a
        model's whole plan up front) are not granted twice: the lease grows only by what its headroom lacks,
        so the reserved total never grows and falls by the headroom used."""
        if nbytes > self.retained:
            raise AssertionError("taking more than is retained")
        self.retained -= nbytes
        lease.granted += max(0, nbytes - lease.headroom)
        self.commit(lease, nbytes)

    def _note_peak(self) -> None:
        c = self.committed
        if c > self.peak_committed:
            self.peak_committed = c
        assert c <= self.budget, "I1 violated: committed bytes exceed the budget"

    def by_role(self) -> dict[str, int]:
        out = {r: 0 for r in ROLES}
        for l in self.leases.values():
            out[l.role] += l.committed
        return out
