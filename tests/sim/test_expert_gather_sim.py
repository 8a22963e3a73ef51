"""The routed-expert gather (kernels/moe/gather.py) in the simulator against its reference: resident units
come from the pool, the others from the host copy, the mapping is the slot order, counters add up."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.kernels.moe import gather as eg

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("unit,chunk", [(96, 1 << 20), (160, 64)])   # one chunk; several chunks per slot
def test_gather_matches_reference(monkeypatch, unit, chunk):
    monkeypatch.setattr(eg, "CHUNK", chunk)
    monkeypatch.setattr(eg, "THREADS", 4)
    monkeypatch.setattr(eg, "_kernel", cuda.jit(eg._gather))      # recompile with the patched constants
    rng = np.random.default_rng(unit)
    E, R, S = 6, 2, 3
    host = rng.integers(0, 256, (E, unit), dtype=np.uint8)
    pool = rng.integers(0, 256, (R, unit), dtype=np.uint8)
    loc = np.array([-1, 1, -1, -1, 0, -1], np.int32)                 # experts 4 and 1 resident (pool 0, 1)
    ids = np.array([[4, 2]], np.int32)                                 # one hit, one miss
    slots = np.zeros((S, unit), np.uint8)
    counts, stats = np.zeros(E, np.int64), np.zeros(3, np.int64)
    want = eg.reference(ids, loc, pool, host, slots, counts, stats)
    d = {n: cuda.to_device(a) for n, a in dict(ids=ids, loc=loc, pool=pool, host=host, slots=slots,
                                               counts=counts, stats=stats).items()}
    mapped = cuda.to_device(np.full((1, 2), -7, np.int32))
    eg.gather(d["ids"], d["loc"], d["pool"], d["host"], d["slots"], mapped, d["counts"], d["stats"])
    got = (d["slots"].copy_to_host(), mapped.copy_to_host(), d["counts"].copy_to_host(), d["stats"].copy_to_host())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[0][0], pool[0])          # expert 4 from the pool
    np.testing.assert_array_equal(got[0][1], host[2])          # expert 2 from the host copy
    assert not got[0][2].any()                                  # the third slot untouched
    assert list(got[3]) == [1, 1, unit]


def test_gather_refuses_bad_shapes():
    z = cuda.to_device(np.zeros((4, 32), np.uint8))
    with pytest.raises(ValueError, match="one token"):
        eg.gather(cuda.to_device(np.zeros((2, 2), np.int32)), cuda.to_device(np.zeros(4, np.int32)), z, z, z,
                  cuda.to_device(np.zeros((2, 2), np.int32)), cuda.to_device(np.zeros(4, np.int64)),
                  cuda.to_device(np.zeros(3, np.int64)))


@pytest.mark.parametrize("unit,chunk", [(96, 1 << 20), (160, 64)])
def test_gather_rounds_match_reference_and_cover_every_pair_once(monkeypatch, unit, chunk):
    """A batch's rounds: 5 tokens top-2 over 6 experts (5 distinct routed, 2 resident), 2 slots a round, so
    ``rounds`` gives 3 (the last one half full). Each round equals its reference (slots, mapping, counters);
    across the rounds every pair is mapped exactly once, to the slot holding its expert."""
    monkeypatch.setattr(eg, "CHUNK", chunk)
    monkeypatch.setattr(eg, "THREADS", 4)
    monkeypatch.setattr(eg, "_round_kernel", cuda.jit(eg._gather_round))
    rng = np.random.default_rng(unit)
    E, R, S = 6, 2, 2
    host = rng.integers(0, 256, (E, unit), dtype=np.uint8)
    pool = rng.integers(0, 256, (R, unit), dtype=np.uint8)
    loc = np.array([-1, 1, -1, -1, 0, -1], np.int32)                 # experts 4 and 1 resident (pool 0, 1)
    ids = np.array([[4, 2], [5, 4], [2, 0], [1, 5], [0, 2]], np.int32)   # distinct: 0 1 2 4 5 (3 never routed)
    n_rounds = eg.rounds(5, 2, E, S)
    assert n_rounds == 3
    d = {n: cuda.to_device(a) for n, a in dict(ids=ids, loc=loc, pool=pool, host=host).items()}
    slots_d = cuda.to_device(np.zeros((S, unit), np.uint8))
    counts_d, stats_d = cuda.to_device(np.zeros(E, np.int64)), cuda.to_device(np.zeros(3, np.int64))
    mapped = cuda.to_device(np.full(ids.shape, -7, np.int32))
    slots, counts, stats = np.zeros((S, unit), np.uint8), np.zeros(E, np.int64), np.zeros(3, np.int64)
    seen = np.zeros(ids.shape, np.int64)
    for r in range(n_rounds):
        slots, want_map, counts, stats = eg.reference_round(ids, loc, pool, host, slots, counts, stats, r)
        eg.gather_round(d["ids"], d["loc"], d["pool"], d["host"], slots_d, mapped, counts_d, stats_d, r)
        got = mapped.copy_to_host()
        np.testing.assert_array_equal(got, want_map)
        np.testing.assert_array_equal(slots_d.copy_to_host(), slots)
        for (t, s) in zip(*np.nonzero(got >= 0)):
            e = ids[t, s]
            src = pool[loc[e]] if loc[e] >= 0 else host[e]
            np.testing.assert_array_equal(slots[got[t, s]], src)
            seen[t, s] += 1
    assert (seen == 1).all()
    np.testing.assert_array_equal(counts_d.copy_to_host(), np.bincount(ids.ravel(), minlength=E))
    assert list(stats_d.copy_to_host()) == [2, 3, 3 * unit]         # hits 4 and 1; misses 0, 2, 5


def test_gather_round_refuses_bad_shapes():
    z = cuda.to_device(np.zeros((4, 32), np.uint8))
    ids = cuda.to_device(np.zeros((3, 2), np.int32))
    with pytest.raises(ValueError, match="mapped as ids"):
        eg.gather_round(ids, cuda.to_device(np.zeros(4, np.int32)), z, z, z, cuda.to_device(np.zeros((2, 2), np.int32)),
                        cuda.to_device(np.zeros(4, np.int64)), cuda.to_device(np.zeros(3, np.int64)), 0)


@pytest.mark.parametrize("tokens,k,e,s,want", [(1, 2, 8, 2, 1), (3, 2, 8, 2, 3), (16, 2, 8, 2, 4), (16, 4, 60, 4, 15),
                                              (2, 4, 60, 4, 2)])
def test_rounds_cover_the_experts_a_batch_can_reach(tokens, k, e, s, want):
    assert eg.rounds(tokens, k, e, s) == want
