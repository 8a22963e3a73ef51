"""The KV cache of a batch: one VA range per sequence slot, committed by mapping pages at its end as the sequence
grows and unmapped when it finishes — no paged-attention kernel, every sequence's K and V stay contiguous.

Layout: ``[slots, stride, layers, 2 (K, V), Hkv, D]`` bf16. ``stride`` (positions per slot, at least
``max_context``) is the least multiple of ``granularity / gcd(granularity, row_bytes)`` that holds ``max_context``,
so each slot's range is whole granules and the slots tile one arena with no gap: the same memory is at once

- one flat cache of ``slots · stride`` rows per layer (``k(layer)``: the append kernel writes token b of a step at
  row ``b · stride + position``),
- a ``[slots, stride, Hkv, D]`` batch (``k4(layer)``: decode attention reads sequence b's keys up to its length),
- and each slot's own ``[stride, Hkv, D]`` cache (``slot_k(slot, layer)``: a joining sequence's prefill).

Each slot's range is split into at most ``MAX_CHUNKS`` blocks reserved up front; ``ensure(slot, n)`` backs the
next ones (never during a capture), ``release(slot)`` unmaps them (fenced on the streams' work), the VA stays.
Committed bytes are charged to the model's ``kv_cache`` lease, so the authority refuses a sequence whose pages do
not fit before any work is done for it.

Owner: ``BatchKV`` owns its blocks and arena; ``close()`` releases them and is idempotent.
"""

from __future__ import annotations

from ..errors import VmmstreamError
from ..interrupts import uninterruptible
from ..planning.floor import kv_row_bytes, slot_stride
from .kv import LayerViews, layer_views, release_blocks

MAX_CHUNKS = 8


class BatchKV(LayerViews):
    def __init__(self, mem, ops, config, max_context: int, slots: int, holder: str):
        if mem.legacy:
            raise VmmstreamError("batched decode maps KV pages per sequence: not with the legacy allocator")
        self.mem, self.ops, self.holder = mem, ops, holder
        self.layers, self.hkv, self.d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.max_context, self.slots = max_context, slots
        self.row_bytes = kv_row_bytes(config)
        g = mem.granularity
        self.stride = slot_stride(max_context, self.row_bytes, g)
        self.slot_bytes = self.stride * self.row_bytes
        self.blocks: list[list] = [[] for _ in range(slots)]
        self.backed = [0] * slots
        self.arena_name = f"kvb:{holder}"
        self.owner = None          # the BatchDecoder using the slots now (one at a time)
        self.closed = False
        try:
            self._build(g)
        except BaseException:
            self.close()
            raise

    def _build(self, g: int) -> None:
        mem = self.mem
        mem.arena(self.arena_name, self.slots * self.slot_bytes)
        per = -(-self.slot_bytes // MAX_CHUNKS)
        chunk = max(g, -(-per // g) * g)
        for s in range(self.slots):
            off = 0
            while off < self.slot_bytes:
                n = min(chunk, self.slot_bytes - off)
                b = mem.reserve(n, role="kv_cache", holder=self.holder, arena=self.arena_name)
                self.blocks[s].append(b)
                off += b.size
        base = self.blocks[0][0].va
        if any(bl[0].va != base + s * self.slot_bytes for s, bl in enumerate(self.blocks)):
            raise VmmstreamError("KV slot ranges are not contiguous")   # pragma: no cover - a fresh arena
        self.va = base
        row, st = self.row_bytes, self.slot_bytes
        self._k, self._v = layer_views(self.ops, base, self.layers, self.hkv, self.d, (self.slots * self.stride,),
                                       (row,))
        self._k4, self._v4 = layer_views(self.ops, base, self.layers, self.hkv, self.d, (self.slots, self.stride),
                                         (st, row))
        self._slot_views: dict = {}

    # -- views (made once, never sliced per call): k / v [slots · stride, Hkv, D], every slot's rows for the
    #    append kernel (row = slot · stride + position); k4 / v4 [slots, stride, Hkv, D] (LayerViews) --

    def slot(self, s: int) -> SlotKV:
        """Slot ``s`` seen as a one-sequence cache (``k(layer)``: [stride, Hkv, D]) for its prefill."""
        if s not in self._slot_views:
            self._slot_views[s] = SlotKV(self, s)
        return self._slot_views[s]

    def row(self, s: int, position: int) -> int:
        return s * self.stride + position

    def view(self, n: int) -> BatchView:
        """The first ``n`` slots, for a decode step of ``n`` sequences (made once per ``n``, kept)."""
        if ("view", n) not in self._slot_views:
            self._slot_views[("view", n)] = BatchView(self, n)
        return self._slot_views[("view", n)]

    # -- pages --
    def committed(self, s: int | None = None) -> int:
        slots = range(self.slots) if s is None else (s,)
        return sum(b.size for i in slots for b in self.blocks[i][:self.backed[i]])

    def pages_for(self, positions: int) -> int:
        """Bytes a slot commits to hold ``positions`` positions (whole chunks)."""
        need, have = min(positions, self.max_context) * self.row_bytes, 0
        for b in self.blocks[0]:
            if have >= need:
                break
            have += b.size
        return have

    @uninterruptible()
    def ensure(self, s: int, positions: int) -> int:
        """Commit pages for ``positions`` positions of slot ``s`` (VMM calls: between steps, never in a capture);
        a refusal (``CapacityError``) leaves what was committed before. Returns the chunks mapped."""
        need = min(positions, self.max_context) * self.row_bytes
        mapped = 0
        while self.committed(s) < need and self.backed[s] < len(self.blocks[s]):
            self.mem.back(self.blocks[s][self.backed[s]])
            self.backed[s] += 1
            mapped += 1
        return mapped

    @uninterruptible()
    def release(self, s: int) -> None:
        """Unmap slot ``s``'s pages (fenced on the queued work that may still read them); its VA stays."""
        while self.backed[s]:
            self.mem.unmap(self.blocks[s][self.backed[s] - 1])
            self.backed[s] -= 1

    @uninterruptible()
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.mem.closed:
            return
        release_blocks(self.mem, [b for bl in self.blocks for b in bl], self.arena_name)


class SlotKV(LayerViews):
    """One slot of a ``BatchKV`` with the interface of a one-sequence cache (``execution/kv.py``): ``k``/``v``
    ([stride, Hkv, D]) and ``k4``/``v4`` ([1, stride, Hkv, D]) per layer, ``ensure``, ``committed``, ``grows``."""

    def __init__(self, kv: BatchKV, s: int):
        self.kv, self.s = kv, s
        base, row = kv.va + s * kv.slot_bytes, kv.row_bytes
        self._k, self._v = layer_views(kv.ops, base, kv.layers, kv.hkv, kv.d, (kv.stride,), (row,))
        self._k4, self._v4 = layer_views(kv.ops, base, kv.layers, kv.hkv, kv.d, (1, kv.stride), (kv.slot_bytes, row))
        self.grows = 0

    @property
    def committed(self) -> int:
        return self.kv.committed(self.s)

    def ensure(self, positions: int) -> int:
        n = self.kv.ensure(self.s, positions)
        self.grows += bool(n)
        return n


class BatchView(LayerViews):
    """The first ``n`` slots of a ``BatchKV`` for one decode step of ``n`` sequences: ``k``/``v`` the flat cache
    (the append kernel's rows), ``k4``/``v4`` ([n, stride, Hkv, D]) for attention."""

    def __init__(self, kv: BatchKV, n: int):
        self.kv, self.n = kv, n
        self._k, self._v = kv._k, kv._v
        self._k4, self._v4 = layer_views(kv.ops, kv.va, kv.layers, kv.hkv, kv.d, (n, kv.stride),
                                         (kv.slot_bytes, kv.row_bytes))
