#!/usr/bin/env bash
# The degree choice of kvr-serve against both choices: kvr-serve --nproc 2 --threads 1 started with --degree 1 (the
# front alone, with the node's 2 cores), --degree 2 (the KV chain, 1 thread per rank) and --degree auto, ROUNDS
# rounds, the order rotating per round, one server at a time; each server takes every length REPEATS times, one
# request at a time. Resumable: a finished (round, degree) is skipped. Then report.py writes ROWS/summary.md and
# ROWS/crossover.png: the auto server's own TTFT against the faster forced degree's, length by length.
# Usage: bash experiments/serve_degree/run.sh   (env: LENGTHS, ROUNDS, REPEATS, ROWS: the rows' folder)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/serve_degree
ROWS=$OUT/${ROWS:-rows-interleaved}
LENGTHS=${LENGTHS:-512,1024,1536,2048,3072,4096,8192}
ROUNDS=${ROUNDS:-3}
REPEATS=${REPEATS:-2}
PORT=8125

serve_and_measure() {  # $1 degree (1, 2, auto), $2 round, $3 repeats
  local done="$ROWS/degree$1.round$2.done"
  [ -f "$done" ] && return 0
  mkdir -p "$ROWS"
  OMP_NUM_THREADS=1 setsid kvr-serve --nproc 2 --threads 1 --degree "$1" --port $PORT \
    > "$ROWS/server.log" 2>&1 &
  local pid=$!
  trap "kill -TERM -- -$pid 2>/dev/null || true" EXIT
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "kvr-serve died" >&2; exit 1; }
    sleep 1
  done
  local rows="$ROWS/degree$1.round$2.jsonl"
  rm -f "$rows"
  python3 "$OUT/crossover.py" "http://127.0.0.1:$PORT/v1" "degree$1" "$2" "$rows" "$LENGTHS" "$3"
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  trap - EXIT
  touch "$done"
}

for round in $(seq 1 "$ROUNDS"); do
  case $((round % 3)) in 1) order="1 2 auto" ;; 2) order="2 auto 1" ;; 0) order="auto 1 2" ;; esac
  for degree in $order; do serve_and_measure "$degree" "$round" "$REPEATS"; done
done
python3 "$OUT/report.py" "$ROWS"
