#!/usr/bin/env bash
# KV-Runahead with --kvr-attention split (prefix block in full, own block causally, merged by log-sum-exp)
# against TSP and ring at the longest context of experiments/ttft_cpu_p2, all in one run: p = 2 ranks of
# 1 thread, the default model, the best of a sweep of rank 0's share, its no-communication bound, and TSP,
# cp-allgather and ring as references, their timed runs alternating. Arguments are passed on to kvr-bench
# (--resume continues an interrupted run).
set -euo pipefail
cd "$(dirname "$0")/../.."
kvr-bench --ctx 8k --nproc 2 --modes tsp,cp-allgather,ring,kvr-best,kvr-nocomm --kvr-attention split \
  --shares 0.56,0.60,0.64,0.68,0.72,0.76 --repeats 3 --warmup 1 --interleave \
  --out experiments/ttft_cpu_p2_split "$@"
