"""Decode tokens/s of the 3.0B Llama-shaped preset (5.62 GiB bf16) on the H200: vmmstream fully resident, at
2 GiB and 4 GiB budgets (streaming), and with the legacy allocator; Hugging Face transformers eager fully
resident and transformers + accelerate offload at the same budgets — all in one run, next to the ceilings
measured in the same run:

* pinned host -> device GB/s (``cuMemcpyHtoDAsync`` of 256 MiB from ``cuMemHostAlloc`` memory, CUDA events);
  the streaming bound is that ÷ streamed bytes per token; bar >= 90 %;
* device -> device GB/s (read + write counted), the HBM bound is that ÷ weight bytes read per token; bar >= 60 %.

Our decode rate is device time (CUDA events around the graph replays, I11). HF rates are CUDA-event time
around ``generate`` (prefill included, as a user sees it). 16 decode tokens per config, 8 for accelerate
offload (about a token per second there). The checkpoint is written by ``make_checkpoint`` into a
temporary directory first (random bf16 weights; values do not matter for speed).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import vmmstream

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30
NEW = 17                # 1 token from prefill + 16 decode tokens (graph replays)
HF_NEW = 16
ACCEL_NEW = 8
MAX_CONTEXT = 512
PROMPT = list(range(1, 9))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    t0 = time.perf_counter()
    path = make_checkpoint("llama-3b", tmp_path_factory.mktemp("llama-3b"), seed=0)
    print(f"\nwrote the 3.0B checkpoint in {time.perf_counter() - t0:.1f} s")
    return path


@pytest.fixture(scope="module")
def driver():
    from vmmstream.driver.cuda import CudaDriver
    return CudaDriver(0)


@pytest.fixture(scope="module")
def ceilings(driver):
    """Pinned H2D and D2D bandwidth of this machine, measured now with CUDA events."""
    n = 256 * MiB
    s = driver.stream_create("ceiling")
    host = driver.host_alloc(n)
    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(host))[:] = 1
    a, b = driver.mem_alloc(n), driver.mem_alloc(n)
    e0, e1 = driver.event_create(True), driver.event_create(True)

    def rate(copy, reps=8, factor=1):
        copy()
        driver.event_record(e0, s)
        for _ in range(reps):
            copy()
        driver.event_record(e1, s)
        driver.event_synchronize(e1)
        return factor * reps * n / (driver.event_elapsed_ms(e0, e1) * 1e-3) / 1e9

    h2d = rate(lambda: driver.memcpy_htod_async(a, host, n, s))
    d2d = rate(lambda: driver.memcpy_dtod_async(b, a, n, s), reps=20, factor=2)
    for p in (a, b):
        driver.mem_free(p)
    driver.host_free(host)
    driver.stream_destroy(s)
    return {"h2d_gbps": h2d, "d2d_gbps": d2d}


def _weight_bytes_per_token(plan) -> int:
    """Weight bytes a decode token reads: every dense tensor, and k routed experts per layer."""
    dense = sum(p.payload for p in plan.placements if p.where not in ("host", "expert"))
    ep = plan.experts
    return dense + (ep.layers * ep.top_k * ep.unit_payload if ep else 0)


@pytest.mark.parametrize("config", ["resident", "2GiB", "4GiB", "legacy", "int4-resident", "int4-1GiB",
                                    "mxfp4-resident", "mxfp4-1GiB"])
def test_bench_decode_vmmstream(benchmark, driver, ckpt, ceilings, config):
    from vmmstream.memory import DeviceMemory
    quantize, _, size = config.rpartition("-") if config.startswith(("int4", "mxfp4")) else (None, "", config)
    quantize = quantize or None
    budget = 24 * GiB if size in ("resident", "legacy") else int(size[:-3]) * GiB
    mem = DeviceMemory(driver, budget, legacy=config == "legacy")
    t0 = time.perf_counter()
    try:
        with vmmstream.load_model(ckpt, memory=mem, max_context=MAX_CONTEXT, progress=False,
                                  quantize=quantize) as m:
            load_s = time.perf_counter() - t0
            m.generate(PROMPT, 4)                         # KV committed, every graph captured, caches warm
            before = m.stats()
            benchmark.pedantic(lambda: m.generate(PROMPT, NEW, eos_token_id=[]), rounds=3, iterations=1)
            s = m.stats()
            plan = m.plan
    finally:
        mem.close()
    toks = s["decode_tokens"] - before["decode_tokens"]
    ms = s["decode_device_ms"] - before["decode_device_ms"]
    tps = toks / (ms / 1e3)
    streamed = plan.streamed_bytes_per_token
    info = {"config": config, "strategy": plan.strategy, "budget_GiB": budget / GiB, "load_s": round(load_s, 1),
            "decode_tok_s": tps, "decode_tokens": toks, "streamed_bytes_per_token": streamed,
            "weight_bytes_per_token": _weight_bytes_per_token(plan), "pinned_h2d_GBps": ceilings["h2d_gbps"],
            "d2d_GBps": ceilings["d2d_gbps"], "vmm_calls_per_decode_token": s["vmm_calls_per_decode_token"],
            "peak_committed_GiB": s["peak_committed"] / GiB, "byte_hit_rate": s["byte_hit_rate"],
            "graph_replays": s["graph_replays"], "copy_h2d_GBps_eager": s["h2d_gbps"],
            "quantize": quantize or "none",
            "quant_rel_rms_error": (s["quantization"] or {}).get("rel_rms_error")}
    if streamed:
        bound = ceilings["h2d_gbps"] * 1e9 / streamed
        info.update(bound="pcie", bound_tok_s=bound, ratio=tps / bound, bar=0.9)
    else:
        bound = ceilings["d2d_gbps"] * 1e9 / info["weight_bytes_per_token"]
        info.update(bound="hbm", bound_tok_s=bound, ratio=tps / bound, bar=0.6)
    benchmark.extra_info.update(info)
    print(f"\n{config}: {tps:.1f} tok/s, bound {bound:.1f} ({info['bound']}), ratio {tps / bound:.2f}")
    assert s["vmm_calls_per_decode_token"] == 0 and s["peak_committed"] <= budget


def _hf_tokens_per_s(benchmark, model, new: int, rounds: int) -> float:
    """Greedy ``generate`` of ``new`` tokens after a 2-token warm-up; CUDA-event time, best of ``rounds``."""
    import torch
    ids = torch.tensor([PROMPT], device="cuda:0")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []

    def run():
        start.record()
        model.generate(ids, **kw)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))

    benchmark.pedantic(run, rounds=rounds, iterations=1)
    return new / (min(times) / 1e3)


@pytest.mark.parametrize("config", ["resident", "2GiB", "4GiB"])
def test_bench_decode_transformers(benchmark, ckpt, ceilings, config):
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    if config == "resident":
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda:0")
        new = HF_NEW
    else:
        import accelerate  # noqa: F401
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="auto",
                                                     max_memory={0: config, "cpu": "96GiB"})
        new = ACCEL_NEW
    load_s = time.perf_counter() - t0
    tps = _hf_tokens_per_s(benchmark, model, new, rounds=2 if config == "resident" else 1)
    benchmark.extra_info.update({"config": f"hf-{'eager' if config == 'resident' else 'accelerate'}-{config}",
                                 "decode_tok_s": tps, "new_tokens": new, "load_s": round(load_s, 1),
                                 "pinned_h2d_GBps": ceilings["h2d_gbps"], "d2d_GBps": ceilings["d2d_gbps"],
                                 "note": "CUDA-event time around generate (prefill included)"})
    print(f"\nhf {config}: {tps:.2f} tok/s")
    del model
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ MoE

@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    t0 = time.perf_counter()
    path = make_checkpoint("mixtral-4.7b", tmp_path_factory.mktemp("mixtral"), seed=0)
    print(f"\nwrote the Mixtral-shaped 4.7B checkpoint in {time.perf_counter() - t0:.1f} s")
    return path


@pytest.mark.parametrize("config", ["resident", "3GiB"])
def test_bench_decode_moe_vmmstream(benchmark, driver, moe_ckpt, ceilings, config):
    """The Mixtral-shaped preset resident and at 3 GiB (about a quarter of the experts resident, the routed
    others gathered): tokens/s, expert bytes streamed per token and the bound (H2D ÷ dense streamed + measured
    expert bytes per token; resident: D2D ÷ bytes read per token)."""
    from vmmstream.memory import DeviceMemory
    budget = 24 * GiB if config == "resident" else int(config[:-3]) * GiB
    mem = DeviceMemory(driver, budget)
    try:
        with vmmstream.load_model(moe_ckpt, memory=mem, max_context=MAX_CONTEXT, progress=False) as m:
            m.generate(PROMPT, 4)
            before = m.stats()
            benchmark.pedantic(lambda: m.generate(PROMPT, NEW, eos_token_id=[]), rounds=3, iterations=1)
            s, plan = m.stats(), m.plan
    finally:
        mem.close()
    toks = s["decode_tokens"] - before["decode_tokens"]
    tps = toks / ((s["decode_device_ms"] - before["decode_device_ms"]) / 1e3)
    ex_bytes = s["expert_bytes_per_token"]
    per_token = plan.streamed_bytes_per_token + ex_bytes
    info = {"config": f"mixtral-{config}", "strategy": plan.strategy, "decode_tok_s": tps,
            "experts_resident": s["experts_resident"], "expert_hit_rate": s["expert_hit_rate"],
            "experts_streamed_per_token": s["experts_streamed_per_token"], "expert_bytes_per_token": ex_bytes,
            "dense_streamed_bytes_per_token": plan.streamed_bytes_per_token,
            "pinned_h2d_GBps": ceilings["h2d_gbps"], "d2d_GBps": ceilings["d2d_gbps"]}
    if per_token:
        bound = ceilings["h2d_gbps"] * 1e9 / per_token
        info.update(bound="pcie", bound_tok_s=bound, ratio=tps / bound)
    else:
        bound = ceilings["d2d_gbps"] * 1e9 / _weight_bytes_per_token(plan)
        info.update(bound="hbm", bound_tok_s=bound, ratio=tps / bound)
    benchmark.extra_info.update(info)
    print(f"\nmixtral {config}: {tps:.1f} tok/s, bound {bound:.1f} ({info['bound']}), {ex_bytes / 1e9:.2f} GB "
          "of experts per token")
    assert s["vmm_calls_per_decode_token"] == 0 and s["peak_committed"] <= budget


@pytest.mark.parametrize("config", ["resident", "3GiB"])
def test_bench_decode_moe_transformers(benchmark, moe_ckpt, ceilings, config):
    import torch
    from transformers import AutoModelForCausalLM
    if config == "resident":
        model = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.bfloat16, device_map="cuda:0")
        new = HF_NEW
    else:
        model = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.bfloat16, device_map="auto",
                                                     max_memory={0: config, "cpu": "96GiB"})
        new = ACCEL_NEW
    tps = _hf_tokens_per_s(benchmark, model, new, rounds=1)
    benchmark.extra_info.update({"config": f"mixtral-hf-{'eager' if config == 'resident' else 'accelerate'}-{config}",
                                 "decode_tok_s": tps, "new_tokens": new,
                                 "note": "CUDA-event time around generate (prefill included)"})
    print(f"\nhf mixtral {config}: {tps:.2f} tok/s")
    del model
    torch.cuda.empty_cache()
