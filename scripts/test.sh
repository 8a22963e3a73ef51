#!/usr/bin/env bash
# Install the test extras and run the CPU tiers: unit (host backend), the Numba simulator tier, and the
# benchmarks as a one-pass smoke. This is the README's test command; CI runs it on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
export VMMSTREAM_BACKEND=host HYPOTHESIS_PROFILE=ci
python3 -m pytest -m unit -q -p no:cacheprovider tests
# The simulator keeps state between the kernels of one process (a sequence of kernels has been seen to hang it
# while each passes alone), so every sim test runs in a process of its own.
export NUMBA_ENABLE_CUDASIM=1
ids=$(python3 -m pytest -m sim --collect-only -q -p no:cacheprovider tests/sim | grep '::')
[ -n "$ids" ] || { echo "no sim tests collected"; exit 1; }
n=0
for id in $ids; do
  timeout 900 python3 -m pytest -q -p no:cacheprovider -m sim "$id" | tail -n 1
  n=$((n + 1))
done
echo "sim tier: $n tests passed, one process each"
unset NUMBA_ENABLE_CUDASIM
python3 -m pytest -q -p no:cacheprovider -m "not gpu" --benchmark-disable bench
