#!/usr/bin/env bash
# TTFT at 12k and 16k of the default model (its RoPE extended by YaRN x2 beyond the 8192 trained positions),
# p = 2 ranks of 1 thread, every mode interleaved; then KVR-P against KVR-S at the held-out 14k.
# Needs the split table (experiments/partition_search_split/run.sh) first. Run it on a quiet machine.
# Resumable: `bash run.sh` again keeps the runs already recorded and the steps already summarised;
# `bash run.sh --fresh` starts over.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/ttft_cpu_p2_16k
HELDOUT=experiments/partition_search_split/heldout_14k.json
if [[ "${1:-}" == "--fresh" ]]; then
  rm -rf "$OUT"/*.jsonl "$OUT"/*.csv "$OUT"/*.md "$OUT"/*.png "$OUT/heldout_14k"
fi

# 1. 12k and 16k: the single process at 1 and 2 threads (timed among the ranks' runs, the other rank idle),
#    TSP, cp-allgather, ring, KVR as kvr-prefill runs it with no flags (kvr-default: split attention, the
#    partition of the shipped table) and KVR on the even partition (kvr-even, split attention too).
#    16k first: the targets are there. No warm-up runs: a run lasts one to three minutes, and interleaving puts
#    every mode's first run in the same round (min and max are reported beside the medians).
if [[ ! -f "$OUT/summary.md" ]]; then
  kvr-bench --ctx 16k,12k --nproc 2 --modes single,tsp,cp-allgather,ring,kvr-default,kvr --repeats 3 \
    --warmup 0 --interleave --resume --out "$OUT"
fi

# 2. 14k, held out of the table: KVR-P (kvr-default, interpolated between the 12k and 16k entries) against
#    KVR-S (kvr-S: the partition a search at 14k found), 5 timed runs each, alternating.
if [[ ! -f "$OUT/heldout_14k/summary.md" ]]; then
  kvr-bench --ctx 14k --nproc 2 --modes kvr-default --table S="$HELDOUT" --repeats 5 --interleave --resume \
    --out "$OUT/heldout_14k"
fi
