"""The prefill walk: a prompt goes through each layer whole (every streamed weight copied once per walk), with the
MLP's up projection and silu(gate)·up computed ``PREFILL_SUB`` tokens at a time, and materialized-score attention
(head_dim 256) a sub-chunk of queries at a time. Checked on the host backend against transformers, with the
sub-chunk made small so that a 40-token prompt takes every path; and how a streamed plan chooses its walk."""

from __future__ import annotations

import pytest
from test_oracle import ATOL_FRAC, COMMON, G, _budgets

from hf_oracle import build_reference, check_against_reference

import vmmstream
from vmmstream import loading
from vmmstream.driver.host import HostDriver
from vmmstream.memory import DeviceMemory
from vmmstream.planning import floor

pytestmark = pytest.mark.unit

PROMPT = [3 + (7 * i) % 120 for i in range(40)]
NEW = 8
SUB = 8


def _memory(budget):
    return DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)


@pytest.fixture
def small_sub(monkeypatch):
    monkeypatch.setattr(floor, "PREFILL_SUB", SUB)
    monkeypatch.setattr(loading, "PREFILL_SUB", SUB)


@pytest.mark.parametrize("head_dim,seed", [(16, 0), (256, 11)])
@pytest.mark.parametrize("walk", [32, 64])
def test_walk_in_parts_matches_transformers_and_streams_once_per_walk(tmp_path, small_sub, head_dim, seed, walk):
    common = {**COMMON, "head_dim": head_dim}
    hf_tokens, hf_logits = build_reference("llama", seed, tmp_path, common, PROMPT, NEW)
    _, half = _budgets(tmp_path)
    mem = _memory(half)
    try:
        with vmmstream.load_model(tmp_path, memory=mem, max_context=64, prefill_chunk=walk) as m:
            assert m.plan.strategy == "streamed" and m.plan.prefill_chunk == walk
            assert m.placement.acts.sub == SUB < walk
            streamed = len(m.plan.streamed)
            before = m.stats()["page_ins"]
            first = m.generate(PROMPT, 1, eos_token_id=[])          # the prefill alone selects the first token
            passes = -(-len(PROMPT) // walk)
            assert m.stats()["page_ins"] - before == streamed * passes
            tokens, logits = m.generate(PROMPT, NEW, return_logits=True, eos_token_id=[])
    finally:
        mem.close()
        mem.driver.close()
    assert first == tokens[:1]
    check_against_reference(f"walk {walk} d{head_dim}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)


def _plan(path, budget, **kw):
    mem = _memory(budget)
    try:
        with vmmstream.load_model(path, memory=mem, **kw) as m:
            return m.plan
    finally:
        mem.close()
        mem.driver.close()


def test_streamed_plan_walks_longer_prompts_resident_longest_that_stays_resident(tmp_path, monkeypatch):
    monkeypatch.setattr(floor, "WALK_SHARE", 2)     # a tiny model's walk is large beside its weights
    build_reference("llama", 0, tmp_path, {**COMMON, "max_position_embeddings": 4096}, [1, 2], 1)
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(tmp_path)
    mc = 2048
    full = make_plan(ck.config, ck.tensors, 1 << 40, granularity=G, max_context=mc,
                     workspace=loading.workspace_peaks(ck.config, mc, 512))
    resident = _plan(tmp_path, 1 << 30, max_context=mc)     # room to spare: the longest resident walk
    assert resident.strategy == "resident" and resident.prefill_chunk == min(mc, loading.RESIDENT_WALK) > 512
    tight = _plan(tmp_path, full.device_bytes + G, max_context=mc)   # a longer walk would stream: it keeps 512
    assert tight.strategy == "resident" and tight.prefill_chunk == floor.PREFILL_CHUNK
    monkeypatch.setattr(floor, "WALK_SHARE", 1 << 20)    # a longer walk's activations past its share of the budget
    assert _plan(tmp_path, 1 << 30, max_context=mc).prefill_chunk == floor.PREFILL_CHUNK
    monkeypatch.setattr(floor, "WALK_SHARE", 2)
    budget = full.floor + full.weight_bytes * 15 // 16
    streamed = _plan(tmp_path, budget, max_context=mc)
    want = floor.streaming_walk(ck.config, mc, 1, G, budget)
    assert streamed.strategy == "streamed" and want > floor.PREFILL_CHUNK
    assert streamed.prefill_chunk == want
    assert any(f"prefill walks {want} tokens" in n for n in streamed.notes)
    assert streamed.device_bytes <= budget
    explicit = _plan(tmp_path, budget, max_context=mc, prefill_chunk=256)
    assert explicit.prefill_chunk == 256 and not any("prefill walks" in n for n in explicit.notes)
    # the walk costs at most its share of the budget more than the default one
    default = _plan(tmp_path, budget, max_context=mc, prefill_chunk=floor.PREFILL_CHUNK)
    assert streamed.activations - default.activations <= budget // floor.WALK_SHARE


def test_streaming_walk_is_bounded_by_its_share_of_the_budget():
    from vmmstream.model.config import ModelConfig
    c = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                               "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                               "num_attention_heads": 24, "num_key_value_heads": 8,
                               "max_position_embeddings": 8192})
    mib = 1 << 20
    walks = [floor.streaming_walk(c, 8192, 1, 2 * mib, b * mib) for b in (128, 1024, 2048, 8192, 1 << 20)]
    assert walks == sorted(walks) and walks[0] == floor.PREFILL_CHUNK and walks[-1] == 8192
    for b, w in zip((128, 1024, 2048, 8192), walks):
        extra = floor.activation_bytes(c, 8192, 1, 2 * mib, w) - floor.activation_bytes(c, 8192, 1, 2 * mib, 512)
        assert extra <= b * mib // floor.WALK_SHARE


def test_attention_and_mlp_buffers_share_one_region(tmp_path):
    # q / k / v / attn live only in a layer's attention half, gate / up only in its MLP half: one region holds
    # both, so a walk costs per token the larger of the two, not their sum (the oracle tests run through it).
    build_reference("llama", 0, tmp_path, COMMON, [1, 2], 1)
    mem = _memory(1 << 30)
    try:
        with vmmstream.load_model(tmp_path, memory=mem, max_context=128) as m:
            a = m.acts
            ends = {n: a.offsets[n] + a._rows(a.spec[n][2], a.tmax) * 2 * a.spec[n][0][0] for n in a.spec
                    if n in ("q", "k", "v", "attn", "gate", "up")}
            assert a.offsets["q"] == a.offsets["gate"]
            assert max(ends[n] for n in ("q", "k", "v", "attn")) > a.offsets["gate"]
            others = [(a.offsets[n], n) for n in a.spec if n not in ends]
            lo, hi = a.offsets["q"], max(ends.values())
            assert not [n for off, n in others if lo <= off < hi]     # nothing else inside the shared region
            assert a.nbytes <= m.plan.activations
    finally:
        mem.close()
        mem.driver.close()


def test_a_4096_token_walk_fits_qwen2_7b_at_2_gib():
    # With the shared region a Qwen2-7B-shaped model walks a 4,096-token prompt at once at 2 GiB (each streamed
    # weight copied once for it); summed buffers allowed only 2,048 within the walk's share of the budget.
    from vmmstream.model.presets import PRESETS
    c = PRESETS["qwen2-7b-12l"].config
    assert floor.streaming_walk(c, 4096 + 64, 1, 2 << 20, 2 << 30) == 4096 + 64     # bench/test_bench_user.py
