"""Routed experts of a mixture of experts on the device: resident units in one pool stack, gather slots in one
slot stack, pinned host copies, the device location table and counters, and re-choosing the resident set.

Made and owned by ``Weights`` (``Weights.experts``); the plan is ``planning.plan.ExpertPlan``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..align import align_up


# A batch's decode step with experts on demand: True = its gathers run in rounds on the device (``moe.gather
# .gather_round``), so the step is captured and replayed like any other; False = host-driven rounds, eagerly (the
# way prefill runs them). Off until measured on a GPU (``bench/test_bench_batch.py``'s ``streamed-graph`` row).
BATCH_GATHER_IN_GRAPH = False


class Experts:
    """Routed experts as units (gate | up | down, each part 256-byte aligned, ``U`` bytes): one ``pool`` block
    of R resident units and one ``slots`` block of k gather slots, so each is a stack ``[n, U]`` the expert
    kernels index; every unit also has a pinned host copy when some are gathered on demand.

    ``loc[layer, e]``: the pool index of a resident unit, -1 for one gathered when routed. It lives in device
    memory (an activation buffer, ``bind``), read by the gather when it runs, so re-choosing the resident set
    (``rebalance``) copies units, rewrites ``loc`` and recaptures nothing; ``self.loc`` is its host copy.
    Device counters: routing counts per (layer, expert) and decode hits, misses, bytes gathered; prefill's are
    counted on the host."""

    def __init__(self, weights, ep):
        self.w, self.ep = weights, ep
        self.U = align_up(ep.unit_payload)
        self.loc = np.full((ep.layers, ep.per_layer), -1, np.int32)
        self.owner = list(ep.resident)                 # pool index -> (layer, e)
        for r, u in enumerate(self.owner):
            self.loc[u] = r
        self.host_counters = dict(prefill_hits=0, prefill_misses=0, prefill_bytes=0, rebalances=0, units_moved=0)
        self.pool_block = self.slot_block = None
        self.host = None                               # (layer, e) -> host address of the unit
        self.host_base = 0
        self.on_demand = ep.slots > 0
        self.loc_dev = self.counts_dev = self.stats_dev = None

    # -- sizes --
    @property
    def n_pool(self) -> int:
        return len(self.owner)

    @property
    def n_slots(self) -> int:
        return self.ep.slots

    @property
    def host_bytes(self) -> int:
        return self.ep.total * self.U

    def pool_va(self, r: int) -> int:
        return self.pool_block.va + int(r) * self.U

    def slot_va(self, j: int) -> int:
        return self.slot_block.va + int(j) * self.U

    # -- construction --
    def allocate(self, arena) -> None:
        w, ep = self.w, self.ep
        by_unit: dict = {}
        for n, t in w.tensors.items():
            if t.where == "expert":
                by_unit.setdefault(_expert_of(n), []).append(t)
        for unit, ts in by_unit.items():
            off = 0
            for t in ts:
                t.unit, t.unit_off = unit, off
                off += align_up(t.payload)
            if off != ep.unit_payload:
                raise ValueError(f"expert unit {unit}: {off} bytes, the plan has {ep.unit_payload}")
        self.units = by_unit
        if self.n_pool:
            self.pool_block = w.mem.allocate(self.n_pool * self.U, role="weights_resident", holder=w.holder,
                                             arena=arena)
        if self.n_slots:
            self.slot_block = w.mem.allocate(self.n_slots * self.U, role="weight_slots", holder=w.holder,
                                             arena=arena)

    def place_host(self, base: int) -> None:
        self.host, self.host_base = {}, base
        for unit in self.units:
            layer, e = unit
            self.host[unit] = base + (layer * self.ep.per_layer + e) * self.U
            for t in self.units[unit]:
                t.host = self.host[unit] + t.unit_off

    def _views_at(self, va: int):
        from ..quantization import views
        first = self.units[(0, 0)]
        out = []
        for t in first:
            a = va + t.unit_off
            out.append(views(t.qlayout, a, self.w.ops.view) if t.qlayout is not None
                       else self.w.ops.view(a, t.shape, np.uint16))
        return tuple(out)

    def make_views(self) -> None:
        self.pool_views = [self._views_at(self.pool_va(r)) for r in range(self.n_pool)]
        self.slot_views = [self._views_at(self.slot_va(j)) for j in range(self.n_slots)]

    def stack(self, which: str, layer: int = 0):
        """The (gate, up, down) weights of a stack as [n, ...] strided views (``which``: "slots", or "pool" for
        one layer when every expert is resident, pool units being in (layer, expert) order)."""
        from ..quantization import QWeight
        if which == "slots":
            va, n = self.slot_block.va, self.n_slots
        else:
            va, n = self.pool_va(layer * self.ep.per_layer), self.ep.per_layer
        out = []
        for t in self.units[(0, 0)]:
            base = va + t.unit_off
            if t.qlayout is None:
                out.append(self.w.ops.view_strided(base, (n,) + tuple(t.shape), np.uint16, self.U))
            else:
                ql = t.qlayout
                parts = {p: self.w.ops.view_strided(base + ql.offsets[p], (n,) + tuple(ql.shapes[p]), ql.dtypes[p],
                                                    self.U) for p in ql.offsets}
                out.append(QWeight(ql.kind, (n, ql.n, ql.k), parts["packed"], parts["scales"], parts.get("zeros")))
        return tuple(out)

    def bind(self, views) -> None:
        """Device-side state in the activation block: loc [L, E] int32, counts [L, E] int64, stats [3] int64."""
        self.loc_dev, self.counts_dev, self.stats_dev = views
        self.push_loc()
        self.reset_counters()

    def push_loc(self) -> None:
        self.w.ops.to_device(self.loc_dev, self.loc)

    def reset_counters(self) -> None:
        ops = self.w.ops
        ops.to_device(self.counts_dev, np.zeros((self.ep.layers, self.ep.per_layer), np.int64))
        ops.to_device(self.stats_dev, np.zeros(3, np.int64))
        for k in self.host_counters:
            self.host_counters[k] = 0

    @property
    def counts(self) -> np.ndarray:
        return np.array(self.w.ops.to_host(self.counts_dev), np.int64)

    @property
    def counters(self) -> dict:
        st = np.array(self.w.ops.to_host(self.stats_dev), np.int64)
        return dict(decode_hits=int(st[0]), decode_misses=int(st[1]), decode_bytes=int(st[2]), **self.host_counters)

    def gather_host(self, j: int, unit) -> None:
        """Copy unit ``unit`` from its pinned host copy into gather slot ``j``: the host backend's twin of the
        device-side gather, called from inside the expert op as it runs (device memory is process memory)."""
        ctypes.memmove(self.slot_va(j), self.host[unit], self.ep.unit_payload)

    # -- re-choosing the resident set --
    def best_resident(self) -> list:
        """The units the routing counts favour, as many as the pool holds (ties keep the current ones)."""
        counts = self.counts
        units = [(layer, e) for layer in range(self.ep.layers) for e in range(self.ep.per_layer)]
        units.sort(key=lambda u: (-int(counts[u]), self.loc[u] < 0, u))
        return units[:self.n_pool]

    def hit_fraction(self, resident) -> float:
        counts = self.counts
        tot = int(counts.sum())
        return sum(int(counts[u]) for u in resident) / tot if tot else 0.0

    def rebalance(self, resident, stream) -> int:
        """Make ``resident`` the resident set: copy each newcomer over an evicted unit's pool entry."""
        want = set(resident)
        evict = [r for r, u in enumerate(self.owner) if u not in want]
        come = [u for u in resident if self.loc[u] < 0]
        for r, u in zip(evict, come):
            old = self.owner[r]
            self.w.driver.memcpy_htod_async(self.pool_va(r), self.host[u], self.ep.unit_payload, stream)
            self.w.driver.stream_synchronize(stream)
            self.loc[old] = -1
            self.loc[u] = r
            self.owner[r] = u
        self.push_loc()
        self.host_counters["rebalances"] += 1
        self.host_counters["units_moved"] += len(come)
        return len(come)

    def free(self, mem) -> None:
        for b in (self.pool_block, self.slot_block):
            if b is not None:
                mem.free(b)
        self.pool_block = self.slot_block = None


def _expert_of(name: str) -> tuple[int, int]:
    parts = name.split(".")
    return int(parts[2]), int(parts[parts.index("experts") + 1])
