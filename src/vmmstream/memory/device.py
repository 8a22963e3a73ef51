"""``DeviceMemory``: the governed memory of one device — authority, pool, arenas, fences (DESIGN §3).

Every device byte vmmstream uses comes from here. A ``Block`` is a VA range that never moves (I4);
what backs it can change: its own physical handle, another block's handle (aliasing), or nothing.
Multi-step work (reserve VA → acquire handle → map → set access) is a transaction (I3); unmapping and
releasing wait for fences (I5); nothing here runs while a capture is open (I6).

With ``legacy=True`` blocks are plain ``cuMemAlloc`` allocations: same ledger and budget, no VMM, no
aliasing, no remapping.
"""

from __future__ import annotations

import threading

from ..budget import format_bytes
from ..driver import GATE, Driver, Stream
from ..errors import VmmstreamError
from ..interrupts import uninterruptible
from .arena import VirtualArena
from .authority import Authority, Lease, _Source
from .fence import FenceQueue
from .pool import PhysicalHandle, PhysicalPool
from .transaction import Transaction

DEFAULT_ARENAS = ("weights", "kv", "workspace", "activations")


class Block:
    """A device range at a stable VA. Owned by the holder that asked for it; freed with ``DeviceMemory.free``."""

    __slots__ = ("memory", "va", "size", "nbytes", "arena", "lease", "handle", "aliased", "state")

    def __init__(self, memory, va, size, nbytes, arena, lease):
        self.memory = memory
        self.va = va              # device address; never changes while the block lives
        self.size = size          # bytes of VA (granularity multiple)
        self.nbytes = nbytes      # bytes asked for
        self.arena = arena
        self.lease = lease
        self.handle: PhysicalHandle | None = None  # what backs the VA now
        self.aliased = False      # True when ``handle`` belongs to another block
        self.state = "unbacked"   # unbacked | own | alias | plain | releasing | freed

    @property
    def backed(self) -> bool:
        return self.state in ("own", "alias", "plain")

    @property
    def device_pointer(self) -> int:
        return self.va

    def __repr__(self):
        return f"Block({self.lease.holder}/{self.lease.role}, va={self.va:#x}, {self.size} B, {self.state})"


class DeviceMemory:
    def __init__(self, driver: Driver, budget: int, *, budget_source=("explicit", ""), legacy: bool = False,
                 arena_bytes: int | None = None, max_retained: int | None = None):
        info = driver.device_info()
        self.driver = driver
        self.legacy = legacy
        self.authority = Authority(budget, _Source(*budget_source), info.total_bytes, legacy)
        self.pool = None if legacy else PhysicalPool(driver, self.authority, max_retained=max_retained)
        self.granularity = driver.granularity()
        self.fences = FenceQueue(driver)
        # Address space is cheap; reserve generously so arenas never run out before memory does.
        g = self.granularity
        default = max(4 * budget, 1 << 30)
        self.arena_bytes = (arena_bytes or default) // g * g or g
        self.arenas: dict[str, VirtualArena] = {}
        self.streams: list[Stream] = []   # streams whose work fences every release
        self.blocks: set[Block] = set()
        self.mapped_bytes = 0
        self.closed = False
        # Models that share this memory serialize their calls on this lock (I12): their engines share the
        # device, the ledger and the pool, none of which is locked on its own.
        self.lock = threading.RLock()
        # The process's shared memory made for a model closes when its last model closes (``models``
        # counts them); memory a caller made or passed in stays the caller's to close.
        self.models = 0
        self.closes_with_models = False

    # -- arenas and streams --
    def arena(self, name: str, va_bytes: int | None = None) -> VirtualArena:
        if name not in self.arenas:
            GATE.check("arena reservation")
            self.arenas[name] = VirtualArena(self.driver, name, va_bytes or self.arena_bytes)
        return self.arenas[name]

    def track_stream(self, stream: Stream) -> None:
        """Releases will wait for work queued on ``stream`` (the package's streams, or a user's)."""
        if all(s is not stream for s in self.streams):
            self.streams.append(stream)

    def untrack_stream(self, stream: Stream) -> None:
        self.streams = [s for s in self.streams if s is not stream]

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise VmmstreamError(f"{what}: device memory is closed")
        GATE.check(what)

    # -- allocation --
    @uninterruptible()
    def allocate(self, nbytes: int, *, role: str, holder: str, arena: str = "activations") -> Block:
        """A backed block of ``nbytes`` at a stable VA, charged to ``holder``/``role``."""
        self._check_open("allocation")
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        self.fences.collect()
        lease = self.authority.lease(holder, role)
        if self.legacy:
            return self._allocate_plain(nbytes, lease)
        block = self.reserve(nbytes, role=role, holder=holder, arena=arena)
        try:
            self.back(block)
        except BaseException:
            self._free_va(block)
            raise
        return block

    def _allocate_plain(self, nbytes: int, lease: Lease) -> Block:
        size = (nbytes + 255) // 256 * 256
        with Transaction() as tx:
            before = lease.granted
            self.authority.grant(lease, size)
            tx.on_undo(self.authority.restore_grant, lease, before)
            ptr = self.driver.mem_alloc(size)
            self.authority.commit(lease, size)
        block = Block(self, ptr, size, nbytes, None, lease)
        block.state = "plain"
        self.blocks.add(block)
        self.mapped_bytes += size
        return block

    @uninterruptible()
    def reserve(self, nbytes: int, *, role: str, holder: str, arena: str = "weights") -> Block:
        """A VA range with nothing behind it yet (streamed tensors, the end of a growing KV cache)."""
        self._check_open("VA reservation")
        if self.legacy:
            raise VmmstreamError("the legacy allocator has no virtual reservations (VMMSTREAM_LEGACY_ALLOCATOR=1)")
        a = self.arena(arena)
        va = a.allocate(nbytes)
        block = Block(self, va, a._used[va - a.base], nbytes, a, self.authority.lease(holder, role))
        self.blocks.add(block)
        return block

    @uninterruptible()
    def back(self, block: Block) -> None:
        """Map a physical handle of the block's own (reused or created) at its VA."""
        self._check_open("map")
        self._require_unbacked(block, "back")
        self.fences.collect()
        with Transaction() as tx:
            granted_before = block.lease.granted
            h = self.pool.acquire(block.lease, block.size)
            tx.on_undo(self.pool.undo_acquire, block.lease, h, granted_before)
            self._map(block, h, tx)
        block.handle, block.aliased, block.state = h, False, "own"

    @uninterruptible()
    def alias(self, block: Block, source: Block) -> None:
        """Map ``source``'s physical handle at ``block``'s VA too (same size; charged once, to ``source``).

        Streamed tensors alias the slot they are assigned to this way.
        """
        self._check_open("alias")
        if self.legacy:
            raise VmmstreamError("the legacy allocator cannot alias (VMMSTREAM_LEGACY_ALLOCATOR=1)")
        self._require_unbacked(block, "alias")
        if source.state != "own":
            raise VmmstreamError(f"alias source must own its backing, not be {source.state}")
        if block.size != source.size:
            # CUDA maps whole handles only (a partial cuMemMap is CUDA_ERROR_NOT_SUPPORTED on the H200):
            # a tensor smaller than its slot reserves a slot-sized VA range and uses its front.
            raise VmmstreamError(f"alias: a {block.size} B range cannot map a {source.size} B handle; "
                                 "reserve the alias at the source's size")
        with Transaction() as tx:
            self._map(block, source.handle, tx)
        block.handle, block.aliased, block.state = source.handle, True, "alias"

    def _map(self, block: Block, h: PhysicalHandle, tx: Transaction) -> None:
        self.driver.mem_map(block.va, block.size, h.handle, 0)
        tx.on_undo(self.driver.mem_unmap, block.va, block.size)
        self.driver.mem_set_access(block.va, block.size)
        self.mapped_bytes += block.size
        tx.on_undo(self._sub_mapped, block.size)

    def _sub_mapped(self, n: int) -> None:
        self.mapped_bytes -= n

    def _require_unbacked(self, block: Block, what: str) -> None:
        if block.state == "releasing":
            self.fences.drain()      # its previous backing is still fenced; wait for it (never in capture)
        if block.state != "unbacked":
            raise VmmstreamError(f"{what}: {block!r} is {block.state}; unmap it first")

    # -- release (fenced) --
    @uninterruptible()
    def unmap(self, block: Block, streams: list[Stream] | None = None) -> None:
        """Take the backing away once in-flight work is done; the VA stays the block's (I4, I5)."""
        self._check_open("unmap")
        if block.state not in ("own", "alias"):
            raise VmmstreamError(f"unmap: {block!r} is not mapped")
        if block.state == "own" and any(b.handle is block.handle and b.state == "alias" for b in self.blocks):
            raise VmmstreamError(f"unmap: {block!r} is still aliased elsewhere; unmap the aliases first")
        h, prev = block.handle, block.state
        own = prev == "own"

        def finish():
            try:
                self.driver.mem_unmap(block.va, block.size)
            except BaseException:
                block.state = prev       # still mapped, still charged: nothing changed (I3)
                raise
            self.mapped_bytes -= block.size
            block.handle, block.aliased = None, False
            block.state = "unbacked" if block.state == "releasing" else block.state
            if own:
                self.pool.give_back(block.lease, h)

        block.state = "releasing"
        self._defer_and_collect(block, prev, self.streams if streams is None else streams, finish)

    def _defer_and_collect(self, block: Block, prev: str, streams, action) -> None:
        """Queue a fenced action and run what is ready; if that fails while ours is still queued,
        withdraw it and restore the block, so the failed call changed nothing (I3)."""
        try:
            ticket = self.fences.defer(streams, action)
        except BaseException:
            block.state = prev
            raise
        try:
            self.fences.collect()
        except BaseException:
            if ticket is not None and self.fences.cancel(ticket):
                block.state = prev
            raise

    @uninterruptible()
    def free(self, block: Block, streams: list[Stream] | None = None) -> None:
        """Release the block: backing and VA, after the fences. Idempotent."""
        if block.state == "freed" or block not in self.blocks:
            return
        if self.closed:
            raise VmmstreamError("free: device memory is closed")
        if GATE.open:   # e.g. a finalizer during a capture: no driver call now, free right after it
            self.fences.park(lambda: self.free(block, streams))
            return
        fence = self.streams if streams is None else streams
        if block.state == "plain":
            def finish_plain():
                try:
                    self.driver.mem_free(block.va)
                except BaseException:
                    block.state = "plain"
                    raise
                self.mapped_bytes -= block.size
                self.authority.uncommit(block.lease, block.size, keep_grant=block.lease.keeps_grant)
                self.blocks.discard(block)
                block.state = "freed"
            block.state = "releasing"
            self._defer_and_collect(block, "plain", fence, finish_plain)
            return
        if block.state in ("own", "alias"):
            self.unmap(block, fence)
        # The VA goes back after the unmap; an unbacked block has nothing in flight to wait for.
        self.fences.defer([], lambda: self._free_va(block))
        self.fences.collect()

    def _free_va(self, block: Block) -> None:
        if block.state != "unbacked":   # the unmap ahead of us failed: the block keeps its VA
            return
        block.arena.free(block.va)
        self.blocks.discard(block)
        block.state = "freed"

    @uninterruptible()
    def collect(self) -> int:
        return self.fences.collect()

    @uninterruptible()
    def synchronize(self) -> None:
        """Wait for every pending release."""
        self.fences.drain()

    # -- observability --
    def snapshot(self) -> dict:
        from .report import snapshot
        return snapshot(self)

    def report(self) -> str:
        from .report import table
        return table(self.snapshot())

    # -- teardown --
    @uninterruptible()
    def close(self) -> None:
        """Release everything: after this the pool owns 0 bytes and created == released (I2). Idempotent."""
        if self.closed:
            return
        GATE.check("DeviceMemory.close")
        self.fences.drain()
        for block in sorted(self.blocks, key=lambda b: b.state != "alias"):  # aliases first
            self.free(block, [])
        self.fences.drain()
        if self.pool is not None:
            self.pool.close()
        for a in self.arenas.values():
            a.close()
        self.fences.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
