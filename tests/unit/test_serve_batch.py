"""``vmmstream serve --max-batch N``: requests decode together in the model's batch (continuous batching), each
answer what ``generate`` gives alone for the same prompt and seed, streamed or not, completions and chat; a
client that leaves frees its sequence; one-sequence calls on the model are refused while the batch holds it."""

from __future__ import annotations

import threading
import time

import pytest
from chat_fixture import make_chat_checkpoint
from test_serve import BRIEF, HELLO, MC, NAME, G, Live, stream_all, wait_idle

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.errors import VmmstreamError
from vmmstream.memory import DeviceMemory
from vmmstream.server.batch_engine import BatchSequenceEngine

pytestmark = pytest.mark.unit

PROMPTS = ["Once upon a time", "The weather today", "Hello there", "A story about"]


@pytest.fixture(scope="module")
def batch_model(tmp_path_factory):
    path = make_chat_checkpoint(tmp_path_factory.mktemp("serve-batch") / NAME)
    mem = DeviceMemory(HostDriver(total_bytes=1 << 30, granularity=G), 256 << 20)
    m = vmmstream.load_model(path, memory=mem, max_context=MC, max_batch=4)
    yield m
    m.close()
    mem.close()


def test_batched_server_answers_as_the_model_alone(batch_model):
    m = batch_model
    want = [m.generate(p, 12, temperature=0.9, seed=7 + i) for i, p in enumerate(PROMPTS)]
    want_greedy = m.generate(PROMPTS[0], 12, temperature=0.0)
    want_chat = [m.chat(msgs, 12, temperature=0.0) for msgs in (HELLO, BRIEF)]
    live = Live(m, engine=BatchSequenceEngine(m), max_queue=16, queue_timeout=10.0)
    try:
        c = live.client()
        got, errors = [None] * len(PROMPTS), []

        def ask(i):
            try:
                if i % 2:           # streamed, token by token
                    chunks = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=12, temperature=0.9,
                                                  seed=7 + i, stream=True)
                    got[i] = "".join(ch.choices[0].text for ch in chunks)
                else:
                    got[i] = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=12, temperature=0.9,
                                                  seed=7 + i).choices[0].text
            except Exception as e:   # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and got == want
        assert live.engine.inner._dec.peak >= 2          # decoded together, not one after another
        g = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.0)
        assert g.choices[0].text == want_greedy
        for msgs, w in zip((HELLO, BRIEF), want_chat):
            r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0.0)
            assert r.choices[0].message.content == w
        assert live.server.engine.max_batch == 4
        wait_idle(live)
    finally:
        live.stop()


def test_one_sequence_calls_wait_for_the_batch_to_empty(batch_model):
    from vmmstream.execution.batch import BatchDecoder
    m = batch_model
    dec = BatchDecoder(m.engine, m.placement.batch_kv)
    try:
        with m._lock:
            dec.add([5, 6, 7], 8)
        with pytest.raises(VmmstreamError, match="decoding a batch"):
            m.generate([5, 6, 7], 2)
    finally:
        dec.close()
    assert m.generate([5, 6, 7], 2, eos_token_id=[])


def test_sixty_four_streaming_clients_on_the_batched_server(batch_model):
    """64 concurrent streaming clients (8 prompts, seeded draws) through 4 batch slots: every answer complete and
    equal to the model's alone; the batch's KV pages all returned at the end."""
    m = batch_model
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    want = {(i, sd): m.generate(p, 6, temperature=0.7, seed=sd) for i, p in enumerate(prompts) for sd in range(8)}
    kv = m.placement.batch_kv
    live = Live(m, engine=BatchSequenceEngine(m), max_queue=64, queue_timeout=30.0)
    try:
        got, errors = stream_all(live.client(), prompts, want, 6)
        wait_idle(live)
        assert not errors and got == want
        assert live.engine.inner._dec.peak == 4 and kv.committed() == 0
        assert m.stats()["packed_prefills"] > 0          # requests admitted together were prefilled together
    finally:
        live.stop()


def test_requests_a_group_start_leaves_out_start_next(batch_model, monkeypatch):
    """When a group start takes only some of the admitted requests (the rest did not fit its walk, or their pages
    were refused), the others go back to the front of the queue and start next, in order."""
    m = batch_model
    want = [m.generate(p, 6, temperature=0.0) for p in PROMPTS]
    engine = BatchSequenceEngine(m)
    whole, admit, sizes, gate = engine.add_many, engine.can_admit, [], threading.Event()

    def first_two(prepared):
        sizes.append(len(prepared))
        return whole(prepared[:2])
    monkeypatch.setattr(engine, "add_many", first_two)
    monkeypatch.setattr(engine, "can_admit", lambda p, active: gate.is_set() and admit(p, active))
    live = Live(m, engine=engine, max_queue=16, queue_timeout=10.0)
    try:
        c = live.client()
        got, threads = [None] * len(PROMPTS), []
        for i, p in enumerate(PROMPTS):
            def ask(i=i, p=p):
                got[i] = c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0.0).choices[0].text
            threads.append(threading.Thread(target=ask))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while live.scheduler.counts()[1] < len(PROMPTS):     # all four queued: then admitted in one round
            assert time.monotonic() < deadline, live.scheduler.counts()
            time.sleep(0.005)
        gate.set()
        for t in threads:
            t.join(30)
        wait_idle(live)
        assert got == want and sizes[0] == len(PROMPTS)  # the four admitted together, started two by two
    finally:
        live.stop()


def test_a_list_of_text_prompts_with_stop_strings_ends_each_as_alone(batch_model):
    m = batch_model
    prompts = PROMPTS + ["Hello there, friend"]
    for stop in (["e"], [" the", "a"]):
        alone = [m.generate(p, 12, temperature=0.0, stop=stop) for p in prompts]
        alone_ids = [m.generate(m.tokenizer.encode(p).ids, 12, temperature=0.0, stop=stop) for p in prompts]
        assert m.generate(prompts, 12, temperature=0.0, stop=stop) == alone
        assert m.generate([m.tokenizer.encode(p).ids for p in prompts], 12, temperature=0.0, stop=stop) == alone_ids
        assert any(len(a) < 12 for a in alone_ids)          # some stop strings were met
