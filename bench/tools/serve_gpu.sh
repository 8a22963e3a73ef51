#!/usr/bin/env bash
# The server's figures on the GPU machine: a preset checkpoint served with continuous batching at the resident
# and the 2 GiB budget, bench/serve_load.py at 1, 8, 32 and 64 clients against each (token-id prompts: presets
# have no tokenizer), one JSON per budget.
#   bash bench/tools/serve_gpu.sh OUTDIR [PRESET] [MAX_BATCH] [TEMPERATURE]   # defaults: llama-3b, 32, 0 (greedy)
# (a TEMPERATURE above 0 draws, as an OpenAI client's default request does: the batch steps' drawing graphs)
set -euo pipefail
out=${1:?usage: serve_gpu.sh OUTDIR [PRESET] [MAX_BATCH] [TEMPERATURE]}; preset=${2:-llama-3b}; batch=${3:-32}
temperature=${4:-0}
mkdir -p "$out"
ck=$(mktemp -d)/$preset
python3 -c "import sys; from vmmstream.model import make_checkpoint; make_checkpoint(sys.argv[1], sys.argv[2], seed=0)" \
  "$preset" "$ck"
port=8011
for budget in 80% 2GiB; do
  python3 -m vmmstream serve "$ck" --budget "$budget" --max-batch "$batch" --max-context 256 --port $port \
    --log-level warning >"$out/serve-${budget%\%}.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { echo "the server exited"; tail "$out/serve-${budget%\%}.log"; exit 1; }
    sleep 0.5
  done
  python3 bench/serve_load.py --url "http://127.0.0.1:$port" --clients 1,8,32,64 --requests 2 --max-tokens 64 \
    --prompt-tokens 16 --temperature "$temperature" --json "$out/serve-load-${budget%\%}-t$temperature.json" || true
  kill -TERM $pid; wait $pid || true
done
