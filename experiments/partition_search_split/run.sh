#!/usr/bin/env bash
# The split-attention partition table of the default model at p = 2 ranks of 1 thread (what kvr-prefill uses
# by default), and the held-out lengths 6k and 14k. Every step measures real TTFT; run it on a quiet machine.
# Resumable: `bash run.sh` again continues from the search checkpoints (a length a table has is kept);
# `bash run.sh --fresh` starts over; `bash run.sh --polish` searches every length again from its checkpoints
# (nothing measured twice), so that searches made before kvr-search polished its best point get polished.
set -euo pipefail
cd "$(dirname "$0")/../.."
TABLE=partition_tables/smollm2-135m_p2_float32_cpu_split.json
OUT=experiments/partition_search_split
if [[ "${1:-}" == "--fresh" ]]; then
  rm -rf "$TABLE" "$OUT"/heldout_*.json "$OUT/candidates"
fi
if [[ "${1:-}" == "--polish" ]]; then
  rm -f "$TABLE" "$OUT"/heldout_*.json
fi
# Whole range for every length (no table entries around it to interpolate a seed from); 2 timed runs per
# candidate after one warm-up run per length. 12k-16k at a 128-token stride (0.8% of the context or less).
# The checkpoints (every candidate measured) are kept in $OUT/candidates, committed with the results.
SEARCH=(kvr-search --nproc 2 --kvr-attention split --no-seeded --repeats 2 --warmup 1 --resume)

"${SEARCH[@]}" --ctx 1k,2k,4k,8k --min-stride 64 --out "$TABLE" --checkpoints "$OUT/candidates/table" \
  2>&1 | tee -a "$OUT/search.log"
"${SEARCH[@]}" --ctx 16k,12k --min-stride 128 --out "$TABLE" --checkpoints "$OUT/candidates/table" \
  2>&1 | tee -a "$OUT/search.log"

# Held out of the table: searched the same way into tables of their own (KVR-S), for the comparison with the
# interpolation of the table (KVR-P) in experiments/ttft_cpu_p2_16k.
# 14k: one timed run per candidate at a 256-token stride (1.8% of the context), so that the whole search fits
# in one sitting: candidates measured hours apart on this machine are not comparable.
"${SEARCH[@]}" --ctx 14k --min-stride 256 --repeats 1 --out "$OUT/heldout_14k.json" \
  --checkpoints "$OUT/candidates/heldout" 2>&1 | tee -a "$OUT/search.log"
"${SEARCH[@]}" --ctx 6k --min-stride 64 --out "$OUT/heldout_6k.json" --checkpoints "$OUT/candidates/heldout" \
  2>&1 | tee -a "$OUT/search.log"

python -m kvrunahead.search.plot "$OUT/candidates/table" "$OUT/candidates/heldout" -o "$OUT/search_curves.png"
