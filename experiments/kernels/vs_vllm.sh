#!/usr/bin/env bash
# The kernels' targets that need whole servers, on this host, float32 and bfloat16 (each part resumable: a finished
# round, piece or setting is skipped; rows name their commit and machine):
#   bash experiments/kernels/vs_vllm.sh floor     # the decode step against its bytes-over-bandwidth floor
#   bash experiments/kernels/vs_vllm.sh single    # kvr-serve against vLLM CPU, one request of 4k, 8k, 16k tokens
#   bash experiments/kernels/vs_vllm.sh load      # TPOT at 1 and 8 concurrent, ShareGPT at 0.25 and 0.5/s
#   bash experiments/kernels/vs_vllm.sh chunks    # a 16k prompt whole against chunked at 500 ms
#   bash experiments/kernels/vs_vllm.sh compile   # kvr-bench at 4k, eager against --compile (the README's figure)
#   bash experiments/kernels/vs_vllm.sh split     # where a decode step's time goes (the kernels against the rest)
#   bash experiments/kernels/vs_vllm.sh rows      # kvr-serve: 8 decode rows against one (serve_rows.py)
#   bash experiments/kernels/vs_vllm.sh startup   # kvr-serve's start-up, eager and --compile (cold, warm cache)
#   bash experiments/kernels/vs_vllm.sh chain     # kvr-bench at 4k: the chain against one process on both cores
# vLLM first: bash experiments/serve_vs_vllm/install.sh. KVR_ROUNDS sets the rounds (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/kernels
rounds=${KVR_ROUNDS:-2}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(floor single load chunks compile split rows startup chain)
for part in "${parts[@]}"; do
  case $part in
    floor) python $out/decode_floor.py --rounds 3 ;;
    single)
      for d in float32 bfloat16; do
        python experiments/serve_vs_vllm/single.py --rows $out/vs_vllm_single.jsonl --rounds "$rounds" \
          --lengths 4096,8184,16376 --servers kvr,vllm --dtype $d
      done ;;
    load)
      for d in float32 bfloat16; do
        python experiments/serve_vs_vllm/load.py concurrency vbench --servers kvr,vllm --concurrency 1,8 \
          --dtype $d --out $out/vs_vllm_load/$d
      done ;;
    chunks)
      for d in float32 bfloat16; do
        python experiments/fast_forward/chunks.py --rounds "$rounds" --lengths 16376 --dtype $d \
          --rows $out/chunks.jsonl
      done ;;
    compile)
      for ((r = 0; r < rounds; r++)); do
        for s in "float32" "float32 --compile" "bfloat16" "bfloat16 --compile"; do
          read -r dtype flag <<<"$s"
          dir="$out/compile/${dtype}${flag:+-compiled}_r$r"
          [ -s "$dir/summary.csv" ] && continue
          kvr-bench --ctx 4k --modes kvr-default --nproc 2 --threads 1 --repeats 1 --warmup 1 --timeout 1800 \
            --dtype "$dtype" $flag --out "$dir" --resume
        done
      done ;;
    split) python $out/decode_floor.py --split ;;
    rows) python $out/serve_rows.py --rounds "$rounds" ;;
    startup) python experiments/fast_forward/startup.py --dtype float32 --rows $out/startup.jsonl ;;
    chain)
      for ((r = 0; r < rounds; r++)); do
        for dtype in float32 bfloat16; do
          dir="$out/chain_vs_one/${dtype}_r$r"
          [ -s "$dir/summary.csv" ] && continue
          kvr-bench --ctx 4k --modes single-pt,kvr-default --nproc 2 --threads 1 --repeats 1 --warmup 1 \
            --timeout 1800 --dtype "$dtype" --out "$dir" --resume
        done
      done ;;
    *) echo "unknown part $part (floor, single, load, chunks, compile, split, rows, startup, chain)" >&2; exit 2 ;;
  esac
done
