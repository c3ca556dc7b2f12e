#!/usr/bin/env bash
# The degree choice of kvr-serve against both choices: kvr-serve --nproc 2 --threads 1 started with --degree 1 (the
# front alone, with the node's 2 cores) and --degree 2 (the KV chain, 1 thread per rank), ROUNDS rounds, the order
# alternating per round, one server at a time; each server takes every length REPEATS times, one request at a
# time. Then one pass with --degree auto records what the policy chooses at each length. Resumable: a finished
# (round, degree) is skipped. Then report.py writes summary.md and crossover.png.
# Usage: bash experiments/serve_degree/run.sh   (env: LENGTHS, ROUNDS, REPEATS)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/serve_degree
LENGTHS=${LENGTHS:-512,1024,1536,2048,3072,4096,8192}
ROUNDS=${ROUNDS:-3}
REPEATS=${REPEATS:-2}
PORT=8125

serve_and_measure() {  # $1 degree (1, 2, auto), $2 round, $3 repeats
  local done="$OUT/rows/degree$1.round$2.done"
  [ -f "$done" ] && return 0
  mkdir -p "$OUT/rows"
  OMP_NUM_THREADS=1 setsid kvr-serve --nproc 2 --threads 1 --degree "$1" --port $PORT \
    > "$OUT/rows/server.log" 2>&1 &
  local pid=$!
  trap "kill -TERM -- -$pid 2>/dev/null || true" EXIT
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "kvr-serve died" >&2; exit 1; }
    sleep 1
  done
  local rows="$OUT/rows/degree$1.round$2.jsonl"
  rm -f "$rows"
  python3 "$OUT/crossover.py" "http://127.0.0.1:$PORT/v1" "degree$1" "$2" "$rows" "$LENGTHS" "$3"
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  trap - EXIT
  touch "$done"
}

for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="1 2"; else order="2 1"; fi
  for degree in $order; do serve_and_measure "$degree" "$round" "$REPEATS"; done
done
serve_and_measure auto 0 1
python3 "$OUT/report.py"
