#!/usr/bin/env bash
# Install the test extras and run the CPU tiers: unit (host backend; every kernel compiled for sm_90), the Numba
# simulator tier, and the benchmarks as a one-pass smoke. This is the README's test command; CI runs it on a
# fresh machine. Tests are spread over the machine's cores (pytest-xdist).
#   bash scripts/test.sh          # everything (about 10 minutes on 2 cores)
#   bash scripts/test.sh quick    # the inner loop: the unit tier without the sm_90 compiles (about a minute)
#   bash scripts/test.sh full     # everything, with the simulator's whole-model steps (another 15 minutes or so)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -e ".[test]"
export VMMSTREAM_BACKEND=host
workers=(-n "${VMMSTREAM_TEST_WORKERS:-auto}" --dist worksteal)
if [ "${1:-}" = "quick" ]; then
  python3 -m pytest -m unit -q -p no:cacheprovider "${workers[@]}" tests --deselect tests/unit/test_kernel_compile.py
  exit
fi
export HYPOTHESIS_PROFILE=ci
# `slow`: whole model steps through the simulated CUDA adapter and sm_90 compiles of non-default kernel variants,
# minutes each on a CI core; `full` runs them too.
unit=(-m "unit and not slow") sim=(-m "sim and not slow")
[ "${1:-}" = "full" ] && unit=(-m unit) sim=(-m sim)
python3 -m pytest "${unit[@]}" -q -p no:cacheprovider "${workers[@]}" tests
# The simulator is chosen when numba is imported, so its tier is a process (and workers) of its own.
NUMBA_ENABLE_CUDASIM=1 python3 -m pytest "${sim[@]}" -q -p no:cacheprovider "${workers[@]}" tests/sim
python3 -m pytest -q -p no:cacheprovider -m "not gpu" --benchmark-disable bench
