"""``vmmstream serve`` on CUDA under load: 64 streaming clients through 4 batch slots, every answer the model's alone,
the budget held by the authority's count and by the device's own (``cuMemGetInfo``), sampled while the requests run;
then the host tier's admission tests against a CUDA model: 32 streams with bad requests interleaved, a full queue's
429 before any byte and a retry that succeeds, the queue deadline's 429, and clients that go away freeing their slot
or their place in the queue (their KV pages back to the idle count)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from chat_fixture import make_chat_checkpoint

import vmmstream
from vmmstream.memory import DeviceMemory
from vmmstream.server.batch_engine import BatchSequenceEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_serve import NAME, Live, stream_all, wait_idle  # noqa: E402  (the server harness of the host tests)
from test_serve import (  # noqa: E402,F401  (the host tier's admission tests, collected here with the CUDA fixtures)
    test_a_client_that_goes_away_frees_its_slot_or_its_place_in_the_queue as test_cuda_a_client_that_goes_away,
    test_a_full_queue_answers_429_before_any_byte_and_a_retry_succeeds as test_cuda_a_full_queue_answers_429,
    test_many_concurrent_streams_complete_right_while_bad_requests_fail as test_cuda_streams_and_bad_requests,
    test_the_queue_deadline_answers_429_and_so_does_a_refused_start as test_cuda_the_queue_deadline_answers_429,
)

pytestmark = pytest.mark.gpu

BUDGET = 96 << 20
PROMPTS = ["Once upon a time", "The weather today", "Hello there", "A story about"]


def test_batched_server_under_load_keeps_the_budget_by_the_device_count(tmp_path):
    from vmmstream.driver.cuda import CudaDriver
    driver = CudaDriver()
    path = make_chat_checkpoint(tmp_path / NAME)
    mem = DeviceMemory(driver, BUDGET)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=256, max_batch=4) as m:
            prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
            want = {(i, sd): m.generate(p, 8, temperature=0.7, seed=sd) for i, p in enumerate(prompts)
                    for sd in range(8)}                  # 64 clients
            m.generate(prompts[:4], 8, temperature=0.7, seed=[0, 1, 2, 3])     # every batch kernel loaded
            free0, _ = driver.mem_get_info()
            committed0 = mem.snapshot()["committed"]
            live = Live(m, engine=BatchSequenceEngine(m), max_queue=64, queue_timeout=60.0)
            samples, failures, done = [], [], threading.Event()

            def sample():       # a thread of its own, as a metrics scraper would be: no context made current for it
                try:
                    while not done.is_set():
                        free, _ = driver.mem_get_info()
                        samples.append((free0 - free, mem.snapshot()["committed"]))
                        time.sleep(0.002)
                except Exception as e:      # noqa: BLE001  (reported by the test below, not lost in the thread)
                    failures.append(e)
            try:
                watcher = threading.Thread(target=sample, daemon=True)
                watcher.start()
                got, errors = stream_all(live.client(), prompts, want, 8, join_s=120)
                wait_idle(live, 30.0)
            finally:
                done.set()
                live.stop()
            assert not failures, failures
            assert not errors and got == want
            assert live.engine.inner._dec.peak == 4
            snap = mem.snapshot()
            assert snap["peak_committed"] <= BUDGET and snap["committed"] == committed0
            # the device's own count: what the batch added on top of the warmed-up model stays within what the
            # budget had left (KV pages come and go; nothing is allocated outside the governed pool)
            grew = max(g for g, _ in samples)
            assert samples and grew <= BUDGET - committed0, (grew, BUDGET - committed0)
    finally:
        mem.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The host tier's chat checkpoint on CUDA, one sequence at a time (``SingleSequenceEngine``), in 96 MiB."""
    from vmmstream.driver.cuda import CudaDriver
    path = make_chat_checkpoint(tmp_path_factory.mktemp("serve-gpu") / NAME)
    mem = DeviceMemory(CudaDriver(), BUDGET)
    m = vmmstream.load_model(path, memory=mem, max_context=256)
    assert m.backend == "cuda"
    yield m
    m.close()
    mem.close()


@pytest.fixture(scope="module")
def live(model):
    s = Live(model, max_queue=64, queue_timeout=10.0)
    yield s
    s.stop()
