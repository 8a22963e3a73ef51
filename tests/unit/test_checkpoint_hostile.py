"""Hostile checkpoint directories: whatever config.json, the index and the safetensors headers say, reading them
never opens a file outside the checkpoint, blocks, reads without end or fails with a raw Python error; each
refusal is a CheckpointError that names the file and what is wrong."""

import builtins
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import vmmstream
from vmmstream.model import (CheckpointError, UnsupportedModelError, make_checkpoint, open_checkpoint, read_header,
                             read_tensor)

INDEX = "model.safetensors.index.json"
DEEP = 200_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("sharded"), seed=3, shard_bytes=50_000)


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_index(root, edit):
    index = json.loads((root / INDEX).read_text())
    edit(index)
    (root / INDEX).write_text(json.dumps(index))


def write_header(path, header, data=b""):
    """A safetensors file with ``header`` (a dict, or raw JSON bytes) verbatim."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return path


def open_in_child(path, timeout=30):
    """``open_checkpoint(path)`` in a child process with a memory cap and a deadline, for the files a careless
    reader would block on or read without end: a regression fails the test instead of hanging the run or
    eating the machine's memory. Returns (exception type name, message)."""
    code = ("import sys\nfrom vmmstream.model import open_checkpoint\n"
            "try:\n    open_checkpoint(sys.argv[1])\nexcept BaseException as e:\n"
            "    print(type(e).__name__ + ': ' + str(e)[:2000])\nelse:\n    print('OK: opened')\n")

    def cap_memory():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                             timeout=timeout, preexec_fn=cap_memory, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"open_checkpoint({path}) still ran after {timeout} s: it blocks")
    line = (out.stdout.strip().splitlines() or [f"NoOutput: rc={out.returncode} {out.stderr[-2000:]}"])[-1]
    kind, _, message = line.partition(": ")
    return kind, message


@pytest.fixture
def opened(monkeypatch):
    """Every path opened (builtins.open, io.open, os.open) while the test runs."""
    seen = []

    def spy(real):
        def wrapper(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)):
                seen.append(os.fsdecode(file))
            return real(file, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(builtins, "open", spy(builtins.open))
    monkeypatch.setattr(io, "open", spy(io.open))
    monkeypatch.setattr(os, "open", spy(os.open))
    return seen


def outside(paths, root):
    root = os.path.abspath(root)
    return [p for p in paths if not os.path.normpath(os.path.abspath(p)).startswith(root + os.sep)]


# -- 1. shard names that leave the checkpoint directory --

@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors",
                                  "../elsewhere/model-00002.safetensors"])
def test_index_shard_names_outside_the_directory_are_refused_before_anything_is_opened(
        sharded, tmp_path, opened, name):
    root = copy(sharded, tmp_path / "ck")
    # a real, valid shard out there: only the name can tell the reader not to use it
    (tmp_path / "elsewhere").mkdir()
    victim = sorted(root.glob("model-*.safetensors"))[1]
    shutil.copy(victim, tmp_path / "elsewhere" / "model-00002.safetensors")
    edit_index(root, lambda ix: ix["weight_map"].update(
        {k: name for k, v in ix["weight_map"].items() if v == victim.name}))
    opened.clear()
    with pytest.raises(CheckpointError, match=rf"{INDEX}.*{re.escape(name)}.*relative.*'\.\.'"):
        open_checkpoint(root)
    assert any(p.endswith(INDEX) for p in opened)          # the spy sees the reader's opens
    assert outside(opened, root) == []


def test_hugging_face_cache_layout_with_symlinks_into_blobs_still_loads(sharded, tmp_path):
    # models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>, as huggingface_hub lays out its cache
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    (snap / "sub").mkdir(parents=True)
    index = json.loads((sharded / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (f"sub/{v}" if v == first else v) for k, v in index["weight_map"].items()}
    (tmp_path / INDEX).write_text(json.dumps(index))
    files = {p.name: p for p in sharded.iterdir()} | {INDEX: tmp_path / INDEX}
    for i, (name, src) in enumerate(sorted(files.items())):
        shutil.copy(src, blobs / f"blob{i}")
        link = snap / ("sub/" + name if name == first else name)
        link.symlink_to(os.path.relpath(blobs / f"blob{i}", link.parent))
    ck, ref = open_checkpoint(snap), open_checkpoint(sharded)
    assert list(ck.tensors) == list(ref.tensors) and len(ck.files) == len(ref.files)
    assert any("/sub/" in f for f in ck.files)
    for name in ck.tensors:
        np.testing.assert_array_equal(read_tensor(ck[name]), read_tensor(ref[name]))


# -- 2. files that are not regular files --

def test_config_json_linked_to_dev_zero_is_refused(tiny, tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    root = copy(tiny, tmp_path / "ck")
    (root / "config.json").unlink()
    (root / "config.json").symlink_to("/dev/zero")
    kind, message = open_in_child(root)
    assert kind == "CheckpointError" and "config.json" in message and "character device" in message, message


@pytest.mark.parametrize("which", ["config.json", "model.safetensors"])
def test_a_named_pipe_is_refused_without_blocking(tiny, tmp_path, which):
    root = copy(tiny, tmp_path / "ck")
    (root / which).unlink()
    os.mkfifo(root / which)
    kind, message = open_in_child(root)
    assert kind == "CheckpointError" and which in message and "named pipe" in message, message


def test_a_shard_named_by_the_index_that_is_a_named_pipe_is_refused(sharded, tmp_path):
    root = copy(sharded, tmp_path / "ck")
    shard = sorted(root.glob("model-*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    kind, message = open_in_child(root)
    assert kind == "CheckpointError" and shard.name in message and "named pipe" in message, message


def test_model_safetensors_that_is_a_directory_is_refused(tiny, tmp_path):
    root = copy(tiny, tmp_path / "ck")
    (root / "model.safetensors").unlink()
    (root / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a directory.*regular file"):
        open_checkpoint(root)


def test_a_symlink_loop_is_refused(tiny, tmp_path):
    root = copy(tiny, tmp_path / "ck")
    (root / "config.json").unlink()
    (root / "config.json").symlink_to("config.json")
    with pytest.raises(CheckpointError, match=r"config\.json cannot be read"):
        open_checkpoint(root)


# -- 3. sizes are checked before anything is read --

@pytest.mark.parametrize("which", ["config.json", INDEX])
def test_oversized_json_files_are_refused_unread(sharded, tmp_path, which):
    root = copy(sharded, tmp_path / "ck")
    with open(root / which, "r+b") as f:
        f.truncate(64 * 2**20 + 1)          # sparse: costs no disk
    with pytest.raises(CheckpointError, match=rf"{which} is 67,108,865 bytes, over the 64 MiB accepted"):
        open_checkpoint(root)


def test_header_length_above_the_limit_is_refused(tmp_path):
    # (this check existed before; here it gets a test)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 2**40) + b"{}")
        f.truncate(200 * 2**20)             # larger than the limit, so only the limit can refuse it
    with pytest.raises(CheckpointError, match="header length 1099511627776 is implausible"):
        read_header(path)


def test_overlapping_tensors_are_refused(tmp_path):
    path = write_header(tmp_path / "model.safetensors", {
        "a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [4, 12]},
        "empty": {"dtype": "BF16", "shape": [0], "data_offsets": [4, 4]}}, bytes(12))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensors 'a' and 'b' overlap"):
        read_header(path)


def test_byte_length_must_equal_shape_times_itemsize(tmp_path):
    # (this check existed before; here it gets a test)
    path = write_header(tmp_path / "model.safetensors",
                        {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}}, bytes(12))
    with pytest.raises(CheckpointError, match=r"'a' F32\[2, 3\] needs 24 bytes but its data_offsets span 12"):
        read_header(path)


# -- 4. nesting too deep for the JSON parser --

@pytest.mark.parametrize("which", ["config.json", INDEX, "header"])
def test_deeply_nested_json_is_refused_not_a_recursion_error(sharded, tmp_path, which):
    root = copy(sharded, tmp_path / "ck")
    deep = b"[" * DEEP + b"]" * DEEP
    if which == "header":
        which = sorted(root.glob("model-*.safetensors"))[0].name
        write_header(root / which, deep)
    else:
        (root / which).write_bytes(deep)
    with pytest.raises(CheckpointError, match=rf"{which}.*nested too deeply"):
        open_checkpoint(root)


@pytest.mark.parametrize("which", ["config.json", INDEX, "header"])
def test_an_integer_too_long_for_int_is_refused_as_invalid_json(sharded, tmp_path, which):
    # json.loads raises a bare ValueError (not JSONDecodeError) for more digits than int() converts
    root = copy(sharded, tmp_path / "ck")
    doc = b'{"n": ' + b"1" * 5000 + b"}"
    if which == "header":
        which = sorted(root.glob("model-*.safetensors"))[0].name
        write_header(root / which, doc)
    else:
        (root / which).write_bytes(doc)
    with pytest.raises(vmmstream.VmmstreamError, match=rf"{which}: .* is not valid JSON \(Exceeds the limit"):
        open_checkpoint(root)


# -- 5. an index whose weight_map is not {tensor name: shard name} --

def test_weight_map_that_is_not_an_object_is_refused(sharded, tmp_path):
    root = copy(sharded, tmp_path / "ck")
    edit_index(root, lambda ix: ix.update(weight_map=list(ix["weight_map"].items())))
    with pytest.raises(CheckpointError, match=rf"{INDEX}: 'weight_map' is a list; .*object"):
        open_checkpoint(root)


@pytest.mark.parametrize("value", [5, None, ["model-00001.safetensors"], ""])
def test_weight_map_values_that_are_not_names_are_refused_naming_the_key(sharded, tmp_path, value):
    root = copy(sharded, tmp_path / "ck")
    edit_index(root, lambda ix: ix["weight_map"].update({"model.norm.weight": value}))
    with pytest.raises(CheckpointError, match=rf"{INDEX}: weight_map\['model\.norm\.weight'\] is .*shard name"):
        open_checkpoint(root)


# -- 7. shapes, dtypes and offsets of the wrong JSON type --

@pytest.mark.parametrize("shape,nbytes", [([64.9], 128), ([-1], 0), ([True], 2), ("64", 48), (64, 128),
                                          ([[8, 8]], 128), (None, 2)])
def test_shape_that_is_not_a_list_of_counts_is_refused_naming_the_tensor(tmp_path, shape, nbytes):
    path = write_header(tmp_path / "model.safetensors",
                        {"model.norm.weight": {"dtype": "BF16", "shape": shape, "data_offsets": [0, nbytes]}},
                        bytes(nbytes))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape .*list of non-negative integers"):
        read_header(path)


@pytest.mark.parametrize("meta", [{"dtype": ["BF16"], "shape": [1], "data_offsets": [0, 2]},
                                  {"dtype": "BF16", "shape": [1], "data_offsets": [False, 2]},
                                  {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2, 4]}])
def test_dtype_and_offsets_of_the_wrong_type_are_refused(tmp_path, meta):
    path = write_header(tmp_path / "model.safetensors", {"t": meta}, bytes(4))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 't' has (dtype|data_offsets)"):
        read_header(path)


def test_config_architecture_of_the_wrong_type_is_refused(tiny, tmp_path):
    root = copy(tiny, tmp_path / "ck")
    for bad in ({"architectures": [["LlamaForCausalLM"]]}, {"architectures": None, "model_type": ["llama"]}):
        cfg = json.loads((tiny / "config.json").read_text()) | bad
        (root / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UnsupportedModelError, match="architecture"):
            open_checkpoint(root)


# -- 8. the errors are part of the top-level API --

def test_checkpoint_errors_are_exported_from_the_package():
    from vmmstream import CheckpointError as top_ck
    from vmmstream import UnsupportedModelError as top_um
    assert top_ck is CheckpointError and top_um is UnsupportedModelError
    assert vmmstream.CheckpointError is CheckpointError and vmmstream.UnsupportedModelError is UnsupportedModelError
    assert {"CheckpointError", "UnsupportedModelError"} <= set(vmmstream.__all__)
    assert issubclass(CheckpointError, vmmstream.VmmstreamError) and issubclass(CheckpointError, ValueError)
    doc = vmmstream.load_model.__doc__
    assert "CheckpointError" in doc and "UnsupportedModelError" in doc


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10 ** 7), ("num_attention_heads", 10 ** 6),
                                         ("vocab_size", 10 ** 9)])
def test_a_config_too_large_for_any_model_is_refused_before_anything_is_built(tmp_path, field, value):
    """A hostile config must not make the reader expand millions of tensor names (memory, minutes)."""
    import json
    from vmmstream.model import make_checkpoint, open_checkpoint
    path = make_checkpoint("tiny", tmp_path / "tiny", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(vmmstream.UnsupportedModelError, match=field):
        open_checkpoint(path)
