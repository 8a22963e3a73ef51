"""What a user waits for, by the wall clock, beside transformers on the same checkpoint in the same run.

For each model (``VMMSTREAM_USER_MODELS``, default the 3.0B preset and ``qwen2-7b-12l``: vocab 152,064 untied,
GQA 7):

- **load**: ``load_model`` + a first token in a fresh process, with an empty kernel cache (``cold``) and with the
  cache the first one filled (``warm``), beside transformers' ``from_pretrained`` to the GPU + a first token in a
  fresh process; the page cache is warm for all three (the checkpoint was just written).
- **time to first token**: ``generate(prompt, max_new_tokens=1)`` for prompts of 16, 1024 and 4096 tokens, resident
  and at 2 GiB (median of 3 after one warm-up call per length), beside one transformers eager forward of the same
  prompt (wall clock after a synchronize). At 2 GiB the floor is max(streamed bytes of one step ÷ pinned H2D,
  the resident time of the same prompt).
- **an answer**: ``generate(16-token prompt, 256 new)``: tokens ÷ wall clock, next to the device decode rate of the
  same call (``stats()``), resident and at 2 GiB; transformers eager ``generate`` (resident) and accelerate
  offload at 2 GiB (8 new tokens: about a token a second) by the wall clock.

Everything is wall clock around a call that returns host values (our ``generate`` returns token ids, so the
device work is done); peers are synchronized before the clock stops. ``test_user_bench_smoke_on_the_host_backend``
runs the same helpers on the host backend with a tiny preset (CI).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

import vmmstream

GiB = 1 << 30
MODELS = os.environ.get("VMMSTREAM_USER_MODELS", "llama-3b,qwen2-7b-12l").split(",")
PROMPTS = (16, 1024, 4096)
MAX_CONTEXT = 4096 + 64
ANSWER_PROMPT, ANSWER_NEW, ACCEL_NEW = 16, 256, 8
BUDGETS = {"resident": None, "2GiB": 2 * GiB}

_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import vmmstream
from vmmstream.kernels.base import jit
with vmmstream.load_model(sys.argv[1], budget=sys.argv[2], backend=sys.argv[3], max_context=256,
                          progress=False) as m:
    t1 = time.perf_counter()
    m.generate([1, 2, 3], 1, eos_token_id=[])
    t2 = time.perf_counter()
print(json.dumps(dict(load_s=t1 - t0, first_token_s=t2 - t0, **jit.stats())))
"""

_HF_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda:0")
torch.cuda.synchronize()
t1 = time.perf_counter()
with torch.no_grad():
    m(torch.tensor([[1, 2, 3]], device="cuda:0")).logits.argmax(-1).cpu()
t2 = time.perf_counter()
print(json.dumps(dict(load_s=t1 - t0, first_token_s=t2 - t0)))
"""


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _fresh(script: str, *args, env=None) -> dict:
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})), timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def load_times(path, budget: str, backend: str, cache_dir, peers: bool) -> dict:
    """Fresh-process load + first token: cold kernel cache, warm kernel cache, and (``peers``) transformers."""
    env = {"VMMSTREAM_CACHE_DIR": str(cache_dir), "VMMSTREAM_KERNEL_CACHE": "1"}
    cold = _fresh(_LOAD, path, budget, backend, env=env)
    warm = _fresh(_LOAD, path, budget, backend, env=env)
    out = {"cold_load_s": cold["load_s"], "cold_first_token_s": cold["first_token_s"],
           "cold_kernels_compiled": cold["misses"], "warm_load_s": warm["load_s"],
           "warm_first_token_s": warm["first_token_s"], "warm_kernels_from_disk": warm["hits"],
           "warm_kernels_compiled": warm["misses"]}
    if peers:
        hf = _fresh(_HF_LOAD, path)
        out.update(hf_load_s=hf["load_s"], hf_first_token_s=hf["first_token_s"],
                   ratio_warm_load_vs_hf=warm["load_s"] / hf["load_s"])
    return out


def ttft(m, lengths, rounds: int = 3, routes: dict | None = None) -> dict:
    """Median wall seconds of ``generate(prompt, 1)`` per prompt length (one warm-up call each); ``routes`` gets,
    per length, the prefill attention launches of the timed calls by the route that ran, and ``graph`` for the
    prefills replayed as a captured graph (short prompts: the route is the one captured)."""
    out = {}
    for n in lengths:
        ids = _ids(n, m.config.vocab_size, seed=n)
        m.generate(ids, 1, eos_token_id=[])
        s0 = m.stats()
        before = dict(s0["prefill_attention_routes"], graph=s0["prefill_graph_replays"])
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            m.generate(ids, 1, eos_token_id=[])
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
        if routes is not None:
            s1 = m.stats()
            after = dict(s1["prefill_attention_routes"], graph=s1["prefill_graph_replays"])
            routes[n] = {r: c - before.get(r, 0) for r, c in after.items() if c > before.get(r, 0)}
    return out


def answer(m, prompt: int = ANSWER_PROMPT, new: int = ANSWER_NEW) -> dict:
    """``generate(prompt, new)`` by the wall clock, and the device decode rate of the same call."""
    ids = _ids(prompt, m.config.vocab_size, seed=1)
    m.generate(ids, 4, eos_token_id=[])                      # graphs captured, caches warm
    before = m.stats()
    t0 = time.perf_counter()
    got = m.generate(ids, new, eos_token_id=[])
    wall = time.perf_counter() - t0
    s = m.stats()
    assert len(got) == new
    dev_ms = s["decode_device_ms"] - before["decode_device_ms"]
    dev_tokens = s["decode_timed_tokens"] - before["decode_timed_tokens"]
    dev_rate = dev_tokens / (dev_ms / 1e3) if dev_ms > 0 else float("nan")
    return {"wall_s": wall, "wall_tok_s": new / wall, "device_decode_tok_s": dev_rate,
            "ratio_wall_vs_device": (new / wall) / dev_rate if dev_ms > 0 else float("nan")}


# ------------------------------------------------------------------------------------------------ GPU

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {}


def _ckpt(checkpoints, tmp_path_factory, name):
    if name not in checkpoints:
        from vmmstream.model import make_checkpoint
        t0 = time.perf_counter()
        checkpoints[name] = make_checkpoint(name, tmp_path_factory.mktemp(name), seed=0)
        print(f"\nwrote {name} in {time.perf_counter() - t0:.1f} s")
    return checkpoints[name]


@pytest.fixture(scope="module")
def h2d_gbps():
    import torch
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(8):
        dev.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    return 8 * n / (a.elapsed_time(b) / 1e3) / 1e9


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS)
def test_bench_user_load(benchmark, checkpoints, tmp_path_factory, tmp_path, model):
    path = _ckpt(checkpoints, tmp_path_factory, model)
    out = benchmark.pedantic(lambda: load_times(path, "80%", "cuda", tmp_path / "kernels", peers=True),
                             rounds=1, iterations=1)
    benchmark.extra_info.update(model=model, **out)
    print(f"\n{model} load: {json.dumps({k: round(v, 2) for k, v in out.items()})}")
    assert out["warm_kernels_compiled"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("model", MODELS)
def test_bench_user_vmmstream(benchmark, checkpoints, tmp_path_factory, h2d_gbps, model, budget):
    path = _ckpt(checkpoints, tmp_path_factory, model)
    b = BUDGETS[budget] or "80%"
    with vmmstream.load_model(path, budget=b, backend="cuda", max_context=MAX_CONTEXT, progress=False) as m:
        routes = {}
        t = ttft(m, PROMPTS, routes=routes)
        a = benchmark.pedantic(lambda: answer(m), rounds=1, iterations=1)
        streamed = m.plan.streamed_bytes_per_token
        strategy = m.plan.strategy
    info = {"model": model, "budget": budget, "strategy": strategy, "pinned_h2d_GBps": h2d_gbps,
            "streamed_bytes_per_step": streamed, **{f"ttft_{n}_s": v for n, v in t.items()},
            **{f"ttft_{n}_attention_routes": r for n, r in routes.items()}, **a}
    if streamed:
        info["ttft_floor_stream_s"] = streamed / (h2d_gbps * 1e9)
    benchmark.extra_info.update(info)
    label = {n: "+".join(r) for n, r in routes.items()}
    print(f"\n{model} {budget}: ttft {', '.join(f'{n}: {v * 1e3:.0f} ms ({label[n]})' for n, v in t.items())}; answer "
          f"{a['wall_tok_s']:.1f} tok/s wall, {a['device_decode_tok_s']:.1f} device ({a['ratio_wall_vs_device']:.2f})"
          + (f"; streamed {streamed / 1e9:.2f} GB a step, H2D {h2d_gbps:.1f} GB/s: "
             f"{1e3 * info['ttft_floor_stream_s']:.1f} ms" if streamed else ""))


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS)
def test_bench_user_transformers(benchmark, checkpoints, tmp_path_factory, model):
    import torch
    from transformers import AutoModelForCausalLM
    path = _ckpt(checkpoints, tmp_path_factory, model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0")
    vocab = hf.config.vocab_size
    info = {"model": model, "peer": "transformers-eager"}
    with torch.no_grad():
        for n in PROMPTS:
            x = torch.tensor([_ids(n, vocab, seed=n)], device="cuda:0")
            hf(x).logits[:, -1].argmax(-1).cpu()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                hf(x).logits[:, -1].argmax(-1).cpu()
                times.append(time.perf_counter() - t0)
            info[f"ttft_{n}_s"] = statistics.median(times)
    ids = torch.tensor([_ids(ANSWER_PROMPT, vocab, seed=1)], device="cuda:0")
    kw = dict(do_sample=False, pad_token_id=0)
    hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)

    def run():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=ANSWER_NEW, min_new_tokens=ANSWER_NEW, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    wall = benchmark.pedantic(run, rounds=1, iterations=1)
    info.update(wall_s=wall, wall_tok_s=ANSWER_NEW / wall)
    hf = None
    torch.cuda.empty_cache()
    acc = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                               max_memory={0: "2GiB", "cpu": "96GiB"})
    acc.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    acc.generate(ids, max_new_tokens=ACCEL_NEW, min_new_tokens=ACCEL_NEW, **kw)
    torch.cuda.synchronize()
    info["accelerate_2GiB_wall_tok_s"] = ACCEL_NEW / (time.perf_counter() - t0)
    # accelerate's max_memory places weights only: what it really held on the GPU, and where its modules went
    info["accelerate_2GiB_peak_allocated_GiB"] = torch.cuda.max_memory_allocated() / GiB
    places = [str(d) for d in getattr(acc, "hf_device_map", {}).values()]
    info["accelerate_2GiB_modules_by_device"] = {d: places.count(d) for d in sorted(set(places))}
    del acc
    torch.cuda.empty_cache()
    benchmark.extra_info.update(info)
    print(f"\n{model} transformers: {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items()})}")


# ----------------------------------------------------------------------------------------------- host

def test_user_bench_smoke_on_the_host_backend(tmp_path):
    from vmmstream.model import make_checkpoint
    path = make_checkpoint("tiny", tmp_path / "tiny", seed=0)
    out = load_times(path, "64MiB", "host", tmp_path / "kernels", peers=False)
    assert out["cold_load_s"] > 0 and out["warm_kernels_compiled"] == 0
    with vmmstream.load_model(path, budget="64MiB", backend="host", max_context=64, progress=False) as m:
        routes = {}
        t = ttft(m, (4, 16), rounds=1, routes=routes)
        a = answer(m, prompt=4, new=8)
    assert set(t) == {4, 16} and all(v > 0 for v in t.values())
    assert set(routes) == {4, 16} and all(set(r) <= {"reference", "graph"} and sum(r.values()) >= 1
                                          for r in routes.values())
    assert a["wall_tok_s"] > 0
