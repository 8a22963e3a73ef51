"""What must never give a silent wrong answer: calls from several threads (I12), arguments out of range, stop
tokens, and several models sharing one device memory (I1, I2), on the host backend."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vmmstream
from vmmstream.errors import CapacityError
from vmmstream.memory import DeviceMemory
from vmmstream.driver.host import HostDriver

pytestmark = pytest.mark.unit

G = 64 << 10
MC = 64
PROMPTS = ([1, 7, 42, 3], [5, 9, 2, 200, 17])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


def memory(budget, g=G):
    return DeviceMemory(HostDriver(total_bytes=1 << 30, granularity=g), budget)


def fits(path, mc=MC) -> int:
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    p = make_plan(ck.config, ck.tensors, 1 << 40, granularity=G, max_context=mc, workspace=workspace_peaks(
        ck.config, mc, mc))
    return p.floor + p.weight_bytes


# ---------------------------------------------------------------------------------------- threads (I12)

def test_i12_generate_from_two_threads_never_interleaves(tiny):
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        want = [m.generate(p, 20) for p in PROMPTS]
        got, errors = {}, []
        barrier = threading.Barrier(len(PROMPTS) * 2)

        def worker(k, i):
            try:
                barrier.wait()
                got[(k, i)] = m.generate(PROMPTS[i], 20)
            except BaseException as e:      # surfaced below
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(k, i)) for k in range(2) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert all(got[(k, i)] == want[i] for k in range(2) for i in range(len(PROMPTS)))
    mem.close()


def test_i12_close_while_another_thread_generates(tiny):
    """A close from another thread waits for the call in flight; the later call is refused, not corrupted."""
    mem = memory(fits(tiny))
    m = vmmstream.load_model(tiny, memory=mem, max_context=MC)
    want = m.generate(PROMPTS[0], 30)
    out, errors = [], []

    def gen():
        try:
            out.append(m.generate(PROMPTS[0], 30))
        except vmmstream.VmmstreamError as e:
            errors.append(e)
    t = threading.Thread(target=gen)
    t.start()
    m.close()
    t.join()
    assert out == [want] or (out == [] and "closed" in str(errors[0]))
    assert mem.mapped_bytes == 0 and not mem.blocks
    mem.close()


# ------------------------------------------------------------------------------------------- arguments

BAD_GENERATE = [
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature="0.7"), TypeError, "temperature"),
    (dict(temperature=1e-40), ValueError, "temperature"),
    (dict(temperature=0.7, top_p=0.0), ValueError, "top_p"),
    (dict(temperature=0.7, top_p=-1.0), ValueError, "top_p"),
    (dict(temperature=0.7, top_p=1.5), ValueError, "top_p"),
    (dict(temperature=0.7, top_p=float("nan")), ValueError, "top_p"),
    (dict(temperature=0.7, top_k=-5), ValueError, "top_k"),
    (dict(temperature=0.7, top_k=2.5), TypeError, "top_k"),
    (dict(max_new_tokens=2.7), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(seed=2 ** 70), ValueError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(eos_token_id=1.5), TypeError, "eos_token_id"),
    (dict(eos_token_id=10 ** 6), ValueError, "eos_token_id"),
    (dict(eos_token_id=[2, "3"]), TypeError, "eos_token_id"),
    (dict(return_logits="yes"), TypeError, "return_logits"),
]


@pytest.mark.parametrize("kwargs,exc,name", BAD_GENERATE, ids=[f"{k}" for k, _, _ in BAD_GENERATE])
def test_bad_generate_argument_names_itself(tiny, kwargs, exc, name):
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        kw = dict(max_new_tokens=4) | kwargs
        with pytest.raises(exc, match=name) as e:
            m.generate(PROMPTS[0], **kw)
        assert "expected" in str(e.value) or "give at least" in str(e.value)
        assert m.engine.counters["generate_calls"] == 0       # refused before any work
    mem.close()


@pytest.mark.parametrize("prompt,exc", [([1.7, 2.2], TypeError), (b"abc", TypeError), (["1"], TypeError),
                                        ([], ValueError), ([1, -1], ValueError), ([1, 10 ** 6], ValueError),
                                        (np.array([[1, 2]]), ValueError), (12, TypeError), ([True, 2], TypeError)])
def test_bad_prompt_ids_are_refused(tiny, prompt, exc):
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        with pytest.raises(exc, match="prompt"):
            m.generate(prompt, 4)
    mem.close()


def test_numpy_scalars_are_values(tiny):
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        a = m.generate(np.array(PROMPTS[0], np.int64), np.int32(6), temperature=np.float32(0.5), seed=np.uint64(3))
        assert a == m.generate(PROMPTS[0], 6, temperature=0.5, seed=3)
    mem.close()


# --------------------------------------------------------------------------------------- stop tokens

def test_decoding_stops_at_the_stop_token(tiny):
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        full = m.generate(PROMPTS[0], 40)
        stop = full[3]
        first = full.index(stop)
        before = m.stats()
        cut = m.generate(PROMPTS[0], 40, eos_token_id=stop)
        after = m.stats()
        assert cut == full[:first + 1]
        assert after["decode_tokens"] - before["decode_tokens"] == len(cut) - 1
        # no more than one check block of replays past the stop, far fewer than the 39 of a full run
        replays = after["graph_replays"] - before["graph_replays"]
        assert len(cut) - 1 <= replays < len(cut) - 1 + m.engine.STOP_CHECK_TOKENS
        # a list of stop ids: the first of them to come ends it
        later = full[10]
        assert m.generate(PROMPTS[0], 40, eos_token_id=[later, stop]) == full[:min(first, full.index(later)) + 1]
        # a stop id that never comes changes nothing
        absent = next(t for t in range(m.config.vocab_size) if t not in full)
        assert m.generate(PROMPTS[0], 40, eos_token_id=[absent]) == full
        # logits follow the tokens returned
        toks, logits = m.generate(PROMPTS[0], 40, eos_token_id=stop, return_logits=True)
        assert toks == cut and logits.shape == (len(cut), m.config.vocab_size)
    mem.close()


def test_a_stop_token_first_ends_at_once(tiny):
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        first = m.generate(PROMPTS[1], 1)[0]
        before = m.stats()["graph_replays"]
        assert m.generate(PROMPTS[1], 30, eos_token_id=first) == [first]
        assert m.stats()["graph_replays"] == before
    mem.close()


# --------------------------------------------------------------------------------- several models (I1, I2)

def _shared_clean():
    from vmmstream import memory as memmod
    return all(m.closed for m in memmod._by_device.values())


def test_shared_memory_closes_with_the_last_model_in_any_order(tiny):
    budget = 64 << 20                     # the process's shared host memory has 2 MiB granules
    for order in ((0, 1), (1, 0)):
        ms = [vmmstream.load_model(tiny, budget=budget, backend="host", max_context=MC) for _ in range(2)]
        mem = ms[0].memory
        assert ms[1].memory is mem and mem.models == 2
        ms[order[0]].close()
        assert not mem.closed
        assert ms[order[1]].generate(PROMPTS[0], 4)
        ms[order[1]].close()
        assert mem.closed and _shared_clean()
        assert mem.pool.created == mem.pool.released and mem.mapped_bytes == 0     # I2
    # and a fresh load with another budget is not refused by a memory nobody holds
    with vmmstream.load_model(tiny, budget=2 * budget, backend="host", max_context=MC) as m:
        assert m.memory.authority.budget == 2 * budget
    assert _shared_clean()


def test_retained_handles_are_counted_once(tiny):
    """Idle handles the pool retained (from another holder's freed memory) are reused by a model without being
    granted twice: two models that each fit in half the budget both load."""
    f = fits(tiny)
    mem = memory(2 * f, )
    scratch = [mem.allocate(G, role="activations", holder="user") for _ in range(mem.pool.max_retained // G)]
    for blk in scratch:
        mem.free(blk)
    assert mem.authority.retained > 0
    a = vmmstream.load_model(tiny, memory=mem, max_context=MC)
    assert mem.pool.reused > 0
    b = vmmstream.load_model(tiny, memory=mem, max_context=MC)
    assert a.plan.strategy == b.plan.strategy == "resident"
    assert mem.authority.reserved <= mem.authority.budget
    a.close()
    b.close()
    mem.close()


def test_a_model_keeps_its_step_workspace_grant_between_calls(tmp_path):
    """The step workspace is freed after every prefill (I8); its grant stays the model's, so another holder
    granted everything left meanwhile cannot make the next call fail mid-way. (head_dim 24: the materialized
    prefill route, which has a step workspace.)"""
    import dataclasses
    from vmmstream.model import get_preset, make_checkpoint
    d24 = make_checkpoint(dataclasses.replace(get_preset("tiny").config, head_dim=24), tmp_path, seed=0)
    f = fits(d24)
    mem = memory(2 * f)
    with vmmstream.load_model(d24, memory=mem, max_context=MC) as m:
        want = m.generate(PROMPTS[0], 8)
        assert m.plan.workspace["step"] > 0
        other = mem.authority.lease("someone-else", "activations")
        mem.authority.grant(other, mem.authority.unassigned + mem.authority.retained)
        assert m.generate(PROMPTS[0], 8) == want
        mem.authority.shrink(other)
    mem.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
def test_models_sharing_a_budget_property(tiny, data):
    """Random loads, generates and closes of 2 to 4 models on one memory with a random budget: committed never
    above the budget (I1), every byte back and created == released at the end (I2), tokens always those of a
    model alone, and a fresh load afterwards gets the whole budget."""
    f = fits(tiny)
    floor = _floor(tiny)
    budget = data.draw(st.integers(floor, 3 * f), label="budget") // G * G
    mem = memory(budget)
    alone = {i: _alone(tiny, i) for i in range(len(PROMPTS))}
    live = []
    for _ in range(data.draw(st.integers(2, 4), label="models")):
        try:
            live.append(vmmstream.load_model(tiny, memory=mem, max_context=MC))
        except CapacityError:
            pass                                         # refused before any change (I9)
        assert mem.authority.committed <= budget
        for m in list(live):
            action = data.draw(st.sampled_from(["generate", "close", "keep"]))
            if action == "generate":
                i = data.draw(st.integers(0, len(PROMPTS) - 1))
                assert m.generate(PROMPTS[i], 12) == alone[i]           # I10 / no cross-talk
            elif action == "close":
                m.close()
                live.remove(m)
            assert mem.authority.committed <= budget
    for m in data.draw(st.permutations(live)):
        m.close()
    assert not mem.blocks and mem.mapped_bytes == 0 and not mem.authority.leases
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:   # the whole budget is there again
        assert m.plan.budget == budget
    mem.close()
    assert mem.pool.created == mem.pool.released                      # I2


_ALONE: dict = {}


def _alone(path, i):
    if i not in _ALONE:
        mem = memory(fits(path))
        with vmmstream.load_model(path, memory=mem, max_context=MC) as m:
            _ALONE[i] = m.generate(PROMPTS[i], 12)
        mem.close()
    return _ALONE[i]


def _floor(path) -> int:
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    with pytest.raises(CapacityError) as e:
        make_plan(ck.config, ck.tensors, 1, granularity=G, max_context=MC,
                  workspace=workspace_peaks(ck.config, MC, MC))
    return math.ceil(e.value.requested / G) * G


# ------------------------------------------------------------------------------------ load_model's arguments

@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(max_context=0), ValueError, "max_context"), (dict(max_context=64.5), TypeError, "max_context"),
    (dict(slots=1), ValueError, "slots"), (dict(slots=2.0), TypeError, "slots"),
    (dict(prefill_chunk=0), ValueError, "prefill_chunk"), (dict(prefill_chunk=-4), ValueError, "prefill_chunk"),
    (dict(h2d_gbps=float("nan")), ValueError, "h2d_gbps"), (dict(h2d_gbps=0), ValueError, "h2d_gbps"),
    (dict(progress="yes"), TypeError, "progress"),
])
def test_bad_load_argument_names_itself(tiny, kwargs, exc, name):
    mem = memory(fits(tiny))
    with pytest.raises(exc, match=name):
        vmmstream.load_model(tiny, memory=mem, **kwargs)
    assert not mem.blocks and not mem.authority.leases and mem.models == 0
    mem.close()


def test_numpy_budget_is_bytes_and_too_large_a_budget_is_refused(tiny):
    from vmmstream.budget import parse_budget
    assert parse_budget(np.int64(1 << 30), 2 << 30) == 1 << 30
    assert parse_budget(np.float32(0.5), 2 << 30) == 1 << 30
    with pytest.raises(vmmstream.BudgetError, match="more than the device has"):
        parse_budget(3 << 30, 2 << 30)
    with pytest.raises(vmmstream.BudgetError, match="more than the device has"):
        vmmstream.load_model(tiny, budget="1TiB", backend="host", max_context=MC)
    assert _shared_clean()


def test_the_cuda_backend_without_a_driver_is_a_typed_error(monkeypatch):
    from vmmstream.driver import cuda as cuda_mod, open_driver
    monkeypatch.setattr(cuda_mod, "cuda_usable", lambda: (False, "libcuda.so.1 not found"))
    with pytest.raises(vmmstream.VmmstreamError, match="libcuda.so.1 not found"):
        open_driver("cuda")


def test_a_number_past_float_range_is_a_named_value_error():
    from vmmstream import validate
    with pytest.raises(ValueError, match="temperature"):
        validate.real("temperature", 10 ** 400, lo=0.0)


def test_top_k_at_or_past_the_vocabulary_is_no_limit(tiny):
    """One decode graph serves every top_k that limits nothing, and the tokens are those of top_k 0."""
    mem = memory(fits(tiny))
    with vmmstream.load_model(tiny, memory=mem, max_context=MC) as m:
        v = m.config.vocab_size
        want = m.generate(PROMPTS[0], 8, temperature=0.8, seed=1, top_k=0, eos_token_id=[])
        for k in (v, v + 1, 10 ** 6):
            assert m.generate(PROMPTS[0], 8, temperature=0.8, seed=1, top_k=k, eos_token_id=[]) == want
        assert m.stats()["graph_captures"] == 2          # greedy (warm-up) and one sampling graph
    mem.close()
