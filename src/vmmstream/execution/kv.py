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
from ..interrupts import uninterruptible
from ..planning.floor import kv_row_bytes

MAX_CHUNKS = 8


def layer_views(ops, base: int, layers: int, hkv: int, d: int, lead: tuple, strides: tuple) -> tuple[list, list]:
    """K and V of every layer of a position-major cache at ``base`` (a position's row holds, per layer, K then V,
    each [Hkv, D] bf16): views of shape ``lead + (Hkv, D)`` whose leading axes step by ``strides`` bytes."""
    half = 2 * hkv * d                                # bytes of one layer's K (or V) at one position
    shape, st = tuple(lead) + (hkv, d), tuple(strides) + (2 * d, 2)
    ks = [ops.view_strides(base + layer * 2 * half, shape, np.uint16, st) for layer in range(layers)]
    vs = [ops.view_strides(base + layer * 2 * half + half, shape, np.uint16, st) for layer in range(layers)]
    return ks, vs


class LayerViews:
    """``k``/``v`` ([S, Hkv, D]: prefill attention, the append kernel) and ``k4``/``v4`` ([B, S, Hkv, D]: decode
    attention) of each layer, from the lists ``_k``, ``_v``, ``_k4``, ``_v4``."""

    def k(self, layer: int):
        return self._k[layer]

    def v(self, layer: int):
        return self._v[layer]

    def k4(self, layer: int):
        return self._k4[layer]

    def v4(self, layer: int):
        return self._v4[layer]


def release_blocks(mem, blocks, arena_name) -> None:
    """Free ``blocks`` (last first), then the arena once nothing in it is used; every release is tried, a
    failure or a Ctrl-C raised once all were."""
    attempt = Attempts()
    for b in reversed(blocks):
        attempt(mem.free, b)
    attempt(mem.synchronize)
    arena = mem.arenas.get(arena_name) if arena_name else None
    if arena is not None and not attempt.errors and not arena._used:   # else its owner's sweep closes it
        attempt(arena.close)
        if not attempt.errors:                     # forgotten only once its range is gone
            del mem.arenas[arena_name]
    attempt.raise_first()


class KVCache(LayerViews):
    def __init__(self, mem, ops, config, plan, holder: str):
        self.mem, self.ops, self.holder = mem, ops, holder
        self.layers, self.hkv, self.d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.max_context = plan.max_context
        self.row_bytes = kv_row_bytes(config)
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
        # Every layer's K and V views, made once from their addresses (never sliced per call): [S_max, Hkv, D]
        # for prefill attention and the append kernel, [1, S_max, Hkv, D] for decode attention.
        base, s, row = self.blocks[0].va, self.max_context, self.row_bytes
        self._k, self._v = layer_views(self.ops, base, self.layers, self.hkv, self.d, (s,), (row,))
        self._k4, self._v4 = layer_views(self.ops, base, self.layers, self.hkv, self.d, (1, s), (s * row, row))

    @property
    def va(self) -> int:
        return self.blocks[0].va

    @property
    def committed(self) -> int:
        return sum(b.size for b in self.blocks[:self.backed])

    def capacity(self) -> int:
        """Positions the committed pages hold now."""
        return min(self.max_context, self.committed // self.row_bytes)

    @uninterruptible()
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

    @uninterruptible()
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.mem.closed:
            return
        release_blocks(self.mem, self.blocks, self.arena_name)
