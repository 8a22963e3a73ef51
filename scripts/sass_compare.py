"""Fingerprint the sm_90 SASS of kernel modules' ``SIGNATURES`` in a source tree: one line per kernel, its
instruction count and a hash of its instructions (symbol names and labels masked). Two trees whose lines are
equal compile to the same machine code, which is how a change that only moves code is checked without a GPU.

    python scripts/sass_compare.py TREE [MODULE ...] > a.txt      # MODULE: gemv moe qgemv (the default)
    git worktree add /tmp/old REV && python scripts/sass_compare.py /tmp/old > b.txt && diff a.txt b.txt

Needs ``ptxas`` and ``cuobjdump`` of CUDA 13 (the ``nvidia-cuda-nvcc`` and ``nvidia-cuda-cuobjdump`` wheels):
their folder in ``SASS_BIN``, else on ``PATH``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile


def _tool(name):
    d = os.environ.get("SASS_BIN")
    path = os.path.join(d, name) if d else shutil.which(name)
    if not path or not os.path.exists(path):
        sys.exit(f"{name} not found: set SASS_BIN to the folder holding ptxas and cuobjdump")
    return path


def main(tree, modules):
    tree = os.path.abspath(tree)
    kdir = os.path.join(tree, "kernels")
    # this tree's kernels package in place of the installed one
    spec = importlib.util.spec_from_file_location("vmmstream.kernels", os.path.join(kdir, "__init__.py"),
                                                  submodule_search_locations=[kdir])
    import vmmstream  # noqa: F401 (the parent package)
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["vmmstream.kernels"] = pkg
    spec.loader.exec_module(pkg)
    from numba import cuda
    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        for name in modules:
            mod = importlib.import_module(f"vmmstream.kernels.{name}")
            print(f"# {mod.__file__}", file=sys.stderr)
            for i, (fn, sig) in enumerate(mod.SIGNATURES):
                ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
                with open(ptx_path, "w") as f:
                    f.write(ptx)
                subprocess.run([ptxas, "-arch=sm_90", ptx_path, "-o", cubin], check=True)
                sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
                ins = [re.sub(r"/\*[0-9a-f]+\*/", "", ln).strip() for ln in sass.splitlines()
                       if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
                ins = [re.sub(r"_cudapy\S*|\$\S+", "X", ln) for ln in ins]
                digest = hashlib.md5("\n".join(ins).encode()).hexdigest()[:12]
                print(f"{name} {i} {getattr(fn, '__name__', '?')} {len(ins)} {digest}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:] or ["gemv", "moe", "qgemv"])
