#!/usr/bin/env bash
# One GPU-machine call: install the carried wheels and this tree, then run named stages in order, each under its
# own time limit, each into OUTDIR/<name>.log, stopping before the call's deadline.
#   bench/tools/gpu_stages.sh OUTDIR DEADLINE_S NAME:LIMIT_S:COMMAND ...
# OUTDIR gets env.txt (GPU, driver, versions) and summary.txt (name, exit status, seconds for each stage).
set -uo pipefail
out=${1:?usage: gpu_stages.sh OUTDIR DEADLINE_S NAME:LIMIT_S:COMMAND ...}; deadline=${2:?}; shift 2
mkdir -p "$out" && out=$(cd "$out" && pwd)
start=$(date +%s)
export PYTHONUNBUFFERED=1
here=$PWD
# the carried wheels, installed again whenever their list changed (a warm machine keeps the last install)
if compgen -G ".whl/*.whl" >/dev/null && [ "$(ls .whl)" != "$(cat .site-wheels/.list 2>/dev/null)" ]; then
  rm -rf .site-wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site-wheels .whl/*.whl \
    >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
  ls .whl > .site-wheels/.list
fi
rm -rf .site-head
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target .site-head . >>"$out/install.log" 2>&1 \
  || { cat "$out/install.log"; exit 1; }
export PYTHONPATH=$here/.site-head:$here/.site-wheels
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max --format=csv,noheader
  python3 -c "import numpy, numba, numba_cuda, vmmstream; print('numpy', numpy.__version__, 'numba', numba.__version__,
'numba-cuda', numba_cuda.__version__, 'vmmstream', vmmstream.__file__)"
  # the optional stacks the stages may need: a missing one is named here, before any stage runs into it
  for m in nvmath gguf fastapi uvicorn prometheus_client openai; do
    python3 -c "import $m" >/dev/null 2>&1 || echo "not importable: $m (carry its wheel and its dependencies)"
  done; } >"$out/env.txt" 2>&1
cat "$out/env.txt"
for stage in "$@"; do
  name=${stage%%:*}; rest=${stage#*:}; limit=${rest%%:*}; cmd=${rest#*:}
  left=$(( deadline - ($(date +%s) - start) ))
  if [ "$left" -lt 20 ]; then echo "$name skipped (deadline)" | tee -a "$out/summary.txt"; continue; fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  timeout -k 5 "$limit" bash -c "$cmd" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$out/summary.txt"
  tail -n 4 "$out/$name.log"
done
