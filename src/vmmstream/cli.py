"""The ``vmmstream`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .budget import format_bytes, parse_budget
from .config import ALL as ALL_VARIABLES
from .config import BUDGET, LEGACY_ALLOCATOR
from .cli_model import _budget
from .errors import VmmstreamError

# Errors that mean "the request is wrong", not "vmmstream is broken": the package's own errors, the API's
# ValueError/TypeError for a bad argument (token ids outside the vocabulary are only known once the checkpoint is
# open), and OSError from reading a path or writing a checkpoint. Anything else is a bug and keeps its traceback.
_USER_ERRORS = (VmmstreamError, ValueError, TypeError, OSError)


def _info(args) -> int:
    from . import selfcheck
    from .driver import open_driver, resolve_backend
    backend = resolve_backend(args.backend)
    driver = open_driver(backend)
    try:
        info = driver.device_info()
        budget_value = args.budget if args.budget is not None else (BUDGET.get() if BUDGET.is_set() else "auto")
        budget = parse_budget(budget_value, info.total_bytes, device_free=info.free_bytes)
    finally:
        driver.close()
    check = selfcheck.run(backend)
    out = {
        "vmmstream": __version__,
        "backend": info.backend,
        "device": info.name,
        "compute_capability": ".".join(map(str, info.compute_capability)) if info.compute_capability else None,
        "driver": info.driver_version,
        "total_bytes": info.total_bytes,
        "free_bytes": info.free_bytes,
        "granularity": info.granularity,
        "budget": {"value": str(budget_value), "bytes": budget},
        "allocator": "legacy" if LEGACY_ALLOCATOR.get() else "vmm",
        "selfcheck": check,
        "environment": {v.name: v.help for v in ALL_VARIABLES},
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"vmmstream {__version__}")
        print(f"backend      {out['backend']}")
        print(f"device       {out['device']}" + (f"  (sm_{info.compute_capability[0]}{info.compute_capability[1]})"
                                                  if info.compute_capability else ""))
        print(f"driver       {out['driver']}")
        print(f"memory       {format_bytes(info.free_bytes)} free of {format_bytes(info.total_bytes)}")
        print(f"granularity  {format_bytes(info.granularity)}")
        print(f"budget       {format_bytes(budget)}  (from {budget_value!r})")
        print(f"allocator    {out['allocator']}")
        print("pool self-check: " + ("ok" if check["ok"] else "FAILED"))
        for name, ok in check["checks"].items():
            print(f"  [{'x' if ok else ' '}] {name}")
    return 0 if check["ok"] else 1


def _cache(args) -> int:
    from vmmstream.kernels.base import jit
    root = jit.cache_root() / "kernels"
    if args.clear:
        freed = jit.clear()
        print(f"removed {root} ({format_bytes(freed)})")
        return 0
    files, size = jit.folder_size(root)
    builds = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    out = {"folder": str(root), "this_build": str(jit.cache_dir()), "enabled": jit.enabled(), "files": files,
           "bytes": size, "builds": builds}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"kernel cache  {root}  ({'on' if out['enabled'] else 'off: VMMSTREAM_KERNEL_CACHE'})")
        print(f"this build    {jit.source_tag()}" + ("" if jit.source_tag() in builds else "  (nothing compiled yet)"))
        print(f"holds         {files} files, {format_bytes(size)}, {len(builds)} build(s)")
        print("clear it with `vmmstream cache --clear` (or delete the folder)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vmmstream", description="Run LLMs larger than your GPU budget.")
    p.add_argument("--version", action="version", version=f"vmmstream {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="backend, device, driver, granularity, budget and a pool self-check")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--budget", type=_budget, default=None,
                      help="budget to resolve (default: VMMSTREAM_BUDGET or auto)")
    info.add_argument("--backend", default=None, choices=("cuda", "host", "auto"))
    info.set_defaults(fn=_info)
    cache = sub.add_parser("cache", help="where the compiled kernels are kept, how much, and how to clear them",
                           description="Compiled CUDA kernels are kept on disk, one folder per build of the "
                                       "kernels, so a second process starts without compiling. VMMSTREAM_CACHE_DIR "
                                       "moves the folder; VMMSTREAM_KERNEL_CACHE=0 turns it off.")
    cache.add_argument("--clear", action="store_true", help="delete every compiled kernel")
    cache.add_argument("--json", action="store_true", help="print JSON")
    cache.set_defaults(fn=_cache)
    from .cli_model import add_subcommands; add_subcommands(sub)
    from .cli_run import add_subcommands as add_run; add_run(sub)
    from .cli_serve import add_subcommands as add_serve; add_serve(sub)
    return p


def main(argv=None) -> int:
    """The ``vmmstream`` command; returns its exit code (2: a bad request, 130: interrupted)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:           # a bad argument (2, after argparse's usage and error lines), --help (0)
        return exc.code
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        # The commands hold models and drivers in `with` / `finally`, so by now everything is released.
        print("vmmstream: interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as exc:
        print(f"vmmstream: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
