#!/usr/bin/env bash
# The shipped SmolLM2 split tables for 2 ranks of 1 thread on loopback, searched again on the kernels a run uses by
# default (--attention-kernel auto, --linears auto: what kvr-kernels chose on this CPU), in float32 and bfloat16,
# with the balance search (kvr-search --criterion balance, its defaults). Each table records the settings it was
# searched with; a run on other settings says the table is stale. Every stage resumes where it stopped.
#   search: each dtype in DTYPES at CTX into tables/p2-<dtype>$TAG.json (checkpoints beside it), log search-<dtype>$TAG.log
#   ship:   each searched table replaces (or becomes) partition_tables/smollm2-135m_p2_<dtype>_cpu_split.json
# Usage: bash experiments/kernel_tables/run.sh   (env: CTX, DTYPES, STAGES, TAG)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/kernel_tables
CTX=${CTX:-1k,2k,4k,8k,12k,16k}
DTYPES=${DTYPES:-float32 bfloat16}
STAGES=${STAGES:-search ship}
TAG=${TAG:-}
export OMP_NUM_THREADS=1
mkdir -p "$OUT/tables"
for stage in $STAGES; do
  for dtype in $DTYPES; do
    table=$OUT/tables/p2-$dtype$TAG.json
    case $stage in
      search)
        { echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) on $(lscpu | sed -n 's/^Model name: *//p')"
          echo "# kvr-search --nproc 2 --ctx $CTX --criterion balance --dtype $dtype --out $table --resume"
          start=$(date +%s)
          kvr-search --nproc 2 --ctx "$CTX" --criterion balance --dtype "$dtype" --out "$table" --resume 2>&1
          echo "search took $(( $(date +%s) - start )) s"; } | tee -a "$OUT/search-$dtype$TAG.log" ;;
      ship)
        cp "$table" "partition_tables/smollm2-135m_p2_${dtype}_cpu_split.json"
        echo "shipped $table" ;;
      *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
  done
done
