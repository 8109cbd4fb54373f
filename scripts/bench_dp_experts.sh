#!/bin/bash
# Data parallelism with experts over the replicas, measured with `deltaserve bench serve` on fresh servers,
# configurations alternating, 2 rounds (docs/benchmarks.md, "Experts over the data-parallel replicas").
#
#   bash scripts/bench_dp_experts.sh          # DP=2 against DP=2 + EP, this tree
#   bash scripts/bench_dp_experts.sh REV      # DP=2 + EP: a worktree of REV against this tree
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
port=${PORT:-18471}
base_rev=${1:-}
if [ -n "$base_rev" ]; then
  base=$(mktemp -d)/base
  git -C "$here" worktree add -q --detach "$base" "$base_rev"
  trap 'git -C "$here" worktree remove --force "$base"' EXIT
fi

run() {  # label, source tree, serve flags...
  local label=$1 src=$2; shift 2
  (cd "$src" && PYTHONPATH="$src" OMP_NUM_THREADS=1 python -c \
    "import sys; from deltaserve.entrypoints.cli import main; sys.argv[0] = 'deltaserve'; main()" \
    serve --port "$port" --data-parallel-size 2 "$@" > "/tmp/bench_dp_experts_$label.log" 2>&1) &
  for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break; sleep 1; done
  deltaserve bench serve --base-url "http://127.0.0.1:$port" --dataset-name random --random-input-len 128 \
    --random-output-len 128 --num-prompts 48 --max-concurrency 8 --seed 1 --reset-prefix-cache 2>&1 \
    | grep -E "Output token throughput|Median TTFT|Median TPOT|Failed" | sed "s/^/$label concurrency 8: /"
  deltaserve bench serve --base-url "http://127.0.0.1:$port" --dataset-name random --random-input-len 128 \
    --random-output-len 32 --num-prompts 8 --max-concurrency 1 --seed 2 --reset-prefix-cache 2>&1 \
    | grep -E "Output token throughput|Median TTFT|Median TPOT" | sed "s/^/$label concurrency 1: /"
  pkill -INT -f "serve --port $port" || true
  wait
}

for round in 1 2; do
  echo "round $round $(date -u +%H:%M:%S)"
  if [ -n "$base_rev" ]; then
    run before "$base" --enable-expert-parallel
    run after "$here" --enable-expert-parallel
  else
    run dp2 "$here"
    run dp2-ep "$here" --enable-expert-parallel
  fi
done
