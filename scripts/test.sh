#!/usr/bin/env bash
# Install the test extras and run the CPU tiers: unit (host backend), the Numba simulator tier, and the
# benchmarks as a one-pass smoke. This is the README's test command; CI runs it on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
export VMMSTREAM_BACKEND=host HYPOTHESIS_PROFILE=ci
python3 -m pytest -m unit -q -p no:cacheprovider tests
# The simulator is chosen when numba is imported, so its tier is a process of its own.
NUMBA_ENABLE_CUDASIM=1 python3 -m pytest -m sim -q -p no:cacheprovider tests/sim
python3 -m pytest -q -p no:cacheprovider -m "not gpu" --benchmark-disable bench
