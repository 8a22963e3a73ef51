"""The load-time plan: strategy, byte-optimal residency, slots, floor refusals (I9), the bound, and the CLI."""

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmmstream.cli import main
from vmmstream.errors import CapacityError
from vmmstream.model import PRESETS, ModelConfig, UnsupportedModelError, synthetic_tensors
from vmmstream.planning import estimate_workspace, knapsack, kv_cache_bytes, make_plan, round_up, split
from vmmstream.planning import residency

G = 4096    # a small granularity makes the tiny presets' tensors span several granules


def tiny(name="tiny"):
    c = PRESETS[name].config
    return c, synthetic_tensors(c)


def fits_exactly(c, t, **kw):
    """The smallest budget at which everything is resident."""
    p = make_plan(c, t, 1 << 40, granularity=G, **kw)
    return p.weight_bytes + p.floor


def half(c, t):
    """A budget that leaves room for about half the weights after the floor."""
    p = make_plan(c, t, 1 << 40, granularity=G)
    return p.floor + p.weight_bytes // 2


def test_resident_when_it_fits_streamed_one_byte_below():
    c, t = tiny()
    b = fits_exactly(c, t)
    p = make_plan(c, t, b, granularity=G)
    assert p.strategy == "resident" and p.device_bytes == b and p.streamed == () and p.slot_count == 0
    assert p.resident_bytes == p.weight_bytes and p.streamed_bytes_per_token == 0
    assert all(x.where == "resident" for x in p.placements if x.name != "model.embed_tokens.weight")
    assert p.placement("model.embed_tokens.weight").where == "host"
    assert p.tokens_per_s_bound is None
    assert make_plan(c, t, b - 1, granularity=G).strategy == "streamed"


def test_streamed_at_half_the_weights():
    c, t = tiny()
    full = make_plan(c, t, 1 << 40, granularity=G)
    p = make_plan(c, t, full.floor + full.weight_bytes // 2, granularity=G)
    assert p.strategy == "streamed" and p.device_bytes <= p.budget
    streamed = [x for x in p.placements if x.where == "streamed"]
    assert p.streamed_bytes_per_token == sum(x.payload for x in streamed) > 0
    assert p.resident_bytes == sum(x.device_bytes for x in p.placements if x.where == "resident")
    assert sum(p.leases().values()) == p.device_bytes
    assert p.floor == p.kv_bytes + p.workspace["step"] + p.workspace["session"] + p.activations \
        + p.slot_count * p.slot_bytes
    assert p.host_bytes == p.streamed_bytes_per_token + t["model.embed_tokens.weight"].nbytes


def test_slots_hold_every_streamed_tensor_round_robin_in_schedule_order():
    c, t = tiny()
    full = make_plan(c, t, 1 << 40, granularity=G)
    for k in (2, 3, 5):
        p = make_plan(c, t, full.floor + full.weight_bytes * 3 // 4, granularity=G, slots=k)
        assert p.slot_count == k >= 2
        streamed = [x for x in p.placements if x.where == "streamed"]
        assert streamed and all(p.slot_bytes >= x.device_bytes for x in streamed)
        assert p.slot_bytes == max(x.device_bytes for x in streamed)
        assert [x.slot for x in streamed] == [i % k for i in range(len(streamed))]
        assert [x.order for x in streamed] == sorted(x.order for x in streamed)
        assert set(itertools.chain.from_iterable(p.slot_tenants(s) for s in range(k))) == set(p.streamed)
    with pytest.raises(ValueError, match="K >= 2"):
        make_plan(c, t, 1 << 30, slots=1)


def test_placements_follow_the_decode_schedule():
    c, t = tiny()
    p = make_plan(c, t, half(c, t), granularity=G)
    sched = c.decode_schedule()
    device = [x for x in p.placements if x.where != "host"]
    assert tuple(x.name for x in device) == sched and [x.order for x in device] == list(range(len(sched)))
    it = iter(sched)
    assert all(name in it for name in p.streamed)         # a subsequence of the schedule


def test_tied_embeddings_are_a_device_weight_and_untied_stay_on_the_host():
    c, t = tiny("qwen2-tiny")
    p = make_plan(c, t, 1 << 30, granularity=G)
    assert p.placements[-1].name == "model.embed_tokens.weight" and p.placements[-1].where == "resident"
    assert p.host_bytes == 0 and not any(x.where == "host" for x in p.placements)
    c2, t2 = tiny()
    p2 = make_plan(c2, t2, 1 << 30, granularity=G)
    emb = p2.placement("model.embed_tokens.weight")
    assert emb.where == "host" and emb.device_bytes == 0 and p2.placements[-2].name == "lm_head.weight"


def test_i9_floor_over_budget_is_a_capacity_error_naming_every_part():
    c, t = tiny()
    kv = kv_cache_bytes(c, 256, 1, G)
    with pytest.raises(CapacityError) as e:
        make_plan(c, t, kv, granularity=G, max_context=256, budget_source=("env", "VMMSTREAM_BUDGET=16KiB"))
    msg = str(e.value)
    for part in ("KV cache", "max_context 256", "workspace step", "workspace session", "activations",
                 "weight slots 2 x", "VMMSTREAM_BUDGET=16KiB", "lower max_context"):
        assert part in msg, part
    assert e.value.budget == kv and e.value.requested > kv and isinstance(e.value, MemoryError)


def test_weights_that_cannot_stream_in_what_the_floor_leaves():
    c, t = tiny()
    full = make_plan(c, t, 1 << 40, granularity=G)
    base = full.floor
    with pytest.raises(CapacityError, match="weight slots 2 x"):
        make_plan(c, t, base + G, granularity=G)        # floor fits, but not two slots


def test_legacy_never_streams_and_names_the_variable_when_over():
    c, t = tiny()
    b = fits_exactly(c, t)
    assert make_plan(c, t, b, granularity=G, legacy=True).strategy == "legacy"
    with pytest.raises(CapacityError, match="VMMSTREAM_LEGACY_ALLOCATOR") as e:
        make_plan(c, t, b - 1, granularity=G, legacy=True)
    assert e.value.requested == b and e.value.budget == b - 1


def test_the_bound():
    c, t = tiny()
    p = make_plan(c, t, half(c, t), granularity=G, h2d_gbps=54.7)
    assert p.tokens_per_s_bound == pytest.approx(54.7e9 / p.streamed_bytes_per_token)
    assert make_plan(c, t, half(c, t), granularity=G).tokens_per_s_bound is None


def test_llama_3b_at_2gib_matches_the_gpu_md_estimate():
    c = PRESETS["llama-3b"].config
    p = make_plan(c, synthetic_tensors(c), 2 << 30, h2d_gbps=54.7)
    assert p.strategy == "streamed" and p.device_bytes <= 2 << 30
    assert 3.9e9 < p.streamed_bytes_per_token < 4.5e9 and 12 < p.tokens_per_s_bound < 14     # "about 13 tok/s"
    assert p.placement("lm_head.weight").where == "resident"    # keeps the slots at one MLP matrix
    assert p.slot_bytes == round_up(8192 * 3072 * 2, 2 << 20)
    assert p.kv_bytes == 2 * 28 * 8 * 128 * 2 * 4096


def test_sources_and_explicit_workspace():
    c, t = tiny()
    p = make_plan(c, t, 1 << 30, budget_source="env", max_context=128, granularity=G,
                  workspace={"step": 5000, "session": 1}, sources={"granularity": "explicit"})
    assert p.sources["budget"] == "env" and p.sources["max_context"] == "explicit"
    assert p.sources["batch"] == "inferred" and p.sources["workspace"] == "explicit"
    assert p.workspace == {"step": 2 * G, "session": G}
    q = make_plan(c, t, 1 << 30, granularity=G)
    assert q.max_context == 256 and q.sources["max_context"] == "inferred"     # min(4096, max_position)
    assert q.workspace == {k: round_up(v, G) for k, v in estimate_workspace(c, 256, 1).items()}
    with pytest.raises(ValueError, match="budget_source"):
        make_plan(c, t, 1 << 30, budget_source="guess")
    with pytest.raises(ValueError, match="workspace"):
        make_plan(c, t, 1 << 30, workspace={"step": -1})


def test_batch_scales_the_kv_cache_and_sliding_window_is_checked():
    c, t = tiny()
    one = make_plan(c, t, 1 << 30, granularity=G, max_context=256)
    four = make_plan(c, t, 1 << 30, granularity=G, max_context=256, batch=4)
    assert four.kv_bytes == 4 * one.kv_bytes == 4 * 2 * 2 * 2 * 16 * 2 * 256
    mistral = ModelConfig(**{**PRESETS["tiny"].config.__dict__, "architecture": "MistralForCausalLM",
                             "sliding_window": 128})
    with pytest.raises(UnsupportedModelError, match="sliding"):
        make_plan(mistral, t, 1 << 30, max_context=256)
    assert "sliding window" in " ".join(make_plan(mistral, t, 1 << 30, max_context=128).notes)


def test_table_and_json_are_readable():
    c, t = tiny()
    p = make_plan(c, t, half(c, t), granularity=G, h2d_gbps=54.7)
    text = str(p)
    for word in ("plan: streamed", "budget", "streamed / token", "slots", "kv cache", "floor", "bound", "tok/s"):
        assert word in text
    assert "model.layers.1.mlp.down_proj.weight" in p.table(tensors=True)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["strategy"] == "streamed" and len(d["placements"]) == len(p.placements)
    assert d["leases"]["weight_slots"] == 2 * p.slot_bytes


# -- byte-optimality against brute force --

def brute_force(dev, pay, capacity, slots):
    """Min streamed payload over every streamed set S != {}: Σ_resident dev + slots·max_S dev <= capacity."""
    best = None
    n = len(dev)
    for mask in range(1, 1 << n):
        s = [i for i in range(n) if mask >> i & 1]
        cost = sum(dev[i] for i in range(n) if not mask >> i & 1) + slots * max(dev[i] for i in s)
        if cost <= capacity:
            v = sum(pay[i] for i in s)
            best = v if best is None else min(best, v)
    return best


@st.composite
def instances(draw):
    n = draw(st.integers(1, 7))
    gran = draw(st.sampled_from([1, 4, 16]))
    sizes = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    dev = [s * gran for s in sizes]
    pay = [draw(st.integers((s - 1) * gran + 1, s * gran)) for s in sizes]
    slots = draw(st.integers(2, 3))
    capacity = draw(st.integers(0, sum(dev)))      # sum(dev) itself: everything fits, the resident case
    return dev, pay, capacity, slots, gran


@given(instances())
def test_residency_is_byte_optimal_against_brute_force(inst):
    dev, pay, capacity, slots, gran = inst
    want = brute_force(dev, pay, capacity, slots)
    got = split(dev, pay, capacity, slots, gran)
    if sum(dev) <= capacity:
        return                          # everything fits: the resident strategy, not a split
    if want is None:
        assert got is None
        return
    assert got is not None and got.exact and got.streamed_payload == want
    assert got.streamed_payload == sum(pay[i] for i in got.streamed)
    assert got.slot_bytes == max(dev[i] for i in got.streamed)
    assert sum(dev[i] for i in got.resident) + slots * got.slot_bytes <= capacity


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 50)), min_size=0, max_size=8), st.integers(0, 20))
def test_knapsack_is_exact(items, capacity):
    costs, values = [c for c, _ in items], [v for _, v in items]
    chosen, exact = knapsack(costs, values, capacity)
    assert exact and sum(costs[i] for i in chosen) <= capacity
    best = max((sum(values[i] for i in s) for r in range(len(items) + 1)
                for s in itertools.combinations(range(len(items)), r) if sum(costs[i] for i in s) <= capacity))
    assert sum(values[i] for i in chosen) == best


def test_greedy_fallback_when_the_exact_table_is_too_big(monkeypatch):
    monkeypatch.setattr(residency, "DP_CELLS_MAX", 0)
    c, t = tiny()
    p = make_plan(c, t, half(c, t), granularity=G)
    assert not p.exact and p.device_bytes <= p.budget and any("greedily" in n for n in p.notes)


def test_equal_tensors_resident_are_spread_over_the_schedule():
    c = PRESETS["llama-3b"].config
    p = make_plan(c, synthetic_tensors(c), 4 << 30)
    mlp = [x for x in p.placements if ".mlp." in x.name]          # 84 tensors of one size
    resident = [i for i, x in enumerate(mlp) if x.where == "resident"]
    assert 0 < len(resident) < len(mlp)
    gaps = [b - a for a, b in zip(resident, resident[1:])]
    assert max(gaps) - min(gaps) <= 1


# -- CLI --

def test_cli_plan_a_preset_and_a_checkpoint(tmp_path, capsys):
    assert main(["plan", "llama-3b", "--budget", "2GiB", "--h2d-gbps", "54.7"]) == 0
    out = capsys.readouterr().out
    assert "plan: streamed" in out and "tok/s" in out and "explicit: --budget 2GiB" in out
    ck = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "tiny", str(ck), "--seed", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["plan", str(ck), "--budget", "1GiB", "--json", "--max-context", "64"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["strategy"] == "resident" and d["max_context"] == 64 and d["sources"]["max_context"] == "explicit"


def test_cli_plan_budget_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("VMMSTREAM_BUDGET", "900MiB")
    assert main(["plan", "llama-3b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["budget_source"] == "env" and d["budget"] == 900 << 20


def test_cli_plan_refusals_print_nothing_on_stdout(monkeypatch, capsys):
    monkeypatch.delenv("VMMSTREAM_BUDGET", raising=False)
    monkeypatch.delenv("VMMSTREAM_LEGACY_ALLOCATOR", raising=False)
    assert main(["plan", "llama-3b", "--budget", "300MiB"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "KV cache" in cap.err and "weight slots" in cap.err
    assert main(["plan", "llama-3b"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["plan", "llama-3b", "--budget", "50%"]) == 2
    assert "device total is unknown" in capsys.readouterr().err
    assert main(["plan", "no-such-model", "--budget", "1GiB"]) == 2
    assert "is neither a checkpoint directory, a .gguf file nor a preset" in capsys.readouterr().err
    monkeypatch.setenv("VMMSTREAM_LEGACY_ALLOCATOR", "1")
    assert main(["plan", "llama-3b", "--budget", "4GiB"]) == 2
    assert "VMMSTREAM_LEGACY_ALLOCATOR" in capsys.readouterr().err


def test_cli_make_checkpoint_shards(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "qwen2-tiny", str(out), "--shard-bytes", "40KB"]) == 0
    assert (out / "model.safetensors.index.json").exists()
    assert main(["make-checkpoint", "--preset", "qwen2-tiny", str(out)]) == 2
    assert "already holds" in capsys.readouterr().err


def test_the_planner_s_fused_prefill_head_dims_are_the_kernel_s():
    """planning/floor.py keeps its own copy (the planner imports no kernel module): the head dims it plans
    without a prefill step workspace are exactly those the attention kernels take without one."""
    from vmmstream.kernels.attention import prefill as ap
    from vmmstream.planning import floor
    assert floor.FUSED_HEAD_DIMS == ap.MMA_HEAD_DIMS
    for d in range(8, 272, 8):
        needs = ap.workspace_requirement(64, 8, 2, d, start_pos=100).bytes > 0
        assert needs == (d not in floor.FUSED_HEAD_DIMS), d
