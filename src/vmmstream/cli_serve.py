"""``vmmstream serve``: load a checkpoint once under a budget and answer OpenAI-style HTTP requests."""

from __future__ import annotations

import sys
import time

from .cli_model import _budget, _positive, _slots


def add_subcommands(subparsers) -> None:
    """Register ``serve`` on the ``vmmstream`` parser's subparsers."""
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server for a checkpoint loaded under a budget",
        description="Load MODEL once within the device memory budget and serve /v1/completions, "
                    "/v1/chat/completions (the checkpoint's chat template; stream: true for server-sent events), "
                    "/v1/models, /health and /metrics (Prometheus). A request waits in a bounded queue for the "
                    "engine; when the queue is full or its deadline passes it gets 429 with Retry-After before "
                    "any byte of its answer, never a spill. SIGTERM / Ctrl-C: stop admitting (503), finish the "
                    "answers being streamed, exit; a second Ctrl-C exits at once. Needs the serve extra: "
                    "pip install 'vmmstream[serve]'.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--budget", type=_budget, default=None,
                   help="device memory budget, e.g. 6GiB (default: VMMSTREAM_BUDGET, else auto = 0.9 x free)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default=None, help="the name clients ask for (default: MODEL's folder name)")
    p.add_argument("--max-batch", type=_positive, default=1,
                   help="sequences decoded together (default 1; more: continuous batching of dense models)")
    p.add_argument("--queue", type=_positive, default=64, help="requests that may wait for the engine (default 64)")
    p.add_argument("--queue-timeout", type=_seconds, default=30.0,
                   help="seconds a request waits for the engine before a 429 (default 30)")
    p.add_argument("--max-context", type=_positive, default=None,
                   help="positions one request may use, prompt + max_tokens (default: min(4096, "
                        "max_position_embeddings, sliding_window))")
    p.add_argument("--slots", type=_slots, default=None, help="streaming slots K >= 2 (default 2)")
    p.add_argument("--quantize", default=None, choices=("int4", "mxfp4"),
                   help="store the layers' linear weights quantized (quantized while loading)")
    p.add_argument("--backend", default=None, choices=("cuda", "host", "auto"))
    p.add_argument("--no-warmup", action="store_true",
                   help="start listening before the batch kernels are compiled and their graphs captured "
                        "(the first requests then pay for it)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(fn=_serve)


def _serve(args) -> int:
    from .errors import VmmstreamError
    from .server import INSTALL_HINT, missing
    lacking = missing()
    if lacking:
        raise VmmstreamError(f"vmmstream serve needs the serve extra ({', '.join(lacking)} missing): "
                             f"{INSTALL_HINT}")
    from .api import load_model
    from .budget import format_bytes
    from .server.batch_engine import BatchSequenceEngine
    from .server.engine import SingleSequenceEngine
    from .server.runner import make_server
    t0 = time.perf_counter()
    batch = args.max_batch if args.max_batch > 1 else None
    with load_model(args.model, args.budget, max_context=args.max_context, slots=args.slots,
                    backend=args.backend, quantize=args.quantize, max_batch=batch) as model:
        engine = BatchSequenceEngine(model) if batch else SingleSequenceEngine(model)
        if batch and not args.no_warmup:
            t1 = time.perf_counter()
            print("vmmstream serve: warming up (kernels and the decode graphs of every batch size)...",
                  file=sys.stderr, flush=True)
            w = engine.warm()
            print(f"vmmstream serve: warm in {time.perf_counter() - t1:.1f} s (batch sizes "
                  f"{', '.join(map(str, w['buckets']))})", file=sys.stderr, flush=True)
        server = make_server(model, engine=engine, host=args.host, port=args.port, model_name=args.model_name,
                             max_queue=args.queue, queue_timeout=args.queue_timeout, log_level=args.log_level)
        p = model.plan
        print(f"vmmstream serve: {server.model_name} ({p.strategy}, {model.backend}) loaded in "
              f"{time.perf_counter() - t0:.1f} s; budget {format_bytes(p.budget)}, max_context {p.max_context}, "
              f"batch {server.engine.max_batch}, queue {args.queue} for {args.queue_timeout:g} s; "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        try:
            server.run()
        finally:
            server.close()
        if server.interrupted:
            raise KeyboardInterrupt
        if not server.started:
            raise VmmstreamError(f"the server did not start on {args.host}:{args.port} (see the lines above)")
    return 0


def _port(text: str) -> int:
    import argparse
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number in [0, 65535]")
    return v


def _seconds(text: str) -> float:
    import argparse
    import math
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0")
    return v
