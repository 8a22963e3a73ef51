"""The house's rules, read from the source: no import circle, imports point down the layers, and the
repository's ``kernels/`` folder never shadows another package when Python starts in the repository root.

Every import counts, a function-local (lazy) one included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Layers, lowest first. A module may import its own group and any group of a lower rank, never a higher rank
# nor another group of the same rank. Groups are top-level modules or subpackages of ``vmmstream``, and the
# kernel families of ``vmmstream.kernels``. docs/ARCHITECTURE.md draws the same table.
RANKS = {
    "errors": 0, "align": 0, "validate": 0, "interrupts": 0,
    "budget": 1, "kernels.base": 1, "progress": 2,
    "config": 2, "kernels.ops": 2, "model": 2, "text": 2, "chat": 2,
    "driver": 3, "kernels.matmul": 3, "kernels.attention": 3,
    "memory": 4, "kernels.moe": 4, "quantization": 4, "prequantized": 4, "kernels": 4,
    "planning": 5, "conversion": 5,
    "execution": 6,
    "loading": 7, "generation": 7, "batching": 7,
    "api": 8, "selfcheck": 8, "numba_plugin": 8, "cli_model": 8, "server": 8,
    "cli_run": 9, "cli_serve": 9,
    "cli": 10,
    "__main__": 11,
    "vmmstream": 11,
}


def _modules() -> dict[str, str]:
    mods = {}
    for root, pkg in (("src/vmmstream", "vmmstream"), ("kernels", "vmmstream.kernels")):
        for dp, _, fs in os.walk(os.path.join(ROOT, root)):
            for f in fs:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dp, f), os.path.join(ROOT, root))[:-3].replace(os.sep, ".")
                if rel == "__init__":
                    name = pkg
                elif rel.endswith(".__init__"):
                    name = f"{pkg}.{rel[:-9]}"
                else:
                    name = f"{pkg}.{rel}"
                mods[name] = os.path.join(dp, f)
    return mods


def _imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports (at any depth of its code)."""
    out = {}
    for name, path in mods.items():
        base = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                b = base
                for _ in range(max(node.level - 1, 0)):
                    b = b.rsplit(".", 1)[0]
                m = (b + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                cands = [m] + [f"{m}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            for c in cands:
                if c.startswith("kernels."):
                    raise AssertionError(f"{path}: imports {c!r}; the kernels are vmmstream.kernels")
                while c and c not in mods:
                    c = c.rsplit(".", 1)[0] if "." in c else ""
                if c and c != name and not name.startswith(c + "."):
                    deps.add(c)
        out[name] = deps
    return out


def _group(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "vmmstream"
    if parts[1] == "kernels" and len(parts) > 2:
        return "kernels." + parts[2]
    return parts[1]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circle():
    graph = _imports(_modules())
    assert _circles(graph) == []


def test_circle_detector_finds_a_circle():
    """The detector itself: a circle of three and a self-contained pair are found, a chain is not."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set(), "f": {"g"}, "g": {"f"}}
    assert sorted(_circles(g)) == [["a", "b", "c"], ["f", "g"]]


def test_every_module_has_a_layer():
    groups = {_group(m) for m in _modules()}
    assert groups - set(RANKS) == set(), "a new module or package needs a row in RANKS (and in ARCHITECTURE.md)"


def test_imports_point_down_the_layers():
    bad = []
    for mod, deps in _imports(_modules()).items():
        g = _group(mod)
        for dep in deps:
            h = _group(dep)
            if h != g and RANKS[h] >= RANKS[g]:
                bad.append(f"{mod} ({g}, layer {RANKS[g]}) imports {dep} ({h}, layer {RANKS[h]})")
    assert bad == []


def test_kernel_base_imports_no_family():
    deps = _imports(_modules())
    base = {m: d for m, d in deps.items() if _group(m) == "kernels.base"}
    assert base, "kernels/base is where the shared kernel code lives"
    assert not {x for d in base.values() for x in d if _group(x).startswith("kernels.") and _group(x) != "kernels.base"}


def test_repository_root_does_not_shadow_the_kernels_package():
    """Python started in the repository root puts it first on sys.path; ``kernels/`` there must not be taken for
    a top-level package (it shadowed Hugging Face's ``kernels``, and building a transformers model failed)."""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "origin = spec.origin if spec else None\n"
            "assert origin is None or not origin.startswith(sys.argv[1]), origin\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
            "                             num_attention_heads=2, num_key_value_heads=1))\n"
            "import vmmstream.kernels.matmul.quant.gemv\n")
    r = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "kernels")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
