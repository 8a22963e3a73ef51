#!/usr/bin/env bash
# The GPU test tier in a few minutes instead of ten: most of its time is Numba compiling kernels, one core per
# process, so the kernel tests run spread over pytest-xdist workers (the GPU has room for all of them). The tests that
# read cuMemGetInfo (memory, load_model) run first and alone, so no other process moves the figure they check.
#   scripts/gpu-tier.sh OUTDIR [PYTEST_K_EXPRESSION]
# Expects vmmstream importable (scripts/gpu-evidence.sh installs it). Writes one log per group into OUTDIR;
# exits non-zero when any group fails.
set -uo pipefail
out=${1:?usage: scripts/gpu-tier.sh OUTDIR [PYTEST_K_EXPRESSION]}
kexpr=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
kargs=()
[ -n "$kexpr" ] && kargs=(-k "$kexpr")
run() {  # name, test files...
  local name=$1; shift
  python3 -m pytest "$@" -m gpu -p no:cacheprovider -q "${kargs[@]}" > "$out/gpu-$name.log" 2>&1
  local rc=$?
  echo "$name: $(tail -n 1 "$out/gpu-$name.log") (rc $rc)"
  return $rc
}
rc=0
run memory tests/gpu/test_memory_gpu.py tests/gpu/test_load_model_gpu.py tests/gpu/test_faults_gpu.py || rc=1
# the kernel files: one test per worker where pytest-xdist is there (16 cores on the GPU machine)
xd=()
python3 -c "import xdist" 2>/dev/null && xd=(-n "${GPU_TIER_WORKERS:-12}")
run kernels "${xd[@]}" tests/gpu/test_dense_kernels_gpu.py tests/gpu/test_qgemv_gpu.py tests/gpu/test_qgemv_imma_gpu.py \
  tests/gpu/test_attention_gpu.py tests/gpu/test_moe_gpu.py || rc=1
covered="test_memory_gpu.py test_load_model_gpu.py test_faults_gpu.py test_dense_kernels_gpu.py test_qgemv_gpu.py test_qgemv_imma_gpu.py test_attention_gpu.py test_moe_gpu.py"
for f in tests/gpu/test_*.py; do
  case " $covered " in *" $(basename "$f") "*) ;; *) echo "not run by this script: $f"; rc=1;; esac
done
exit $rc
