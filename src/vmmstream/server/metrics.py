"""``GET /metrics``: Prometheus text from the server's own registry (one per app, so two servers in a process
never share counters).

Request counts by endpoint and status come from an ASGI middleware that sees every response start; the
scheduler reports queue depth, batch size, tokens, refusals and the latencies (time to first token from the
request's arrival, the gaps between a sequence's tokens as the engine hands them out); the model's memory
authority is read at each scrape (committed and budget bytes, KV, bytes streamed from host memory).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metrics; every method is safe from any thread (prometheus_client locks)."""

    def __init__(self, engine=None, *, model_name: str = "", max_batch: int = 1):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._requests = Counter("vmmstream_requests", "HTTP requests by endpoint and status code",
                                 ("endpoint", "status"), registry=r)
        self._prompt = Counter("vmmstream_prompt_tokens", "prompt tokens of the requests started", registry=r)
        self._generated = Counter("vmmstream_generation_tokens", "tokens generated and handed out", registry=r)
        self._rejected = Counter("vmmstream_rejected_requests", "requests refused before their response began, "
                                 "by reason (queue_full, queue_timeout, capacity: 429; shutting_down: 503)",
                                 ("reason",), registry=r)
        self._finished = Counter("vmmstream_finished_requests", "sequences ended, by finish reason (stop, "
                                 "length, cancelled: the client went away, error)", ("reason",), registry=r)
        self._queued = Gauge("vmmstream_queue_depth", "requests waiting for the engine", registry=r)
        self._running = Gauge("vmmstream_batch_size", "sequences running on the engine", registry=r)
        Gauge("vmmstream_max_batch", "sequences the engine decodes together at most", registry=r).set(max_batch)
        self._ttft = Histogram("vmmstream_time_to_first_token_seconds", "from a request's arrival to its first "
                               "token (queue wait and prefill included)", buckets=_LATENCY_BUCKETS, registry=r)
        self._queue_wait = Histogram("vmmstream_queue_wait_seconds", "from a request's arrival to its start on "
                                     "the engine", buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("vmmstream_inter_token_latency_seconds", "between consecutive tokens of one "
                              "sequence as the engine hands them out", buckets=_ITL_BUCKETS, registry=r)
        if engine is not None:
            r.register(_EngineCollector(engine, model_name))

    # from the scheduler
    def set_load(self, *, queued: int, running: int) -> None:
        self._queued.set(queued)
        self._running.set(running)

    def started(self, prompt_tokens: int, waited_s: float) -> None:
        self._prompt.inc(prompt_tokens)
        self._queue_wait.observe(waited_s)

    def tokens_out(self, n: int) -> None:
        self._generated.inc(n)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float, count: int = 1) -> None:
        for _ in range(count):
            self._itl.observe(seconds)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(reason).inc()

    def response(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        """The exposition (reads the model's counters: call it off the event loop)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The model's memory authority and streaming counters, read when scraped."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return []

    def collect(self):
        m = self.engine.memory()
        gauges = (("vmmstream_committed_bytes", "device bytes committed under the memory authority (all holders)",
                   m["committed"]),
                  ("vmmstream_budget_bytes", "the memory authority's budget: committed bytes never exceed it",
                   m["budget"]),
                  ("vmmstream_peak_committed_bytes", "the most bytes ever committed at once", m["peak_committed"]),
                  ("vmmstream_model_held_bytes", "bytes this model holds", m["held"]),
                  ("vmmstream_kv_committed_bytes", "bytes of KV cache committed", m["kv_committed"]))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("vmmstream_streamed_bytes", "weight bytes copied from host memory to the device "
                                  "(streamed weights)", value=m["streamed_bytes"])


class RequestCounter:
    """ASGI middleware: counts each HTTP response by endpoint (known paths; anything else is "other") and the
    status it started with."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.response(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counted)
