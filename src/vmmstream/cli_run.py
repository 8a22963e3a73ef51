"""``vmmstream generate``, ``vmmstream chat`` and ``vmmstream demo``: load a checkpoint under a budget and generate."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time

from .budget import format_bytes
from .cli_model import _budget, _non_negative, _positive, _slots


def add_subcommands(subparsers) -> None:
    """Register ``generate``, ``chat`` and ``demo`` on the ``vmmstream`` parser's subparsers."""
    gen = subparsers.add_parser(
        "generate", help="load a checkpoint under a budget and continue a prompt",
        description="Load MODEL (a Hugging Face checkpoint directory) within the device memory budget, keeping "
                    "what fits resident and streaming the rest, and generate tokens (greedy by default).")
    gen.add_argument("model", metavar="MODEL")
    gen.add_argument("--budget", type=_budget, default=None,
                     help="device memory budget, e.g. 2GiB (default: VMMSTREAM_BUDGET, else auto = 0.9 x free)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in MODEL)")
    src.add_argument("--ids", type=_ids, help="prompt token ids, comma separated: 1,2,3")
    _add_run_options(gen, max_new_tokens=32, max_new_help=None,
                     context_help="positions the KV cache holds (default: min(4096, max_position_embeddings, sliding_window))")
    gen.add_argument("--plan", action="store_true", help="print the plan before generating")
    gen.add_argument("--stats", action="store_true", help="print the counters after generating")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(fn=_generate)

    chat = subparsers.add_parser(
        "chat", help="an interactive chat in the terminal with a checkpoint loaded under a budget",
        description="Load MODEL within the device memory budget and chat: each line read from stdin is a user "
                    "message; the answer (the checkpoint's chat template, greedy by default, until its end of "
                    "turn) streams to stdout as it is produced and tokens/s go to stderr. The conversation is "
                    "kept; /reset starts over; /exit or end of input (Ctrl-D) quits. Ctrl-C stops an answer.")
    chat.add_argument("model", metavar="MODEL")
    chat.add_argument("--budget", type=_budget, default=None,
                      help="device memory budget, e.g. 2GiB (default: VMMSTREAM_BUDGET, else auto = 0.9 x free)")
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_run_options(chat, max_new_tokens=512, max_new_help="most tokens an answer may have",
                     context_help="positions the KV cache holds, the whole conversation included "
                                  "(default: min(4096, max_position_embeddings, sliding_window))")
    chat.set_defaults(fn=_chat)

    demo = subparsers.add_parser(
        "demo", help="make a small checkpoint, load it under a budget below its size, generate, print plan and stats",
        description="The main job in one command: writes a random-weight checkpoint of a preset into a temporary "
                    "directory, loads it under a budget that forces part of it to stream, generates, and prints "
                    "the plan, the tokens and the counters. Runs on the host backend when there is no GPU.")
    demo.add_argument("--preset", default=None,
                      help="preset to build (default: 'small' on a GPU, 'tiny' on the host backend)")
    demo.add_argument("--budget", type=_budget, default=None, help="budget (default: the floor plus half the weights)")
    demo.add_argument("--max-new-tokens", type=_positive, default=16)
    demo.add_argument("--backend", default=None, choices=("cuda", "host", "auto"))
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(fn=_demo)


def _generate(args) -> int:
    from .api import load_model
    from .errors import VmmstreamError
    t0 = time.perf_counter()
    with load_model(args.model, args.budget, max_context=args.max_context, slots=args.slots,
                    backend=args.backend, quantize=args.quantize) as model:
        load_s = time.perf_counter() - t0
        if args.plan and not args.json:
            print(model.plan)
            if args.quantize:
                print(model.weights.quant)
        prompt = args.prompt if args.prompt is not None else args.ids
        if args.prompt is not None and model.tokenizer is None:
            raise VmmstreamError(f"{args.model} has no tokenizer.json; pass --ids instead of --prompt")
        options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       stop=args.stop or None, eos_token_id=[] if args.ignore_eos else None)
        t1 = time.perf_counter()
        if args.json or args.prompt is None:
            out = model.generate(prompt, args.max_new_tokens, **options)
        else:                           # text: written as it is produced
            with model.stream(prompt, args.max_new_tokens, **options) as s:
                for tok in s:
                    _write(tok.text)
            _write("\n")
            out = s.text
        gen_s = time.perf_counter() - t1
        stats = model.stats()
        if args.json:
            print(json.dumps({"output": out, "load_s": load_s, "generate_s": gen_s, "plan": model.plan.to_dict(),
                              "stats": stats}, indent=2, default=str))
            return 0
        if args.prompt is None:
            print(",".join(map(str, out)))
        if args.stats:
            _print_stats(stats, gen_s)
    return 0


def _chat(args) -> int:
    from .api import load_model
    from .errors import ContextLengthError, VmmstreamError
    interactive = sys.stdin.isatty()
    with load_model(args.model, args.budget, max_context=args.max_context, slots=args.slots,
                    backend=args.backend, quantize=args.quantize) as model:
        if model.tokenizer is None:
            raise VmmstreamError(f"{args.model} has no tokenizer.json; chat needs it")
        _ = model.chat_template             # no template, or one that does not compile: an error before the loop
        start = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(start)
        options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       stop=args.stop or None, eos_token_id=[] if args.ignore_eos else None)
        if interactive:
            print(f"vmmstream chat: {model.path.name} ({model.plan.strategy}, {model.backend}); /reset starts over, "
                  "/exit or Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:       # at the prompt: leave
                print(file=sys.stderr)
                return 0
            if not line:                    # end of input
                if interactive:
                    print(file=sys.stderr)
                return 0
            line = line.rstrip("\r\n")
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                messages = list(start)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            t0 = time.perf_counter()
            try:
                s = model.chat(messages, args.max_new_tokens, stream=True, **options)
                n = 0
                try:
                    for tok in s:
                        n += 1
                        _write(tok.text)
                except KeyboardInterrupt:   # stop this answer, keep the conversation
                    _write(" [stopped]")
                finally:
                    s.close()
            except ContextLengthError as exc:
                messages.pop()
                print(f"vmmstream: {exc}; /reset starts a new conversation", file=sys.stderr)
                continue
            dt = time.perf_counter() - t0
            _write("\n")
            messages.append({"role": "assistant", "content": s.text})
            print(f"[{n} tokens in {dt:.2f} s, {n / dt if dt > 0 else 0.0:.1f} tokens/s"
                  f"{'' if s.finish_reason != 'length' else '; max-new-tokens reached'}]", file=sys.stderr,
                  flush=True)


def _write(text) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _add_run_options(p, *, max_new_tokens: int, max_new_help, context_help: str) -> None:
    """The options ``generate`` and ``chat`` share: lengths, placement, sampling, stops, backend."""
    p.add_argument("--max-new-tokens", type=_positive, default=max_new_tokens, help=max_new_help)
    p.add_argument("--max-context", type=_positive, default=None, help=context_help)
    p.add_argument("--slots", type=_slots, default=None, help="streaming slots K >= 2 (default 2)")
    p.add_argument("--quantize", default=None, choices=("int4", "mxfp4"),
                   help="store the layers' linear weights quantized (quantized while loading)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=_non_negative, default=0, help="0 = no limit (default)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]; 1 = no limit (default)")
    p.add_argument("--seed", type=_non_negative, default=0)
    _add_stops(p)
    p.add_argument("--backend", default=None, choices=("cuda", "host", "auto"))


def _add_stops(p) -> None:
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the text contains TEXT (not printed); repeatable")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode all of --max-new-tokens, past the checkpoint's end-of-sequence ids")


def _demo(args) -> int:
    from .api import load_model
    from .driver import resolve_backend
    from .loading import workspace_peaks
    from .model import get_preset, make_checkpoint, open_checkpoint
    from .planning import PREFILL_CHUNK, make_plan
    backend = resolve_backend(args.backend)
    preset = get_preset(args.preset or ("small" if backend == "cuda" else "tiny"))
    max_context = min(256, preset.config.max_position_embeddings)
    with tempfile.TemporaryDirectory(prefix="vmmstream-demo-") as tmp:
        make_checkpoint(preset, tmp, seed=0)
        ck = open_checkpoint(tmp)
        budget = args.budget
        if budget is None:
            # the floor plus half the weights: a budget below the model's size, so some of it streams
            from .driver import open_driver
            drv = open_driver(backend)
            try:
                gran = drv.granularity()
            finally:
                drv.close()
            ws = workspace_peaks(ck.config, max_context, min(PREFILL_CHUNK, max_context), backend)
            full = make_plan(ck.config, ck.tensors, 1 << 50, max_context=max_context, granularity=gran, workspace=ws)
            budget = full.floor + full.weight_bytes // 2
        size = sum(t.nbytes for t in ck.tensors.values())
        with load_model(tmp, budget, max_context=max_context, backend=backend) as model:
            prompt = [1, 2, 3, 4]
            t0 = time.perf_counter()
            ids = model.generate(prompt, args.max_new_tokens, eos_token_id=[])    # random weights: all of them
            gen_s = time.perf_counter() - t0
            stats = model.stats()
            if args.json:
                print(json.dumps({"preset": preset.name, "backend": backend, "checkpoint_bytes": size,
                                  "budget": model.plan.budget, "prompt": prompt, "output": ids,
                                  "plan": model.plan.to_dict(), "stats": stats}, indent=2, default=str))
                return 0
            p = model.plan
            print(f"vmmstream demo: preset {preset.name} ({preset.config.n_params():,} parameters, "
                  f"{format_bytes(size)} bf16) on the {backend} backend. Fully resident it needs "
                  f"{format_bytes(p.weight_bytes + p.floor - p.slot_count * p.slot_bytes)} of device memory "
                  f"(weights in whole {format_bytes(p.granularity)} granules + KV, workspace, activations); "
                  f"the budget is {format_bytes(p.budget)}, so {format_bytes(p.streamed_bytes_per_token)} "
                  "stream every token")
            print(model.plan)
            print(f"prompt {prompt} -> {args.max_new_tokens} new tokens: {ids}")
            _print_stats(stats, gen_s)
    return 0


def _print_stats(s: dict, seconds: float) -> None:
    print("stats:")
    keys = ("strategy", "prefill_tokens", "decode_tokens", "graph_captures", "graph_replays", "page_ins",
            "page_in_bytes", "streamed_bytes_per_token", "byte_hit_rate", "h2d_gbps", "decode_tokens_per_s",
            "tokens_per_s_bound", "vmm_calls_per_decode_token", "kv_committed", "committed", "peak_committed",
            "budget")
    for k in keys:
        v = s.get(k)
        if isinstance(v, float):
            v = f"{v:,.3f}"
        elif isinstance(v, int) and k in ("page_in_bytes", "streamed_bytes_per_token", "kv_committed", "committed",
                                          "peak_committed", "budget"):
            v = f"{v:,} ({format_bytes(v)})"
        print(f"  {k:<28} {v}")
    print(f"  {'generate wall time':<28} {seconds:.3f} s (host clock, includes prefill)")
    print("  (h2d and decode rates are device time from CUDA events; on the host backend, emulated stream time)",
          file=sys.stdout)


def _ids(text: str) -> list:
    """Comma-separated non-negative token ids; whether they are inside the vocabulary is known only once the
    checkpoint is open (the API's ValueError, reported by ``main``)."""
    accepted = "comma-separated non-negative integer token ids such as 1,7,42"
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdecimal() for x in parts):      # isdecimal: no sign, point or exponent
        raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted}")
    return [int(x) for x in parts]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _temperature(text: str) -> float:
    v = _float(text)
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0 (0 = greedy)")
    return v


def _top_p(text: str) -> float:
    v = _float(text)
    if not 0 < v <= 1:                  # false for nan too
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number in (0, 1]")
    return v
