#!/usr/bin/env bash
# The same benchmarks from two source trees on one machine in one run, alternating, so a change that should not
# move a figure (a refactor, a new default elsewhere) is checked against the figure of the tree before it.
#   bench/tools/compare_builds.sh BASE_TREE OUTDIR ROUNDS -- PYTEST_ARGS...
# BASE_TREE is a plain copy of the older tree (git archive REV | tar -x -C DIR). Each tree is installed
# (non-editable) into a folder of its own and runs its own bench/ files; wheels in .whl/ (numpy < 2.5 for
# numba-cuda 0.30) go first. Writes OUTDIR/{base,head}-R.json and .log for each round R.
set -uo pipefail
base=${1:?usage: compare_builds.sh BASE_TREE OUTDIR ROUNDS -- PYTEST_ARGS...}
base=$(cd "$base" && pwd)
out=${2:?}; rounds=${3:?}; shift 3
[ "${1:-}" = "--" ] && shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
here=$PWD
wheels=$here/.site-wheels
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$wheels" .whl/*.whl || exit 1
fi
for t in base head; do
  src=$([ $t = base ] && echo "$base" || echo "$here")
  if [ ! -d "$here/.site-$t" ]; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$here/.site-$t" "$src" \
      >"$out/install-$t.log" 2>&1 || { echo "install of $t failed"; cat "$out/install-$t.log"; exit 1; }
  fi
done
rc=0
for r in $(seq 1 "$rounds"); do
  for t in base head; do
    src=$([ $t = base ] && echo "$base" || echo "$here")
    (cd "$src" && PYTHONPATH="$here/.site-$t:$wheels" python3 -m pytest -p no:cacheprovider -q "$@" \
      --benchmark-json "$out/$t-$r.json" > "$out/$t-$r.log" 2>&1) || rc=1
    echo "$t round $r: $(tail -n 1 "$out/$t-$r.log")"
  done
done
exit $rc
