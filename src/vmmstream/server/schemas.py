"""The OpenAI request and response shapes the server speaks, checked by hand: every field is named in the error
that refuses it, a field this server does not implement is refused (never silently ignored), and ``bool`` is
not accepted where a number is (JSON ``true`` is not 1).

``parse_completion`` / ``parse_chat`` turn a decoded JSON body into ``GenerationParams`` or raise ``APIError``;
the ``*_response`` / ``*_chunk`` functions build the bodies the OpenAI clients read.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

MAX_STOP_STRINGS = 4            # as OpenAI's API


class APIError(Exception):
    """A request refused with ``status`` and an OpenAI error object ``{"error": {message, type, param, code}}``;
    ``headers`` go with the response (``Retry-After`` on a 429)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationParams:
    """One checked request. ``prompt`` (completions: text or token ids) or ``messages`` (chat: plain dicts of
    role, content and name); ``max_tokens`` None: as many as the context leaves (chat's default)."""
    kind: str                   # "completion" or "chat"
    model: str
    prompt: str | list | None
    messages: list | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple
    stream: bool


_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream")
COMPLETION_FIELDS = _COMMON + ("prompt",)
CHAT_FIELDS = _COMMON + ("messages", "max_completion_tokens")
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0       # OpenAI's default: a draw, not greedy


def bad(param: str | None, message: str, *, code: str | None = None, status: int = 400) -> APIError:
    return APIError(status, message, param=param, code=code)


def parse_completion(body, served: str) -> GenerationParams:
    fields = _fields(body, COMPLETION_FIELDS)
    if "prompt" not in fields:
        raise bad("prompt", "prompt is required: a string or a list of token ids")
    return _common(fields, "completion", served, prompt=_prompt(fields["prompt"]),
                   max_tokens=_max_tokens(fields, "max_tokens", DEFAULT_COMPLETION_TOKENS))


def parse_chat(body, served: str) -> GenerationParams:
    fields = _fields(body, CHAT_FIELDS)
    if "messages" not in fields:
        raise bad("messages", "messages is required: a list of {role, content} objects")
    if "max_tokens" in fields and "max_completion_tokens" in fields:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    return _common(fields, "chat", served, messages=_messages(fields["messages"]),
                   max_tokens=_max_tokens(fields, name, None))


def _fields(body, known) -> dict:
    """The body's fields, null ones dropped (null means "the default" in the OpenAI API); an unknown field is
    refused by name."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, not {_json_type(body)}")
    unknown = [k for k in body if k not in known]
    if unknown:
        raise bad(unknown[0], f"unsupported field {unknown[0]!r}; this server accepts {', '.join(known)}",
                  code="unsupported_field")
    return {k: v for k, v in body.items() if v is not None}


def _common(f: dict, kind: str, served: str, *, prompt=None, messages=None, max_tokens=None) -> GenerationParams:
    model = f.get("model")
    if model is None:
        raise bad("model", f"model is required; this server serves {served!r}")
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, not {_json_type(model)}")
    if model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")
    if "n" in f and (_integer(f, "n", lo=1) != 1):
        raise bad("n", "n must be 1: this server returns one choice per request")
    temperature = _number(f, "temperature", DEFAULT_TEMPERATURE, lo=0.0, hi=2.0)
    top_p = _number(f, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _integer(f, "top_k", lo=-1, default=0)           # -1 or 0: no limit
    seed = _integer(f, "seed", lo=0, hi=2**64 - 1, default=None)
    if seed is None:                     # no seed: each request draws differently, as the OpenAI API does
        seed = secrets.randbits(63)
    stream = f.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be true or false, not {_json_type(stream)}")
    return GenerationParams(kind, model, prompt, messages, max_tokens, temperature, top_p, max(top_k, 0), seed,
                            _stop(f.get("stop")), stream)


def _prompt(value):
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                 # one prompt in a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "prompt is empty")
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        if any(t < 0 for t in value):
            raise bad("prompt", "prompt token ids must be >= 0")
        return list(value)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise bad("prompt", f"one prompt per request, not {len(value)}")
    raise bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids (integers)")


_MESSAGE_KEYS = ("role", "content", "name")


def _messages(value) -> list:
    if not isinstance(value, list) or not value:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with role and content, not {_json_type(m)}")
        extra = [k for k in m if k not in _MESSAGE_KEYS]
        if extra:
            raise bad(f"{where}.{extra[0]}", f"unsupported field {extra[0]!r} in {where}; a message has "
                      f"{', '.join(_MESSAGE_KEYS)}", code="unsupported_field")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role", f"{where}.role must be a non-empty string")
        msg = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise bad(f"{where}.name", f"{where}.name must be a string")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _content(value, where: str) -> str:
    """A message's text: a string, or a list of text parts (``{"type": "text", "text": ...}``) joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                raise bad(f"{where}[{j}]", f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                          "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, f"{where} must be a string or a list of text parts, not {_json_type(value)}")


def _stop(value) -> tuple:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, not {len(stops)}")
    if any(not s for s in stops):
        raise bad("stop", "a stop string must not be empty")
    return tuple(stops)


def _max_tokens(f: dict, name: str, default):
    return _integer(f, name, lo=1, default=default)


def _integer(f: dict, name: str, *, lo=None, hi=None, default=None):
    if name not in f:
        return default
    v = f[name]
    if type(v) is float and v.is_integer():      # 16.0 from a client that writes every number as a float
        v = int(v)
    if type(v) is not int:
        raise bad(name, f"{name} must be an integer, not {_json_type(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"{name}={v} is out of range: expected {_range(lo, hi)}")
    return v


def _number(f: dict, name: str, default: float, *, lo: float, hi: float, lo_open: bool = False) -> float:
    if name not in f:
        return default
    v = f[name]
    if type(v) not in (int, float):
        raise bad(name, f"{name} must be a number, not {_json_type(v)}")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"{name}={v:g} is out of range: expected a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return v


def _range(lo, hi) -> str:
    if hi is None:
        return f"an integer >= {lo}"
    return f"an integer in [{lo}, {hi}]"


def _json_type(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


# ---------------------------------------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_response(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
