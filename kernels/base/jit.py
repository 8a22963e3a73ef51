"""Kernels compiled once per machine, not once per process.

``jit(fn, **options)`` is ``numba.cuda.jit(fn, **options)`` with numba-cuda's on-disk cache turned on and filed in
a folder of ours::

    $VMMSTREAM_CACHE_DIR/kernels/<tag>/        default: $XDG_CACHE_HOME/vmmstream, else ~/.cache/vmmstream

``<tag>`` hashes the source of every kernel module (the kernel and every device helper it inlines), the versions
of numba-cuda and Numba, and Python's: a changed kernel lands in a new folder and is compiled again. Inside a
folder each entry is keyed by argument types, compute capability and CUDA runtime version (numba-cuda's key), so
another GPU recompiles too, and by what this module adds: the kernel's bytecode, the values it closes over (the
parameters its factory specialized it on, so ``_make(vec=8)`` and ``_make(vec=4)`` are two entries) and its
compile options (launch bounds, register cap, carveout). Each entry is a file named by a hash of its whole key
that also holds the key, checked on load; there is no shared index, so processes filling the folder at once
cannot cross their entries. A kernel that closes over something
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


def _code_hash(code) -> str:
    """The bytecode, names and constants of ``code`` and of the code objects nested in it."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        h.update((_code_hash(c) if isinstance(c, types.CodeType) else f"{type(c).__name__}:{c!r}").encode())
    return h.hexdigest()[:16]


def _function(fn, depth: int = 0) -> str:
    code = fn.__code__
    cells = fn.__closure__ or ()
    inner = ",".join(_describe(c.cell_contents, depth) for c in cells)
    return f"{fn.__module__}.{fn.__qualname__}@{code.co_firstlineno}:{_code_hash(code)}[{inner}]"


def closure_key(fn, options=None) -> str:
    """The fingerprint of ``fn``'s code and of what it closes over, and of the compile ``options`` (launch bounds,
    register cap, carveout: a factory parameter that only reaches the decorator is no closure value)."""
    extra = "" if options is None else repr(sorted((k, repr(v)) for k, v in options.items()))
    return hashlib.sha256((_function(fn) + extra + f"|opt={config.OPT}").encode()).hexdigest()


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
            return cls(py_func, cache_dir())     # the folder is made when an entry is first saved

    class _Impl(CUDACacheImpl):
        _locator_classes = [_Locator]

    class _KeyedFiles:
        """One file per entry, named by a hash of its full key and holding the key beside the kernel; a load
        checks the key. No shared index, so processes filling the folder at once never point one key at
        another's data (each write is a temporary file renamed into place)."""

        def __init__(self, path: str, base: str, stamp):
            self._path, self._base, self._stamp = path, base, stamp

        def _name(self, key) -> str:
            digest = hashlib.sha256(repr((self._stamp, key)).encode()).hexdigest()[:32]
            return os.path.join(self._path, f"{self._base}.{digest}.nbc")

        def save(self, key, data) -> None:
            import pickle
            import uuid
            path = self._name(key)
            tmp = f"{path}.tmp.{uuid.uuid4().hex[:16]}"
            try:
                with open(tmp, "wb") as f:
                    pickle.dump((repr((self._stamp, key)), data), f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

        def load(self, key):
            import pickle
            try:
                with open(self._name(key), "rb") as f:
                    stored, data = pickle.load(f)
            except FileNotFoundError:
                return None
            return data if stored == repr((self._stamp, key)) else None

        def flush(self) -> None:
            pass

    class _Cache(CUDACache):
        _impl_class = _Impl

        def __init__(self, py_func, key: str):
            self._closure = key
            super().__init__(py_func)
            self._cache_file = _KeyedFiles(self._cache_path, self._impl.filename_base, source_tag())

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self._closure)
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key

        def load_overload(self, sig, target_context):
            try:
                return super().load_overload(sig, target_context)
            except Exception:               # a damaged or foreign entry: compile instead
                return None

        def save_overload(self, sig, data):
            try:
                super().save_overload(sig, data)
            except OSError:                 # a folder that cannot be written: this process compiles, as without
                self.disable()


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
        d._cache = _Cache(fn, closure_key(fn, getattr(d, "targetoptions", options)))
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
