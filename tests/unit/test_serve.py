"""``vmmstream serve`` as its users meet it: the real server (uvicorn on 127.0.0.1, a free port) over the chat
checkpoint of ``tests/chat_fixture.py`` loaded under a budget below its size (so weights stream), spoken to
with the official ``openai`` client and with raw HTTP. The answers are the model's own (greedy and seeded
draws); a refusal is a 429 with Retry-After before any byte of its answer (I9); a client that goes away frees
its slot; bad requests are 4xx while good ones complete; /metrics parses and moves; SIGTERM drains.

One server serves the module. Its engine is today's ``SingleSequenceEngine`` behind ``Paced``, a
``SequenceEngine`` that can slow a step or refuse a start, so a test can hold the one sequence slot long
enough to fill the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from chat_fixture import make_chat_checkpoint
from prometheus_client.parser import text_string_to_metric_families

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.errors import CapacityError
from vmmstream.memory import DeviceMemory
from vmmstream.server.engine import SingleSequenceEngine
from vmmstream.server.runner import make_server

pytestmark = pytest.mark.unit

G = 64 << 10
MC = 256
NAME = "tiny-chat"
HELLO = [{"role": "user", "content": "Hello there!"}]
BRIEF = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the weather like?"}]


class Paced:
    """A ``SequenceEngine`` around another: ``delay`` seconds before each step, ``refuse`` raised by the next
    starts while set, ``break_step`` raised once by the next step."""

    def __init__(self, inner):
        self.inner, self.delay, self.refuse, self.break_step = inner, 0.0, None, None
        self.max_batch, self.max_context = inner.max_batch, inner.max_context
        if hasattr(inner, "add_many"):     # an engine that starts several at once keeps doing so
            self.add_many = self._add_many

    def _add_many(self, prepared):
        if self.refuse is not None:
            raise self.refuse
        return self.inner.add_many(prepared)

    def prepare(self, params):
        return self.inner.prepare(params)

    def can_admit(self, prepared, active):
        return self.inner.can_admit(prepared, active)

    def add(self, prepared):
        if self.refuse is not None:
            raise self.refuse
        return self.inner.add(prepared)

    def step(self):
        if self.delay:
            time.sleep(self.delay)
        if self.break_step is not None:
            exc, self.break_step = self.break_step, None
            raise exc
        return self.inner.step()

    def cancel(self, seq):
        self.inner.cancel(seq)

    def memory(self):
        return self.inner.memory()


class Live:
    """A server running in a thread on a free port of 127.0.0.1."""

    def __init__(self, model, engine=None, **options):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = Paced(engine or SingleSequenceEngine(model))
        self.server = make_server(model, engine=self.engine, model_name=NAME, log_level="error", port=self.port,
                                  **options)
        self.scheduler = self.server.scheduler
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.005)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.server.close()

    @contextlib.contextmanager
    def limits(self, *, delay=0.0, queue=None, timeout=None):
        s, saved = self.scheduler, (self.scheduler.max_queue, self.scheduler.queue_timeout)
        self.engine.delay = delay
        s.max_queue, s.queue_timeout = queue or s.max_queue, timeout or s.queue_timeout
        try:
            yield
        finally:
            self.engine.delay, self.engine.refuse, self.engine.break_step = 0.0, None, None
            s.max_queue, s.queue_timeout = saved
            wait_idle(self)


def wait_idle(live, seconds=10.0) -> None:
    deadline = time.monotonic() + seconds
    while live.scheduler.counts() != (0, 0):
        assert time.monotonic() < deadline, f"the server is still busy: {live.scheduler.counts()}"
        time.sleep(0.005)


def stream_all(client, prompts, keys, max_tokens: int, join_s: float = 60.0):
    """One streaming completion per (prompt index, seed) in ``keys``, each in its own thread, all at once:
    ({key: text}, [errors])."""
    got, errors = {}, []

    def ask(i, sd):
        try:
            chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=max_tokens,
                                               temperature=0.7, seed=sd, stream=True)
            got[(i, sd)] = "".join(ch.choices[0].text for ch in chunks)
        except Exception as e:   # noqa: BLE001 - returned to the test
            errors.append(e)
    threads = [threading.Thread(target=ask, args=key) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return got, errors


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_chat_checkpoint(tmp_path_factory.mktemp("serve") / NAME)
    probe = load(path, 64 << 20)
    budget = probe.plan.floor + probe.plan.weight_bytes // 2      # below the model's size: half the weights stream
    probe.close()
    m = load(path, budget)
    assert m.plan.strategy == "streamed"
    yield m
    m.close()


def load(path, budget):
    return vmmstream.load_model(path, memory=DeviceMemory(HostDriver(total_bytes=1 << 30, granularity=G), budget),
                                max_context=MC)


@pytest.fixture(scope="module")
def live(model):
    s = Live(model, max_queue=64, queue_timeout=10.0)
    yield s
    s.stop()


def sse(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream, decoded (``[DONE]`` kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


# ---------------------------------------------------------------------------------- the answers are the model's

def test_openai_client_gets_the_models_answers(live, model):
    c = live.client()
    # completions, greedy: the text generate returns, usage and finish reason
    r = c.completions.create(model=NAME, prompt="Hello there", max_tokens=20, temperature=0)
    want = model.generate("Hello there", 20)
    assert r.choices[0].text == want and r.object == "text_completion" and r.model == NAME
    ids = model.tokenizer.encode("Hello there").ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(model.generate(ids, 20))
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 20 else "stop")
    # completions, a seeded draw with top_k / top_p, streamed: the same pieces joined
    draw = dict(temperature=0.9, top_p=0.9, seed=7)
    chunks = list(c.completions.create(model=NAME, prompt="The quick", max_tokens=24, stream=True,
                                       extra_body={"top_k": 40}, **draw))
    assert "".join(ch.choices[0].text for ch in chunks) == model.generate("The quick", 24, top_k=40, **draw)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # token ids as the prompt, and a stop string
    with model.stream(ids, 30, stop=["o"], temperature=0.5, seed=3) as st:
        text = "".join(t.text for t in st)
    assert st.finish_reason == "stop" and text == model.generate("Hello there", 30, stop=["o"], temperature=0.5,
                                                                 seed=3)
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=30, stop="o", temperature=0.5, seed=3)
    assert r.choices[0].text == text
    # chat through the template: greedy whole, a seeded draw streamed
    r = c.chat.completions.create(model=NAME, messages=BRIEF, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == model.chat(BRIEF, 24) and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(
        model.tokenizer.encode(model.render_chat(BRIEF), add_special_tokens=False).ids)
    chunks = list(c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=24, stream=True, **draw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == model.chat(HELLO, 24, **draw)
    assert [m.id for m in c.models.list().data] == [NAME]


def test_a_stream_is_one_event_per_token_ending_with_done(live, model):
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    s = model.stream("Hello", 12)
    pieces = [t.text for t in s]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == s.finish_reason
    assert [e["choices"][0]["text"] for e in events[:-2]] == pieces         # token by token, as the model's stream
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


# --------------------------------------------------------------------------------------------- bad requests

BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": MC}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": NAME, "messages": HELLO, "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": HELLO, "max_tokens": 1000}, 400, "messages"),
    ("/v1/nothing", {}, 404, None),
]


def _send(client, path, body):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def test_bad_requests_are_4xx_error_objects_naming_the_field(live):
    with httpx.Client(base_url=live.url) as c:
        for path, body, status, param in BAD:
            r = _send(c, path, body)
            assert r.status_code == status, (body, r.text)
            assert error_of(r)["param"] == param, (body, r.text)
        r = c.post("/v1/completions", content=b'{"model": "x", "prompt": "' + b"a" * (1 << 20) + b'"}')
        assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
        assert c.get("/v1/completions").status_code == 405
        assert c.get("/health").json()["status"] == "ok"        # still serving


# ------------------------------------------------------------------------------------------------------ load

def test_many_concurrent_streams_complete_right_while_bad_requests_fail(live, model):
    clients = 32
    asks = [("chat" if i % 4 == 3 else "completion", f"Hello {i}", 8 + i % 9, 0.0 if i % 2 else 0.8, i)
            for i in range(clients)]
    want = [model.chat([{"role": "user", "content": p}], n, temperature=t, seed=s) if kind == "chat"
            else model.generate(p, n, temperature=t, seed=s) for kind, p, n, t, s in asks]

    async def one(c, kind, prompt, n, t, seed):
        path, body = "/v1/completions", {"prompt": prompt}
        if kind == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        body.update(model=NAME, max_tokens=n, temperature=t, seed=seed, stream=True)
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            events = sse([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        key = "delta" if kind == "chat" else None
        return "".join((e["choices"][0][key].get("content", "") if key else e["choices"][0]["text"])
                       for e in events[:-1])

    async def bad(c, path, body, status):
        r = await c.post(path, content=body) if isinstance(body, bytes) else await c.post(path, json=body)
        return r.status_code, r

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            good = [asyncio.ensure_future(one(c, *a)) for a in asks]
            wrong = [asyncio.ensure_future(bad(c, p, b, s)) for p, b, s, _ in BAD * 2]
            return await asyncio.gather(*good), await asyncio.gather(*wrong)

    t0 = time.monotonic()
    got, refused = asyncio.run(asyncio.wait_for(main(), 60))
    assert got == want
    assert [s for s, _ in refused] == [s for _, _, s, _ in BAD * 2] and all(error_of(r) for _, r in refused)
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------------------ admission

def _stream_body(n, prompt="Hello"):
    return {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}


def _refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["content-type"].startswith("application/json") and b"data:" not in r.content
    assert error_of(r)["code"] == code


def test_a_full_queue_answers_429_before_any_byte_and_a_retry_succeeds(live, model):
    want = model.generate("Hello", 40)

    async def stream(c, held: asyncio.Event | None = None):
        async with c.stream("POST", "/v1/completions", json=_stream_body(40)) as r:
            if r.status_code != 200:
                await r.aread()
                return r
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if held is not None:
                    held.set()
            return "".join(e["choices"][0]["text"] for e in sse(lines)[:-1])

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            held = asyncio.Event()
            first = asyncio.ensure_future(stream(c, held))
            await held.wait()                                  # it has the slot
            queued = [asyncio.ensure_future(stream(c)) for _ in range(2)]
            while live.scheduler.counts() != (1, 2):
                await asyncio.sleep(0.002)
            surplus = await asyncio.gather(*[stream(c) for _ in range(3)])
            done = await asyncio.gather(first, *queued)
            retried = await stream(c)                          # capacity again: it goes through
            return surplus, done, retried

    with live.limits(delay=0.005, queue=2):
        surplus, done, retried = asyncio.run(asyncio.wait_for(main(), 30))
    for r in surplus:
        _refused(r, "queue_full")
    assert done == [want] * 3 and retried == want


def test_the_queue_deadline_answers_429_and_so_does_a_refused_start(live, model):
    with live.limits(delay=0.01, timeout=0.3):
        with httpx.Client(base_url=live.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=_stream_body(200)) as held:
                lines = held.iter_lines()      # kept: a dropped iterator closes the connection
                next(lines)
                t0 = time.monotonic()
                r = c.post("/v1/completions", json=_stream_body(4))
                waited = time.monotonic() - t0
            _refused(r, "queue_timeout")
            assert 0.3 <= waited < 2.0
    live.engine.refuse = CapacityError("the KV cache cannot grow", requested=1 << 20, budget=1 << 20)
    with live.limits():
        _refused(httpx.post(live.url + "/v1/completions", json=_stream_body(4)), "capacity")
    assert live.client().completions.create(model=NAME, prompt="Hello", max_tokens=4,
                                            temperature=0).choices[0].text == model.generate("Hello", 4)


_KILLED_CLIENT = r"""
import socket, sys, time
body = sys.argv[2].encode()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
          + str(len(body)).encode() + b"\r\n\r\n" + body)
got = b""
while b"data: " not in got:
    got += s.recv(65536)
print("streaming", flush=True)
time.sleep(60)
"""


def test_a_client_that_goes_away_frees_its_slot_or_its_place_in_the_queue(live, model):
    c = live.client()
    c.completions.create(model=NAME, prompt="Hello", max_tokens=200, temperature=0)     # the KV cache at its size
    idle = model.stats()["committed"]
    cancelled = _sample(live, "vmmstream_finished_requests_total", reason="cancelled")
    with live.limits(delay=0.02):                   # 200 tokens: 4 s unless the sequence is cancelled
        p = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, str(live.port), json.dumps(_stream_body(200))],
                             stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "streaming"
            assert live.scheduler.counts() == (1, 0)
            p.kill()
            t0 = time.monotonic()
        finally:
            p.kill()
            p.wait()
        r = c.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
        assert time.monotonic() - t0 < 2.0            # the slot came free at the next token
    assert r.choices[0].text == model.generate("Hello", 4)
    assert _sample(live, "vmmstream_finished_requests_total", reason="cancelled") == cancelled + 1
    assert model.stats()["committed"] == idle and model._active is None
    # a client that gives up while it waits leaves the queue at once (its deadline is 10 s away)
    with live.limits(delay=0.02):
        with httpx.Client(base_url=live.url, timeout=30) as held:
            with held.stream("POST", "/v1/completions", json=_stream_body(200)) as r:
                lines = r.iter_lines()
                next(lines)
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(live.url + "/v1/completions", json=_stream_body(4), timeout=0.3)
                t0 = time.monotonic()
                while live.scheduler.counts() != (1, 0):
                    assert time.monotonic() - t0 < 1.0, live.scheduler.counts()
                    time.sleep(0.005)
    # a client that gives up on a whole (not streamed) answer frees the slot too
    with live.limits(delay=0.02):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json={**_stream_body(200), "stream": False}, timeout=0.3)
        t0 = time.monotonic()
        wait_idle(live, 2.0)
        assert time.monotonic() - t0 < 1.0
    assert _sample(live, "vmmstream_finished_requests_total", reason="cancelled") == cancelled + 3
    assert model.stats()["committed"] == idle and model._active is None


def test_an_engine_failure_ends_that_answer_and_the_server_goes_on(live, model):
    with live.limits():
        live.engine.break_step = RuntimeError("injected step failure")
        with httpx.stream("POST", live.url + "/v1/completions", json=_stream_body(20)) as r:
            assert r.status_code == 200
            events = sse(r.iter_lines())
        assert "injected step failure" in events[-1]["error"]["message"] and "[DONE]" not in events
        live.engine.break_step = RuntimeError("injected step failure")
        r = httpx.post(live.url + "/v1/completions", json={**_stream_body(20), "stream": False})
        assert r.status_code == 500 and "injected step failure" in error_of(r)["message"]
    r = live.client().completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0)
    assert r.choices[0].text == model.generate("Hello", 8) and model._active is None


# -------------------------------------------------------------------------------------------------- metrics

def _metrics(live) -> dict:
    r = httpx.get(live.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sample(live, name, **labels) -> float:
    return _metrics(live).get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move(live, model):
    before = _metrics(live)
    r = live.client().completions.create(model=NAME, prompt="Hello there", max_tokens=16, temperature=0)
    httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x", "n": 3})
    after = _metrics(live)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("vmmstream_requests_total", endpoint="/v1/completions", status="200") == 1
    assert moved("vmmstream_requests_total", endpoint="/v1/completions", status="400") == 1
    assert moved("vmmstream_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("vmmstream_generation_tokens_total") == r.usage.completion_tokens
    assert moved("vmmstream_time_to_first_token_seconds_count") == 1
    assert moved("vmmstream_inter_token_latency_seconds_count") == r.usage.completion_tokens - 1
    assert moved("vmmstream_streamed_bytes_total") > 0                     # half the weights stream
    s = model.stats()
    assert after[("vmmstream_budget_bytes", ())] == s["budget"] == model.plan.budget
    assert 0 < after[("vmmstream_committed_bytes", ())] <= s["budget"]    # I1
    assert after[("vmmstream_queue_depth", ())] == 0 and after[("vmmstream_batch_size", ())] == 0


# --------------------------------------------------------------------------------------------------- shutdown

def test_sigterm_drains_the_running_stream_refuses_the_rest_and_stops(model):
    live = Live(model)
    want = model.generate("Hello", 60)
    try:
        live.engine.delay = 0.005
        with httpx.Client(base_url=live.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=_stream_body(60)) as r:
                lines = iter(r.iter_lines())
                first = next(lines)
                waiting = {}
                t = threading.Thread(target=lambda: waiting.setdefault(
                    "r", httpx.post(live.url + "/v1/completions", json=_stream_body(4), timeout=30)))
                t.start()
                while live.scheduler.counts() != (1, 1):
                    time.sleep(0.002)
                live.server.handle_exit(signal.SIGTERM, None)
                t.join(10)
                rest = [first, *lines]
        assert waiting["r"].status_code == 503 and error_of(waiting["r"])["code"] == "shutting_down"
        events = sse(rest)
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == want
        live.thread.join(10)
        assert not live.thread.is_alive() and not live.server.interrupted
        with pytest.raises(httpx.ConnectError):
            httpx.get(live.url + "/health")
    finally:
        live.stop()
    # a second Ctrl-C does not wait for the stream: the sequence ends at its next step
    live = Live(model)
    try:
        live.engine.delay = 0.02
        with httpx.Client(base_url=live.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=_stream_body(200)) as r:
                lines = r.iter_lines()
                next(lines)
                assert live.scheduler.counts() == (1, 0)
                t0 = time.monotonic()
                live.server.handle_exit(signal.SIGINT, None)
                live.server.handle_exit(signal.SIGINT, None)
                live.thread.join(5)
                assert not live.thread.is_alive() and live.server.interrupted
                assert time.monotonic() - t0 < 2.0
    finally:
        live.stop()
    assert model._active is None


# --------------------------------------------------------------------------------------------------- the CLI

def test_cli_serve_answers_and_exits_cleanly_on_sigterm(model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vmmstream", "serve", str(model.path), "--backend", "host", "--budget", "64MiB",
           "--max-context", str(MC), "--port", str(port), "--queue", "4", "--log-level", "warning"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, VMMSTREAM_BACKEND="host"))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() else "no start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"model": model.path.name, "messages": HELLO, "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] == model.chat(HELLO, 8)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert f"vmmstream serve: {model.path.name} (resident, host)" in err


def test_cli_serve_refuses_what_it_cannot_do(model, monkeypatch, capsys):
    from vmmstream.cli import main
    monkeypatch.setitem(sys.modules, "uvicorn", None)           # the serve extra is not installed
    assert main(["serve", str(model.path), "--backend", "host"]) == 2
    err = capsys.readouterr().err
    assert "uvicorn missing" in err and "pip install 'vmmstream[serve]'" in err


def test_a_client_gone_while_queued_is_answered_by_nobody_and_its_job_cancelled():
    """The disconnect wins the race with the admission: ``_admitted`` is False (no error raised into the
    server's log) and the waiting job's own cancellation has run by then."""
    from vmmstream.server.app import _admitted

    class Job:
        cancelled = False

        def cancel(self):
            self.cancelled = True

        async def admitted(self):
            try:
                await asyncio.sleep(3600)          # never admitted
            except asyncio.CancelledError:
                self.saw_cancel = True
                raise

    class Gone:
        async def receive(self):
            return {"type": "http.disconnect"}

    job = Job()
    assert asyncio.run(_admitted(job, Gone())) is False
    assert job.saw_cancel and job.cancelled

    class StartedAsItLeft(Job):
        """The worker started it as the client left: the wait's cancel is lost (asyncio.wait_for returns the
        finished result), so only ``_admitted`` can end the job."""
        ended = False

        async def admitted(self):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                return None

        def cancel(self):
            self.ended = True

    job = StartedAsItLeft()
    assert asyncio.run(_admitted(job, Gone())) is False
    assert job.ended

    class Started(Job):
        async def admitted(self):
            return None

    class Silent:
        async def receive(self):
            await asyncio.sleep(3600)

    assert asyncio.run(_admitted(Started(), Silent())) is True
