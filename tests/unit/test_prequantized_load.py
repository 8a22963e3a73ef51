"""GPTQ and AWQ 4-bit checkpoints (``quantization_config`` in config.json, ``qweight`` / ``qzeros`` / ``scales`` /
``g_idx`` tensors) loaded by ``load_model`` without dequantizing, on the host backend.

The checkpoints are written here from known int4 values: a tiny random Llama from ``transformers`` (the oracle of
``test_quantized_load.py``), each linear weight quantized by ``formats.quantize_int4`` and its codes, zero points
and scales packed by this test's own packers (NumPy shifts over the published bit layouts). transformers runs on
the dequantized weights; the loaded model must give the same greedy tokens and logits within the oracle's
tolerance, resident and streamed, and be the very model ``quantize="int4"`` makes from the bf16 checkpoint:
the same tokens, the same logits bit for bit, the same plan sizes and streamed bytes per token (the 4-bit ones).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hf_oracle import build_reference, check_against_reference
from vmmstream.kernels.matmul.quant.formats import quantize_int4, unpack_nibbles

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory
from vmmstream.model import open_checkpoint
from vmmstream.prequantized import AWQ_ORDER, PrequantizedFormatError
from vmmstream.quantization import is_linear

pytestmark = pytest.mark.unit

G = 64 << 10
NEW = 24
PROMPT = [1, 5, 9, 33, 7, 2]
MC = 64
COMMON = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2}
QC = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
               "checkpoint_format": "gptq"},
      "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}}


def _words(nib: np.ndarray) -> np.ndarray:
    """[..., M, 8] nibbles -> int32 [..., M]: nibble j in bits 4j..4j+3."""
    w = np.zeros(nib.shape[:-1], np.uint32)
    for j in range(8):
        w |= nib[..., j].astype(np.uint32) << np.uint32(4 * j)
    return w.view(np.int32)


def pack(method: str, w: np.ndarray) -> dict:
    """Quantize ``w`` [N, K] and pack it as ``method`` publishes it: {part: array}."""
    packed, scales, zeros = quantize_int4(w)
    q = unpack_nibbles(packed)                                     # [N, K]
    n, k = q.shape
    z = zeros.astype(np.int64)                                     # [N, G]
    assert z.min() >= 1                                            # the original gptq format stores zero - 1
    if method == "gptq":
        return {"qweight": _words(q.T.reshape(k // 8, 8, n).transpose(0, 2, 1)),
                "qzeros": _words((z.T - 1).reshape(k // 128, n // 8, 8)),
                "scales": np.ascontiguousarray(scales.T), "g_idx": (np.arange(k) // 128).astype(np.int32)}
    cols = np.asarray(AWQ_ORDER)
    return {"qweight": _words(q.T.reshape(k, n // 8, 8)[:, :, cols]),
            "qzeros": _words(z.T.reshape(k // 128, n // 8, 8)[:, :, cols]),
            "scales": np.ascontiguousarray(scales.T)}


def write_prequantized(src, out, method: str, qc: dict | None = None, keep=()) -> None:
    """The bf16 checkpoint ``src`` rewritten as a ``method`` checkpoint at ``out`` (tensors named in ``keep`` stay
    bf16)."""
    import torch
    from safetensors.torch import load_file, save_file
    out.mkdir(exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    for name in [n for n in sd if is_linear(n) and n not in keep]:
        w = sd.pop(name).float().numpy()
        for part, arr in pack(method, w).items():
            sd[name.removesuffix(".weight") + "." + part] = torch.from_numpy(arr)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc or QC[method]
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequantized")
    bf16 = root / "bf16"
    tokens, logits = build_reference("llama", 0, bf16, COMMON, PROMPT, NEW, quantize="int4")
    for method in QC:
        write_prequantized(bf16, root / method, method)
    return root, tokens, logits


def _run(path, budget, quantize=None):
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC, quantize=quantize) as model:
            tokens, logits = model.generate(PROMPT, NEW, return_logits=True)
            return model.plan, model.stats(), tokens, logits
    finally:
        mem.close()
        mem.driver.close()


def _full_plan(path, quantize):
    from vmmstream.api import workspace_peaks
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    return make_plan(ck.config, ck.tensors, 1 << 40, granularity=G, max_context=MC,
                     workspace=workspace_peaks(ck.config, MC, MC), quantize=quantize)


def _budget(path, where):
    full = _full_plan(path, "int4")
    return full.floor + full.weight_bytes if where == "resident" else full.floor + full.weight_bytes // 2


@pytest.mark.parametrize("where", ["resident", "streamed"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_prequantized_checkpoint_runs_its_int4_weights_as_stored(reference, method, where):
    root, hf_tokens, hf_logits = reference
    budget = _budget(root / "bf16", where)
    plan, stats, tokens, logits = _run(root / method, budget)
    assert plan.strategy == where and plan.quantization == "int4"
    assert any(f"{method} checkpoint: 14 4-bit linear weights repacked" in n for n in plan.notes)
    q = stats["quantization"]
    assert q["tensors"] == q["repacked"] == 14 and q["rel_rms_error"] == 0 and not q["kept_bf16"]
    assert stats["conversion"] == {method: {"tensors": 14, "stored_as": "int4", "max_abs_error": 0.0,
                                            "worst_rel_rms_error": 0.0, "worst_tensor": stats["conversion"][method]
                                            ["worst_tensor"], "rel_rms_error": 0.0, "exact": True}}
    check_against_reference(f"{method}/{where}", tokens, logits, hf_tokens, hf_logits, 0.02)
    # the very model quantize="int4" makes of the bf16 checkpoint: same bytes on the device, same results
    plan_q, _, tokens_q, logits_q = _run(root / "bf16", budget, quantize="int4")
    assert tokens == tokens_q
    np.testing.assert_array_equal(logits, logits_q)
    assert plan.weight_bytes == plan_q.weight_bytes and plan.resident_bytes == plan_q.resident_bytes
    assert plan.streamed_bytes_per_token == plan_q.streamed_bytes_per_token
    if where == "streamed":
        assert stats["measured_streamed_bytes_per_step"] == plan.streamed_bytes_per_token > 0
        bf16 = sum(p.payload for p in _full_plan(root / "bf16", None).placements if is_linear(p.name))
        int4 = sum(p.payload for p in plan.placements if is_linear(p.name))
        assert int4 * 3 < bf16 and plan.streamed_bytes_per_token <= int4 + sum(
            p.payload for p in plan.placements if p.where == "streamed" and not is_linear(p.name))


def test_quantize_of_another_kind_is_refused(reference):
    root = reference[0]
    with pytest.raises(ValueError, match="gptq checkpoint whose layer weights are int4 already"):
        _run(root / "gptq", 1 << 28, quantize="mxfp4")


@pytest.mark.parametrize("change, match", [
    ({"desc_act": True}, "act-order"),
    ({"bits": 8}, "bits 8"),
    ({"group_size": 64}, "group_size 64"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
])
def test_configs_we_cannot_run_exactly_are_refused_before_any_work(reference, tmp_path, change, match):
    root = reference[0]
    shutil.copytree(root / "gptq", tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrequantizedFormatError, match=match):
        open_checkpoint(tmp_path / "ck")


def test_layouts_we_cannot_run_exactly_are_refused_naming_the_tensor(reference, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    root = reference[0]
    shutil.copytree(root / "gptq", tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    sd = load_file(str(f))
    name = "model.layers.1.mlp.down_proj.g_idx"
    sd[name] = torch.from_numpy(np.random.default_rng(0).permutation(256).astype(np.int32) // 128)
    save_file(sd, str(f))
    with pytest.raises(PrequantizedFormatError, match=r"model\.layers\.1\.mlp\.down_proj \(gptq\): g_idx.*act-order"):
        _run(tmp_path / "ck", 1 << 28)
    # a layer weight left unquantized: refused before the weights are read
    write_prequantized(root / "bf16", tmp_path / "mixed", "awq", keep=("model.layers.0.mlp.up_proj.weight",))
    with pytest.raises(PrequantizedFormatError, match=r"stored unquantized \(e\.g\. model\.layers\.0\.mlp\.up_proj"):
        _run(tmp_path / "mixed", 1 << 28)


def test_vmmstream_plan_sizes_a_prequantized_checkpoint_as_int4(reference, capsys):
    from vmmstream.cli import main
    root = reference[0]
    want = _full_plan(root / "bf16", "int4")
    assert main(["plan", str(root / "gptq"), "--budget", "1GiB", "--json", "--max-context", str(MC),
                 "--granularity", "64KiB"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["quantization"] == "int4" and d["weight_bytes"] == want.weight_bytes
