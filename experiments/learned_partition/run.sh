#!/usr/bin/env bash
# The chain's partition learned by the server on a host its table was not searched on: SmolLM2-135M (float32) at
# 16k tokens, kvr-serve --nproc 2 --threads 1 --degree 2 --learn (a fresh file) takes SERVED prompts of 16k
# (distinct stretches of the shipped text, one at a time: each response says its partition and where it came
# from); kvr-learned exports what it learned as a partition table; then kvr-bench times, in ROUNDS interleaved
# rounds, KVR on the shipped table (kvr-default), KVR on the exported table (kvr-learned) and ring attention.
# Resumable: each part is skipped once done (served.done, the exported table, kvr-bench --resume).
#   bash experiments/learned_partition/run.sh && python experiments/learned_partition/report.py
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/learned_partition
SERVED=${SERVED:-5}
ROUNDS=${ROUNDS:-3}
PORT=8126
source experiments/serve_up.sh
mkdir -p "$OUT"
if [ ! -f "$OUT/served.done" ]; then
  rm -f "$OUT/learned.json" "$OUT/served.jsonl"
  serve_up $PORT "$OUT/server.log" kvr-serve --nproc 2 --threads 1 --degree 2 --learn "$OUT/learned.json" \
    --timeout 900
  python3 experiments/serve_degree/crossover.py "http://127.0.0.1:$PORT/v1" served16k 1 "$OUT/served.jsonl" 16384 \
    "$SERVED"
  serve_down
  touch "$OUT/served.done"
fi
table="$OUT/smollm2-135m_p2_float32_cpu_split_served.json"
[ -f "$table" ] || kvr-learned "$OUT/learned.json" --export "$OUT" | tee "$OUT/learned.md"
kvr-bench --ctx 16k --modes kvr-default,ring --table "learned=$table" --nproc 2 --threads 1 --interleave --resume \
  --timeout 1800 --warmup 0 --repeats "$ROUNDS" --net loopback --out "$OUT/16k_loopback"
