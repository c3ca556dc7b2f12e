#!/usr/bin/env bash
# Split-attention partition tables of the default model at p = 2 ranks of 1 thread on the two emulated networks
# equivalent to the paper's (experiments/network_equivalence): 650 MB/s (300 GB/s) and 22 MB/s (10 GB/s), searched
# as the loopback table was (whole range, 2 timed runs per candidate after one warm-up per length). They go to
# partition_tables/ under the name of their cap, where kvr-prefill --net cap=... finds them. Needs root.
# Resumable: rerun and it continues from the checkpoints (a length a table has is kept). The longer lengths
# (8k, 12k, 16k) are a separate part: NET_LONG=1 bash run.sh. Each length is searched at both caps before the next
# one starts, so an interrupted run leaves complete pairs to compare.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/partition_search_net
SEARCH=(kvr-search --nproc 2 --kvr-attention split --no-seeded --repeats 2 --warmup 1 --resume --min-stride 64)
CTX=1k,2k,4k
if [[ -n "${NET_LONG:-}" ]]; then CTX=8k,12k,16k; fi
for ctx in ${CTX//,/ }; do
  for cap in 22MB/s 650MB/s; do
    slug=$(echo "$cap" | tr -d '/')
    "${SEARCH[@]}" --ctx "$ctx" --net "cap=$cap" --checkpoints "$OUT/candidates/$slug" 2>&1 | tee -a "$OUT/search.log"
  done
done
python -m kvrunahead.search.plot "$OUT"/candidates/* -o "$OUT/search_curves.png"
