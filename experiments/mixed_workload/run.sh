#!/usr/bin/env bash
# Long and short requests together on kvr-serve --nproc 2 (2 ranks of 1 thread): first come, first served with
# each prompt prefilled in one step (fcfs) against chunked prefill within a step budget with the LARS order (lars),
# the same requests (kvr-serve-bench --seed) at each rate. One server runs at a time; the policies alternate per
# rate. Resumable: a part whose rows are complete is skipped (kvr-serve-bench --resume). Then report.py writes
# summary.md and the plots.
# Usage: bash experiments/mixed_workload/run.sh  (SKIP_REPORT=1: rows only; RATES="0.25 0.5" REQUESTS=60 DURATION=240 BUDGET_MS=1000 SEED=14
#        TTFT_SLO_S=2 LONG_TOKENS=8k-16k POLICIES="fcfs lars" OUT=experiments/mixed_workload)
# One long document among short requests (seed 10: 32 requests, the 6th a 16k document): OUT=experiments/mixed_workload/light RATES=0.1 DURATION=300 SEED=10 bash experiments/mixed_workload/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-experiments/mixed_workload}
RATES=${RATES:-0.25 0.5}
REQUESTS=${REQUESTS:-60}
DURATION=${DURATION:-240}
BUDGET_MS=${BUDGET_MS:-1000}
SEED=${SEED:-14}
TTFT_SLO_S=${TTFT_SLO_S:-2}  # kvr-serve's default --ttft-slo-s; the bench's summary gives the share of short requests within it
LONG_TOKENS=${LONG_TOKENS:-8k-16k}
POLICIES=${POLICIES:-fcfs lars}  # e.g. POLICIES=lars: only the chunked runs (fcfs does not depend on the chunking)
PORT=8131
mkdir -p "$OUT"

wait_up() {  # $1 pid
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || { echo "the server died; see $OUT/server.log" >&2; return 1; }
    sleep 1
  done
  echo "the server was not up in 300 s" >&2; return 1
}
stop_server() { kill -TERM -- "-$1" 2>/dev/null || true; for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -KILL -- "-$1" 2>/dev/null || true; }
policy_args() {  # fcfs, lars (--step-budget-ms BUDGET_MS), lars-MS (that budget); a -separate suffix: --separate-steps
  local name=${1%-separate} extra=""
  [ "$name" != "$1" ] && extra=" --separate-steps"
  case $name in
    fcfs) echo "--schedule fcfs$extra" ;;
    lars) echo "--schedule lars --step-budget-ms $BUDGET_MS$extra" ;;
    lars-*) echo "--schedule lars --step-budget-ms ${name#lars-}$extra" ;;
    *) echo "unknown policy $1" >&2; return 2 ;;
  esac
}

for rate in $RATES; do
  for policy in $POLICIES; do
    dir="$OUT/rate$rate/$policy"
    if [ -f "$dir/summary.csv" ] && python3 -c "import csv,sys; sys.exit(0 if list(csv.DictReader(open('$dir/summary.csv'))) else 1)"; then
      echo "rate $rate $policy: done"; continue
    fi
    args=$(policy_args "$policy")
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 setsid kvr-serve --nproc 2 --threads 1 --port $PORT $args --ttft-slo-s "$TTFT_SLO_S" \
      > "$OUT/server.log" 2>&1 &
    pid=$!
    trap "stop_server $pid" EXIT
    wait_up "$pid"
    kvr-serve-bench --base-url "http://127.0.0.1:$PORT/v1" --label "$policy" --out "$dir" --resume \
      --tokenizer smollm2-135m --seed "$SEED" --rate "$rate" --requests "$REQUESTS" --duration "$DURATION" \
      --long-share 0.05 --long-tokens "$LONG_TOKENS" --long-max-tokens 16 --max-tokens-cap 64 --max-prompt-tokens 1024 \
      --timeout 900 --ttft-slo-s "$TTFT_SLO_S"
    stop_server "$pid"; trap - EXIT
  done
done
[ -n "${SKIP_REPORT:-}" ] && exit 0
python3 experiments/mixed_workload/report.py "$OUT"
python3 experiments/mixed_workload/predict.py "$OUT" --budget-ms "$BUDGET_MS"
