"""``vmmstream plan`` and ``vmmstream make-checkpoint``: the model and planning layers from the command line.

Neither touches a device: ``plan`` reads ``config.json`` and the safetensors headers (no weight bytes),
or a preset's shapes; ``make-checkpoint`` writes random bf16 weights in Hugging Face layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .budget import format_bytes, parse_budget, parse_budget_spec
from .config import BUDGET, LEGACY_ALLOCATOR
from .errors import BudgetError, VmmstreamError

_PROGRESS_MIN_BYTES = 64 << 20     # smaller checkpoints are written before a progress line would help


def add_subcommands(subparsers) -> None:
    """Register ``plan`` and ``make-checkpoint`` on the ``vmmstream`` parser's subparsers."""
    from .model import PRESETS
    plan = subparsers.add_parser(
        "plan", help="print the memory plan for a checkpoint (or a preset) under a budget; reads no weights",
        description="Plan where every device byte of MODEL goes under a budget. MODEL is a Hugging Face "
                    f"checkpoint directory or a preset name ({', '.join(PRESETS)}). Reads only config.json "
                    "and the safetensors headers.")
    plan.add_argument("model", metavar="MODEL")
    plan.add_argument("--budget", type=_budget, default=None,
                      help="device memory budget in bytes, e.g. 2GiB (default: VMMSTREAM_BUDGET)")
    plan.add_argument("--max-context", type=_positive, default=None,
                      help="longest sequence the KV cache holds (default: min(4096, max_position_embeddings, sliding_window))")
    plan.add_argument("--batch", type=_positive, default=None, help="sequences decoded together (default 1)")
    plan.add_argument("--slots", type=_slots, default=None, help="weight slots K >= 2 (default 2)")
    plan.add_argument("--granularity", default=None, help="VMM granularity (default 2MiB, the H200's)")
    plan.add_argument("--h2d-gbps", type=float, default=None,
                      help="host-to-device bandwidth in GB/s, for the tokens/s bound (H200 pinned: 54.7)")
    plan.add_argument("--legacy", action="store_true", default=None,
                      help="plan for VMMSTREAM_LEGACY_ALLOCATOR=1: nothing streams")
    plan.add_argument("--tensors", action="store_true", help="list every tensor's placement")
    plan.add_argument("--quantize", default=None, choices=("int4", "mxfp4"),
                      help="plan with the layers' linear weights stored quantized")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(fn=_plan)

    make = subparsers.add_parser(
        "make-checkpoint", help="write a random-weight bf16 checkpoint of a preset in Hugging Face layout",
        description="Write config.json and model.safetensors (or shards + index) with random bf16 weights.")
    make.add_argument("--preset", required=True, choices=sorted(PRESETS))
    make.add_argument("out", metavar="OUT", help="output directory")
    make.add_argument("--seed", type=_non_negative, default=0)
    make.add_argument("--shard-bytes", default=None, help="split into shards of at most this size, e.g. 2GB")
    make.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in OUT")
    make.set_defaults(fn=_make_checkpoint)


def _plan(args) -> int:
    from .loading import plan_walked
    from .model import PRESETS, open_checkpoint, synthetic_tensors
    if args.budget is not None:
        budget_value, source = args.budget, ("explicit", f"--budget {args.budget}")
    elif BUDGET.is_set():
        budget_value, source = BUDGET.get(), ("env", f"VMMSTREAM_BUDGET={BUDGET.get()}")
    else:
        raise BudgetError("plan needs a budget in bytes: pass --budget 6GiB or set VMMSTREAM_BUDGET "
                          "(plan looks at no device, so 'auto' and fractions cannot be resolved)")
    budget = parse_budget(budget_value)        # no device total: a fraction is a clear BudgetError
    if args.legacy is None and LEGACY_ALLOCATOR.is_set():
        legacy, legacy_src = LEGACY_ALLOCATOR.get(), "env"
    else:
        legacy, legacy_src = bool(args.legacy), "explicit" if args.legacy else "inferred"
    gran = None if args.granularity is None else parse_budget(args.granularity)

    path = Path(args.model)
    quantize = args.quantize
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        ck = open_checkpoint(path)
        config, tensors, what = ck.config, ck.tensors, str(path)
        quantize = ck.quantization or quantize          # a GPTQ / AWQ checkpoint is int4 as stored
    elif args.model in PRESETS:
        config = PRESETS[args.model].config
        tensors, what = synthetic_tensors(config), f"preset {args.model}"
    else:
        raise VmmstreamError(f"{args.model!r} is neither a checkpoint directory, a .gguf file nor a preset "
                             f"({', '.join(PRESETS)})")
    try:
        plan = plan_walked(config, tensors, budget, backend="cuda", budget_source=source,
                           max_context=args.max_context, batch=args.batch, slots=args.slots, granularity=gran,
                           h2d_gbps=args.h2d_gbps, legacy=legacy, sources={"legacy": legacy_src},
                           quantize=quantize)
    except VmmstreamError:
        raise
    except ValueError as exc:
        raise VmmstreamError(str(exc)) from None
    if args.json:
        print(json.dumps({"model": what, "legacy": legacy, **plan.to_dict()}, indent=2))
    else:
        print(f"model: {what}  ({config.n_params() / 1e9:.2f} B parameters, {config.num_hidden_layers} layers)")
        print(plan.table(tensors=args.tensors))
    return 0


def _make_checkpoint(args) -> int:
    from .model import get_preset, make_checkpoint
    preset = get_preset(args.preset)
    shard = None if args.shard_bytes is None else parse_budget(args.shard_bytes)
    total = preset.weight_bytes
    from .progress import ByteProgress
    bar = ByteProgress(total, f"writing {args.out}") if total >= _PROGRESS_MIN_BYTES else None
    try:
        out = make_checkpoint(preset, args.out, seed=args.seed, shard_bytes=shard, overwrite=args.overwrite,
                              progress=(lambda done, tot: bar(done, tot)) if bar else None)
    finally:
        if bar is not None:     # end the bar, so an error or "interrupted" starts on its own line
            bar.close()
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".json"))
    print(f"wrote {out}: preset {preset.name}, {preset.config.n_params():,} parameters, "
          f"{format_bytes(total)} bf16, seed {args.seed}; {', '.join(files)}")
    return 0


# Argument types: a bad value is an argparse error at parse time ("vmmstream <sub>: error: argument --x: ...",
# exit 2), before any checkpoint is opened or device touched. Each message names the value and what is accepted.

def _integer(text: str, lo: int, accepted: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected {accepted}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted}")
    return v


def _positive(text: str) -> int:
    return _integer(text, 1, "an integer >= 1")


def _non_negative(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


def _slots(text: str) -> int:
    return _integer(text, 2, "an integer >= 2 (streaming fills one slot while another is read)")


def _budget(text: str) -> str:
    """The budget as given (a fraction or 'auto' is resolved against the device later), checked by the package's
    own parser so the message is the one the API gives."""
    try:
        parse_budget_spec(text)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
