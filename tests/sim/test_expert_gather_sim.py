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
