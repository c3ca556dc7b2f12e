#!/usr/bin/env bash
# One node, one rank per GPU (or per CPU core group): KV-Runahead prefill of a 16k prompt.
#   bash launch/torchrun_single_node.sh 8 --ctx 16k --allow-long-context
set -euo pipefail
NPROC=${1:-8}; shift || true
exec torchrun --standalone --nproc-per-node "$NPROC" --no-python kvr-prefill "$@"
