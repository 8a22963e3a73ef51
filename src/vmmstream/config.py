"""Every ``VMMSTREAM_*`` environment variable, declared once, typed and strictly parsed.

A bad value is a ``ConfigError`` naming the variable and the value; nothing is guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use one of 1/true/yes/on or 0/false/no/off")


def _parse_backend(name: str, raw: str) -> str:
    v = raw.strip().lower()
    if v in ("cuda", "host", "auto"):
        return v
    raise ConfigError(f"{name}={raw!r} is not a backend; use cuda, host or auto")


def _parse_budget_text(name: str, raw: str) -> str:
    # Validated (syntax only) here; resolved against the device total by vmmstream.budget.
    from .budget import parse_budget_spec
    try:
        parse_budget_spec(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r}: {exc}") from None
    return raw.strip()


@dataclass(frozen=True)
class Variable(Generic[T]):
    name: str
    parse: Callable[[str, str], T]
    default: T
    help: str

    def get(self, environ=None) -> T:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        return self.parse(self.name, raw)

    def is_set(self, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return bool(env.get(self.name, "").strip())


LEGACY_ALLOCATOR = Variable(
    "VMMSTREAM_LEGACY_ALLOCATOR", _parse_bool, False,
    "1 = plain cuMemAlloc allocations: no VMM pool, no aliasing, no streaming (for comparison)")
BUDGET = Variable(
    "VMMSTREAM_BUDGET", _parse_budget_text, None,
    "default device memory budget when none is passed: bytes, '6GiB', '80%', 0.8 or 'auto'")
BACKEND = Variable(
    "VMMSTREAM_BACKEND", _parse_backend, "auto",
    "driver backend: cuda, host (emulation without a GPU) or auto (cuda when a device is usable)")

def _parse_path(name: str, raw: str) -> str:
    return os.path.expanduser(raw.strip())


KERNEL_CACHE = Variable(
    "VMMSTREAM_KERNEL_CACHE", _parse_bool, True,
    "0 = compile the CUDA kernels in every process instead of keeping them on disk (see `vmmstream cache`)")
CACHE_DIR = Variable(
    "VMMSTREAM_CACHE_DIR", _parse_path, None,
    "where compiled kernels are kept (default: $XDG_CACHE_HOME/vmmstream, else ~/.cache/vmmstream)")

CUBLASLT = Variable(
    "VMMSTREAM_CUBLASLT", _parse_bool, True,
    "dense bf16 prefill GEMMs through cuBLASLt where nvmath-python is installed (pip install 'vmmstream[cublas]'); "
    "0 = our tensor-core GEMM")

CUDNN = Variable(
    "VMMSTREAM_CUDNN", _parse_bool, False,
    "1 = prefill attention of long prompts (2,048 tokens, or as much work after a cached prefix) through cuDNN's fused SDPA where "
    "nvidia-cudnn-frontend is installed (pip install 'vmmstream[cudnn]'); 0 (default) = our tensor-core kernel")

CUDNN_BUCKETS = Variable(
    "VMMSTREAM_CUDNN_BUCKETS", _parse_bool, False,
    "with VMMSTREAM_CUDNN=1: one cuDNN graph per bucket of prompt lengths (at most 1/8 more rows, the real lengths "
    "given by cuDNN's padding mask) instead of one per length; off (default) until checked on a GPU")

ALL = (LEGACY_ALLOCATOR, BUDGET, BACKEND, KERNEL_CACHE, CACHE_DIR, CUBLASLT, CUDNN, CUDNN_BUCKETS)
