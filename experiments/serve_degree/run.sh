#!/usr/bin/env bash
# The degree choice of kvr-serve against both choices: kvr-serve --nproc 2 --threads 1 started with --degree 1 (the
# front alone, with the node's 2 cores), --degree 2 (the KV chain, 1 thread per rank) and --degree auto, ROUNDS
# rounds, the order rotating per round, one server at a time; each server takes every length REPEATS times, one
# request at a time. Resumable: a finished (round, degree) is skipped. Then report.py writes ROWS/summary.md and
# ROWS/crossover.png: the auto server's own TTFT against the faster forced degree's, length by length.
# Usage: bash experiments/serve_degree/run.sh   (env: LENGTHS, ROUNDS, REPEATS, ROWS: the rows' folder, SERVERS)
#
# SERVERS="1 2 learned" (ROWS=rows-learned): the auto server correcting its choice by its own timings (--learn,
# kept in ROWS/learned.json across its restarts, removed before its first): in round 1 it first takes WARMUP
# passes over the lengths (label learned-warmup: the cold start), then its measured repeats like the others.
# Then: python experiments/serve_degree/report_learned.py ROWS
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/serve_degree
ROWS=$OUT/${ROWS:-rows-interleaved}
LENGTHS=${LENGTHS:-512,1024,1536,2048,3072,4096,8192}
ROUNDS=${ROUNDS:-3}
REPEATS=${REPEATS:-2}
SERVERS=${SERVERS:-1 2 auto}
WARMUP=${WARMUP:-7}
PORT=8125
source experiments/serve_up.sh

serve_and_measure() {  # $1 degree (1, 2, auto), $2 round, $3 repeats
  local done="$ROWS/degree$1.round$2.done"
  [ -f "$done" ] && return 0
  mkdir -p "$ROWS"
  local how=(--degree "$1" --learn off)  # the forced degrees and auto as they were: the prior alone
  if [ "$1" = learned ]; then
    how=(--degree auto --learn "$ROWS/learned.json")
    [ "$2" = 1 ] && rm -f "$ROWS/learned.json" "$ROWS"/degreelearned-warmup.round1.jsonl
  fi
  serve_up $PORT "$ROWS/server.log" kvr-serve --nproc 2 --threads 1 "${how[@]}"
  local rows="$ROWS/degree$1.round$2.jsonl"
  rm -f "$rows"
  if [ "$1" = learned ] && [ "$2" = 1 ]; then
    # round 0: prompts of their own (crossover.py offsets its stretches of text by the round)
    python3 "$OUT/crossover.py" "http://127.0.0.1:$PORT/v1" "degreelearned-warmup" 0 \
      "$ROWS/degreelearned-warmup.round1.jsonl" "$LENGTHS" "$WARMUP"
  fi
  python3 "$OUT/crossover.py" "http://127.0.0.1:$PORT/v1" "degree$1" "$2" "$rows" "$LENGTHS" "$3"
  serve_down
  touch "$done"
}

read -r -a servers <<< "$SERVERS"
for round in $(seq 1 "$ROUNDS"); do
  s=$(( (round - 1) % 3 ))  # the order rotates: a b c, b c a, c a b
  order="${servers[@]:$s} ${servers[@]:0:$s}"
  for degree in $order; do serve_and_measure "$degree" "$round" "$REPEATS"; done
done
if [[ " $SERVERS " == *" learned "* ]]; then python3 "$OUT/report_learned.py" "$ROWS"; else python3 "$OUT/report.py" "$ROWS"; fi
