"""Turn a pytest-benchmark JSON into the Markdown tables of docs/BENCHMARKS.md.

    python bench/report.py bench.json machine.txt
Every benchmark puts its figures in extra_info; this prints them, one table per benchmark module.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def fmt(v):
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def main(path: str, machine: str | None = None) -> None:
    data = json.load(open(path))
    info = data.get("machine_info", {})
    print(f"Run {data.get('datetime', '?')}, Python {info.get('python_version', '?')}")
    if machine:
        print("\n```\n" + open(machine).read().strip() + "\n```")
    groups = defaultdict(list)
    for b in data["benchmarks"]:
        groups[b["fullname"].split("::")[0]].append(b)
    for module, benches in groups.items():
        keys = []
        for b in benches:
            for k in b.get("extra_info", {}):
                if k not in keys:
                    keys.append(k)
        print(f"\n### {module}\n")
        print("| benchmark | median (host) | " + " | ".join(keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for b in benches:
            ei = b.get("extra_info", {})
            med = b["stats"]["median"] * 1e3
            print(f"| {b['name']} | {med:.3f} ms | " + " | ".join(fmt(ei.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
