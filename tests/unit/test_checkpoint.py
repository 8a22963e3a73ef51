"""Checkpoints: make_checkpoint writes real HF layout, headers are read without weights, every defect is named."""

import json
import shutil
import struct

import numpy as np
import pytest

from vmmstream.model import (PRESETS, CheckpointError, UnsupportedModelError, iter_load, load_all, load_tokenizer,
                             make_checkpoint, open_checkpoint, read_header, read_tensor)
from vmmstream.model.presets import f32_to_bf16_finite, tensor_values


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_checkpoint("qwen2-tiny", tmp_path_factory.mktemp("qwen"), shard_bytes=40_000)


def write_st(path, tensors):
    """A minimal safetensors writer for fixtures: {name: (dtype string, raw bytes, shape)}."""
    header, blobs, off = {}, [], 0
    for name, (dtype, raw, shape) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def rewrite(src, dst, drop=(), replace=None):
    """Copy checkpoint ``src`` into a single-file ``dst``, dropping or replacing tensors."""
    ck = open_checkpoint(src)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    out = {n: (t.dtype, read_tensor(t).tobytes(), t.shape) for n, t in ck.tensors.items() if n not in drop}
    out.update(replace or {})
    write_st(dst / "model.safetensors", out)
    return dst


def test_round_trip_values_are_what_was_written(tiny):
    ck = open_checkpoint(tiny)
    config = PRESETS["tiny"].config
    assert ck.config == config and list(ck.tensors) == list(config.tensor_shapes())
    assert ck.total_bytes == 2 * config.n_params() and ck.files == (str(tiny / "model.safetensors"),)
    for name, info in ck.tensors.items():
        got = read_tensor(info)
        assert got.dtype == np.uint16 and got.shape == info.shape
        np.testing.assert_array_equal(got, tensor_values(name, info.shape, seed=3))
    assert (read_tensor(ck["model.norm.weight"]) == 0x3F80).all()                 # bf16 1.0
    w = (read_tensor(ck["model.embed_tokens.weight"]).astype(np.uint32) << 16).view(np.float32)
    assert 0.018 < w.std() < 0.022
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "bfloat16"


def test_the_reference_safetensors_reader_agrees(tiny):
    import safetensors  # a dependency of the package
    ck = open_checkpoint(tiny)
    with safetensors.safe_open(str(tiny / "model.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == set(ck.tensors) and f.metadata() == {"format": "pt"}
        for name in f.keys():
            sl = f.get_slice(name)
            assert sl.get_dtype() == "BF16" and tuple(sl.get_shape()) == ck[name].shape


def test_fast_bf16_conversion_matches_the_kernels_reference():
    from vmmstream.kernels.base.dtypes import f32_to_bf16
    x = np.random.default_rng(0).standard_normal(100_000, dtype=np.float32) * np.float32(0.02)
    edges = np.array([0.0, -0.0, 1.0, -1.0, 3.4028235e38, -3.4028235e38, 1e-45, 1.00390625, 1.01171875,
                      np.float32(1.0) + np.float32(2**-8), 65504.0], dtype=np.float32)
    for v in (x, edges):
        np.testing.assert_array_equal(f32_to_bf16_finite(v.copy()), f32_to_bf16(v))


def test_values_do_not_depend_on_sharding(tiny, tmp_path):
    sharded = make_checkpoint("tiny", tmp_path / "sharded", seed=3, shard_bytes=50_000)
    a, b = open_checkpoint(tiny), open_checkpoint(sharded)
    assert len(b.files) > 2 and (sharded / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == a.total_bytes and set(index["weight_map"]) == set(a.tensors)
    for name in a.tensors:
        np.testing.assert_array_equal(read_tensor(a[name]), read_tensor(b[name]))


def test_qwen2_sharded_with_biases_and_tied_embeddings(qwen):
    ck = open_checkpoint(qwen)
    assert ck.config.attention_bias and ck.config.tie_word_embeddings and len(ck.files) > 1
    assert "lm_head.weight" not in ck.tensors and ck["model.layers.1.self_attn.v_proj.bias"].shape == (32,)


def test_iter_load_fills_caller_buffers_in_file_order(qwen):
    ck = open_checkpoint(qwen)
    bufs = {n: bytearray(t.nbytes + 7) for n, t in ck.tensors.items()}    # larger buffers are fine
    seen = []
    got = [t.name for t in iter_load(reversed(list(ck.tensors.values())), lambda t: bufs[t.name],
                                     progress=lambda done, total, t: seen.append((done, total)))]
    assert sorted(got) == sorted(ck.tensors)
    order = [(ck[n].file, ck[n].offset) for n in got]
    assert order == sorted(order)
    assert seen[-1] == (ck.total_bytes, ck.total_bytes) and len(seen) == len(got)
    for n, t in ck.tensors.items():
        assert bytes(bufs[n][:t.nbytes]) == read_tensor(t).tobytes()
    pinned = np.zeros(ck.total_bytes // 2, np.uint16)           # one host buffer, carved per tensor
    offsets, off = {}, 0
    for n, t in ck.tensors.items():
        offsets[n], off = off, off + t.nbytes // 2
    assert load_all(ck.tensors.values(), lambda t: pinned[offsets[t.name]:offsets[t.name] + t.nbytes // 2]) \
        == ck.total_bytes
    t = ck["model.embed_tokens.weight"]
    np.testing.assert_array_equal(pinned[offsets[t.name]:offsets[t.name] + t.numel].reshape(t.shape),
                                  read_tensor(t))


def test_read_tensor_into_a_buffer_and_short_buffers(tiny):
    t = open_checkpoint(tiny)["model.layers.0.mlp.down_proj.weight"]
    out = np.empty(t.numel, np.uint16)
    view = read_tensor(t, out)
    assert np.shares_memory(view, out) and (view == tensor_values(t.name, t.shape, seed=3)).all()
    with pytest.raises(CheckpointError, match="holds 16 bytes"):
        read_tensor(t, bytearray(16))
    with pytest.raises(CheckpointError, match="read-only"):
        read_tensor(t, bytes(t.nbytes))


def test_missing_tensor(tiny, tmp_path):
    bad = rewrite(tiny, tmp_path / "bad", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.mlp.up_proj.weight") as e:
        open_checkpoint(bad)
    assert e.value.problems == ["missing tensor model.layers.1.mlp.up_proj.weight"]
    assert isinstance(e.value, ValueError)


def test_wrong_shape_names_expected_and_got(tiny, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = rewrite(tiny, tmp_path / "bad", replace={name: ("BF16", bytes(64 * 32 * 2), (64, 32))})
    with pytest.raises(CheckpointError, match=r"q_proj.weight: expected shape \[64, 64\], got \[64, 32\]"):
        open_checkpoint(bad)


@pytest.mark.parametrize("dtype,itemsize", [("F64", 8), ("I32", 4), ("F8_E4M3", 1)])
def test_unsupported_dtype(tiny, tmp_path, dtype, itemsize):
    name = "model.layers.0.mlp.gate_proj.weight"
    bad = rewrite(tiny, tmp_path / "bad", replace={name: (dtype, bytes(128 * 64 * itemsize), (128, 64))})
    with pytest.raises(CheckpointError, match=f"gate_proj.weight has dtype {dtype}; supported: BF16, F16, F32"):
        open_checkpoint(bad)
    info = open_checkpoint(bad, validate=False).tensors[name]
    with pytest.raises(CheckpointError, match=dtype):
        read_tensor(info)


def test_f32_and_f16_checkpoints_are_accepted(tiny, tmp_path):
    name = "model.norm.weight"
    ok = rewrite(tiny, tmp_path / "ok", replace={name: ("F32", np.arange(64, dtype="<f4").tobytes(), (64,))})
    np.testing.assert_array_equal(read_tensor(open_checkpoint(ok)[name]), np.arange(64, dtype=np.float32))


def test_truncated_file(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    f = bad / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match="truncated.*file holds"):
        open_checkpoint(bad)
    with open(f, "r+b") as fh:
        fh.truncate(5)
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(bad)
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match="header says 1000 bytes"):
        read_header(f)


def test_file_shrinking_after_the_header_was_read(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "ck")
    ck = open_checkpoint(tmp_path / "ck")
    with open(tmp_path / "ck" / "model.safetensors", "r+b") as fh:
        fh.truncate(ck["lm_head.weight"].offset + 10)
    with pytest.raises(CheckpointError, match="truncated: tensor lm_head.weight"):
        read_tensor(ck["lm_head.weight"])


def test_index_naming_a_missing_shard(qwen, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(qwen, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} that are not in") as e:
        open_checkpoint(bad)
    assert e.value.problems == [f"missing shard {shard.name}"]


def test_index_placing_a_tensor_in_the_wrong_shard(qwen, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(qwen, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    wm["model.norm.weight"] = next(s for s in wm.values() if s != wm["model.norm.weight"])
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        open_checkpoint(bad)


def test_unexpected_tensor_and_no_weights_and_not_a_directory(tiny, tmp_path):
    extra = {"model.layers.0.mlp.gate_proj.bias": ("BF16", bytes(256), (128,))}
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.mlp.gate_proj.bias"):
        open_checkpoint(rewrite(tiny, tmp_path / "bad", replace=extra))
    ignored = {"model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", bytes(32), (8,))}
    open_checkpoint(rewrite(tiny, tmp_path / "ok", replace=ignored))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        open_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not a directory"):
        open_checkpoint(tiny / "config.json")
    (empty / "config.json").unlink()
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        open_checkpoint(empty)


def test_make_checkpoint_refuses_to_overwrite_by_accident(tiny, tmp_path):
    out = make_checkpoint("tiny", tmp_path / "ck")
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        make_checkpoint("tiny", out, shard_bytes=50_000)
    make_checkpoint("tiny", out, shard_bytes=50_000, overwrite=True)
    assert not (out / "model.safetensors").exists() and len(open_checkpoint(out).files) > 1
    assert not list(out.glob("*.partial"))


def test_tokenizer_is_optional(tiny, tmp_path):
    assert load_tokenizer(tiny) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        assert load_tokenizer(tmp_path) is None


def test_transformers_loads_our_checkpoint(tiny, qwen):
    import torch
    import transformers
    for path in (tiny, qwen):
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **{dtype_kw: torch.bfloat16})
        ck = open_checkpoint(path)
        name = "model.layers.1.self_attn.k_proj.weight"
        theirs = model.state_dict()[name].view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(theirs, read_tensor(ck[name]))
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, ck.config.vocab_size) and torch.isfinite(logits).all()
