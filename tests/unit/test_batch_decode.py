"""Many sequences per decode step (``load_model(..., max_batch=B)``, ``generate([...])``) on the host backend: each
sequence of a batch gets the tokens (and logits) it gets alone, resident and streamed, bf16 and int4, dense and
mixtures of experts, prompts of
different lengths finishing at different steps, more prompts than slots (joining as slots free); KV pages are
mapped per sequence and unmapped when it leaves."""

from __future__ import annotations

import numpy as np
import pytest
from hf_oracle import build_reference
from test_oracle import COMMON, G

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.errors import VmmstreamError
from vmmstream.memory import DeviceMemory

pytestmark = pytest.mark.unit

MC = 64
PROMPTS = [[1, 5, 9, 33, 7, 2], [3, 4], list(range(10, 31)), [7] * 9, [100, 17, 5]]
NEWS = [12, 5, 9, 12, 7]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch")
    build_reference("llama", 0, out, COMMON, [1, 2], 1)
    return out


def _budgets(path, batch):
    from vmmstream.loading import plan_walked
    from vmmstream.model import open_checkpoint
    ck = open_checkpoint(path)
    full = plan_walked(ck.config, ck.tensors, 1 << 40, backend="host", granularity=G, max_context=MC, batch=batch)
    return full.floor + full.weight_bytes, full.floor + full.weight_bytes // 2


def _load(path, budget, **kw):
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)
    return mem, vmmstream.load_model(path, memory=mem, max_context=MC, **kw)


@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_each_sequence_of_a_batch_gets_what_it_gets_alone(ckpt, where, quantize):
    resident, half = _budgets(ckpt, 3)
    budget = resident if where == "resident" else half
    mem, m = _load(ckpt, budget, max_batch=3, quantize=quantize)
    try:
        assert m.plan.strategy == where and m.plan.batch == 3
        alone = [m.generate(p, k, return_logits=True, eos_token_id=[]) for p, k in zip(PROMPTS, NEWS)]
        kv0 = m.placement.batch_kv.committed()
        together = [m.generate(PROMPTS, NEWS[i], return_logits=True, eos_token_id=[]) for i in (0,)][0]
        # five prompts, three slots: two join as the first ones finish; every prompt its own max_new_tokens
        mixed = m.generate(PROMPTS, 12, eos_token_id=[])
        assert m.placement.batch_kv.committed() <= kv0       # every sequence's pages unmapped when it left
    finally:
        m.close()
        mem.close()
    for (tokens, logits), (want, want_logits) in zip(together, alone):
        k = min(len(want), NEWS[0])
        assert tokens[:k] == want[:k]
        scale = np.max(np.abs(want_logits[:k]))
        assert np.max(np.abs(logits[:k] - want_logits[:k])) <= 1e-3 * scale
    for got, (want, _), k in zip(mixed, alone, NEWS):
        assert got[:k] == want


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
def test_a_mixture_of_experts_batch_gives_each_sequence_its_own_tokens(tmp_path, arch):
    """Each token of a step routes to its own experts: resident, and streamed with the experts gathered on demand
    (the CUDA steps of that case run the host-driven rounds over the slots, eagerly); tokens and logits equal
    each sequence's alone."""
    build_reference(arch, 0, tmp_path, COMMON, [1, 2], 1)
    resident, half = _budgets(tmp_path, 3)
    for budget, on_demand in ((resident, False), (half, True)):
        mem, m = _load(tmp_path, budget, max_batch=3)
        try:
            assert (m.plan.experts.slots > 0) == on_demand
            alone = [m.generate(p, k, return_logits=True, eos_token_id=[]) for p, k in zip(PROMPTS, NEWS)]
            together = m.generate(PROMPTS, 12, return_logits=True, eos_token_id=[])
            assert m.stats()["packed_prefills"] > 0       # the joining prompts routed and prefilled together
        finally:
            m.close()
            mem.close()
        for (tokens, logits), (want, want_logits), k in zip(together, alone, NEWS):
            assert tokens[:k] == want, (arch, on_demand)
            scale = np.max(np.abs(want_logits))
            assert np.max(np.abs(logits[:k] - want_logits)) <= 1e-3 * scale


def test_joining_prompts_prefill_together_streaming_each_weight_once(ckpt):
    """Three prompts that join together take one walk through the layers: streamed, the weights are copied once
    for the three (not once per prompt); each still gets its own first tokens, sampled ones their own draws."""
    _, half = _budgets(ckpt, 3)
    mem, m = _load(ckpt, half, max_batch=3)
    try:
        assert m.plan.strategy == "streamed"
        prompts, seeds = PROMPTS[:3], [4, 5, 6]
        alone = [m.generate(p, 6, eos_token_id=[]) for p in prompts]
        drawn = [m.generate(p, 6, eos_token_id=[], temperature=0.8, top_k=20, seed=sd) for p, sd in zip(prompts, seeds)]
        before = m.stats()
        together = m.generate(prompts, 1, eos_token_id=[])
        after = m.stats()
        sampled = m.generate(prompts, 6, eos_token_id=[], temperature=0.8, top_k=20, seed=seeds)
        greedy = m.generate(prompts, 6, eos_token_id=[])
    finally:
        m.close()
        mem.close()
    assert after["packed_prefills"] - before["packed_prefills"] == 1
    assert after["page_ins"] - before["page_ins"] == len(m.plan.streamed)      # one pass for the three prompts
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert greedy == alone and sampled == drawn


def test_packed_prefill_with_materialized_attention_scores(tmp_path, monkeypatch):
    """head_dim 40 (no fused attention route): the plan has a step workspace for 4 query rows, and a packed
    prefill attends each prompt's rows 4 at a time over its own slot; tokens and logits equal each prompt's alone."""
    from vmmstream import loading
    from vmmstream.planning import floor
    monkeypatch.setattr(floor, "PREFILL_SUB", 4)
    monkeypatch.setattr(loading, "PREFILL_SUB", 4)
    build_reference("llama", 3, tmp_path, dict(COMMON, head_dim=40), [1, 2], 1)
    resident, _ = _budgets(tmp_path, 3)
    mem, m = _load(tmp_path, resident, max_batch=3)
    try:
        assert m.plan.workspace["step"] > 0 and m.acts.sub == 4
        alone = [m.generate(p, 5, return_logits=True, eos_token_id=[]) for p in PROMPTS[:3]]
        together = m.generate(PROMPTS[:3], 5, return_logits=True, eos_token_id=[])
        assert m.stats()["packed_prefills"] == 1
    finally:
        m.close()
        mem.close()
    for (tokens, logits), (want, want_logits) in zip(together, alone):
        assert tokens == want
        assert np.max(np.abs(logits - want_logits)) <= 1e-3 * np.max(np.abs(want_logits))


def test_a_join_the_memory_refuses_leaves_the_others_joined(ckpt, monkeypatch):
    """Three prompts join together; the third one's pages are refused: the first two still join (and prefill
    together), the third joins at the next try, and every answer is its own."""
    from vmmstream.errors import CapacityError
    resident, _ = _budgets(ckpt, 3)
    mem, m = _load(ckpt, resident, max_batch=3)
    try:
        alone = [m.generate(p, 6, eos_token_id=[]) for p in PROMPTS[:3]]
        kv = m.placement.batch_kv
        ensure, calls = kv.ensure, []

        def refuse_the_third(s, positions):
            calls.append(s)
            if len(calls) == 3:
                raise CapacityError("held elsewhere", requested=positions, budget=0)
            return ensure(s, positions)
        monkeypatch.setattr(kv, "ensure", refuse_the_third)
        before = m.stats()["packed_prefills"]
        got = m.generate(PROMPTS[:3], 6, eos_token_id=[])
        packed = m.stats()["packed_prefills"] - before
    finally:
        m.close()
        mem.close()
    assert got == alone and len(calls) == 4 and packed == 1


def test_a_failed_join_leaves_no_sequence_of_its_group_behind(ckpt, monkeypatch):
    """Joins that cannot be packed (a prompt longer than the walk) go one by one; when a later one fails with
    something other than a refusal of memory, the ones before it leave too: no slot or page is kept by a sequence
    nobody holds."""
    from vmmstream.execution.batch import BatchDecoder
    resident, _ = _budgets(ckpt, 3)
    mem, m = _load(ckpt, resident, max_batch=3)
    try:
        dec = BatchDecoder(m.engine, m.placement.batch_kv)
        monkeypatch.setattr(m.engine.acts, "tmax", 8)          # the 21-token prompt is longer than the walk
        with m._lock, pytest.raises(VmmstreamError):
            dec.add_many([(PROMPTS[2], 4, {}), ([3, 4], 10 * MC, {})])     # the second asks past max_context
        assert dec.free_slots() == 3 and m.placement.batch_kv.committed() == 0
        dec.close()
    finally:
        m.close()
        mem.close()


def test_sequences_stop_at_their_own_stop_ids_and_the_batch_goes_on(ckpt):
    resident, _ = _budgets(ckpt, 4)
    mem, m = _load(ckpt, resident, max_batch=4)
    try:
        alone = [m.generate(p, 16, eos_token_id=[]) for p in PROMPTS[:4]]
        stop = alone[1][2]                                    # the third new token of prompt 1
        together = m.generate(PROMPTS[:4], 16, eos_token_id=[stop])
    finally:
        m.close()
        mem.close()
    for got, want in zip(together, alone):
        cut = next((i for i, t in enumerate(want) if t == stop), None)
        assert got == (want if cut is None else want[:cut + 1])
    assert len(together[1]) == 3


def test_a_batch_plan_holds_a_kv_range_per_sequence(ckpt):
    from vmmstream.loading import plan_walked
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import floor
    ck = open_checkpoint(ckpt)
    one = plan_walked(ck.config, ck.tensors, 1 << 40, backend="host", granularity=G, max_context=MC)
    four = plan_walked(ck.config, ck.tensors, 1 << 40, backend="host", granularity=G, max_context=MC, batch=4)
    row = 2 * ck.config.num_hidden_layers * ck.config.num_key_value_heads * ck.config.head_dim * 2
    stride = floor.slot_stride(MC, row, G)
    assert stride >= MC and stride * row % G == 0
    assert four.kv_bytes == 4 * stride * row >= 4 * one.kv_bytes - 4 * G


def test_a_list_of_prompts_needs_a_batch_model_and_greedy(ckpt):
    resident, _ = _budgets(ckpt, 1)
    mem, m = _load(ckpt, resident)
    try:
        with pytest.raises(TypeError, match="max_batch > 1"):
            m.generate(PROMPTS[:2], 4)
        assert m.generate(PROMPTS[0], 3, eos_token_id=[])          # one prompt of ids is not a list of prompts
    finally:
        m.close()
        mem.close()
    mem, m = _load(ckpt, resident * 2, max_batch=2)
    try:
        with pytest.raises(VmmstreamError, match="no tokenizer"):
            m.generate(PROMPTS[:2], 4, stop=["x"])
    finally:
        m.close()
        mem.close()


def test_a_batch_step_is_captured_once_per_size_and_replayed(ckpt):
    """The first step of n sequences runs eagerly, the next ones replay its captured graph (streamed weights
    included): the tokens stay those of each prompt alone."""
    _, half = _budgets(ckpt, 3)
    mem, m = _load(ckpt, half, max_batch=3)
    try:
        alone = [m.generate(p, 10, eos_token_id=[]) for p in PROMPTS[:3]]
        c0 = dict(m.engine.counters)
        together = m.generate(PROMPTS[:3], 10, eos_token_id=[])
        again = m.generate(PROMPTS[:3], 10, eos_token_id=[])
        c = m.engine.counters
        assert c["batch_graph_captures"] - c0["batch_graph_captures"] == 1    # n = 3 throughout
        assert c["batch_graph_replays"] - c0["batch_graph_replays"] == 2 * 9 - 1     # the first step eager
    finally:
        m.close()
        mem.close()
    assert together == alone and again == alone


def test_refusals_of_a_batch(ckpt):
    """A join past max_context is refused before any page is mapped; a max_batch the prefill buffers cannot
    hold is refused at load."""
    from vmmstream.errors import ContextLengthError
    from vmmstream.execution.batch import BatchDecoder
    resident, _ = _budgets(ckpt, 2)
    mem, m = _load(ckpt, resident, max_batch=2)
    try:
        dec = BatchDecoder(m.engine, m.placement.batch_kv)
        before = m.placement.batch_kv.committed()
        with pytest.raises(ContextLengthError):
            dec.add(list(range(1, 61)), 10)
        with pytest.raises(ContextLengthError):
            dec.add([], 3)
        assert m.placement.batch_kv.committed() == before and dec.free_slots() == 2
    finally:
        m.close()
        mem.close()
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), 1 << 28)
    try:
        with pytest.raises(ValueError, match="max_batch=20"):
            vmmstream.load_model(ckpt, memory=mem, max_context=MC, max_batch=20, prefill_chunk=16)
    finally:
        mem.close()


def test_sampled_sequences_of_a_batch_draw_what_they_draw_alone(ckpt):
    """Each sequence with its own seed, and with top-k / top-p: the same tokens as the same call alone."""
    _, half = _budgets(ckpt, 3)
    mem, m = _load(ckpt, half, max_batch=3)
    try:
        seeds = [11, 12, 13, 14]
        alone = [m.generate(p, 10, temperature=0.8, seed=sd, eos_token_id=[]) for p, sd in zip(PROMPTS, seeds)]
        together = m.generate(PROMPTS[:4], 10, temperature=0.8, seed=seeds, eos_token_id=[])
        assert together == alone
        assert len({tuple(t) for t in together}) > 1
        alone_k = [m.generate(p, 10, temperature=1.2, top_k=20, top_p=0.9, seed=5, eos_token_id=[])
                   for p in PROMPTS[:2]]
        assert m.generate(PROMPTS[:2], 10, temperature=1.2, top_k=20, top_p=0.9, seed=5, eos_token_id=[]) == alone_k
        greedy = m.generate(PROMPTS[:2], 10, temperature=1.0, seed=[1, 2], eos_token_id=[])
        assert greedy != m.generate(PROMPTS[:2], 10, eos_token_id=[])   # sampling draws, not argmax
        with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
            m.generate(PROMPTS[:3], 4, temperature=1.0, seed=[1, 2])
    finally:
        m.close()
        mem.close()


def test_steps_run_at_power_of_two_buckets_and_warm_takes_them_all_before_any_request(ckpt):
    """Three sequences in five slots step as four (the fourth row free: it reads and writes nothing); after
    ``warm()`` a batch of every size replays graphs captured there — no capture, no eager decode step, while
    each sequence still gets its own tokens."""
    from vmmstream.execution.batch import BatchDecoder
    resident, _ = _budgets(ckpt, 5)
    mem, m = _load(ckpt, resident, max_batch=5)
    try:
        alone = [m.generate(p, 12, eos_token_id=[]) for p in PROMPTS]
        drawn_alone = [m.generate(p, 12, eos_token_id=[], temperature=0.8, top_k=20, seed=i)
                       for i, p in enumerate(PROMPTS)]
        dec = BatchDecoder(m.engine, m.placement.batch_kv)
        assert [dec.bucket(n) for n in range(1, 6)] == [1, 2, 4, 4, 5] and dec.buckets() == [1, 2, 4, 5]
        dec.close()
        m.engine.batch_graphs.clear()
        m.engine.batch_seen.clear()
        three = m.generate(PROMPTS[:3], 12, eos_token_id=[])
        assert (3, False) not in m.engine.batch_graphs and m.engine.batch_graphs.get((4, False)) is not None
        dec = BatchDecoder(m.engine, m.placement.batch_kv)
        idle = m.placement.batch_kv.committed()
        w = dec.warm()
        dec.close()
        assert w == {"buckets": [1, 2, 4, 5], "joins": True}
        assert all(m.engine.batch_graphs.get((n, s)) is not None for n in (1, 2, 4, 5) for s in (False, True))
        assert m.placement.batch_kv.committed() == idle         # the warm-up's sequences left
        c0 = dict(m.engine.counters)
        together = m.generate(PROMPTS, 12, eos_token_id=[])
        c = m.engine.counters
        assert c["batch_graph_captures"] == c0["batch_graph_captures"]
        assert c["eager_steps"] - c0["eager_steps"] == c["packed_prefills"] - c0["packed_prefills"]
        c0 = dict(c)          # draws too: the sampled steps replay the graphs captured with free rows
        drawn = m.generate(PROMPTS, 12, eos_token_id=[], temperature=0.8, top_k=20, seed=list(range(5)))
        assert c["batch_graph_captures"] == c0["batch_graph_captures"]
        assert c["batch_graph_replays"] - c0["batch_graph_replays"] == 11
        # greedy and drawing rows in one step, leaving at different steps (the bucket shrinks from 4 to 2 to 1)
        mixed_alone = [m.generate(PROMPTS[0], 9, eos_token_id=[]),
                       m.generate(PROMPTS[1], 3, eos_token_id=[], temperature=1.1, top_p=0.9, seed=4),
                       m.generate(PROMPTS[2], 6, eos_token_id=[], temperature=0.7, top_k=5, seed=9)]
        dec = BatchDecoder(m.engine, m.placement.batch_kv)
        seqs = [dec.add(PROMPTS[0], 9), dec.add(PROMPTS[1], 3, sampling=(1.1, 0, 0.9), seed=4),
                dec.add(PROMPTS[2], 6, sampling=(0.7, 5, 1.0), seed=9)]
        sizes = []
        while dec.active():
            sizes.append(dec.bucket(1 + max(q.slot for q in dec.active())))
            dec.step()
        mixed = [q.tokens for q in seqs]
        # the same three joining together: one packed prefill, its first draws in one launch, greedy row kept
        packed = dec.add_many([(PROMPTS[0], 9, {}), (PROMPTS[1], 3, dict(sampling=(1.1, 0, 0.9), seed=4)),
                               (PROMPTS[2], 6, dict(sampling=(0.7, 5, 1.0), seed=9))])
        while dec.active():
            dec.step()
        dec.close()
        mixed_packed = [q.tokens for q in packed]
    finally:
        m.close()
        mem.close()
    assert three == alone[:3]
    assert together == alone
    assert drawn == drawn_alone
    assert mixed == mixed_alone and sizes[0] == 4 and sizes[-1] == 1
    assert mixed_packed == mixed_alone
