"""One process, one engine, one uvicorn server: ``make_server`` wires a loaded model to the HTTP app, ``Server``
adds the shutdown the issue asks for, ``serve`` runs it until a signal.

SIGTERM or Ctrl-C: stop admitting (a new request gets 503, a queued one too), let the running answers stream
to their end (uvicorn closes the listening socket and waits for the open responses), then return. A second
Ctrl-C returns at once; the worker then ends the running sequences at their next step.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

from .app import MAX_BODY_BYTES, create_app
from .engine import SingleSequenceEngine
from .metrics import Metrics
from .scheduler import Scheduler


class Server(uvicorn.Server):
    """uvicorn's server with the scheduler's drain on the first exit signal. ``scheduler``, ``metrics`` and
    ``app`` are the pieces it serves; ``close()`` stops the scheduler's worker."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, metrics: Metrics):
        super().__init__(config)
        self.scheduler, self.metrics = scheduler, metrics
        self.interrupted = False           # a second Ctrl-C cut the drain short

    def handle_exit(self, sig, frame) -> None:
        self.scheduler.drain()
        if self.should_exit and sig == signal.SIGINT:
            self.interrupted = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # As uvicorn's, without raising the signal again once the server has stopped: the process then ends
        # through the command's own cleanup (the model closed, exit status 0 after a drain).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def close(self) -> None:
        self.scheduler.close()


def make_server(model, *, host: str = "127.0.0.1", port: int = 8000, engine=None, model_name: str | None = None,
                max_queue: int = 64, queue_timeout: float = 30.0, max_body: int = MAX_BODY_BYTES,
                log_level: str = "info") -> Server:
    """A ``Server`` for ``model`` (not started: ``server.run()``, or ``run(sockets=[...])`` on bound sockets).
    ``engine``: a ``SequenceEngine`` (default: ``SingleSequenceEngine(model)``). The scheduler's worker is
    running when this returns; ``server.close()`` stops it (the caller closes the model)."""
    engine = engine if engine is not None else SingleSequenceEngine(model)
    name = model_name or model.path.name
    metrics = Metrics(engine, model_name=name, max_batch=engine.max_batch)
    scheduler = Scheduler(engine, max_queue=max_queue, queue_timeout=queue_timeout, metrics=metrics).start()
    app = create_app(engine, scheduler, metrics, model_name=name, max_body=max_body)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=None)
    server = Server(config, scheduler, metrics)
    server.app, server.engine, server.model_name = app, engine, name
    return server
