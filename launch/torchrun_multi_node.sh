#!/usr/bin/env bash
# Several nodes with a c10d rendezvous. Run the same line on every node:
#   NNODES=2 NPROC_PER_NODE=8 RDZV_HOST=node0 bash launch/torchrun_multi_node.sh --ctx 16k
# Rank order follows node order: the chain hops between nodes NNODES-1 times, once per node boundary.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NPROC_PER_NODE:?set NPROC_PER_NODE}" "${RDZV_HOST:?set RDZV_HOST}"
exec torchrun \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-kvrunahead}" \
  --no-python kvr-prefill "$@"
