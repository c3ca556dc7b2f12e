#!/usr/bin/env bash
# Mixed steps against separate steps (kvr-serve --mixed-steps / --separate-steps) on the light trace (one 16k
# document among short ShareGPT requests at 0.1/s: light-v9's seed and arrivals) and, with TRACES="light heavy",
# the overloaded one (0.25/s, 2 documents of 8k-16k), LARS at step budgets of 250, 500 and 1000 ms, fcfs with
# separate steps as the baseline (today's engine with the long prompt whole), 2 ranks of 1 thread. The order of the
# servers rotates by one each round (ROUNDS), so no setting always runs first; resumable: a server whose rows are
# complete is skipped. Then report.py writes summary.md and frontier.png.
# Usage: bash experiments/mixed_steps/run.sh  (ROUNDS=1 TRACES=light BUDGETS="250 500 1000" OUT=experiments/mixed_steps)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-experiments/mixed_steps}
ROUNDS=${ROUNDS:-1}
TRACES=${TRACES:-light}
BUDGETS=${BUDGETS:-250 500 1000}
servers=(fcfs-separate)
for b in $BUDGETS; do servers+=("lars-$b" "lars-$b-separate"); done
for round in $(seq 1 "$ROUNDS"); do
  n=${#servers[@]}
  order=()
  for i in $(seq 0 $((n - 1))); do order+=("${servers[$(( (i + round - 1) % n ))]}"); done
  for trace in $TRACES; do
    case $trace in
      light) set -- RATES=0.1 DURATION=300 SEED=10 ;;
      heavy) set -- RATES=0.25 DURATION=240 SEED=14 ;;
    esac
    for server in "${order[@]}"; do
      env "$@" OUT="$OUT/$trace/round$round" POLICIES="$server" SKIP_REPORT=1 bash experiments/mixed_workload/run.sh
    done
  done
done
python3 experiments/mixed_steps/report.py "$OUT"
