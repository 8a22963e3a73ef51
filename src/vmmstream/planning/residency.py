"""Which weights stay resident and which stream: a byte-optimal choice (DESIGN §4).

A decode step reads every dense weight exactly once, in the same cyclic order every token. Under
that access pattern LRU always evicts the least recently used tensor, which in a cyclic scan is
precisely the next one the step will read: with capacity below the total, every access misses —
0 hits, the worst possible policy. What any fixed resident set of B
bytes saves is exactly B bytes per token, whichever tensors they are, so the best plan is the one
that keeps the most *payload* bytes resident in the device capacity the floor leaves.

Two things make it more than "sort and fill": each tensor occupies whole granules (its cost) while
its copy moves only its payload bytes (its value), and the K slots must hold the largest streamed
tensor, so keeping the few biggest tensors (an untied ``lm_head``) resident can shrink every slot.
``split`` therefore tries each distinct tensor size as the slot size ``s`` — tensors larger than
``s`` are forced resident — and solves the rest as a 0/1 knapsack over granules. That is exact: the
optimal plan's largest streamed tensor is one of the sizes tried.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DP_CELLS_MAX = 200_000_000   # items x granules of the exact DP (a bool table); beyond it, greedy


@dataclass(frozen=True)
class Split:
    resident: frozenset       # indices into the caller's tensor list
    streamed: tuple           # indices, in the caller's (schedule) order
    slot_bytes: int           # the largest streamed tensor's device bytes
    streamed_payload: int     # bytes copied per token
    exact: bool               # False when the greedy fallback was used


def knapsack(costs, values, capacity: int) -> tuple[list[int], bool]:
    """Indices maximising Σ values with Σ costs ≤ capacity (integers, costs in granules); (chosen, exact).

    Exact dynamic programme over capacities (O(n · capacity), vectorised per item). When the table
    would exceed ``DP_CELLS_MAX`` cells (a model of hundreds of GiB at a 2 MiB granule), largest
    value first instead, which is within one tensor of optimal.
    """
    n = len(costs)
    capacity = max(0, int(capacity))
    if sum(costs) <= capacity:
        return list(range(n)), True
    if n * (capacity + 1) > DP_CELLS_MAX:
        chosen, left = [], capacity
        for i in sorted(range(n), key=lambda i: (-values[i], costs[i], i)):
            if costs[i] <= left:
                chosen.append(i)
                left -= costs[i]
        return sorted(chosen), False
    best = np.zeros(capacity + 1, dtype=np.int64)      # best[c]: max value within c granules
    take = np.zeros((n, capacity + 1), dtype=bool)
    for i in range(n):
        w, v = int(costs[i]), int(values[i])
        if w > capacity:
            continue
        with_i = best[:capacity + 1 - w] + v            # computed from the table before item i
        better = with_i > best[w:]
        take[i, w:] = better
        best[w:] = np.where(better, with_i, best[w:])
    chosen, c = [], capacity
    for i in range(n - 1, -1, -1):
        if take[i, c]:
            chosen.append(i)
            c -= int(costs[i])
    return sorted(chosen), True


def split(device_bytes, payload, capacity: int, slots: int, granularity: int) -> Split | None:
    """Best resident/streamed split with ``slots`` slots in ``capacity`` bytes, or None if none fits.

    ``device_bytes[i]``: tensor i's granule-rounded size; ``payload[i]``: the bytes its copy moves.
    Minimises streamed payload; ties go to the plan that commits fewer bytes.
    """
    n = len(device_bytes)
    best, best_key = None, None
    for s in sorted(set(device_bytes), reverse=True):
        forced = [i for i in range(n) if device_bytes[i] > s]
        free = [i for i in range(n) if device_bytes[i] <= s]
        room = capacity - slots * s - sum(device_bytes[i] for i in forced)
        if room < 0:
            continue
        chosen, exact = knapsack([device_bytes[i] // granularity for i in free],
                                 [payload[i] for i in free], room // granularity)
        resident = set(forced) | {free[j] for j in chosen}
        streamed = [i for i in range(n) if i not in resident]
        if not streamed:
            continue    # everything fits: that is the resident strategy, decided by the caller
        slot = max(device_bytes[i] for i in streamed)
        committed = sum(device_bytes[i] for i in resident) + slots * slot
        key = (sum(payload[i] for i in streamed), committed)
        if best_key is None or key < best_key:
            best_key = key
            best = Split(frozenset(resident), tuple(streamed), slot, key[0], exact)
    return None if best is None else _spread(best, device_bytes, payload)


def _spread(sp: Split, device_bytes, payload) -> Split:
    """Among tensors of identical size, spread the resident ones evenly over the schedule.

    Swapping equal tensors changes no byte count, but streamed tensors bunched together (say, all
    the early layers) leave the copy engine idle during the resident stretch and then stall compute;
    interleaved, each copy overlaps the compute of the resident tensors around it.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(device_bytes)):
        groups.setdefault((device_bytes[i], payload[i]), []).append(i)
    resident = set(sp.resident)
    for members in groups.values():
        r = sum(1 for i in members if i in resident)
        if 0 < r < len(members):
            m = len(members)
            keep = {members[(2 * j + 1) * m // (2 * r)] for j in range(r)}
            resident -= set(members)
            resident |= keep
    streamed = tuple(i for i in range(len(device_bytes)) if i not in resident)
    return Split(frozenset(resident), streamed, sp.slot_bytes, sp.streamed_payload, sp.exact)
