"""Time to first token of long prompts with prefill attention through cuDNN and through our kernel, one process,
one checkpoint: the wall clock of ``generate(prompt, 1)`` (the median of three, after a first call of 8 tokens),
whether both routes give the same greedy tokens, and how far apart their first logits are (÷ their spread).
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
for route in ("cudnn", "ours"):
    prefill.PREFER_CUDNN = route == "cudnn"
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
            rows[(route, n)] = dict(first_call_s=first, ttft_s=statistics.median(times), tokens=list(first_tokens),
                                    logits=np.asarray(logits[0], np.float64))
    print(f"{route}: load {load:.2f} s; " + "; ".join(
        f"{n}: first call (8 tokens) {rows[(route, n)]['first_call_s'] * 1e3:.0f} ms, TTFT {rows[(route, n)]['ttft_s'] * 1e3:.1f} ms"
        for n in lengths), flush=True)
print("cuDNN graphs kept:", len(cudnn_sdpa._state.get("graphs", {})), "prewarm error:",
      cudnn_sdpa._state.get("prewarm_error"), "unavailable:", cudnn_sdpa.unavailable_reason())
for n in lengths:
    a, b = rows[("cudnn", n)], rows[("ours", n)]
    same = a["tokens"] == b["tokens"]
    # the first token's logits: both routes round P to bf16, in different places; a wrong read of the cache is
    # a difference of the logits' own size, rounding a small fraction of it
    la, lb = a["logits"], b["logits"]
    rel = float(np.abs(la - lb).max() / (lb.std() + 1e-30))
    top = np.sort(lb)[-2:]
    print(f"{n} tokens: same 8 greedy tokens on both routes: {same}"
          + ("" if same else f" ({a['tokens']} vs {b['tokens']})")
          + f"; first logits max |diff| / std {rel:.4f}, our top-2 gap / std {(top[1] - top[0]) / lb.std():.4f}")
print(json.dumps({f"{r}_{n}": {k: v for k, v in d.items() if k not in ("tokens", "logits")}
                  for (r, n), d in rows.items()}))
