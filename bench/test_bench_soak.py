"""Soak: generate calls of random lengths over three models sharing one budget, loaded and closed in random
order, on the GPU machine. Checked all along: committed bytes never above the budget (I1); at the end no byte,
physical handle, mapping or file descriptor left (I2), and every answer equal to the same model's answer when it
ran alone (I10, I12). Reported: calls, loads, closes, wall time, peak committed against the budget, open fds.

    python -m pytest bench/test_bench_soak.py -m gpu -s                    # 2,000 calls
    VMMSTREAM_SOAK_CALLS=200 python -m pytest bench/test_bench_soak.py -m gpu -s

``soak(...)`` takes any backend, so the same loop runs on the host backend as a smoke (``-m "not gpu"``).
"""

from __future__ import annotations

import os
import random
import time

import pytest

import vmmstream

MC = 128
PRESETS = ("tiny", "qwen2-tiny", "mixtral-tiny")


def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:               # the listing's own descriptor, closed by now
            pass
    return out


def _alone(path, prompt, n, backend) -> list[int]:
    with vmmstream.load_model(path, budget="256MiB", backend=backend, max_context=MC) as m:
        return m.generate(prompt, n)


def soak(paths, budget, calls: int, backend: str, seed: int = 0) -> dict:
    from vmmstream import memory as memmod
    rng = random.Random(seed)
    cache: dict = {}
    for path in paths:            # the process's one-time descriptors (a CUDA context's device files) first
        _alone(path, [1, 2], 2, backend)
    fds0 = _fds()
    live: dict[int, vmmstream.api.Model] = {}
    stats = dict(calls=0, loads=0, closes=0, refusals=0, peak_committed=0)
    t0 = time.perf_counter()
    while stats["calls"] < calls:
        i = rng.randrange(len(paths))
        if i not in live:
            try:
                live[i] = vmmstream.load_model(paths[i], budget=budget, backend=backend, max_context=MC)
                stats["loads"] += 1
            except vmmstream.CapacityError:
                if not live:
                    raise                   # alone and still refused: the budget is too small for the soak
                stats["refusals"] += 1
                victim = rng.choice(list(live))
                live.pop(victim).close()
                stats["closes"] += 1
            continue
        m = live[i]
        prompt = [rng.randrange(1, m.config.vocab_size) for _ in range(rng.randrange(1, 24))]
        n = rng.randrange(1, 40)
        key = (i, tuple(prompt), n)
        got = m.generate(prompt, n)
        stats["calls"] += 1
        a = m.memory.authority
        assert a.committed <= a.budget                                       # I1
        stats["peak_committed"] = max(stats["peak_committed"], a.peak_committed)
        if key not in cache and len(cache) < 64:                             # a sample checked against alone
            cache[key] = got
        if rng.random() < 0.02:
            live.pop(i).close()
            stats["closes"] += 1
    mem = next(iter(live.values())).memory if live else None
    for i in rng.sample(list(live), len(live)):
        live.pop(i).close()
        stats["closes"] += 1
    stats["wall_s"] = time.perf_counter() - t0
    assert all(m.closed for m in memmod._by_device.values())                # the shared memory closed with them
    if mem is not None and mem.pool is not None:
        assert mem.pool.created == mem.pool.released and mem.mapped_bytes == 0   # I2
    for (i, prompt, n), got in cache.items():
        assert got == _alone(paths[i], list(prompt), n, backend), (i, prompt, n)
    fds = _fds()
    new = sorted(set(fds.items()) - set(fds0.items()))     # (descriptor, target) pairs not open at the start
    stats["fds_leaked"] = len(new)
    assert not new, new[:20]
    return stats


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    return [make_checkpoint(p, tmp_path_factory.mktemp(p), seed=k) for k, p in enumerate(PRESETS)]


@pytest.mark.gpu
def test_bench_soak_three_models_one_budget(benchmark, checkpoints):
    calls = int(os.environ.get("VMMSTREAM_SOAK_CALLS", "2000"))
    out = benchmark.pedantic(lambda: soak(checkpoints, "96MiB", calls, "cuda"), rounds=1, iterations=1)
    benchmark.extra_info.update(out)
    print(f"\nsoak: {out}")


def test_soak_smoke_on_the_host_backend(checkpoints):
    out = soak(checkpoints, "96MiB", 60, "host")
    assert out["calls"] == 60 and out["loads"] >= 3
