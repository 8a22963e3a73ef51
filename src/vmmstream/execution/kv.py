"""The KV cache: one VA range for ``max_context`` positions, committed by mapping more at its end as it grows.

Layout is position-major across layers, ``[S_max, layers, 2 (K, V), Hkv, D]`` bf16, so growing the context
maps pages at the *end* of the one range and the plan's single granule-rounded ``kv_bytes`` holds it.
Layer ``l``'s K is the strided view ``cache[:, l, 0]`` — ``[S_max, Hkv, D]`` with contiguous rows, which
is what the attention kernels take. The range is split into a few chunk blocks reserved up front in the
model's own arena (so they are contiguous); ``ensure`` backs the next chunks, never during a capture.

Owner: ``KVCache`` owns its blocks and arena; ``close()`` releases them and is idempotent.
"""

from __future__ import annotations

import numpy as np

from ..errors import Attempts, VmmstreamError

MAX_CHUNKS = 8


class KVCache:
    def __init__(self, mem, ops, config, plan, holder: str):
        self.mem, self.ops, self.holder = mem, ops, holder
        self.layers, self.hkv, self.d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.max_context = plan.max_context
        self.row_bytes = self.layers * 2 * self.hkv * self.d * 2
        self.size = plan.kv_bytes
        if self.row_bytes * self.max_context > self.size:   # pragma: no cover - the plan's formula
            raise VmmstreamError("KV plan is smaller than its layout")
        self.blocks = []
        self.backed = 0
        self.arena_name = None
        self.grows = 0
        self.closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        mem, g = self.mem, self.mem.granularity
        if mem.legacy:       # plain allocations cannot grow in place: the whole range at once
            self.blocks.append(mem.allocate(self.size, role="kv_cache", holder=self.holder, arena="kv"))
            self.backed = 1
        else:
            self.arena_name = f"kv:{self.holder}"
            mem.arena(self.arena_name, self.size)
            per = -(-self.size // MAX_CHUNKS)                  # at most MAX_CHUNKS mappings to grow
            chunk = max(g, -(-per // g) * g)
            off = 0
            while off < self.size:
                n = min(chunk, self.size - off)
                b = mem.reserve(n, role="kv_cache", holder=self.holder, arena=self.arena_name)
                if b.va != (self.blocks[0].va + off if self.blocks else b.va):
                    raise VmmstreamError("KV chunks are not contiguous")   # pragma: no cover - fresh arena
                self.blocks.append(b)
                off += b.size
            self.ensure(1)
        base = self.blocks[0].va
        shape = (self.max_context, self.layers, 2, self.hkv, self.d)
        self.cache = self.ops.view(base, shape, np.uint16)
        self.cache4 = self.ops.view(base, (1,) + shape, np.uint16)

    @property
    def va(self) -> int:
        return self.blocks[0].va

    def k(self, layer: int):
        """[S_max, Hkv, D] (prefill attention, the append kernel)."""
        return self.cache[:, layer, 0]

    def v(self, layer: int):
        return self.cache[:, layer, 1]

    def k4(self, layer: int):
        """[1, S_max, Hkv, D] (decode attention takes a batch axis)."""
        return self.cache4[:, :, layer, 0]

    def v4(self, layer: int):
        return self.cache4[:, :, layer, 1]

    @property
    def committed(self) -> int:
        return sum(b.size for b in self.blocks[:self.backed])

    def capacity(self) -> int:
        """Positions the committed pages hold now."""
        return min(self.max_context, self.committed // self.row_bytes)

    def ensure(self, positions: int) -> int:
        """Commit pages for ``positions`` positions (VMM calls: call it before a step, never in a capture).
        Returns how many chunks were mapped."""
        need = min(positions, self.max_context) * self.row_bytes
        mapped = 0
        while self.committed < need and self.backed < len(self.blocks):
            self.mem.back(self.blocks[self.backed])
            self.backed += 1
            mapped += 1
        if mapped:
            self.grows += 1
        return mapped

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.mem.closed:
            return
        attempt = Attempts()       # every release is tried, a failure or a Ctrl-C raised once all were
        for b in reversed(self.blocks):
            attempt(self.mem.free, b)
        attempt(self.mem.synchronize)
        if self.arena_name and self.arena_name in self.mem.arenas and not attempt.errors:
            attempt(self.mem.arenas.pop(self.arena_name).close)
        attempt.raise_first()
