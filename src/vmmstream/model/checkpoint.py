"""Read a Hugging Face checkpoint directory: ``config.json`` and safetensors headers first, weights on demand.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON (``{name: {dtype, shape, data_offsets}}``,
offsets relative to the end of the header) + the raw little-endian tensor bytes. Parsing the header
ourselves costs a read of a few kilobytes per file, so ``open_checkpoint`` and ``vmmstream plan`` never
touch weight bytes, and every problem (missing tensor, wrong shape, unsupported dtype, truncated file,
missing shard) is a ``CheckpointError`` before anything is allocated.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from ..errors import VmmstreamError
from .config import ModelConfig, load_config


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

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]


def read_header(path) -> list[TensorInfo]:
    """Parse one safetensors file's header (no tensor bytes are read); raise ``CheckpointError`` if it is bad."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated: {size} bytes, not even the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} is implausible; not a safetensors file?")
            if 8 + n > size:
                raise CheckpointError(f"{path} is truncated: header says {n} bytes of JSON, file holds {size - 8}")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}); not a safetensors file?") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: header entry for {name!r} is malformed: {meta!r}") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end) or min(shape, default=0) < 0:
            raise CheckpointError(f"{path}: tensor {name!r} has bad data_offsets {meta['data_offsets']!r}")
        info = TensorInfo(name, str(dtype), shape, end - begin, path, data_start + begin)
        if dtype in _ITEMSIZE and info.numel * _ITEMSIZE[dtype] != info.nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs "
                                  f"{info.numel * _ITEMSIZE[dtype]} bytes but its data_offsets span {info.nbytes}")
        if end > data_len:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at data byte {end} but the file holds {data_len} "
                "data bytes; re-download or re-write the checkpoint")
        out.append(info)
    return out


def _shard_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else the single file, else every one there."""
    index = root / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid index (needs a 'weight_map'): {exc}") from None
        names = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in names if not (root / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names shard(s) {', '.join(missing)} that are not in {root}; the download is incomplete",
                [f"missing shard {s}" for s in missing])
        return [root / s for s in names]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no {SINGLE}, {INDEX} or other *.safetensors in {root}")
    return found


def read_headers(path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory, by name, from the headers alone."""
    root = Path(path)
    files = _shard_files(root)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for t in read_header(f):
            if t.name in tensors:
                raise CheckpointError(f"tensor {t.name!r} is in both {tensors[t.name].file} and {f}")
            tensors[t.name] = t
    index = root / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        wrong = [f"{n} (index: {s})" for n, s in weight_map.items()
                 if n not in tensors or Path(tensors[n].file).name != s]
        if wrong:
            raise CheckpointError(f"{index} places tensors in shards that do not hold them: "
                                  f"{_first(wrong)}", wrong)
    return tensors


def validate_tensors(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Check names, shapes and dtypes against the config; return the tensors in the config's order."""
    expected = config.tensor_shapes()
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
        if t.dtype not in DTYPES:
            problems.append(f"tensor {name} has dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    extra = [n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    problems += [f"unexpected tensor {n}" for n in extra]
    if problems:
        raise CheckpointError(
            f"checkpoint does not match its {config.architecture} config ({len(problems)} problem(s)): "
            f"{_first(problems)}. Is config.json the one for these weights?", problems)
    return {n: tensors[n] for n in expected}


def open_checkpoint(path, *, validate: bool = True) -> Checkpoint:
    """Config + tensor headers of a checkpoint directory; no weight bytes are read."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; give a Hugging Face checkpoint directory")
    config = load_config(root)
    tensors = read_headers(root)
    if validate:
        tensors = validate_tensors(config, tensors)
    files = tuple(dict.fromkeys(t.file for t in tensors.values()))
    return Checkpoint(root, config, tensors, files)


def synthetic_tensors(config: ModelConfig, dtype: str = "BF16") -> dict[str, TensorInfo]:
    """The tensors a checkpoint of ``config`` would hold, without a file: for planning a preset."""
    size = _ITEMSIZE[dtype]
    return {name: TensorInfo(name, dtype, tuple(shape), int(np.prod(shape, dtype=np.int64)) * size, None, 0)
            for name, shape in config.tensor_shapes().items()}


def read_tensor(info: TensorInfo, out=None) -> np.ndarray:
    """One tensor's values: bf16 as uint16 bit patterns, f16/f32 as themselves.

    With ``out`` (a writable C-contiguous buffer of at least ``info.nbytes``, e.g. pinned host memory),
    the bytes land there directly and a view of it is returned.
    """
    if info.dtype not in DTYPES:
        raise CheckpointError(f"tensor {info.name} has dtype {info.dtype}; supported: {', '.join(DTYPES)}")
    if info.file is None:
        raise CheckpointError(f"tensor {info.name} is synthetic (planned from a preset); it has no bytes to read")
    dt = DTYPES[info.dtype]
    if out is None:
        out = np.empty(info.numel, dtype=dt)
    view = _byte_view(out, info)
    with open(info.file, "rb") as f:
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
                raise CheckpointError(f"tensor {info.name} has dtype {info.dtype}; supported: {', '.join(DTYPES)}")
            if info.file is None:
                raise CheckpointError(f"tensor {info.name} is synthetic; it has no bytes to read")
            if info.file != name:
                if f is not None:
                    f.close()
                f, name = open(info.file, "rb"), info.file
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


def load_tokenizer(path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` if both exist, else None (tokenizers is optional)."""
    p = Path(path) / "tokenizer.json"
    if not p.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(p))


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


def _first(items, k: int = 5) -> str:
    more = f" (and {len(items) - k} more)" if len(items) > k else ""
    return "; ".join(items[:k]) + more
