"""Many sequences per decode step: aggregate tokens/s at B = 1, 4, 16, 32, resident and at 2 GiB (the Mixtral-shaped
preset at 3 GiB), beside the bound of each row (``step_bytes``): streamed, the bytes a step copies ÷ pinned H2D (the
same bytes serve every sequence of the step); resident, the bytes a step reads from HBM ÷ the device-copy rate
and the step's FLOPs ÷ torch's bf16 matmul rate, both measured in the same run. A mixture of experts reads (and,
streamed, gathers) the experts its B tokens route to: ``n · (1 - (1 - k/n)^B)`` of n per layer under uniform routing,
so its bound grows slower than B.

``generate([B prompts of 16 tokens], 64)`` on a model loaded with ``max_batch=32`` (one plan for every B), by the
wall clock after a warm-up call of the same B (graphs captured); aggregate = B · 64 ÷ wall. The same call with one
new token (the B prefills alone) is timed too, so the decode steps' own rate is reported beside it. The bars of the batched
decode: at 2 GiB, B = 16 at least 12× B = 1; resident, at least 6×. ``test_batch_bench_smoke_on_the_host_backend``
runs the same helper on a tiny preset (CI).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest
from test_bench_user import h2d_gbps  # noqa: F401  (the pinned host-to-device fixture, shared)

import vmmstream

GiB = 1 << 30
MODELS = os.environ.get("VMMSTREAM_BATCH_MODELS", "llama-3b,mixtral-4.7b").split(",")
STREAMED = {"mixtral-4.7b": 3 * GiB}      # the budget of the streamed row (2 GiB unless named here)
BATCHES = (1, 4, 16, 32)
PROMPT, NEW = 16, 64


def aggregate(m, b: int, new: int = NEW) -> dict:
    """B prompts decoded together: aggregate and per-sequence tokens/s by the wall clock (one warm-up call)."""
    prompts = [np.random.default_rng(i).integers(3, m.config.vocab_size, PROMPT).tolist() for i in range(b)]
    m.generate(prompts, 4, eos_token_id=[])
    t0 = time.perf_counter()
    m.generate(prompts, 1, eos_token_id=[])          # the prefills alone: each sequence's first token
    joins = time.perf_counter() - t0
    before = m.stats()
    t0 = time.perf_counter()
    out = m.generate(prompts, new, eos_token_id=[])
    wall = time.perf_counter() - t0
    after = m.stats()
    counts = {k: after[k] - before[k] for k in ("batch_graph_replays", "eager_steps", "prefill_graph_replays")}
    assert all(len(o) == new for o in out)
    steps = max(wall - joins, 1e-9)                  # the new - 1 decode steps of the batch
    return {"batch": b, "wall_s": wall, "aggregate_tok_s": b * new / wall, "per_sequence_tok_s": new / wall,
            "prefill_wall_s": joins, "decode_step_ms": 1e3 * steps / (new - 1),
            "decode_aggregate_tok_s": b * (new - 1) / steps, **counts}


def step_bytes(plan, config, b: int, context: float) -> dict:
    """What one decode step of ``b`` sequences at ``context`` positions moves and computes: ``hbm`` bytes read
    (every device weight, the experts its tokens route to, each sequence's K and V), ``h2d`` bytes copied (streamed
    weights, and the routed experts not resident), ``flops`` (2 per weight element a token uses, plus attention)."""
    c = config
    dense = sum(p.payload for p in plan.placements if p.where not in ("host", "expert"))   # experts: below
    routed = active = 0.0
    ep = plan.experts
    if ep:
        distinct = ep.per_layer * (1.0 - (1.0 - ep.top_k / ep.per_layer) ** b)      # experts a layer's tokens hit
        routed = ep.layers * distinct * ep.unit_payload
        active = ep.layers * ep.top_k * ep.unit_payload                             # bytes one token uses
    miss = (1.0 - len(ep.resident) / ep.total) if ep else 0.0
    kv = b * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    attn = b * context * c.num_hidden_layers * c.num_attention_heads * c.head_dim * 4
    return {"hbm": dense + routed + kv, "h2d": plan.streamed_bytes_per_token + routed * miss,
            "flops": b * (dense + active) + attn}         # bf16 weights: 2 bytes = 1 multiply-add = 2 FLOPs


@pytest.fixture(scope="module")
def device_rates():
    """This GPU's device-to-device copy GB/s (read + write) and torch's bf16 matmul TFLOP/s, measured now."""
    import torch
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(f, reps):
        f()
        e0.record()
        for _ in range(reps):
            f()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3 / reps

    def copy_gbps(n=256 << 20):
        src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
        return 2 * n / timed(lambda: dst.copy_(src), 20) / 1e9

    def matmul_tflops(n=8192):
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        return 2 * n ** 3 / timed(lambda: x @ x, 10) / 1e12
    rates = {"d2d_GBps": copy_gbps(), "matmul_TFLOPs": matmul_tflops()}
    torch.cuda.empty_cache()
    return rates


def bounds(row: dict, plan, config, h2d_gbps: float, rates: dict | None) -> dict:
    """The row's bound in tokens/s: H2D where the step copies weights, else HBM and compute, the tighter."""
    sb = step_bytes(plan, config, row["batch"], PROMPT + NEW / 2)
    out = {"step_hbm_bytes": sb["hbm"], "step_h2d_bytes": sb["h2d"], "step_flops": sb["flops"]}
    if sb["h2d"]:
        out["bound_tok_s"] = row["batch"] * h2d_gbps * 1e9 / sb["h2d"]
        out["bound"] = "h2d"
    elif rates:
        hbm = row["batch"] * rates["d2d_GBps"] * 1e9 / sb["hbm"]
        tc = row["batch"] * rates["matmul_TFLOPs"] * 1e12 / sb["flops"]
        out["bound_tok_s"], out["bound"] = min(hbm, tc), "hbm" if hbm <= tc else "compute"
    if "bound_tok_s" in out:
        out["decode_of_bound"] = row["decode_aggregate_tok_s"] / out["bound_tok_s"]
    return out


@pytest.fixture(scope="module")
def checkpoints():
    return {}


def _rows():
    from vmmstream.model import get_preset
    return [(m, b) for m in MODELS for b in ("resident", "streamed", "resident-mma", "streamed-graph")
            if b in ("resident", "streamed") or get_preset(m).config.is_moe]


@pytest.mark.gpu
@pytest.mark.parametrize("model,budget", _rows())
def test_bench_batched_decode(benchmark, checkpoints, tmp_path_factory, h2d_gbps, device_rates, monkeypatch, model,
                              budget):
    """``resident-mma``: a mixture's bf16 experts through the tensor-core kernels (``moe.experts_mma.MMA``), resident, in
    the same run as the SIMT kernels' row. ``streamed-graph``: a mixture's batch steps at its streamed budget with
    their expert gathers in rounds on the device, captured (``BATCH_GATHER_IN_GRAPH``), beside the eager row."""
    from vmmstream.model import make_checkpoint
    if budget == "resident-mma":
        from vmmstream.kernels.moe import experts_mma as experts
        monkeypatch.setattr(experts, "MMA", True)
    if budget == "streamed-graph":
        from vmmstream.execution import experts as experts_mod
        monkeypatch.setattr(experts_mod, "BATCH_GATHER_IN_GRAPH", True)
    if model not in checkpoints:
        checkpoints[model] = make_checkpoint(model, tmp_path_factory.mktemp(model), seed=0)
    b = "80%" if budget.startswith("resident") else STREAMED.get(model, 2 * GiB)
    with vmmstream.load_model(checkpoints[model], budget=b, backend="cuda", max_context=PROMPT + NEW + 8,
                              max_batch=max(BATCHES), progress=False) as m:
        rows = [aggregate(m, n) for n in BATCHES]
        streamed = m.plan.streamed_bytes_per_token
        strategy = m.plan.strategy
        for r in rows:
            r.update(bounds(r, m.plan, m.config, h2d_gbps, device_rates))
    base, dbase = rows[0]["aggregate_tok_s"], rows[0]["decode_aggregate_tok_s"]
    for r in rows:
        r["speedup_vs_b1"] = r["aggregate_tok_s"] / base
        r["decode_speedup_vs_b1"] = r["decode_aggregate_tok_s"] / dbase
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info.update(model=model, budget=budget if budget.startswith("resident")
                                else f"{b / GiB:g}GiB" + budget[len("streamed"):],
                                strategy=strategy, streamed_bytes_per_step=streamed,
                                pinned_h2d_GBps=h2d_gbps, **device_rates, rows=rows)
    print(f"\n{model} {budget} ({strategy}): {json.dumps(rows)}")


PEER_BATCHES, ACCEL_NEW = (1, 16), 8


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS)
def test_bench_batched_decode_transformers(benchmark, checkpoints, tmp_path_factory, model):
    """The peers on the same checkpoint: transformers' batched greedy ``generate`` (resident; B prompts of 16 tokens,
    64 new) and transformers + accelerate at the streamed row's budget (``max_memory``; 8 new: it is slow), aggregate
    tokens/s by the wall clock after a warm-up call."""
    import torch
    from transformers import AutoModelForCausalLM

    from vmmstream.model import make_checkpoint
    if model not in checkpoints:
        checkpoints[model] = make_checkpoint(model, tmp_path_factory.mktemp(model), seed=0)
    path = checkpoints[model]
    kw = dict(do_sample=False, pad_token_id=0)

    def rate(m, b, new):
        vocab = m.config.vocab_size
        ids = torch.tensor([np.random.default_rng(i).integers(3, vocab, PROMPT).tolist() for i in range(b)],
                           device="cuda:0")
        m.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        return b * new / (time.perf_counter() - t0)

    info = {"model": model}
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0")
        info["transformers_resident_tok_s"] = {b: rate(hf, b, NEW) for b in PEER_BATCHES}
        del hf
        torch.cuda.empty_cache()
        gib = STREAMED.get(model, 2 * GiB) / GiB
        acc = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                                   max_memory={0: f"{gib:g}GiB", "cpu": "96GiB"})
        torch.cuda.reset_peak_memory_stats()
        info[f"accelerate_{gib:g}GiB_tok_s"] = {b: rate(acc, b, ACCEL_NEW) for b in PEER_BATCHES}
        info["accelerate_peak_allocated_GiB"] = torch.cuda.max_memory_allocated() / GiB
        del acc
        torch.cuda.empty_cache()
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    print(f"\n{model} peers: {json.dumps(info)}")


def test_batch_bench_smoke_on_the_host_backend(tmp_path):
    from vmmstream.model import make_checkpoint
    path = make_checkpoint("tiny", tmp_path / "tiny", seed=0)
    with vmmstream.load_model(path, budget=1 << 30, backend="host", max_context=64, max_batch=4,
                              progress=False) as m:
        one, four = aggregate(m, 1, new=4), aggregate(m, 4, new=4)
        b4 = bounds(four, m.plan, m.config, 50.0, {"d2d_GBps": 3000.0, "matmul_TFLOPs": 700.0})
    assert one["batch"] == 1 and four["batch"] == 4 and four["aggregate_tok_s"] > 0
    assert b4["bound"] in ("hbm", "compute") and b4["bound_tok_s"] > 0 and b4["step_h2d_bytes"] == 0


def test_step_bytes_of_a_mixture_grow_with_the_experts_its_tokens_hit(tmp_path):
    """Dense: a step reads its weights once for any B. Mixture: B tokens hit n·(1-(1-k/n)^B) experts of a layer,
    so a step's bytes grow with B towards every expert's; streamed, the routed experts not resident are copied."""
    from vmmstream.model import make_checkpoint
    path = make_checkpoint("mixtral-tiny", tmp_path / "moe", seed=0)
    with vmmstream.load_model(path, budget="80%", backend="host", max_context=64, max_batch=4, progress=False) as m:
        plan, c = m.plan, m.config
    ep = plan.experts
    one, many = step_bytes(plan, c, 1, 0), step_bytes(plan, c, 10_000, 0)
    dense = sum(p.payload for p in plan.placements if p.where in ("resident", "streamed"))
    assert one["hbm"] == pytest.approx(dense + ep.layers * ep.top_k * ep.unit_payload)     # each expert once
    assert many["hbm"] - one["hbm"] == pytest.approx(ep.layers * (ep.per_layer - ep.top_k) * ep.unit_payload)
    assert step_bytes(plan, c, 1, 100)["hbm"] - one["hbm"] == 100 * c.num_hidden_layers * 4 * c.num_key_value_heads * c.head_dim
    streamed = dataclasses.replace(plan, experts=dataclasses.replace(ep, resident=ep.resident[: ep.total // 2]))
    assert step_bytes(streamed, c, 1, 0)["h2d"] == pytest.approx(ep.layers * ep.top_k * ep.unit_payload / 2
                                                                 + plan.streamed_bytes_per_token)
