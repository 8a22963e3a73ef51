"""Kernels compiled once per machine, not once per process.

``jit(fn, **options)`` is ``numba.cuda.jit(fn, **options)`` with numba-cuda's on-disk cache turned on and filed in
a folder of ours::

    $VMMSTREAM_CACHE_DIR/kernels/<tag>/        default: $XDG_CACHE_HOME/vmmstream, else ~/.cache/vmmstream

``<tag>`` hashes the source of every kernel module (the kernel and every device helper it inlines), the versions
of numba-cuda and Numba, and Python's: a changed kernel lands in a new folder and is compiled again. Inside a
folder numba-cuda keys each entry by argument types, compute capability and CUDA runtime version, so another GPU
recompiles too; this module adds the values the kernel closes over (the parameters its factory specialized it
on), so ``_make(vec=8)`` and ``_make(vec=4)`` are two entries of one index. A kernel that closes over something
whose value cannot be fingerprinted (an object without a stable description) is compiled per process, as without
the cache. The cache holds PTX and cubins: a hit skips Numba's typing, lowering and the PTX-to-cubin link.

``VMMSTREAM_KERNEL_CACHE=0`` turns the cache off for a process; ``vmmstream cache`` shows the folder and its size,
``vmmstream cache --clear`` deletes it (or delete the folder by hand: nothing else lives there). The simulator
(``NUMBA_ENABLE_CUDASIM=1``) never caches.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import types
import weakref
from pathlib import Path

from numba import config, cuda

from vmmstream.errors import ConfigError

SIM = bool(config.ENABLE_CUDASIM)


class Uncachable(Exception):
    """A kernel closes over a value with no stable fingerprint."""


def cache_root() -> Path:
    """The folder of every cache of this package (kernels in ``kernels/``)."""
    root = os.environ.get("VMMSTREAM_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vmmstream"


def enabled() -> bool:
    """``VMMSTREAM_KERNEL_CACHE`` (default on; never in the simulator)."""
    raw = os.environ.get("VMMSTREAM_KERNEL_CACHE", "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return not SIM
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"VMMSTREAM_KERNEL_CACHE={raw!r} is not a boolean; use one of 1/true/yes/on or 0/false/no/off")


def kernel_sources() -> list[Path]:
    """Every kernel module: the families beside this package's ``base`` folder."""
    top = Path(__file__).resolve().parents[1]
    return sorted(p for p in top.rglob("*.py") if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=None)
def source_tag() -> str:
    """16 hex digits that change when a kernel's source, numba-cuda, Numba or Python changes."""
    import numba
    import numba_cuda

    top = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in kernel_sources():
        h.update(p.relative_to(top).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"numba-cuda {numba_cuda.__version__} numba {numba.__version__} python {sys.version}".encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """This build's folder: ``<root>/kernels/<tag>``."""
    return cache_root() / "kernels" / source_tag()


def _describe(v, depth: int = 0) -> str:
    """A description of a closed-over value that is the same in every process and differs when the value does."""
    if depth > 8:
        raise Uncachable("closure nested too deep")
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (tuple, list, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, frozenset) else v
        return f"{type(v).__name__}(" + ",".join(_describe(x, depth + 1) for x in items) + ")"
    mod = type(v).__module__ or ""
    if mod == "numpy" or mod.startswith("numpy."):
        import numpy as np

        if isinstance(v, np.ndarray):
            return f"ndarray:{v.dtype.str}:{v.shape}:{hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()}"
        if isinstance(v, (np.generic, np.dtype)):
            return f"{type(v).__name__}:{v!r}"
    if mod.startswith("numba") and hasattr(v, "py_func"):      # a device function: what it closes over, in turn
        return "device:" + _function(v.py_func, depth + 1)
    if mod.startswith("numba") and isinstance(getattr(v, "_defn", None), types.FunctionType):   # an intrinsic
        return "intrinsic:" + _function(v._defn, depth + 1)
    if isinstance(v, types.FunctionType):
        return "function:" + _function(v, depth + 1)
    if mod.startswith("numba") and any(c.__name__ == "Type" for c in type(v).__mro__):
        return f"numbatype:{type(v).__name__}:{v}"
    raise Uncachable(f"cannot fingerprint a {type(v).__module__}.{type(v).__qualname__}")


def _function(fn, depth: int = 0) -> str:
    code = fn.__code__
    cells = fn.__closure__ or ()
    inner = ",".join(_describe(c.cell_contents, depth) for c in cells)
    return f"{fn.__module__}.{fn.__qualname__}@{code.co_firstlineno}[{inner}]"


def closure_key(fn) -> str:
    """The fingerprint of what ``fn`` closes over (its code is covered by :func:`source_tag`)."""
    return hashlib.sha256(_function(fn).encode()).hexdigest()


if not SIM:
    import numba_cuda
    from numba.cuda.core.caching import _CacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class _Locator(_CacheLocator):
        def __init__(self, py_func, path: Path):
            self._lineno = py_func.__code__.co_firstlineno
            self._path = path

        def get_cache_path(self):
            return str(self._path)

        def get_source_stamp(self):
            return source_tag()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            self = cls(py_func, cache_dir())
            try:
                self.ensure_cache_path()
            except OSError:                 # not writable: compile per process
                return None
            return self

    class _Impl(CUDACacheImpl):
        _locator_classes = [_Locator]

    class _Cache(CUDACache):
        _impl_class = _Impl

        def __init__(self, py_func, key: str):
            self._closure = key
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self._closure)
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key


_made: weakref.WeakSet = weakref.WeakSet()       # every dispatcher made here, for stats()


def jit(fn=None, **options):
    """``cuda.jit(fn, **options)`` for a kernel, cached on disk (see the module's docstring). Also a decorator:
    ``@jit(launch_bounds=256)``."""
    if fn is None:
        return lambda f: jit(f, **options)
    d = cuda.jit(fn, **options)
    if SIM:
        return d
    _made.add(d)
    if not enabled():
        return d
    try:
        d._cache = _Cache(fn, closure_key(fn))
    except (Uncachable, RuntimeError, OSError):
        pass                                # compiled per process, as without the cache
    return d


def cached(d) -> bool:
    """Does the dispatcher ``d`` read and write the disk cache?"""
    return not SIM and isinstance(getattr(d, "_cache", None), _Cache)


def stats() -> dict:
    """This process's kernels: how many were made, how many use the cache, the signatures loaded from it (hits)
    and compiled (misses), and the kernels that cannot use it."""
    made = list(_made)
    return dict(kernels=len(made), cached=sum(cached(d) for d in made),
                hits=sum(sum(d._cache_hits.values()) for d in made),
                misses=sum(sum(d._cache_misses.values()) for d in made),
                uncached=sorted(d.py_func.__qualname__ for d in made if not cached(d)))


def folder_size(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = size = 0
    if path.is_dir():
        for p in path.rglob("*"):
            if p.is_file():
                files += 1
                size += p.stat().st_size
    return files, size


def clear() -> int:
    """Delete every kernel cache folder (all builds); returns the bytes freed."""
    top = cache_root() / "kernels"
    _, size = folder_size(top)
    shutil.rmtree(top, ignore_errors=True)
    return size
