#!/usr/bin/env bash
# TTFT of every prefill mode on this 2-core CPU: p = 2 ranks of 1 thread each, the default model,
# contexts 1k..8k (the model's trained length), one warm-up and 3 timed runs per point.
# Then the two transports on the same run, for the two point-to-point / all-gather modes.
# Run it on a quiet machine: every number is a wall-clock TTFT. Arguments are passed on to kvr-bench
# (bash run.sh --resume continues an interrupted run).
set -euo pipefail
cd "$(dirname "$0")/../.."
kvr-bench --ctx 1k,2k,4k,8k --nproc 2 --modes single,tsp,cp-allgather,ring,kvr,kvr-best,kvr-nocomm \
  --kvr-attention masked --repeats 3 --warmup 1 --out experiments/ttft_cpu_p2 "$@"
kvr-bench --ctx 2k,4k --nproc 2 --modes tsp,kvr --kvr-attention masked --transports torch,mpi --repeats 3 --warmup 1 \
  --out experiments/ttft_cpu_p2/transports "$@"
