#!/usr/bin/env bash
# One process with KV-Runahead's own attention (kvr at world size 1: split attention, sliding layers band by
# band), the fair one-process reference for a model with sliding windows: transformers' single process applies
# the window as a mask over the whole square. 1 and 2 threads, one run each, appended as JSON lines; rerun to
# measure only what is missing: bash experiments/hybrid_gemma3/one_process.sh [8k 16k 32k]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/hybrid_gemma3/one_process.jsonl
touch "$out"
for ctx in ${@:-8k 16k 32k}; do
  for threads in 1 2; do
    if python - "$out" "$ctx" "$threads" <<'PY'
import json, sys
from kvrunahead.prompt import parse_tokens
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if any(r["context_len"] == parse_tokens(sys.argv[2]) and r["threads_per_rank"] == int(sys.argv[3])
                  for r in rows) else 1)
PY
    then continue; fi
    kvr-prefill --model gemma3-270m --nproc 1 --threads "$threads" --ctx "$ctx" --json >> "$out"
  done
done
