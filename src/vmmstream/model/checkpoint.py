"""Read a Hugging Face checkpoint directory: ``config.json`` and safetensors headers first, weights on demand.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON (``{name: {dtype, shape, data_offsets}}``,
offsets relative to the end of the header) + the raw little-endian tensor bytes. Parsing the header
ourselves costs a read of a few kilobytes per file, so ``open_checkpoint`` and ``vmmstream plan`` never
touch weight bytes, and every problem (missing tensor, wrong shape, unsupported dtype, truncated file,
missing shard) is a ``CheckpointError`` before anything is allocated.

The files may be hostile: a shard name that leaves the directory, a pipe or device instead of a file, sizes and
nesting that would exhaust memory or the parser. Every file is opened through ``_open_regular`` (regular file,
size-checked, never blocking) and every name from the index through ``_check_shard_name``.
"""

from __future__ import annotations

import ctypes
import json
import os
import reprlib
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from ..errors import VmmstreamError
from .config import ModelConfig, UnsupportedModelError


class CheckpointError(VmmstreamError, ValueError):
    """A checkpoint that does not match its config or cannot be read completely. ``problems`` lists each one."""

    def __init__(self, message: str, problems: Iterable[str] = ()):
        super().__init__(message)
        self.problems = list(problems)


# dtypes the kernels' host side can take (bf16 comes back as uint16 bit patterns)
DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
# every safetensors dtype, so a header with others still parses and validation can name them
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER = 100 * 2**20          # safetensors' own limit; a bigger N means a corrupt or foreign file
MAX_JSON = 64 * 2**20             # config.json and the index: real ones are kilobytes, a bigger one is not theirs
CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)   # buffers some old exports saved; recomputed from config


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str                 # safetensors dtype string: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]
    nbytes: int
    file: str | None           # None: a synthetic entry (a preset planned without writing it)
    offset: int                # absolute byte offset of the data in ``file``
    # a tensor stored in another form (GPTQ / AWQ parts, a GGUF block type): ``source.read()`` gives its values,
    # fp32 or the stored int4 parts (``quantized.Int4Parts``); ``source.format`` names the stored form, ``source.exact`` says whether bf16 / int4
    # on the device holds the stored values exactly. ``nbytes`` is then what is read from the file(s).
    source: object = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    tensors: dict = field(hash=False)     # name -> TensorInfo, in the config's tensor order when validated
    files: tuple[str, ...] = ()
    format: str = "safetensors"           # "safetensors", "gptq", "awq" or "gguf"
    quantization: str | None = None       # "int4": its layers' linear weights come in that layout (GPTQ / AWQ)
    notes: tuple = ()                     # what loading it does beyond reading bf16, for the plan

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]


def read_header(path) -> list[TensorInfo]:
    """Parse one safetensors file's header (no tensor bytes are read); raise ``CheckpointError`` if it is bad."""
    path = str(path)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, not even the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CheckpointError(f"{path}: header length {n} is implausible; not a safetensors file?")
        if 8 + n > size:
            raise CheckpointError(f"{path} is truncated: header says {n} bytes of JSON, file holds {size - 8}")
        raw = f.read(n)
    header = _loads(raw, path, "header", hint="; not a safetensors file?")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: header entry for {name!r} is {reprlib.repr(meta)}; it must be an object "
                                  "with dtype, shape and data_offsets")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in meta]
        if missing:
            raise CheckpointError(f"{path}: header entry for {name!r} is malformed, it lacks {', '.join(missing)}: "
                                  f"{reprlib.repr(meta)}")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not isinstance(dtype, str):
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {reprlib.repr(dtype)}; a dtype is a string "
                                  "such as 'BF16'")
        if not isinstance(shape, list) or not all(map(_is_count, shape)):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {reprlib.repr(shape)}; a shape is a list of "
                                  "non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {reprlib.repr(offsets)}; they must be "
                                  "[begin, end] with integers 0 <= begin <= end")
        begin, end = offsets
        info = TensorInfo(name, dtype, tuple(shape), end - begin, path, data_start + begin)
        if dtype in _ITEMSIZE and info.numel * _ITEMSIZE[dtype] != info.nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs "
                                  f"{info.numel * _ITEMSIZE[dtype]} bytes but its data_offsets span {info.nbytes}")
        if end > data_len:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at data byte {end} but the file holds {data_len} "
                "data bytes; re-download or re-write the checkpoint")
        out.append(info)
    # two tensors sharing bytes would alias each other's buffers once loaded
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out if t.nbytes)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap (data bytes {b0 - data_start}-"
                                  f"{e0 - data_start} and {b1 - data_start}-{e1 - data_start}); each tensor must "
                                  "have bytes of its own")
    return out


def _read_index(root: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> shard name), checked; None when there is no index."""
    index = root / INDEX
    if not os.path.lexists(index):
        return None
    doc = _read_json(index, "index")
    if not isinstance(doc, dict) or "weight_map" not in doc:
        raise CheckpointError(f"{index} is not a valid index: it needs a 'weight_map' object")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' is a {type(weight_map).__name__}; it must be an object "
                              "{tensor name: shard file name}")
    for key, shard in weight_map.items():
        _check_shard_name(root, key, shard)
    return weight_map


def _check_shard_name(root: Path, key: str, name) -> None:
    """Refuse a shard name from the index that is not a string or could reach outside ``root``.

    The name is judged, not where it leads: the Hugging Face cache's snapshot files are symlinks into
    ``../../blobs``, so the resolved path of a legitimate shard is outside the snapshot directory.
    """
    index = root / INDEX
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{index}: weight_map[{key!r}] is {reprlib.repr(name)}; it must be a shard name, "
                              "a file name relative to the checkpoint directory")
    p = Path(name)
    if p.anchor or ".." in p.parts:
        raise CheckpointError(f"{index}: weight_map[{key!r}] names shard {name!r}, which is outside {root}; shard "
                              "names must be relative paths inside the checkpoint directory, without '..'")


def _shard_files(root: Path, weight_map: dict[str, str] | None) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else the single file, else every one there."""
    if weight_map is not None:
        files = list(dict.fromkeys(root / s for s in weight_map.values()))
        missing = [str(f.relative_to(root)) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(
                f"{root / INDEX} names shard(s) {', '.join(missing)} that are not in {root}; the download is "
                "incomplete", [f"missing shard {s}" for s in missing])
        return files
    if os.path.lexists(root / SINGLE):
        return [root / SINGLE]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no {SINGLE}, {INDEX} or other *.safetensors in {root}")
    return found


def read_headers(path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory, by name, from the headers alone."""
    root = Path(path)
    weight_map = _read_index(root)
    tensors: dict[str, TensorInfo] = {}
    for f in _shard_files(root, weight_map):
        for t in read_header(f):
            if t.name in tensors:
                raise CheckpointError(f"tensor {t.name!r} is in both {tensors[t.name].file} and {f}")
            tensors[t.name] = t
    if weight_map is not None:
        wrong = [f"{n} (index: {s})" for n, s in weight_map.items()
                 if n not in tensors or tensors[n].file != str(root / s)]
        if wrong:
            raise CheckpointError(f"{root / INDEX} places tensors in shards that do not hold them: "
                                  f"{_first(wrong)}", wrong)
    return tensors


def validate_tensors(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Check names, shapes and dtypes against the config (the checkpoint's names: fused tensors whole); return
    the tensors the model reads, in the config's order, a fused tensor's parts as tensors of their own."""
    expected = config.checkpoint_shapes()
    problems = []
    missing = [n for n in expected if n not in tensors]
    if missing:
        problems += [f"missing tensor {n}" for n in missing]
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"tensor {name}: expected shape {list(shape)}, got {list(t.shape)}")
        if t.dtype not in DTYPES and t.source is None:
            problems.append(f"tensor {name} has dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    extra = [n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    problems += [f"unexpected tensor {n}" for n in extra]
    if problems:
        raise CheckpointError(
            f"checkpoint does not match its {config.architecture} config ({len(problems)} problem(s)): "
            f"{_first(problems)}. Is config.json the one for these weights?", problems)
    out = {n: tensors[n] for n in expected}
    for name, parts in config.fused_tensors().items():
        out.update(split_rows(out.pop(name), parts))
    return {n: out[n] for n in config.tensor_shapes()}


def split_rows(info: TensorInfo, parts) -> dict[str, TensorInfo]:
    """A 2-D tensor's consecutive row blocks ``parts`` ((name, rows), ...) as tensors of their own: each is a
    contiguous byte range of ``info`` in the same file, so it is read directly, never the whole tensor."""
    rows, cols = info.shape
    if sum(r for _, r in parts) != rows or info.dtype not in DTYPES:
        raise CheckpointError(f"tensor {info.name} {info.dtype}{list(info.shape)} cannot be split into "
                              f"{', '.join(f'{n} ({r} rows)' for n, r in parts)}")
    row_bytes = cols * DTYPES[info.dtype].itemsize
    out, first = {}, 0
    for name, r in parts:
        out[name] = TensorInfo(name, info.dtype, (r, cols), r * row_bytes, info.file,
                               info.offset + first * row_bytes)
        first += r
    return out


def read_config_json(root: Path):
    """``config.json`` of a checkpoint directory, parsed (a dict for ``ModelConfig.from_dict``)."""
    # not load_config: config.json is a file of the checkpoint like the others and gets the same guarded read
    path = root / CONFIG
    if not os.path.lexists(path):
        raise UnsupportedModelError(f"no config.json at {path}; a Hugging Face checkpoint directory has one")
    return _read_json(path, "config", invalid=UnsupportedModelError)


def synthetic_tensors(config: ModelConfig, dtype: str = "BF16") -> dict[str, TensorInfo]:
    """The tensors a checkpoint of ``config`` would hold, without a file: for planning a preset."""
    size = _ITEMSIZE[dtype]
    return {name: TensorInfo(name, dtype, tuple(shape), int(np.prod(shape, dtype=np.int64)) * size, None, 0)
            for name, shape in config.tensor_shapes().items()}


def read_tensor(info: TensorInfo, out=None) -> np.ndarray:
    """One tensor's values: bf16 as uint16 bit patterns, f16/f32 as themselves; a tensor stored in another form
    (``info.source``) as its source reads it (fp32, or ``quantized.Int4Parts``).

    With ``out`` (a writable C-contiguous buffer of at least ``info.nbytes``, e.g. pinned host memory),
    the bytes land there directly and a view of it is returned.
    """
    if info.source is not None and out is None:
        return info.source.read()
    if info.dtype not in DTYPES:
        raise CheckpointError(f"tensor {info.name} has dtype {info.dtype}; supported: {', '.join(DTYPES)}")
    if info.file is None:
        raise CheckpointError(f"tensor {info.name} is synthetic (planned from a preset); it has no bytes to read")
    dt = DTYPES[info.dtype]
    if out is None:
        out = np.empty(info.numel, dtype=dt)
    view = _byte_view(out, info)
    with _open_regular(info.file) as f:
        _read_into(f, info, view)
    return np.frombuffer(out, dtype=np.uint8, count=info.nbytes).view(dt).reshape(info.shape)


def iter_load(tensors: Iterable[TensorInfo], buffer_for: Callable[[TensorInfo], object], *,
              progress: Callable[[int, int, TensorInfo], None] | None = None) -> Iterator[TensorInfo]:
    """Read each tensor into ``buffer_for(info)`` (a writable buffer of >= ``info.nbytes``); yield it when done.

    Reads go in file then offset order, each file opened once, so a spinning disk or a network mount
    reads sequentially. ``progress(done_bytes, total_bytes, info)`` runs after each tensor.
    """
    todo = sorted(tensors, key=lambda t: (t.file or "", t.offset))
    total, done = sum(t.nbytes for t in todo), 0
    f, name = None, None
    try:
        for info in todo:
            if info.dtype not in DTYPES:
                raise CheckpointError(f"tensor {info.name} has dtype {info.dtype}; supported: {', '.join(DTYPES)}"
                                      + ("; read it with its source" if info.source is not None else ""))
            if info.file is None:
                raise CheckpointError(f"tensor {info.name} is synthetic; it has no bytes to read")
            if info.file != name:
                if f is not None:
                    f.close()
                f, name = _open_regular(info.file), info.file
            _read_into(f, info, _byte_view(buffer_for(info), info))
            done += info.nbytes
            if progress is not None:
                progress(done, total, info)
            yield info
    finally:
        if f is not None:
            f.close()


def load_all(tensors: Iterable[TensorInfo], buffer_for, *, progress=None) -> int:
    """``iter_load`` run to the end; returns the bytes read."""
    return sum(t.nbytes for t in iter_load(tensors, buffer_for, progress=progress))


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _open_regular(path, limit: int | None = None, what: str = "file"):
    """``path`` opened for binary reading; a ``CheckpointError`` unless it is a regular file (a symlink to one is
    fine) of at most ``limit`` bytes.

    The type and size come from ``os.stat`` before anything is opened, since ``open()`` blocks forever on a
    named pipe and a read of ``/dev/zero`` never ends. The open is non-blocking and the descriptor checked
    again, so a file swapped for a pipe in between cannot block us either.
    """
    path = str(path)

    def refuse_unless_regular(st):
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise CheckpointError(f"{path} is {kind}; a checkpoint's files must be regular files "
                                  "(or symlinks to regular files)")
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"{path} is {st.st_size:,} bytes, over the {limit >> 20} MiB accepted for a "
                                  f"{what} file; is it the right file?")

    try:
        refuse_unless_regular(os.stat(path))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror}") from None
    f = os.fdopen(fd, "rb")
    try:
        refuse_unless_regular(os.fstat(fd))
    except BaseException:
        f.close()
        raise
    return f


def _read_json(path: Path, what: str, invalid=CheckpointError):
    """A small JSON file of the checkpoint (config.json, the index), parsed."""
    with _open_regular(path, MAX_JSON, what) as f:
        raw = f.read(MAX_JSON + 1)
    if len(raw) > MAX_JSON:     # it grew after the size check
        raise CheckpointError(f"{path} is over the {MAX_JSON >> 20} MiB accepted for a {what} file")
    return _loads(raw, path, what, invalid)


def _loads(raw: bytes, path, what: str, invalid=CheckpointError, hint: str = ""):
    """``json.loads``; bad JSON raises ``invalid``, naming the file."""
    try:
        return json.loads(raw)
    except RecursionError:      # the C parser recurses once per nesting level: "[[[[..." of a few hundred KB
        raise CheckpointError(f"{path}: the {what} JSON is nested too deeply to parse; a {what} nests a few "
                              "levels at most") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, or an integer of more digits than int() takes
        raise invalid(f"{path}: {what} is not valid JSON ({exc}){hint}") from None


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _byte_view(buf, info: TensorInfo) -> memoryview:
    try:
        view = memoryview(buf).cast("B")
    except TypeError:
        raise CheckpointError(f"buffer for {info.name} is not a C-contiguous buffer") from None
    if view.readonly:
        raise CheckpointError(f"buffer for {info.name} is read-only")
    if view.nbytes < info.nbytes:
        raise CheckpointError(f"buffer for {info.name} holds {view.nbytes} bytes; the tensor needs {info.nbytes}")
    return view[:info.nbytes]


def _read_into(f, info: TensorInfo, view: memoryview) -> None:
    f.seek(info.offset)
    got = 0
    while got < info.nbytes:        # readinto may return short counts (pipes, network file systems)
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{info.file} is truncated: tensor {info.name} needs {info.nbytes} bytes at "
                                  f"offset {info.offset}, only {got} were there")
        got += n


def read_span(file, offset: int, nbytes: int, what: str) -> np.ndarray:
    """``nbytes`` bytes of ``file`` from ``offset`` (uint8); ``what`` names them in a truncation error."""
    out = np.empty(nbytes, np.uint8)
    info = TensorInfo(what, "U8", (nbytes,), nbytes, str(file), offset)
    with _open_regular(file) as f:
        _read_into(f, info, memoryview(out).cast("B"))
    return out


def open_regular(path):
    """A checkpoint data file opened for reading (a ``CheckpointError`` unless it is a regular file)."""
    return _open_regular(path)


def pread_into(f, info: TensorInfo, off: int, addr: int, n: int) -> None:
    """Bytes ``off .. off + n`` of tensor ``info`` from the open file ``f`` into host memory at ``addr``, without
    moving the file position (``os.preadv``), so several threads may read one file at once."""
    if off < 0 or n < 0 or off + n > info.nbytes:
        raise CheckpointError(f"tensor {info.name}: bytes {off}..{off + n} are outside its {info.nbytes}")
    view = memoryview((ctypes.c_uint8 * n).from_address(addr)).cast("B") if n else memoryview(b"")
    fd, got = f.fileno(), 0
    while got < n:
        if hasattr(os, "preadv"):
            k = os.preadv(fd, [view[got:]], info.offset + off + got)
        else:                                   # pragma: no cover - platforms without preadv
            data = os.pread(fd, n - got, info.offset + off + got)
            k = len(data)
            view[got:got + k] = data
        if not k:
            raise CheckpointError(f"{info.file} is truncated: tensor {info.name} needs {info.nbytes} bytes at "
                                  f"offset {info.offset}, only {off + got} were there")
        got += k


def _first(items, k: int = 5) -> str:
    more = f" (and {len(items) - k} more)" if len(items) > k else ""
    return "; ".join(items[:k]) + more
