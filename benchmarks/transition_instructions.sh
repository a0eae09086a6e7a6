#!/bin/bash
# Instructions per cold DAG build (see benchmarks/transition_instructions.py), for the
# tree given (default: this one) with the project's interpreter.
set -euo pipefail
tree=$(cd "${1:-$(dirname "$0")/..}" && pwd)
python=${PYTHON:-$tree/.venv/bin/python}
builds=${BUILDS:-30}
count() {
  (cd "$tree" && PYTHONHASHSEED=0 PYTHONPATH=$tree valgrind --tool=cachegrind --cache-sim=no \
    --cachegrind-out-file=/dev/null "$python" -m benchmarks.transition_instructions "$1" "$2" 2>&1 |
    sed -n 's/.*I *refs: *//p' | tr -d ,)
}
base=$(count fresh 0)
fresh=$(count fresh "$builds")
warm=$(count warm "$builds")
ebase=$(count edges 0)
edges=$(count edges "$builds")
printf '{"ir_fresh": %d, "ir_warm": %d, "ir_edges": %d}\n' \
  $(( (fresh - base) / builds )) $(( (warm - base) / builds )) $(( (edges - ebase) / builds ))
