"""Load on a running ``vmmstream serve``: for each number of concurrent clients, every client sends streamed
completions one after another; reports requests/s, aggregate tokens/s, p50 / p99 time to first token and
inter-token latency as the clients see them (wall clock at the client), and how many requests were refused
(429 / 503: counted, not retried).

    vmmstream serve ./llama-3b --budget 2GiB &
    python bench/serve_load.py --url http://127.0.0.1:8000 --clients 1,8,32,64 --requests 4 --max-tokens 128
    python bench/serve_load.py --prompt-tokens 16 --json out.json    # token ids: checkpoints without tokenizer

A token is one server-sent event (the server sends one per token); the time to first token runs from sending
the request to the first token's event, queueing included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx


def percentile(values, q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


async def _one(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "tokens": 0}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"status": 500, "tokens": len(stamps)}
            if event["choices"][0]["finish_reason"] is None:
                stamps.append(time.perf_counter())
    return {"status": 200, "tokens": len(stamps), "ttft": stamps[0] - t0 if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "seconds": time.perf_counter() - t0}


async def run_level(url: str, body: dict, clients: int, requests: int) -> dict:
    """``clients`` concurrent clients, ``requests`` streamed completions each, back to back."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker():
            return [await _one(client, body) for _ in range(requests)]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*[worker() for _ in range(clients)])
        wall = time.perf_counter() - t0
    done = [x for xs in per_client for x in xs]
    ok = [x for x in done if x["status"] == 200]
    ttft = [x["ttft"] for x in ok if x.get("ttft") is not None]
    gaps = [g for x in ok for g in x.get("gaps", ())]
    tokens = sum(x["tokens"] for x in ok)
    return {"clients": clients, "requests": len(done), "completed": len(ok),
            "refused": sum(x["status"] in (429, 503) for x in done),
            "failed": sum(x["status"] not in (200, 429, 503) for x in done),
            "wall_s": wall, "requests_per_s": len(ok) / wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "itl_mean_s": statistics.fmean(gaps) if gaps else None}


def served_model(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run(url: str, *, clients=(1, 8, 32, 64), requests: int = 4, max_tokens: int = 64, prompt="Once upon a time",
        temperature: float = 0.0, model: str | None = None) -> list[dict]:
    """Every level in turn (one warm-up request first); ``prompt`` is text or a list of token ids."""
    url = url.rstrip("/")
    body = {"model": model or served_model(url), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "seed": 0, "stream": True}
    asyncio.run(run_level(url, body, 1, 1))
    return [asyncio.run(run_level(url, body, c, requests)) for c in clients]


def table(rows: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f}"
    out = [f"{'clients':>7} {'requests':>8} {'refused':>7} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
           f"{'ITL p50':>8} {'ITL p99':>8}  (ms)"]
    for r in rows:
        out.append(f"{r['clients']:>7} {r['completed']:>8} {r['refused']:>7} {r['requests_per_s']:>8.2f} "
                   f"{r['tokens_per_s']:>9.1f} {ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>9} "
                   f"{ms(r['itl_p50_s']):>8} {ms(r['itl_p99_s']):>8}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's, from /v1/models)")
    p.add_argument("--clients", default="1,8,32,64", help="comma-separated levels of concurrency")
    p.add_argument("--requests", type=int, default=4, help="requests per client at each level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="Once upon a time")
    src.add_argument("--prompt-tokens", type=int, default=None,
                     help="send N token ids (3, 4, ...) instead of text: for checkpoints without a tokenizer")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    a = p.parse_args(argv)
    prompt = [3 + i % 64 for i in range(a.prompt_tokens)] if a.prompt_tokens else a.prompt
    rows = run(a.url, clients=[int(c) for c in a.clients.split(",")], requests=a.requests,
               max_tokens=a.max_tokens, prompt=prompt, temperature=a.temperature, model=a.model)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"url": a.url, "max_tokens": a.max_tokens, "requests_per_client": a.requests, "rows": rows},
                      f, indent=2)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
