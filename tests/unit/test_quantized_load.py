"""Quantize at load (``load_model(..., quantize="int4" | "mxfp4")``) on the host backend.

Oracle: a tiny random Llama, Qwen2 and Phi-3 from ``transformers`` (hidden 128, intermediate 256, so every linear
weight's input dim is a multiple of both groups), saved in bf16. transformers then runs in float32 on the
*dequantized* weights — each linear weight replaced by dequantize(quantize(w)), exact in fp32 — which are
the weights our quantized kernels compute with; so, as in ``test_oracle.py``, our error is activation
rounding only and the same tolerance (2 % of the step's max |logit|) applies; greedy tokens must be equal
for all 32 new tokens. Resident and at a budget that streams (quantized payloads through the slots).
Also: the plan and the streamed bytes use the quantized sizes, the error report, bad arguments.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import build_reference, check_against_reference

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory
from vmmstream.quantization import layout, quantizable

pytestmark = pytest.mark.unit

G = 64 << 10
NEW = 32
PROMPT = [1, 5, 9, 33, 7, 2]
ATOL_FRAC = 0.02
MC = 64
COMMON = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.02, bos_token_id=1, eos_token_id=2)
CASES = [("llama", "int4", 0), ("llama", "mxfp4", 3), ("qwen2", "int4", 1),     # seeds: greedy margins above rounding
         ("phi3", "int4", 7), ("phi3-partial", "mxfp4", 1)]     # Phi-3: q/k/v, gate/up split from fused tensors


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{q}" for a, q, _ in CASES])
def reference(request, tmp_path_factory):
    arch, kind, seed = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{kind}")
    tokens, logits = build_reference(arch, seed, out, COMMON, PROMPT, NEW, quantize=kind)
    return arch, kind, out, tokens, logits


def _plan(path, budget, kind):
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    ws = workspace_peaks(ck.config, MC, MC)
    return ck, make_plan(ck.config, ck.tensors, budget, granularity=G, max_context=MC, workspace=ws, quantize=kind)


def _run(path, budget, kind):
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC, quantize=kind) as model:
            tokens, logits = model.generate(PROMPT, NEW, return_logits=True)
            return model.plan, model.stats(), tokens, logits
    finally:
        mem.close()
        mem.driver.close()


@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_quantized_greedy_tokens_and_logits_match_transformers_on_dequantized_weights(reference, where):
    arch, kind, path, hf_tokens, hf_logits = reference
    _, full = _plan(path, 1 << 40, kind)
    budget = full.floor + full.weight_bytes if where == "resident" else full.floor + full.weight_bytes // 2
    plan, stats, tokens, logits = _run(path, budget, kind)
    assert plan.strategy == where and plan.quantization == kind
    q = stats["quantization"]
    assert q["kind"] == kind and q["tensors"] == 7 * COMMON["num_hidden_layers"] and not q["kept_bf16"]
    assert 0 < q["rel_rms_error"] < (0.15 if kind == "int4" else 0.2)
    assert q["bytes_quantized"] < q["bytes_bf16"] / 3
    if where == "streamed":
        assert stats["measured_streamed_bytes_per_step"] == plan.streamed_bytes_per_token > 0
    check_against_reference(f"{arch}/{kind}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)


def test_quantization_changes_the_result(reference):
    """The reference side matters: bf16 transformers (no quantization) decodes other logits than ours."""
    arch, kind, path, _, hf_q_logits = reference
    _, full = _plan(path, 1 << 40, kind)
    _, _, _, logits = _run(path, full.floor + full.weight_bytes, None)       # our bf16 run
    assert np.abs(logits[0] - hf_q_logits[0]).max() > ATOL_FRAC * np.abs(hf_q_logits[0]).max()


def test_plan_sizes_are_the_quantized_layouts(reference):
    _, kind, path, _, _ = reference
    ck, p = _plan(path, 1 << 40, kind)
    _, dense = _plan(path, 1 << 40, None)
    n_q = 0
    for pl in p.placements:
        shape = ck.tensors[pl.name].shape
        if quantizable(pl.name, shape, kind):
            n_q += 1
            assert pl.payload == layout(kind, shape).total < 2 * int(np.prod(shape)) / 3
        else:
            assert pl.payload == dense.placement(pl.name).payload
    assert n_q == 7 * COMMON["num_hidden_layers"]
    assert any(kind in note for note in p.notes)
    # a streamed plan: bytes per token are the streamed tensors' quantized payloads
    _, sp = _plan(path, p.floor + p.weight_bytes // 2, kind)
    assert sp.streamed_bytes_per_token == sum(x.payload for x in sp.placements if x.where == "streamed")


def test_bad_quantize_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="quantize='int8'"):
        vmmstream.load_model(tmp_path / "nothing-here", quantize="int8")


def test_layers_whose_input_dim_is_not_a_group_multiple_stay_bf16():
    assert quantizable("model.layers.0.mlp.down_proj.weight", (64, 256), "int4")
    assert not quantizable("model.layers.0.mlp.down_proj.weight", (64, 96), "int4")     # 96 % 128
    assert quantizable("model.layers.0.mlp.down_proj.weight", (64, 96), "mxfp4")        # 96 % 32 == 0
    assert not quantizable("lm_head.weight", (128, 256), "int4")
    assert not quantizable("model.layers.0.self_attn.q_proj.bias", (128,), "int4")
    assert not quantizable("model.layers.0.mlp.down_proj.weight", (64, 256), None)
