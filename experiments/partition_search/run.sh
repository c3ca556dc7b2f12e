#!/usr/bin/env bash
# Partition table for the default model at p = 2 on this CPU, and its validation.
# Every step measures real TTFT on 2 ranks of 1 thread each; run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
TABLE=partition_tables/smollm2-135m_p2_float32_cpu.json
OUT=experiments/partition_search
rm -f "$TABLE"; rm -rf "${TABLE%.json}.search" "$OUT"/*.json "$OUT"/*.search "$OUT/candidates"

# 1. The shipped table (KVR-S at the table lengths, each new length seeded from the ones before it).
kvr-search --ctx 1k,2k,4k,8k --nproc 2 --repeats 2 --warmup 0 --out "$TABLE"

# 2. Held-out lengths searched directly over the whole range (KVR-S), and seeded from the table.
kvr-search --ctx 3k,6k --nproc 2 --repeats 2 --warmup 0 --no-seeded --out "$OUT/direct.json"
kvr-search --ctx 3k,6k --nproc 2 --repeats 2 --warmup 0 --seed-table "$TABLE" --out "$OUT/seeded.json"

# 3. TTFT at the held-out lengths: KVR-P (interpolated from the table) against KVR-S, KVR-E and TSP.
kvr-bench --ctx 3k,6k --nproc 2 --modes tsp,kvr --table P="$TABLE" --table S="$OUT/direct.json" \
  --out "$OUT/heldout"

# 4. TTFT at the table's lengths: KVR-S (the table's entries) against KVR-E and TSP, in one run.
kvr-bench --ctx 1k,2k,4k,8k --nproc 2 --modes tsp,kvr --table S="$TABLE" --out "$OUT/table_lengths"

# Every candidate each search measured (its checkpoints), kept beside the results.
rm -rf "$OUT/candidates"; mkdir -p "$OUT/candidates"
mv "${TABLE%.json}.search" "$OUT/candidates/table"
mv "$OUT/direct.search" "$OUT/candidates/direct"
mv "$OUT/seeded.search" "$OUT/candidates/seeded"
