"""The HTTP layer: it only translates. A request body is read (bounded), checked (``schemas``), prepared by the
engine off the event loop (tokenized, context checked: a 400 when it can never fit), queued with the scheduler
and admitted — all before any response byte — then answered as one JSON object or as server-sent events,
token by token, ending with ``data: [DONE]``. Every error is an OpenAI error object; nothing here touches the
model but through the engine and the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request

from ..errors import VmmstreamError
from . import schemas
from .metrics import RequestCounter
from .scheduler import Rejected
from .schemas import APIError

MAX_BODY_BYTES = 1 << 20


def create_app(engine, scheduler, metrics, *, model_name: str, max_body: int = MAX_BODY_BYTES,
               created: int | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` through ``scheduler`` under the name ``model_name``. The caller starts
    and closes the scheduler (``runner.py``)."""
    app = FastAPI(title="vmmstream", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time()) if created is None else created
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(schemas.error_body(f"{request.method} {request.url.path}: {exc.detail}", type=kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return JSONResponse(schemas.error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        running, waiting = scheduler.counts()
        body = {"status": "draining" if scheduler.draining else "ok", "running": running, "waiting": waiting}
        return JSONResponse(body, status_code=503 if scheduler.draining else 200)

    @app.get("/metrics")
    async def metrics_text():
        data = await run_in_threadpool(metrics.text)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "vmmstream", "max_model_len": engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, schemas.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, schemas.parse_chat)

    async def _generate(request: Request, parse):
        arrival = time.monotonic()
        if scheduler.draining:
            raise _refusal(Rejected(503, "shutting_down", "the server is shutting down", retry_after=5))
        params = parse(await _read_json(request, max_body), model_name)
        prepared = await run_in_threadpool(_prepare, engine, params)
        try:
            job = scheduler.submit(prepared, arrival=arrival)
            if not await _admitted(job, request):
                return Response(status_code=499)      # the client left while it waited: nobody to answer
        except Rejected as r:
            raise _refusal(r) from None
        answer = _Answer(params, model_name)
        if params.stream:
            return _EventStream(answer.events(job), job)
        return await _collect(answer, job, request)

    return RequestCounter(app, metrics)


def _refusal(r: Rejected) -> APIError:
    headers = {"Retry-After": str(r.retry_after)} if r.retry_after is not None else {}
    kind = "rate_limit_error" if r.status == 429 else "service_unavailable"
    return APIError(r.status, str(r), type=kind, code=r.code, headers=headers)


async def _read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; the limit is {limit}",
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client went away before sending the whole body") from None
    raw = b"".join(chunks)
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _prepare(engine, params):
    """``engine.prepare`` with its refusals as 400s (a prompt that can never fit is one)."""
    from ..errors import ContextLengthError
    param = "messages" if params.kind == "chat" else "prompt"
    try:
        return engine.prepare(params)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
    except (ValueError, TypeError, VmmstreamError) as exc:
        raise APIError(400, str(exc), param=_param_of(str(exc), param)) from None


def _param_of(message: str, default: str) -> str:
    """The request field a model error is about (its messages start with the argument's name)."""
    for name, field in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
                        ("stop", "stop"), ("max_new_tokens", "max_tokens")):
        if message.startswith(name):
            return field
    return default


class _Answer:
    """The response bodies of one request: whole, or chunk by chunk."""

    def __init__(self, params, model_name: str):
        self.params, self.model = params, model_name
        self.chat = params.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def whole(self, text: str, job) -> dict:
        make = schemas.chat_response if self.chat else schemas.completion_response
        return make(self.id, self.created, self.model, text, job.finish_reason,
                    schemas.usage(job.prompt_tokens, job.completion_tokens))

    def chunk(self, text: str, finish=None) -> dict:
        if self.chat:
            delta = {"content": text} if finish is None else {}
            return schemas.chat_chunk(self.id, self.created, self.model, delta, finish)
        return schemas.completion_chunk(self.id, self.created, self.model, text, finish)

    async def events(self, job):
        if self.chat:
            yield _sse(schemas.chat_chunk(self.id, self.created, self.model, {"role": "assistant", "content": ""}))
        try:
            async for tokens in job.events():
                for t in tokens:
                    yield _sse(self.chunk(t.text or ""))
        except Exception as exc:          # after the headers: the error is the stream's last event
            yield _sse(schemas.error_body(f"the generation failed: {type(exc).__name__}: {exc}",
                                          type="server_error"))
            return
        yield _sse(self.chunk("", job.finish_reason))
        yield b"data: [DONE]\n\n"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose job is cancelled however the response ends (a client gone mid-stream
    included): its sequence ends at the next step and frees its slot."""

    def __init__(self, body, job):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the body is read by then: what remains to receive is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _admitted(job, request: Request) -> bool:
    """Wait for the job's admission (``Rejected`` raised); False if the client disconnects first (the job is
    then out of the queue)."""
    admitted, gone = asyncio.ensure_future(job.admitted()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((admitted, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not admitted.done():
            admitted.cancel()                 # Job.admitted cancels the job
    if admitted.done() and not admitted.cancelled():
        admitted.result()                     # Rejected, or the engine's error, raised here
        return True
    await asyncio.wait((admitted,))           # a cancel takes effect when the task next runs: let it
    if not admitted.cancelled():
        admitted.exception()                  # it ended anyway (started, or refused): nobody is there for it
    job.cancel()                              # a job started just as the client left would run on for no one
    return False


async def _collect(answer: _Answer, job, request: Request):
    """The whole answer; if the client disconnects first, the job is cancelled and nothing is sent."""
    async def gather():
        pieces = []
        async for tokens in job.events():
            pieces.extend(t.text or "" for t in tokens)
        return "".join(pieces)

    work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            job.cancel()
    if not work.done() or work.cancelled():
        return Response(status_code=499)      # nobody is listening
    return JSONResponse(answer.whole(work.result(), job))
