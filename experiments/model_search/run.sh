#!/usr/bin/env bash
# The model-backed partition search against the measured one, at p = 2 on this machine (2 ranks of 1 thread,
# gloo, loopback, split attention): the cost model's answer on the shipped CPU profile, refined on the ranks
# (the answer and its neighbours one stride away), beside partition_tables/smollm2-135m_p2_float32_cpu_split.json
# (the measured search: golden section over [1/2, 7/8] plus polish). Resumable (--resume).
#   bash experiments/model_search/run.sh          # refine 1k-8k (about 9 min), compare (about 9 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/model_search
rm -f "$out/model_only.json"
kvr-search --backend model --profile cpu --ctx 1k,2k,4k,8k --nproc 2 --out "$out/model_only.json"
kvr-search --backend model --refine --profile cpu --ctx 1k,2k,4k,8k --nproc 2 --threads 1 --repeats 3 --warmup 1 \
  --out "$out/refined.json" --checkpoints "$out/refined.search" --resume 2>&1 | tee "$out/refine.log"
# The partitions both searches found, measured interleaved (the search's own TTFTs come from different hours).
kvr-bench --ctx 2k,4k,8k --nproc 2 --threads 1 --modes kvr --interleave --repeats 3 --warmup 1 --resume \
  --table searched=partition_tables/smollm2-135m_p2_float32_cpu_split.json --table refined="$out/refined.json" \
  --out "$out/compare"
python experiments/model_search/compare.py
