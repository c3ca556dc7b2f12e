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
#   cap (not in the default STAGES): the carry search at the cap CAP (650MB/s by default, or 22MB/s), 1k-16k by
#      default, into tables/cap650$TAG.json (tables/cap22$TAG.json); gemma (not in the default STAGES): Gemma 3 270M's table at GEMMA_CTX, seeded by
#      the table before, into tables/gemma3$TAG.json; ship-more: the cap table (CAP's) and the Gemma 3 table replace their
#      shipped tables (old ones kept in old_tables/ first); cap-bench: kvr-bench --interleave at the cap CAP at
#      CAP_CTX: kvr-default (the shipped cap table), kvr-old (the one before) and the peers in MODES, into
#      bench-cap650$TAG/ (bench-cap22$TAG/; TAG: a suffix naming the machine);
#   model-p34 (not in the default STAGES): the cost model's tables for 3 and 4 ranks (loopback and both caps, CTX,
#      on the shipped profile) into partition_tables/, where kvr-prefill --nproc 3/4 finds them; oversub: the
#      balance search at 3 and 4 ranks on this machine's 2 cores at OVERSUB_CTX (oversubscribed: 3-4 ranks of 1
#      thread time-share 2 cores) into tables/p3-oversubscribed$TAG.json and p4-..., against the model's answer;
#   margin-bench (not in the default STAGES): kvr-bench --interleave on loopback at 12k and 16k: kvr-default (the
#      shipped table, its entries rechosen with the 1% confirmation margin by rechoose.py), kvr-nomargin (the table
#      before) and ring, ROUNDS rounds, into bench-margin$TAG/;
#   heldout-margin (not in the default STAGES): the same at 14k (held out): kvr-default (interpolated), kvr-s14
#      (14k's own search on the Xeon), kvr-nomargin and ring, ROUNDS rounds, into bench-14k-margin$TAG/;
#   cap-tsp (not in the default STAGES): TSP against the default KVR at the cap CAP at CAP_CTX, ROUNDS rounds, into
#      bench-$CAPN-tsp$TAG/ (one process needs no network: its runs are the loopback benchmarks');
#   4. bench: kvr-bench --interleave at 12k and 16k (bench/) and at 14k (bench-14k/): kvr-default (the shipped
#      table), kvr-old (the table before), at 14k kvr-s14 (14k's own search), and the peers in MODES; ROUNDS timed
#      runs each, one run of every mode per round.
# Usage: bash experiments/balance_search/run.sh   (env: CTX, MODES, ROUNDS, STAGES, CARRY, TAG, GEMMA_CTX, CAP, CAP_CTX,
#        OVERSUB_CTX, PROFILE)
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
OVERSUB_CTX=${OVERSUB_CTX:-2k,4k}
CAP=${CAP:-650MB/s}
CAP_CTX=${CAP_CTX:-12k,14k,16k}
CAPN=cap${CAP%MB/s}  # cap650, cap22: the name of the cap's files here
PROFILE=${PROFILE:-kvrunahead/sim/profiles/cpu-t1.json}  # the cap search's seed: the shipped profile has the cap's link
SHIPPED=partition_tables/smollm2-135m_p2_float32_cpu_split.json
SHIPPED_CAP=partition_tables/smollm2-135m_p2_float32_cpu_split_cap-${CAP%MB/s}mb-s.json
declare -A CAP_BEFORE=([cap650]=a6e7227 [cap22]=6d1cdcd)  # the commit of each cap's table before the re-search
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
        --net "cap=$CAP" --profile "$PROFILE" --out "$OUT/tables/$CAPN$TAG.json" --resume 2>&1 | tee -a "$OUT/search-$CAPN$TAG.log" ;;
    gemma)  # the cost model does not price sliding-window layers: seeded by the table it re-searches instead
      [ -f "$OUT/old_tables/gemma3.json" ] || git show 9a91e65:"$SHIPPED_GEMMA" > "$OUT/old_tables/gemma3.json"
      kvr-search --model gemma3-270m --nproc 2 --ctx "$GEMMA_CTX" --kvr-attention split --criterion balance \
        --seed-table "$OUT/old_tables/gemma3.json" --out "$OUT/tables/gemma3$TAG.json" --resume 2>&1 | tee -a "$OUT/search-gemma3$TAG.log" ;;
    ship-more)
      [ -f "$OUT/old_tables/$CAPN.json" ] || git show "${CAP_BEFORE[$CAPN]}:$SHIPPED_CAP" > "$OUT/old_tables/$CAPN.json"
      [ -f "$OUT/old_tables/gemma3.json" ] || git show 9a91e65:"$SHIPPED_GEMMA" > "$OUT/old_tables/gemma3.json"
      if [ -f "$OUT/tables/$CAPN$TAG.json" ]; then cp "$OUT/tables/$CAPN$TAG.json" "$SHIPPED_CAP"; fi
      if [ -f "$OUT/tables/gemma3$TAG.json" ]; then cp "$OUT/tables/gemma3$TAG.json" "$SHIPPED_GEMMA"; fi ;;
    cap-bench)
      kvr-bench --nproc 2 --ctx "$CAP_CTX" --net "cap=$CAP" --modes "$MODES" --kvr-attention split --interleave \
        --repeats "$ROUNDS" --warmup 0 --table "old=$OUT/old_tables/$CAPN.json" --out "$OUT/bench-$CAPN$TAG" \
        --resume 2>&1 | tee -a "$OUT/bench-$CAPN$TAG.log" ;;
    model-p34)
      for p in 3 4; do
        for net in loopback 650MB/s 22MB/s; do
          if [ "$net" = loopback ]; then flag=(); name=""; else flag=(--net "cap=$net"); name="_cap-${net%MB/s}mb-s"; fi
          kvr-search --backend model --nproc "$p" --ctx "$CTX" --kvr-attention split --profile "$PROFILE" "${flag[@]}" \
            --out "partition_tables/smollm2-135m_p${p}_float32_cpu_split$name.json" 2>&1 | tee -a "$OUT/model-p34.log"
        done
      done ;;
    oversub)
      for p in 3 4; do
        kvr-search --nproc "$p" --ctx "$OVERSUB_CTX" --kvr-attention split --criterion balance --backend model \
          --refine --profile "$PROFILE" --out "$OUT/tables/p$p-oversubscribed$TAG.json" --resume 2>&1 \
          | tee -a "$OUT/search-oversub$TAG.log"
      done ;;
    margin-bench)
      kvr-bench --nproc 2 --ctx 12k,16k --modes kvr-default,ring --kvr-attention split --interleave \
        --repeats "$ROUNDS" --warmup 0 --table "nomargin=$OUT/old_tables/loopback-nomargin.json" \
        --out "$OUT/bench-margin$TAG" --resume 2>&1 | tee -a "$OUT/bench-margin$TAG.log" ;;
    cap-tsp)
      kvr-bench --nproc 2 --ctx "$CAP_CTX" --net "cap=$CAP" --modes kvr-default,tsp --kvr-attention split \
        --interleave --repeats "$ROUNDS" --warmup 0 --out "$OUT/bench-$CAPN-tsp$TAG" --resume 2>&1 \
        | tee -a "$OUT/bench-$CAPN-tsp$TAG.log" ;;
    heldout-margin)
      kvr-bench --nproc 2 --ctx 14k --modes kvr-default,ring --kvr-attention split --interleave \
        --repeats "$ROUNDS" --warmup 0 --table "s14=$OUT/tables/loopback-14k-xeon.json" \
        --table "nomargin=$OUT/old_tables/loopback-nomargin.json" --out "$OUT/bench-14k-margin$TAG" --resume 2>&1 \
        | tee -a "$OUT/bench-14k-margin$TAG.log" ;;
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
