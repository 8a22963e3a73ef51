"""Time to first token of long prompts with prefill attention through cuDNN and through our tensor-core kernel,
one process, one checkpoint: the wall clock of ``generate(prompt, 1)`` (the median of three, after a first call of
8 tokens), the TTFT of a prompt one token shorter, the first of its length (what a new length costs: cuDNN builds
a graph for it), whether both routes give the same greedy tokens, and how far each route's first logits are from
those of our fp32 route (``fused``: fp32 scores and probabilities), ÷ their spread: two bf16 routes that both
round are each about as far from it, a misread cache is far from it.
    python3 bench/tools/ttft_attention_route.py [PRESET] [LENGTHS] [BACKEND]   # llama-3b 2048,4096 cuda
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import numpy as np

import vmmstream
from vmmstream.kernels.attention import cudnn_sdpa, prefill
from vmmstream.model import make_checkpoint

preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3b"
lengths = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "2048,4096").split(",")]
backend = sys.argv[3] if len(sys.argv) > 3 else "cuda"        # host: the script's own check, both routes ours
path = make_checkpoint(preset, tempfile.mkdtemp() + "/" + preset, seed=0)
rows = {}
ours_choice = prefill.choose_route


def fp32_route(T, Hq, Hkv, D, **kw):
    return prefill.FUSED if D in prefill.FUSED_HEAD_DIMS else prefill.MATERIALIZED


for route in ("cudnn", "ours", "fp32"):
    prefill.PREFER_CUDNN = route == "cudnn"
    prefill.choose_route = fp32_route if route == "fp32" else ours_choice
    t0 = time.perf_counter()
    with vmmstream.load_model(path, budget="80%", backend=backend, max_context=max(lengths) + 64,
                              progress=False) as m:
        load = time.perf_counter() - t0
        for n in lengths:
            ids = np.random.default_rng(n).integers(3, m.config.vocab_size, n).tolist()
            t0 = time.perf_counter()
            first_tokens, logits = m.generate(ids, 8, eos_token_id=[], return_logits=True)
            first = time.perf_counter() - t0
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                m.generate(ids, 1, eos_token_id=[])
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m.generate(ids[1:], 1, eos_token_id=[])           # a length not seen before
            new_length = time.perf_counter() - t0
            rows[(route, n)] = dict(first_call_s=first, ttft_s=statistics.median(times), new_length_ttft_s=new_length,
                                    tokens=list(first_tokens), logits=np.asarray(logits[0], np.float64))
    print(f"{route}: load {load:.2f} s; " + "; ".join(
        f"{n}: first call (8 tokens) {rows[(route, n)]['first_call_s'] * 1e3:.0f} ms, TTFT {rows[(route, n)]['ttft_s'] * 1e3:.1f} ms"
        f", TTFT at a new length {rows[(route, n)]['new_length_ttft_s'] * 1e3:.1f} ms"
        for n in lengths), flush=True)
prefill.choose_route = ours_choice
graphs = cudnn_sdpa._state.get("graphs", {})
print("cuDNN graphs kept:", len(graphs), "on the kernel cache:", sum(bool(getattr(g, "cached", False))
                                                                      for g in graphs.values()),
      "kernel cache error:", cudnn_sdpa._state.get("kernel_cache_error"), "prewarm error:",
      cudnn_sdpa._state.get("prewarm_error"), "unavailable:", cudnn_sdpa.unavailable_reason())


def gap(x, ref):       # the first token's logits: max |x - ref| ÷ ref's spread
    return float(np.abs(x - ref).max() / (ref.std() + 1e-30))


for n in lengths:
    a, b, f = rows[("cudnn", n)], rows[("ours", n)], rows[("fp32", n)]
    same = a["tokens"] == b["tokens"]
    top = np.sort(f["logits"])[-2:]
    print(f"{n} tokens: same 8 greedy tokens on both routes: {same}"
          + ("" if same else f" ({a['tokens']} vs {b['tokens']})")
          + f"; as the fp32 route's: cudnn {a['tokens'] == f['tokens']}, ours {b['tokens'] == f['tokens']}"
          + f"; first logits max |diff| / std: cudnn-fp32 {gap(a['logits'], f['logits']):.4f}, ours-fp32 "
          + f"{gap(b['logits'], f['logits']):.4f}, cudnn-ours {gap(a['logits'], b['logits']):.4f}"
          + f"; fp32 top-2 gap / std {(top[1] - top[0]) / f['logits'].std():.4f}")
print(json.dumps({f"{r}_{n}": {k: v for k, v in d.items() if k not in ("tokens", "logits")}
                  for (r, n), d in rows.items()}))
