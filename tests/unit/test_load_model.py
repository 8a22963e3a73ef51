"""load_model on the host backend: plans, streaming through aliased slots, the captured decode graph, counters,
legacy, typed errors with rollback, context exhaustion, the CLI. The host backend makes real mappings (memfd +
mmap), so streaming, aliasing and graph replay are exercised for real; kernels are the NumPy references."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import vmmstream
from vmmstream.cli import main
from vmmstream.driver.host import HostDriver
from vmmstream.errors import (BudgetError, CapacityError, ContextLengthError, DriverError, VmmstreamError)
from vmmstream.memory import DeviceMemory
from vmmstream.model import CheckpointError, UnsupportedModelError, make_checkpoint

G = 16 << 10          # a small granularity: the tiny presets' tensors span one or a few granules
MC = 64               # max_context
PROMPT = [1, 7, 42, 3, 99]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def tiny_d24(tmp_path_factory):
    """The tiny preset at head_dim 24 (not a multiple of 16): prefill takes the materialized route, with a step
    workspace."""
    import dataclasses
    from vmmstream.model import get_preset
    cfg = dataclasses.replace(get_preset("tiny").config, head_dim=24)
    return make_checkpoint(cfg, tmp_path_factory.mktemp("tiny_d24"), seed=3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_checkpoint("qwen2-tiny", tmp_path_factory.mktemp("qwen"), seed=4)


def memory(budget, g=G):
    return DeviceMemory(HostDriver(granularity=g, total_bytes=1 << 30), budget)


def budgets(path, g=G, mc=MC):
    """(fits, half the weights, the floor: the smallest budget any plan fits in)."""
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    ws = workspace_peaks(ck.config, mc, mc)
    full = make_plan(ck.config, ck.tensors, 1 << 40, granularity=g, max_context=mc, workspace=ws)
    with pytest.raises(CapacityError) as e:
        make_plan(ck.config, ck.tensors, 1, granularity=g, max_context=mc, workspace=ws)
    return full.floor + full.weight_bytes, full.floor + full.weight_bytes // 2, e.value.requested


def run(path, budget, *, new=24, g=G, **gen):
    mem = memory(budget, g)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC) as m:
            out = m.generate(PROMPT, new, **gen)
            return out, m.plan, m.stats()
    finally:
        mem.close()
        mem.driver.close()


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_i10_greedy_tokens_identical_fitting_half_and_floor(which, request):
    path = request.getfixturevalue(which)
    fits, half, floor = budgets(path)
    results = {}
    for name, b in (("fits", fits), ("half", half), ("floor", floor)):
        ids, plan, stats = run(path, b)
        results[name] = (ids, plan.strategy, plan.streamed_bytes_per_token)
        assert stats["committed"] <= b and stats["peak_committed"] <= b          # I1
    assert results["fits"][1] == "resident" and results["fits"][2] == 0
    assert results["half"][1] == results["floor"][1] == "streamed"
    assert 0 < results["half"][2] < results["floor"][2]
    assert results["fits"][0] == results["half"][0] == results["floor"][0]


def test_i10_a_missing_slot_copy_changes_the_tokens(tiny):
    """The copies matter: leave one out of every step and the floor plan decodes something else."""
    fits, _, floor = budgets(tiny)
    good, _, _ = run(tiny, fits)
    mem = memory(floor)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            m.engine.streamer.skip = 3
            m.engine.graphs.clear()             # recapture without that copy
            assert m.generate(PROMPT, 24) != good
    finally:
        mem.close()


def test_counters_streamed_bytes_replays_and_zero_vmm_calls_per_token(tiny):
    _, half, _ = budgets(tiny)
    mem = memory(half)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            p = m.plan
            s0 = m.stats()
            assert s0["graph_captures"] == 1 and s0["graph_replays"] == 0 and s0["page_ins"] == len(p.streamed)
            m.generate(PROMPT, 20)
            m.generate(PROMPT[:2], 11)
            s = m.stats()
            assert s["decode_tokens"] == 19 + 10 == s["graph_replays"]
            assert s["prefill_tokens"] == len(PROMPT) + 2
            assert s["measured_streamed_bytes_per_step"] == p.streamed_bytes_per_token > 0
            steps = 1 + 2 + s["graph_replays"]               # warm-up, two prefills, replays
            assert s["page_ins"] == steps * len(p.streamed)
            assert s["page_in_bytes"] == steps * p.streamed_bytes_per_token
            assert s["vmm_calls_decode"] == 0 and s["vmm_calls_per_decode_token"] == 0
            assert 0 < s["byte_hit_rate"] < 1
            assert s["h2d_device_ms"] > 0 and s["h2d_gbps"] > 0 and s["decode_device_ms"] > 0
            assert s["graph_captures"] == 1
            assert "streamed" in m.memory_report() and "plan: streamed" in str(m.plan)
    finally:
        mem.close()


def test_decode_fuses_qkv_and_gate_up_only_when_their_streamed_tensors_fit_the_slots(qwen):
    """q/k/v (+ biases) go in one launch and gate/up/silu in another, unless the group streams more tensors
    than there are slots (it could never be filled at once); fused or not, the tokens are the same."""
    from vmmstream.model import open_checkpoint
    cfg = open_checkpoint(qwen).config
    _, _, floor = budgets(qwen)
    fits, _, _ = budgets(qwen)
    tokens, fused_counts = [], []
    for budget, slots in ((fits, None), (floor, 2), (floor + (4 << 20), 8)):
        mem = memory(budget)
        try:
            with vmmstream.load_model(qwen, memory=mem, max_context=MC, slots=slots) as m:
                calls = {"gemv_multi": 0, "gemv_gate_up_silu": 0}
                for name in calls:
                    orig = getattr(m.engine.ops, name)

                    def counted(*a, _orig=orig, _name=name, **k):
                        calls[_name] += 1
                        return _orig(*a, **k)
                    setattr(m.engine.ops, name, counted)
                m.engine.graphs.clear()                              # recapture through the counters
                tokens.append(m.generate(PROMPT, 12))
                streamed, K = set(m.plan.streamed), m.plan.slot_count
                want = {"gemv_multi": 0, "gemv_gate_up_silu": 0}
                for layer in range(cfg.num_hidden_layers):
                    p = f"model.layers.{layer}."
                    qkv = [p + f"self_attn.{n}_proj.{t}" for n in "qkv" for t in ("weight", "bias")]
                    gu = [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]
                    want["gemv_multi"] += len(streamed & set(qkv)) <= K
                    want["gemv_gate_up_silu"] += len(streamed & set(gu)) <= K
                assert calls == want, (slots, calls, want)            # one capture: one call per fused group
                fused_counts.append(want["gemv_multi"])
        finally:
            mem.close()
    assert fused_counts[0] == cfg.num_hidden_layers            # resident: every layer fused
    assert fused_counts[1] < cfg.num_hidden_layers             # floor with 2 slots: q/k/v+biases stream, unfused
    assert tokens[0] == tokens[1] == tokens[2]


def test_kv_cache_grows_at_its_end_outside_the_decode_loop(tiny):
    # 4 KiB granules: the tiny model's 64-position cache (256 B per position) is 4 chunks of 16 positions
    mem = DeviceMemory(HostDriver(granularity=4096, total_bytes=1 << 30), 64 << 20)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            assert m.kv.committed == 4096 and len(m.kv.blocks) == 4
            va = m.kv.va
            a = m.generate(PROMPT, 8)
            assert m.kv.committed == 4096
            b = m.generate(PROMPT, 40)
            assert m.kv.committed == 3 * 4096 and m.kv.va == va           # I4: grown in place
            assert b[:8] == a
            assert m.stats()["vmm_calls_decode"] == 0
    finally:
        mem.close()


def test_sampling_is_seeded_and_replayed_from_its_own_graph(tiny):
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            a = m.generate(PROMPT, 12, temperature=0.8, top_k=20, seed=5, eos_token_id=[])   # all 12: counted below
            b = m.generate(PROMPT, 12, temperature=0.8, top_k=20, seed=5, eos_token_id=[])
            c = m.generate(PROMPT, 12, temperature=0.8, top_k=20, seed=6, eos_token_id=[])
            greedy = m.generate(PROMPT, 12, eos_token_id=[])
            assert a == b and a != c and all(0 <= t < 256 for t in a)
            s = m.stats()
            assert s["graph_captures"] == 2 and s["graph_replays"] == s["decode_tokens"] == 44
            assert greedy == m.generate(PROMPT, 12, temperature=0)
    finally:
        mem.close()


def test_i8_step_workspace_is_released_after_prefill(tiny_d24):
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(tiny_d24, memory=mem, max_context=MC) as m:
            assert m.plan.workspace["step"] > 0              # head_dim 24: the materialized prefill route
            m.generate(PROMPT, 4)
            lease = mem.authority.leases[(m.holder, "workspace_step")]
            assert lease.committed == 0 and lease.peak == m.plan.workspace["step"]
    finally:
        mem.close()


def test_max_context_exhaustion_is_a_clear_error_before_launching(tiny):
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            before = m.stats()
            with pytest.raises(ContextLengthError, match="max_context 64") as e:
                m.generate(PROMPT, MC)
            assert isinstance(e.value, ValueError) and e.value.requested == len(PROMPT) + MC
            assert m.stats() == before
            assert len(m.generate(PROMPT, MC - len(PROMPT))) == MC - len(PROMPT)    # exactly full is fine
            with pytest.raises(ValueError):
                m.generate([], 3)
            with pytest.raises(ValueError):
                m.generate([256], 3)
            with pytest.raises(VmmstreamError, match="tokenizer"):
                m.generate("hello", 3)
    finally:
        mem.close()


def test_close_releases_everything_i2(tiny):
    mem = memory(64 << 20)
    m = vmmstream.load_model(tiny, memory=mem, max_context=MC)
    m.generate(PROMPT, 4)
    assert mem.snapshot()["by_holder"][m.holder] > 0
    m.close()
    m.close()                                               # idempotent
    assert not mem.blocks and mem.mapped_bytes == 0
    assert not any(l.holder == m.holder for l in mem.authority.leases.values())
    assert mem.authority.committed == mem.authority.retained and mem.authority.reserved == mem.authority.retained
    with pytest.raises(VmmstreamError, match="closed"):
        m.generate(PROMPT, 2)
    mem.close()
    snap = mem.snapshot()
    assert snap["handles"]["created"] == snap["handles"]["released"] and snap["mapped"] == 0
    assert mem.driver.live() == {"handles": 0, "reservations": 0, "mappings": 0, "allocs": 0, "host_allocs": 0}


def test_legacy_loads_plain_no_streaming_and_over_budget_names_the_variable(tiny, monkeypatch):
    monkeypatch.setenv("VMMSTREAM_LEGACY_ALLOCATOR", "1")
    with vmmstream.load_model(tiny, "256MiB", backend="host", max_context=MC) as m:
        assert m.plan.strategy == "legacy" and m.plan.streamed == () and m.memory.legacy
        ids = m.generate(PROMPT, 12)
        assert m.driver.vmm_call_count() == 0 and m.stats()["page_ins"] == 0
        assert m.stats()["graph_replays"] == 11
        mem = m.memory
    assert mem.closed                         # the model made the process's memory, and gave it back
    monkeypatch.delenv("VMMSTREAM_LEGACY_ALLOCATOR")
    with vmmstream.load_model(tiny, "256MiB", backend="host", max_context=MC) as m:
        assert m.plan.strategy == "resident" and m.generate(PROMPT, 12) == ids
    monkeypatch.setenv("VMMSTREAM_LEGACY_ALLOCATOR", "1")
    with pytest.raises(CapacityError, match="VMMSTREAM_LEGACY_ALLOCATOR"):
        vmmstream.load_model(tiny, "20MiB", backend="host", max_context=MC)


# ------------------------------------------------------------------------------------ errors and rollback

def _clean(mem, before):
    a = mem.authority
    assert not mem.blocks and mem.mapped_bytes == 0
    assert a.committed - a.retained == before and a.reserved - a.retained == before
    assert not any(l.granted or l.committed for l in a.leases.values())
    assert not mem.driver.host_allocs


def test_i9_floor_over_budget_is_a_capacity_error_before_anything_is_allocated(tiny):
    _, _, floor = budgets(tiny)
    mem = memory(floor - G)
    calls = dict(mem.driver.calls)
    with pytest.raises(CapacityError, match="no plan fits") as e:
        vmmstream.load_model(tiny, memory=mem, max_context=MC)
    assert e.value.requested == floor
    assert mem.authority.committed == 0 and not mem.blocks and dict(mem.driver.calls) == calls
    mem.close()


def test_typed_errors_for_bad_checkpoints_and_budgets(tiny, tmp_path):
    import shutil
    from vmmstream import memory as memmod
    open_before = {id(m) for m in memmod._by_device.values() if not m.closed}
    with pytest.raises(BudgetError):
        vmmstream.load_model(tiny, "12 parsecs", backend="host")
    with pytest.raises(CheckpointError, match="not a directory"):
        vmmstream.load_model(tmp_path / "nowhere", "1GiB", backend="host")
    bad = tmp_path / "missing"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.2"):
        vmmstream.load_model(bad, "1GiB", backend="host")
    cfg["num_hidden_layers"] = 2
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="expected shape"):
        vmmstream.load_model(bad, "1GiB", backend="host")
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        vmmstream.load_model(bad, "1GiB", backend="host")
    trunc = tmp_path / "truncated"
    shutil.copytree(tiny, trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        vmmstream.load_model(trunc, "1GiB", backend="host")
    assert {id(m) for m in memmod._by_device.values() if not m.closed} == open_before   # nothing left open


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_checkpoint("mixtral-tiny", tmp_path_factory.mktemp("mixtral"), seed=2)


@pytest.mark.parametrize("which", ["tiny", "mixtral"])
def test_i3_a_driver_failure_anywhere_in_load_releases_everything(which, request, fail_at):
    """Fail the n-th driver call of a load, for every n, and check the memory is as it was (no blocks, no
    mappings, no grants, no pinned host memory); the pool may keep idle handles, charged as retained. The
    Mixtral case keeps 4 experts in the pool stack and gathers the others on demand (slot stack, host units)."""
    tiny = request.getfixturevalue(which)
    fits, half, _ = budgets(tiny)
    if which == "mixtral":        # the dense part and 4 of 8 experts resident, 2 gather slots
        from vmmstream.api import workspace_peaks
        from vmmstream.model import open_checkpoint
        from vmmstream.planning import make_plan
        ck = open_checkpoint(tiny)
        full = make_plan(ck.config, ck.tensors, fits, granularity=G, max_context=MC,
                         workspace=workspace_peaks(ck.config, MC, MC))
        ep = full.experts
        half = full.floor + full.weight_bytes - (ep.total - ep.top_k - 4) * ep.unit_bytes
        plan = make_plan(ck.config, ck.tensors, half, granularity=G, max_context=MC,
                         workspace=workspace_peaks(ck.config, MC, MC))
        assert plan.experts.slots == 2 and len(plan.experts.resident) == 4
    mem = memory(half)
    failed = 0
    for n in range(1, 10_000):
        inj = fail_at(n)
        mem.driver.fault_injector = inj
        try:
            m = vmmstream.load_model(tiny, memory=mem, max_context=MC)
        except DriverError as exc:
            assert inj.fired and "INJECTED" in str(exc)
            failed += 1
        else:
            assert inj.fired is None          # every call of a load has been failed once: done
            mem.driver.fault_injector = None
            assert len(m.generate(PROMPT, 3)) == 3                  # and it still loads and runs afterwards
            m.close()
            break
        finally:
            mem.driver.fault_injector = None
        _clean(mem, 0)
    assert failed > 100
    _clean(mem, 0)
    mem.close()


def test_capacity_taken_by_another_holder_is_refused_before_allocation(tiny):
    """Another holder leaves less than the floor: refused before any allocation (I9)."""
    fits, _, floor = budgets(tiny)
    mem = memory(fits)
    other = mem.allocate(fits - floor + G, role="activations", holder="someone-else")
    with pytest.raises(CapacityError):
        vmmstream.load_model(tiny, memory=mem, max_context=MC, slots=2)
    assert [b for b in mem.blocks] == [other]
    mem.free(other)
    mem.close()


def test_a_model_is_planned_against_the_budget_the_others_left(tiny):
    """Another holder takes half the budget: the model plans to stream within the rest instead of failing, the
    plan says how much was left, and its tokens are the fully resident run's (I10)."""
    fits, _, floor = budgets(tiny)
    want, _, _ = run(tiny, fits)
    mem = memory(fits)
    other = mem.allocate(fits // 2, role="activations", holder="someone-else")
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            assert m.plan.strategy == "streamed" and m.plan.budget <= fits - fits // 2
            assert "left by the other models" in str(m.plan)
            assert m.generate(PROMPT, 24) == want
            assert mem.authority.committed <= mem.authority.budget
    finally:
        mem.free(other)
        mem.close()


# ------------------------------------------------------------------------------------------------- CLI

def test_cli_generate_and_demo(tiny, capsys):
    assert main(["generate", str(tiny), "--budget", "64MiB", "--ids", "1,7,42", "--max-new-tokens", "5",
                 "--backend", "host", "--max-context", "64"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(out.split(",")) == 5
    assert main(["generate", str(tiny), "--budget", "64MiB", "--ids", "1,7,42", "--max-new-tokens", "5",
                 "--backend", "host", "--max-context", "64", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["stats"]["graph_replays"] == 4 and j["output"] == [int(x) for x in out.split(",")]
    assert main(["generate", str(tiny), "--budget", "64MiB", "--prompt", "hi", "--backend", "host"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["demo", "--backend", "host", "--max-new-tokens", "6", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["strategy"] == "streamed" and len(d["output"]) == 6
    assert d["stats"]["graph_replays"] == 5 and d["stats"]["vmm_calls_per_decode_token"] == 0
    assert d["plan"]["budget"] < d["plan"]["weight_bytes"] + d["plan"]["floor"]
    assert main(["demo", "--backend", "host", "--max-new-tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert "plan: streamed" in text and "graph_replays" in text


def test_text_prompt_with_a_tokenizer(tiny, tmp_path):
    import tokenizers
    import shutil
    path = tmp_path / "with-tok"
    shutil.copytree(tiny, path)
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC) as m:
            text = m.generate("w1 w7 w42", 4)
            ids = m.generate([1, 7, 42], 4)
            assert text.split() == [f"w{i}" for i in ids]
    finally:
        mem.close()


def test_import_stays_light():
    import subprocess
    import sys
    code = ("import sys, vmmstream; print('numba' in sys.modules, 'vmmstream.api' in sys.modules, "
            "'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.stdout.split() == ["False", "False", "False"]
    assert callable(vmmstream.load_model) and vmmstream.Model.__name__ == "Model"
    assert np.dtype(np.uint16).itemsize == 2


def test_chunked_prefill_equals_one_chunk_and_eos_stops(tiny):
    prompt = list(range(3, 40, 3))                           # 13 tokens: chunks of 4, 4, 4 and 1
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            whole = m.generate(prompt, 12)
        with vmmstream.load_model(tiny, memory=mem, max_context=MC, prefill_chunk=4) as m:
            assert m.acts.tmax == 4
            assert m.generate(prompt, 12) == whole
            assert m.stats()["prefill_tokens"] == len(prompt)
            stop = whole[4]
            cut = m.generate(prompt, 12, eos_token_id=stop)
            assert cut == whole[:whole.index(stop) + 1]
    finally:
        mem.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_checkpoint("small", tmp_path_factory.mktemp("small"), seed=5)


@pytest.mark.parametrize("streamed", [False, True])
def test_short_prompts_padded_and_replayed_as_a_graph_equal_the_eager_prefill(small, streamed, monkeypatch):
    """A short prompt runs padded to a power of two, eagerly the first time, then as a captured graph: the tokens
    and the first logits equal the unpadded eager prefill's, streamed too (the graph holds the slot copies).
    (head_dim 64: a fused attention route, no step workspace; the tiny presets' head_dim 16 prefills eagerly.)"""
    fits, half, _ = budgets(small)
    budget = half if streamed else fits
    monkeypatch.setattr("vmmstream.execution.engine.Engine.PREFILL_GRAPH_MAX", 256)
    prompts = [PROMPT, [5], list(range(2, 19)), PROMPT[::-1], [9, 8], list(range(30, 47))]   # buckets 16, 16, 32, ...

    def answers():
        mem = memory(budget)
        try:
            with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
                assert (m.plan.strategy == "streamed") == streamed
                out = [m.generate(p, 6, return_logits=True) for p in prompts]
                s = m.stats()
                if streamed:              # a prefill replay streams like any step and counts as one
                    assert s["measured_streamed_bytes_per_step"] == m.plan.streamed_bytes_per_token
                return [(ids, lg[0]) for ids, lg in out], s
        finally:
            mem.close()
    graphed, s = answers()
    assert s["prefill_graph_captures"] == 2 and s["prefill_graph_replays"] == 4    # 16: 3 of 4 prompts; 32: 1 of 2
    monkeypatch.setattr("vmmstream.execution.engine.Engine.PREFILL_GRAPH_MAX", 0)
    eager, s2 = answers()
    assert s2["prefill_graph_captures"] == 0
    for (a, la), (b, lb) in zip(graphed, eager):
        assert a == b
        np.testing.assert_array_equal(la, lb)


@pytest.mark.parametrize("streamed", [False, True])
def test_long_prompts_padded_replay_as_a_graph_equal_to_eager(small, streamed, monkeypatch):
    """Above PREFILL_GRAPH_STEP tokens a prompt pads to a multiple of a sixteenth of its power of two (600 and 610
    -> 640 here, a walk longer than the MLP's sub-chunks): eager, captured, replayed, resident and streamed; tokens
    and first logits those of the unpadded eager prefill. With one graph kept, another length's capture evicts the
    first, which is captured again on its next use."""
    from vmmstream.execution import engine as eng
    mc = 1100
    fits, half, _ = budgets(small, mc=mc)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, n).tolist() for n in (600, 610, 600, 200, 1000, 1000, 600, 600)]

    def answers(graph_max):
        monkeypatch.setattr(eng.Engine, "PREFILL_GRAPH_MAX", graph_max)
        monkeypatch.setattr(eng.Engine, "PREFILL_GRAPHS_KEPT", 1)
        mem = memory(half if streamed else fits * 2)
        try:
            with vmmstream.load_model(small, memory=mem, max_context=mc) as m:
                assert (m.plan.strategy == "streamed") == streamed
                assert m.acts.tmax >= 1024 and m.acts.sub < 600
                assert m.engine._prefill_bucket(600) == (640 if graph_max else None)
                out = [m.generate(p, 4, return_logits=True, eos_token_id=[]) for p in prompts]
                assert len(m.engine.prefill_graphs) <= 1
                return [(ids, lg[0]) for ids, lg in out], m.stats()
        finally:
            mem.close()
    graphed, s = answers(4096)
    # 640: eager, capture, replay; 1024: eager, capture (640's evicted); 640: capture again, replay
    assert s["prefill_graph_captures"] == 3 and s["prefill_graph_replays"] == 5
    eager, s2 = answers(0)
    assert s2["prefill_graph_captures"] == 0
    for (a, la), (b, lb) in zip(graphed, eager):
        assert a == b
        np.testing.assert_array_equal(la, lb)


def test_kv_views_are_made_once_and_are_the_layout_s_slices(tiny):
    """Each layer's K/V views (made once at load from their addresses) are exactly the slices of the
    position-major cache [S, layers, 2, Hkv, D] that the kernels read; a call hands out the same objects."""
    mem = memory(budgets(tiny)[0])
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        kv = m.kv
        full = m.engine.ops.view(kv.va, (kv.max_context, kv.layers, 2, kv.hkv, kv.d), np.uint16)
        full4 = full[None]
        for layer in range(kv.layers):
            for got, want in ((kv.k(layer), full[:, layer, 0]), (kv.v(layer), full[:, layer, 1]),
                              (kv.k4(layer), full4[:, :, layer, 0]), (kv.v4(layer), full4[:, :, layer, 1])):
                assert got.shape == want.shape
                assert [st for n, st in zip(got.shape, got.strides) if n > 1] == \
                    [st for n, st in zip(want.shape, want.strides) if n > 1]       # a size-1 axis has no stride
                assert got.__array_interface__["data"][0] == want.__array_interface__["data"][0]
            assert kv.k(layer) is kv.k(layer)
    mem.close()


def test_activation_views_are_cached_per_token_count_and_bounded(tiny, monkeypatch):
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
            acts = m.acts
            monkeypatch.setattr(type(acts), "VIEW_SETS", 8)
            first = acts.views(5)
            assert acts.views(5) is first                     # built once, then reused
            for t in range(10, 30):
                acts.views(t)
            assert len(acts._views) <= 8 and 5 not in acts._views
            assert acts.views(29) is acts.views(29)
            assert m.generate(PROMPT, 4) == m.generate(PROMPT, 4)
    finally:
        mem.close()


def test_a_prefill_graph_that_cannot_be_captured_leaves_that_length_eager(small, monkeypatch):
    from vmmstream.execution import engine as eng
    monkeypatch.setattr(eng.Engine, "PREFILL_GRAPH_MAX", 256)
    real = eng.DecodeGraph

    def refuse_prefill(driver, stream, emit, *, key=None):
        if isinstance(key, tuple) and key[0] == "prefill":
            raise DriverError("cuStreamBeginCapture", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        return real(driver, stream, emit, key=key)
    monkeypatch.setattr(eng, "DecodeGraph", refuse_prefill)
    mem = memory(64 << 20)
    try:
        with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
            runs = [m.generate(PROMPT, 5) for _ in range(3)]
            assert runs[0] == runs[1] == runs[2]
            s = m.stats()
            assert s["prefill_graph_captures"] == 0 and s["prefill_graph_replays"] == 0
    finally:
        mem.close()


def test_prefill_attention_is_told_the_rows_it_may_touch_past_its_own(tiny):
    """The dense walk passes prefill attention the rows past its own that a length bucket may read and write (the
    cuDNN route's ``spare_rows`` / ``spare_keys``): the q / attn buffers' rows past T, and the cache's committed rows
    past the keys, never more than exist."""
    seen = []
    with vmmstream.load_model(tiny, budget=1 << 30, backend="host", max_context=MC, progress=False) as m:
        ops = m.engine.ops
        real = ops.attn_prefill

        def spy(s, q, ck, cv, out, ws, start_pos, session=None, spare_rows=0, spare_keys=0):
            seen.append((q.shape[0], start_pos, spare_rows, spare_keys, ck.shape[0]))
            return real(s, q, ck, cv, out, ws, start_pos, session=session, spare_rows=spare_rows,
                        spare_keys=spare_keys)
        ops.attn_prefill = spy
        m.generate(PROMPT, 2, eos_token_id=[])
        tmax, capacity = m.engine.acts.tmax, m.engine.kv.capacity()
    layers = m.config.num_hidden_layers
    assert len(seen) == layers
    for t, start, rows, keys, cache_rows in seen:       # (a short prompt's walk is its padded bucket's length)
        assert start == 0 and len(PROMPT) <= t < tmax
        assert rows == tmax - t and keys == capacity - t >= 0 and capacity <= cache_rows
