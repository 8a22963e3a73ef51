"""Weight residency: a VA per tensor for life, resident backing, slots aliased at streamed VAs, pinned host copies.

Owner: ``Weights`` owns every block it made (resident tensors, slots, streamed tensors' VA ranges), its
pinned host allocation and its VA arena; ``close()`` releases them (fenced: after work queued on the
package's streams) and is idempotent.

* resident tensor: its own physical pages at its own VA, filled once at load;
* streamed tensor: its own VA, mapped onto the first bytes of slot ``k`` (a physical handle shared by
  every tenant of the slot), filled from its pinned host copy before each use (``Streamer``);
* the embedding table is also kept in pinned host memory: the gather reads only a step's rows from there;
* with ``plan.quantization``, the layers' linear weights are quantized on the host as they are read (from
  the checkpoint's own precision) into their quantized payload (``vmmstream.quantization``); their device
  view is a ``QWeight`` and the error of every one is gathered in ``Weights.quant``.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from ..align import align_up
from ..errors import Attempts
from ..interrupts import uninterruptible

EMBED = "model.embed_tokens.weight"
_PROGRESS_MIN_BYTES = 64 << 20
READERS = 4           # threads reading the checkpoint (page-cache copies and disk reads in parallel)
PIECE = 32 << 20      # bytes per read
RING = 4              # staging slots a resident tensor's pieces rotate through




class Tensor:
    __slots__ = ("name", "shape", "payload", "where", "block", "host", "slot", "array", "index", "qlayout",
                 "unit", "unit_off")

    def __init__(self, name, shape, payload, where, qlayout=None):
        self.name, self.shape, self.payload, self.where = name, tuple(shape), payload, where
        self.qlayout = qlayout   # quantization.QLayout of a quantized weight
        self.unit = None         # routed experts: (layer, expert) of the unit holding it
        self.unit_off = 0        # and its offset in that unit
        self.block = None    # device Block (resident or streamed)
        self.host = None     # pinned host address (streamed tensors and the embedding table)
        self.slot = None
        self.array = None    # device view (or the host-mapped table for the embedding gather)
        self.index = None    # position among streamed tensors


class Weights:
    def __init__(self, mem, ops, plan, checkpoint, holder: str, stream, *, progress=None):
        self.mem, self.ops, self.plan, self.holder = mem, ops, plan, holder
        self.driver = mem.driver
        self.stream = stream
        self.tensors: dict[str, Tensor] = {}
        self.slots = []
        self.streamed: list[Tensor] = []
        self.host_ptr = 0
        self.host_bytes = 0
        self.arena_name = None
        self.closed = False
        from ..quantization import ErrorReport
        self.quant = ErrorReport(plan.quantization)
        from ..conversion import ConversionReport
        self.conversion = ConversionReport()   # tensors stored in another form (GGUF types, GPTQ / AWQ parts)
        self.experts = None
        try:
            self._build(checkpoint, progress)
        except BaseException:
            self.close()
            raise

    # -- construction --
    def _build(self, ck, progress) -> None:
        from ..quantization import is_linear, layout, quantizable
        plan, mem, g = self.plan, self.mem, self.mem.granularity
        kind = plan.quantization
        for p in plan.placements:
            shape = ck.tensors[p.name].shape
            ql = layout(kind, shape) if quantizable(p.name, shape, kind) else None
            if ql is not None and ql.total != p.payload:
                raise ValueError(f"{p.name}: the plan's payload {p.payload} is not its {kind} layout's {ql.total}")
            if kind and ql is None and is_linear(p.name):
                self.quant.kept_bf16.append(p.name)
            self.tensors[p.name] = Tensor(p.name, shape, p.payload, p.where, ql)
        device = [t for t in self.tensors.values() if t.where not in ("host", "expert")]
        ep = plan.experts
        if ep is not None:
            from .experts import Experts
            self.experts = Experts(self, ep)
        if not mem.legacy:
            # Streamed tensors reserve a whole slot of VA: CUDA maps a handle whole, so a tensor smaller
            # than its slot aliases the full slot and uses the front of it.
            n_streamed = sum(1 for p in plan.placements if p.where == "streamed")
            va = (sum(p.device_bytes for p in plan.placements if p.where == "resident")
                  + (plan.slot_count + n_streamed) * plan.slot_bytes + g
                  + (0 if ep is None else (len(ep.resident) + ep.slots) * ep.unit_bytes))
            self.arena_name = f"weights:{self.holder}"
            mem.arena(self.arena_name, va)
        arena = self.arena_name or "weights"
        for t in device:
            if t.where == "resident":
                t.block = mem.allocate(t.payload, role="weights_resident", holder=self.holder, arena=arena)
        for _ in range(plan.slot_count):
            self.slots.append(mem.allocate(plan.slot_bytes, role="weight_slots", holder=self.holder, arena=arena))
        for p in plan.placements:
            if p.where == "streamed":
                t = self.tensors[p.name]
                t.slot, t.index = p.slot, len(self.streamed)
                t.block = mem.reserve(plan.slot_bytes, role="weight_slots", holder=self.holder, arena=arena)
                mem.alias(t.block, self.slots[p.slot])
                self.streamed.append(t)
        if self.experts is not None:
            self.experts.allocate(arena)
        # pinned host memory: streamed tensors, the embedding table, every expert unit when some are gathered
        # on demand, and a staging area for resident loads
        host = [t for t in self.tensors.values() if t.where == "streamed" or t.name == EMBED]
        # the slow path (_load: converted or quantized tensors) stages a whole tensor; the read ring (_load_plain)
        # RING pieces, never more than there is to stage
        slow = [t for t in self.tensors.values() if not self._plain(ck.tensors[t.name])]
        staging = max([t.payload for t in slow if t.where in ("resident", "expert") and t.name != EMBED] + [0])
        ring = sum(t.payload for t in self.tensors.values() if t.where in ("resident", "expert"))
        staging = max(staging, min(RING * PIECE, ring), RING if ring else 0)
        offsets, off = {}, 0
        for t in host:
            offsets[t.name] = off
            off = align_up(off + t.payload)
        units_off = off
        if self.experts is not None and self.experts.on_demand:
            off += self.experts.host_bytes
        stage_off = off
        self.host_bytes = off + staging
        with uninterruptible():           # allocated and kept together, so close() frees it
            self.host_ptr = self.driver.host_alloc(max(self.host_bytes, 1))
        for t in host:
            t.host = self.host_ptr + offsets[t.name]
        if self.experts is not None and self.experts.on_demand:
            self.experts.place_host(self.host_ptr + units_off)
        self._load(ck, self.host_ptr + stage_off, staging, progress)
        if self.experts is not None:
            self.experts.make_views()
        from ..quantization import views
        for t in device:
            t.array = (views(t.qlayout, t.block.va, self.ops.view) if t.qlayout is not None
                       else self.ops.view(t.block.va, t.shape, np.uint16))
        self.embedding_table = self.ops.view(self.tensors[EMBED].host, self.tensors[EMBED].shape, np.uint16)

    def _load(self, ck, stage_ptr: int, stage_bytes: int, progress) -> None:
        """Read every tensor once (file, then offset order): host copies land in place, resident ones go
        through the staging area to their VA. f16/f32 checkpoints are converted to bf16 on the way; weights
        to quantize are quantized from their checkpoint values."""
        from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
        infos = [ck.tensors[name] for name in self.tensors]
        total = sum(i.nbytes for i in infos)
        report = _progress_printer(total, progress)
        temp = {}

        def dest(t: Tensor) -> int:
            return t.host if t.host is not None else stage_ptr

        def buffer_for(info):
            t = self.tensors[info.name]
            if info.dtype != "BF16" or t.qlayout is not None:
                temp[info.name] = np.empty(info.nbytes, np.uint8)
                return temp[info.name]
            return (ctypes.c_uint8 * t.payload).from_address(dest(t))

        def place(t: Tensor, src: int) -> None:
            """The tensor's bytes at host address ``src`` go to its device home (resident, pool unit)."""
            if t.where == "resident":
                self.driver.memcpy_htod_async(t.block.va, src, t.payload, self.stream)
                self.driver.stream_synchronize(self.stream)   # the staging area is reused by the next tensor
            elif t.where == "expert":
                r = self.experts.loc[t.unit]
                if r >= 0:
                    self.driver.memcpy_htod_async(self.experts.pool_va(r) + t.unit_off, src, t.payload, self.stream)
                    self.driver.stream_synchronize(self.stream)

        def quantize(t: Tensor, vals: np.ndarray) -> np.ndarray:
            out = np.zeros(t.payload, np.uint8)
            self.quant.quantize_into(t.name, vals.reshape(t.shape), t.qlayout, out)
            return out

        # Quantization (NumPy, which releases the GIL in its array work) runs on a few threads while the
        # file is read; each result is placed when it is done, in the order it was submitted.
        from concurrent.futures import ThreadPoolExecutor
        n_workers = max(1, min(8, os.cpu_count() or 1))
        sourced = [i for i in infos if i.source is not None]
        workers = ThreadPoolExecutor(max_workers=n_workers) if self.quant.kind or sourced else None
        pending = []

        def drain(limit: int) -> None:
            while len(pending) > limit:
                t, fut = pending.pop(0)
                out = fut.result()
                if t.host is not None:
                    ctypes.memmove(t.host, out.ctypes.data, t.payload)
                place(t, out.ctypes.data)

        from ..model import iter_load
        plain = [i for i in infos if self._plain(i)]
        try:
            done = self._load_plain(plain, stage_ptr, stage_bytes, report, total) if plain else 0
        except BaseException:
            if report is not None and hasattr(report, "close"):
                report.close()           # a bar left open on an error would keep its line
            raise
        infos = [i for i in infos if not self._plain(i) and i.source is None]
        slow_report = None if report is None else \
            (lambda d, tot, info, final=False: report(done + d, total, info, final=final))
        try:
            # tensors stored in another form: read and converted on the workers (``vmmstream.conversion``)
            from ..conversion import convert
            for info in sorted(sourced, key=lambda i: (i.file or "", i.offset)):
                t = self.tensors[info.name]
                pending.append((t, workers.submit(convert, info, t.payload, t.qlayout, self.quant, self.conversion)))
                drain(2 * n_workers)
                done += info.nbytes
                if slow_report is not None:
                    report(done, total, info)
            drain(0)
            for info in iter_load(infos, buffer_for, progress=slow_report):
                t = self.tensors[info.name]
                if info.name in temp:
                    raw = temp.pop(info.name)
                    from ..model.checkpoint import DTYPES
                    if info.dtype == "BF16":
                        vals = bf16_to_f32(raw.view(np.uint16))
                    else:
                        vals = raw.view(DTYPES[info.dtype]).astype(np.float32)
                    if t.qlayout is not None:
                        pending.append((t, workers.submit(quantize, t, vals)))
                        drain(2 * n_workers)
                        continue
                    bits = f32_to_bf16(vals)
                    ctypes.memmove(dest(t), bits.ctypes.data, t.payload)
                place(t, dest(t))
            drain(0)
        finally:
            if workers is not None:
                workers.shutdown(wait=True, cancel_futures=True)
            if report is not None and hasattr(report, "close"):
                report.close()           # a bar left open on an error would keep its line
        if report is not None:
            report(total, total, None, final=True)

    def _plain(self, info) -> bool:
        """A tensor whose checkpoint bytes are its payload as they are (bf16, not quantized)."""
        t = self.tensors[info.name]
        return (info.dtype == "BF16" and t.qlayout is None and info.nbytes == t.payload and info.file is not None
                and info.source is None)

    def _device_addr(self, t: Tensor) -> int | None:
        if t.where == "resident":
            return t.block.va
        if t.where == "expert":
            r = self.experts.loc[t.unit]
            return self.experts.pool_va(r) + t.unit_off if r >= 0 else None
        return None

    def _load_plain(self, infos, stage_ptr: int, stage_bytes: int, report, total: int) -> int:
        """Read bf16 tensors on ``READERS`` threads, in pieces of at most ``PIECE`` bytes, file then offset order:
        pieces of tensors kept in pinned host memory land in place; the others land in a ring of ``RING``
        slots of the staging area and are copied to their device home as they arrive, a slot reused once its
        copy is done (an event), so reading, copying and the next reads overlap. Returns the bytes read."""
        from concurrent.futures import ThreadPoolExecutor

        from ..model.checkpoint import open_regular, pread_into
        d = self.driver
        ring_piece = max(1, min(PIECE, stage_bytes // RING))
        todo = []
        for info in sorted(infos, key=lambda i: (i.file, i.offset)):
            piece = PIECE if self.tensors[info.name].host is not None else ring_piece   # in place / via the ring
            for off in range(0, info.nbytes, piece):
                todo.append((info, off, min(piece, info.nbytes - off)))
        files, events, pending = {}, [], []
        slot_event = [None] * RING
        nxt_slot, done = 0, 0
        pool = ThreadPoolExecutor(max_workers=READERS)
        try:
            for info in {i.file: i for i in infos}.values():
                files[info.file] = open_regular(info.file)
            i = 0
            while i < len(todo) or pending:
                while i < len(todo) and len(pending) < RING:
                    info, off, n = todo[i]
                    t = self.tensors[info.name]
                    slot = None
                    if t.host is not None:
                        dst = t.host + off
                    else:
                        slot, nxt_slot = nxt_slot, (nxt_slot + 1) % RING
                        if slot_event[slot] is not None:
                            d.event_synchronize(slot_event[slot])      # the slot's last copy is done
                        dst = stage_ptr + slot * ring_piece
                    fut = pool.submit(pread_into, files[info.file], info, off, dst, n)
                    pending.append((fut, info, off, n, dst, slot))
                    i += 1
                fut, info, off, n, src, slot = pending.pop(0)
                fut.result()
                t = self.tensors[info.name]
                dev = self._device_addr(t)
                if dev is not None:
                    d.memcpy_htod_async(dev + off, src, n, self.stream)
                    if slot is not None:
                        if slot_event[slot] is None:
                            slot_event[slot] = d.event_create(False)
                            events.append(slot_event[slot])
                        d.event_record(slot_event[slot], self.stream)
                done += n
                if report is not None:
                    report(done, total, info)
        finally:
            with uninterruptible():      # a second Ctrl-C must not free memory a reader or a copy still uses
                pool.shutdown(wait=True, cancel_futures=True)   # no thread writes into the staging area after this
                for f in files.values():
                    f.close()
                try:
                    d.stream_synchronize(self.stream)         # no copy reads the staging area after this
                finally:
                    for ev in events:
                        d.event_destroy(ev)
        return done

    # -- access --
    def array(self, name: str):
        return self.tensors[name].array

    def is_streamed(self, name: str) -> bool:
        return self.tensors[name].where == "streamed"

    @property
    def streamed_payload(self) -> int:
        return sum(t.payload for t in self.streamed)

    # -- teardown --
    @uninterruptible()
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        mem = self.mem
        attempt = Attempts()       # every release is tried, a failure or a Ctrl-C raised once all were
        if not mem.closed:
            for t in self.tensors.values():      # aliases first: a slot cannot go while it is mapped elsewhere
                if t.where == "streamed" and t.block is not None:
                    attempt(mem.free, t.block)
            for b in self.slots:
                attempt(mem.free, b)
            for t in self.tensors.values():
                if t.where == "resident" and t.block is not None:
                    attempt(mem.free, t.block)
            if self.experts is not None:
                attempt(self.experts.free, mem)
            attempt(mem.synchronize)
            arena = mem.arenas.get(self.arena_name) if self.arena_name else None
            if arena is not None and not attempt.errors and not arena._used:   # else its owner's sweep closes it
                attempt(arena.close)
                if not attempt.errors:                 # forgotten only once its range is gone
                    del mem.arenas[self.arena_name]
        if self.host_ptr:
            # never tried twice: a free that failed (or returned under a Ctrl-C) has an unknown outcome, and a
            # second free of the same pointer could release someone else's allocation
            attempt(self.driver.host_free, self.host_ptr)
            self.host_ptr = 0
        attempt.raise_first()


def _progress_printer(total: int, progress):
    if progress is False or (progress is None and total < _PROGRESS_MIN_BYTES):
        return None
    if callable(progress) and progress is not True:
        return lambda done, tot, info, final=False: progress(done, tot)
    from ..progress import ByteProgress
    return ByteProgress(total, "loading weights")


class Streamer:
    """Schedules the slot copies of one step on the copy stream, with one event per edge.

    For streamed tensor ``i`` (schedule order) in slot ``i % K``: the copy stream waits until the slot's
    previous tenant ``i - K`` has been read (``free[i - K]``, recorded on the compute stream after its
    reader; the step's start ``E0`` for the first K), copies host -> the tensor's own VA, records
    ``filled[i]``; the compute stream waits ``filled[i]`` before the reader. Copies therefore run up to
    K - 1 tensors ahead of compute. The step ends with the compute stream waiting on the copy stream, so
    a capture of the step joins both streams. Events are created here, before any capture.
    """

    def __init__(self, driver, compute, copy, tensors: list, slots: int):
        self.driver, self.S, self.C = driver, compute, copy
        self.tensors = tensors
        self.K = slots
        self.index = {t.name: t.index for t in tensors}
        n = len(tensors)
        self.events = []
        self.filled = [self._ev() for _ in range(n)]
        self.free = [self._ev() for _ in range(n)]
        self.t0 = [self._ev(True) for _ in range(n)]
        self.t1 = [self._ev(True) for _ in range(n)]
        self.start = self._ev() if n else None
        self.end_ev = self._ev() if n else None
        self.timed = False
        self.issued = 0            # copies enqueued since construction (eager steps and captures)
        self.skip = None           # test hook: index of a copy to leave out (to see the tests go red)

    def _ev(self, timing=False):
        with uninterruptible():           # made and kept together, so close() destroys every one
            e = self.driver.event_create(timing)
            self.events.append(e)
        return e

    def begin(self, timed: bool = False) -> None:
        if not self.tensors:
            return
        self.timed = timed
        self.driver.event_record(self.start, self.S)
        self.driver.stream_wait_event(self.C, self.start)
        for i in range(min(self.K, len(self.tensors))):
            self._issue(i)

    def _issue(self, i: int) -> None:
        d, t = self.driver, self.tensors[i]
        if i >= self.K:
            d.stream_wait_event(self.C, self.free[i - self.K])
        if self.timed:
            d.event_record(self.t0[i], self.C)
        if i != self.skip:
            d.memcpy_htod_async(t.block.va, t.host, t.payload, self.C)
        if self.timed:
            d.event_record(self.t1[i], self.C)
        d.event_record(self.filled[i], self.C)
        self.issued += 1

    def before(self, names) -> None:
        for n in names:
            i = self.index.get(n)
            if i is not None:
                self.driver.stream_wait_event(self.S, self.filled[i])

    def after(self, names) -> None:
        for n in names:
            i = self.index.get(n)
            if i is not None:
                self.driver.event_record(self.free[i], self.S)
                if i + self.K < len(self.tensors):
                    self._issue(i + self.K)

    def end(self) -> None:
        if not self.tensors:
            return
        self.driver.event_record(self.end_ev, self.C)
        self.driver.stream_wait_event(self.S, self.end_ev)

    def copy_ms(self) -> float:
        """Device time of the last timed step's copies (CUDA events on the copy stream)."""
        return sum(self.driver.event_elapsed_ms(a, b) for a, b in zip(self.t0, self.t1))

    @uninterruptible()
    def close(self) -> None:
        for e in self.events:
            self.driver.event_destroy(e)
        self.events = []
