"""Mixture-of-experts models on the host backend against Hugging Face transformers (CPU torch, float32).

Tiny random Mixtral and Qwen2-MoE (shared expert with its sigmoid gate; ``norm_topk_prob`` off and on),
6 experts, top-2, built with ``transformers`` and saved in bf16 (per-expert tensors, the checkpoint layout).
The routers are scaled up so the top-2 choices are decisive rather than decided by rounding. Same bar as
``test_oracle.py``: every step's logits within 2 % of its max |logit| and all 32 greedy tokens equal — fully
resident, and at a budget that streams (experts included, through the slots, in schedule order).
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import build_reference

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory

pytestmark = pytest.mark.unit

G = 16 << 10
NEW = 32
PROMPT = [1, 5, 9, 33, 7, 2]
ATOL_FRAC = 0.02
MC = 64
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.02, bos_token_id=1, eos_token_id=2)
SEEDS = {"mixtral": 3, "qwen2-moe": 0, "qwen2-moe-norm": 0}   # greedy margins above rounding


@pytest.fixture(scope="module", params=list(SEEDS))
def reference(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    tokens, logits = build_reference(arch, SEEDS[arch], out, COMMON, PROMPT, NEW)
    return arch, out, tokens, logits


def _full_plan(path):
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    ws = workspace_peaks(ck.config, MC, MC)
    return ck, make_plan(ck.config, ck.tensors, 1 << 40, granularity=G, max_context=MC, workspace=ws)


def _run(path, budget):
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC) as model:
            tokens, logits = model.generate(PROMPT, NEW, return_logits=True)
            return model.plan, model.stats(), tokens, logits
    finally:
        mem.close()
        mem.driver.close()


@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_moe_greedy_tokens_and_logits_match_transformers(reference, where):
    arch, path, hf_tokens, hf_logits = reference
    ck, full = _full_plan(path)
    assert ck.config.is_moe and ck.config.num_experts == 6
    budget = full.floor + full.weight_bytes if where == "resident" else full.floor + full.weight_bytes // 2
    plan, stats, tokens, logits = _run(path, budget)
    assert plan.strategy == where
    if where == "streamed":
        experts = [n for n in plan.streamed if ".experts." in n]
        assert experts, "the streamed plan should stream some experts"
        assert stats["measured_streamed_bytes_per_step"] == plan.streamed_bytes_per_token
    k = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), NEW)
    tol = ATOL_FRAC * np.abs(hf_logits).max(axis=1, keepdims=True)
    err = np.abs(logits - hf_logits)[:k + 1]
    assert np.all(err <= tol[:k + 1]), f"{arch}: worst step error {err.max():.4f} > tolerance {tol.min():.4f}"
    assert k == NEW, f"{arch}: greedy tokens differ first at new token {k}"
    assert len(set(hf_tokens)) > 3, "a trajectory, not a fixed point"


def test_moe_config_parsing_and_refusals(tmp_path):
    import json

    from vmmstream.model import UnsupportedModelError, load_config
    base = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    (tmp_path / "config.json").write_text(json.dumps(base))
    c = load_config(tmp_path)
    assert c.is_moe and c.num_experts == 4 and c.shared_expert_intermediate_size == 24 and not c.norm_topk_prob
    names = c.layer_tensor_shapes(1)
    assert names["model.layers.1.mlp.gate.weight"] == (4, 32)
    assert names["model.layers.1.mlp.experts.3.down_proj.weight"] == (32, 16)
    assert names["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 32)
    assert "model.layers.1.mlp.gate_proj.weight" not in names
    for bad, match in ((dict(mlp_only_layers=[0]), "dense layers"), (dict(num_experts_per_tok=5), "exceeds"),
                       (dict(num_experts=0), "num_experts")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **bad}))
        with pytest.raises(UnsupportedModelError, match=match):
            load_config(tmp_path)
    mix = dict(base, architectures=["MixtralForCausalLM"], num_local_experts=8)
    for k in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
        mix.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(mix))
    c = load_config(tmp_path)
    assert c.num_experts == 8 and c.moe_intermediate_size == 64 and c.norm_topk_prob
    assert c.expert_names(0, 7) == tuple(f"model.layers.0.block_sparse_moe.experts.7.{w}.weight"
                                         for w in ("w1", "w3", "w2"))
