#!/usr/bin/env bash
# Reproduce the GPU evidence in one command, from the project root on a GPU machine:
#   scripts/gpu-evidence.sh OUTDIR [PYTEST_K_EXPRESSION]
# Runs the gpu test tier and the benchmarks; writes logs, pytest-benchmark JSON and a Markdown
# summary into OUTDIR. Wheels in .whl/ (numpy<2.5 for numba-cuda 0.30) are installed into .site/ first.
set -uo pipefail
out=${1:?usage: scripts/gpu-evidence.sh OUTDIR [PYTEST_K_EXPRESSION]}
kexpr=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || { echo "editable install failed"; exit 1; }
kargs=()
[ -n "$kexpr" ] && kargs=(-k "$kexpr")

{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv; date -u +%Y-%m-%dT%H:%M:%SZ; } > "$out/machine.txt" 2>&1
python3 -m vmmstream.cli info --json > "$out/info.json" 2>&1
rc=0
bash scripts/gpu-tier.sh "$out" "$kexpr" 2>&1 | tee "$out/gpu-tests.log" || rc=1
python3 -m pytest bench -p no:cacheprovider -q --continue-on-collection-errors "${kargs[@]}" --benchmark-json "$out/bench.json" \
  --benchmark-columns=min,median,max,rounds 2>&1 | tee "$out/bench.log" || rc=1
python3 bench/report.py "$out/bench.json" "$out/machine.txt" > "$out/BENCHMARKS-run.md" 2>&1 || rc=1
exit $rc
