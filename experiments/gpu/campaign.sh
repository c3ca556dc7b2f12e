#!/usr/bin/env bash
# The GPU campaign in one command (docs/gpu.md): run from anywhere, on a machine with one GPU.
#   bash experiments/gpu/campaign.sh                 # on the GPU, outputs in $OUT or experiments/gpu/out
#   bash experiments/gpu/campaign.sh --dry-run       # the plan for one H100, then every step on CPU, tiny
# The package need not be installed: the checkout is put on PYTHONPATH (the GPU image has torch, transformers,
# numpy, scipy, click and pytest; the campaign imports nothing else).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m kvrunahead.bench.gpu.campaign "$@"
