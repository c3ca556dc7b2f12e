#!/usr/bin/env bash
# The balance-guided re-search of the shipped SmolLM2 split table (loopback, 2 ranks of 1 thread) and the
# benchmark of what it ships against the table before it and the peers. Every stage resumes where it stopped.
#   1. search: kvr-search --criterion balance, seeded by the cost model (--backend model --refine), at CTX, into
#      tables/loopback.json (its checkpoints in tables/loopback.search/);
#   2. held out: the same search at 14k alone (KVR-S, tables/loopback-14k.json), while the shipped table has no
#      14k entry (KVR-P interpolates it);
#   3. ship: the re-searched table replaces partition_tables/smollm2-135m_p2_float32_cpu_split.json (the table it
#      replaces is kept in old_tables/ first);
#   carry (not in the default STAGES): the same search with each length seeded by the rates the shorter one
#      measured and only the neighbour its imbalance points to confirmed (kvr-search's defaults since), into
#      tables/loopback-carry.json (CARRY=<name>: tables/<name>.json, for a run on another machine), to count its
#      candidates against both searches before;
#   cap (not in the default STAGES): the carry search at the 650 MB/s cap, 1k-16k by default, into
#      tables/cap650$TAG.json; gemma (not in the default STAGES): Gemma 3 270M's table at GEMMA_CTX, seeded by
#      the table before, into tables/gemma3$TAG.json; ship-more: both replace their shipped tables (old ones kept in old_tables/ first);
#      cap-bench: kvr-bench --interleave at the 650 MB/s cap at CAP_CTX: kvr-default (the shipped cap table),
#      kvr-old (the one before) and the peers in MODES, into bench-cap650$TAG/ (TAG: a suffix naming the machine);
#   4. bench: kvr-bench --interleave at 12k and 16k (bench/) and at 14k (bench-14k/): kvr-default (the shipped
#      table), kvr-old (the table before), at 14k kvr-s14 (14k's own search), and the peers in MODES; ROUNDS timed
#      runs each, one run of every mode per round.
# Usage: bash experiments/balance_search/run.sh   (env: CTX, MODES, ROUNDS, STAGES, CARRY, TAG, GEMMA_CTX, CAP_CTX)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/balance_search
CTX=${CTX:-1k,2k,4k,8k,12k,16k}
MODES=${MODES:-kvr-default,ring,cp-allgather}
ROUNDS=${ROUNDS:-5}
STAGES=${STAGES:-search heldout ship bench}
CARRY=${CARRY:-loopback-carry}
TAG=${TAG:-}
GEMMA_CTX=${GEMMA_CTX:-8k,16k,32k}
CAP_CTX=${CAP_CTX:-12k,14k,16k}
PROFILE=${PROFILE:-kvrunahead/sim/profiles/cpu-t1.json}  # the cap search's seed: the shipped profile has the cap's link
SHIPPED=partition_tables/smollm2-135m_p2_float32_cpu_split.json
SHIPPED_CAP=partition_tables/smollm2-135m_p2_float32_cpu_split_cap-650mb-s.json
SHIPPED_GEMMA=partition_tables/gemma3-270m_p2_float32_cpu_split.json
export OMP_NUM_THREADS=1
mkdir -p "$OUT/tables" "$OUT/old_tables"

for stage in $STAGES; do
  case $stage in
    search)
      kvr-search --nproc 2 --ctx "$CTX" --kvr-attention split --criterion balance --backend model --refine \
        --confirm both --no-carry-rates --out "$OUT/tables/loopback.json" --resume 2>&1 | tee -a "$OUT/search.log" ;;
    carry)
      kvr-search --nproc 2 --ctx "$CTX" --kvr-attention split --criterion balance --backend model --refine \
        --out "$OUT/tables/$CARRY.json" --resume 2>&1 | tee -a "$OUT/search-${CARRY#loopback-}.log" ;;
    cap)
      kvr-search --nproc 2 --ctx "$CTX" --kvr-attention split --criterion balance --backend model --refine \
        --net cap=650MB/s --profile "$PROFILE" --out "$OUT/tables/cap650$TAG.json" --resume 2>&1 | tee -a "$OUT/search-cap650$TAG.log" ;;
    gemma)  # the cost model does not price sliding-window layers: seeded by the table it re-searches instead
      [ -f "$OUT/old_tables/gemma3.json" ] || git show 9a91e65:"$SHIPPED_GEMMA" > "$OUT/old_tables/gemma3.json"
      kvr-search --model gemma3-270m --nproc 2 --ctx "$GEMMA_CTX" --kvr-attention split --criterion balance \
        --seed-table "$OUT/old_tables/gemma3.json" --out "$OUT/tables/gemma3$TAG.json" --resume 2>&1 | tee -a "$OUT/search-gemma3$TAG.log" ;;
    ship-more)
      [ -f "$OUT/old_tables/cap650.json" ] || git show a6e7227:"$SHIPPED_CAP" > "$OUT/old_tables/cap650.json"
      [ -f "$OUT/old_tables/gemma3.json" ] || git show 9a91e65:"$SHIPPED_GEMMA" > "$OUT/old_tables/gemma3.json"
      if [ -f "$OUT/tables/cap650$TAG.json" ]; then cp "$OUT/tables/cap650$TAG.json" "$SHIPPED_CAP"; fi
      if [ -f "$OUT/tables/gemma3$TAG.json" ]; then cp "$OUT/tables/gemma3$TAG.json" "$SHIPPED_GEMMA"; fi ;;
    cap-bench)
      kvr-bench --nproc 2 --ctx "$CAP_CTX" --net cap=650MB/s --modes "$MODES" --kvr-attention split --interleave \
        --repeats "$ROUNDS" --warmup 0 --table "old=$OUT/old_tables/cap650.json" --out "$OUT/bench-cap650$TAG" \
        --resume 2>&1 | tee -a "$OUT/bench-cap650$TAG.log" ;;
    heldout)
      kvr-search --nproc 2 --ctx 14k --kvr-attention split --criterion balance --backend model --refine \
        --confirm both --out "$OUT/tables/loopback-14k.json" --resume 2>&1 | tee -a "$OUT/search.log" ;;
    ship)
      [ -f "$OUT/old_tables/loopback.json" ] || git show 2d6a55e:"$SHIPPED" > "$OUT/old_tables/loopback.json"
      cp "$OUT/tables/loopback.json" "$SHIPPED" ;;
    bench)
      bench() {  # $1 lengths, $2 out, then --table arguments
        local ctx=$1 out=$2; shift 2
        kvr-bench --nproc 2 --ctx "$ctx" --modes "$MODES" --kvr-attention split --interleave --repeats "$ROUNDS" \
          --warmup 0 --table "old=$OUT/old_tables/loopback.json" "$@" --out "$out" --resume 2>&1 | tee -a "$OUT/bench.log"
      }
      bench 12k,16k "$OUT/bench"
      bench 14k "$OUT/bench-14k" --table "s14=$OUT/tables/loopback-14k.json" ;;
  esac
done
