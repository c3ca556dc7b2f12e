#!/usr/bin/env bash
# kvr-serve under a burst of long requests in a memory-capped cgroup (root; kvrunahead/bench/burst.py): every
# request answered or refused by name, the server alive after, nothing OOM-killed. One JSON row per run in rows.jsonl
# (command, machine, commit, the pool said at start, statuses, peak memory, preemptions, samples every 2 s).
#   bash experiments/kv_pool/run.sh short   # 12 requests of n=16, max_tokens 200, 6 GB: every request answered
#   bash experiments/kv_pool/run.sh medium  # max_tokens 1500: the pool fills, requests are preempted, all end
#   bash experiments/kv_pool/run.sh full    # the issue's burst: max_tokens 6000, cut after 20 minutes
set -euo pipefail
cd "$(dirname "$0")/../.."
rows=experiments/kv_pool/rows.jsonl
case ${1:-short} in
  short) python -m kvrunahead.bench.burst --memory 6G --requests 12 --n 16 --max-tokens 200 --duration 1200 \
           --rows $rows ;;
  medium) python -m kvrunahead.bench.burst --memory 6G --requests 12 --n 16 --max-tokens 1500 --duration 1500 \
           --rows $rows ;;
  full) python -m kvrunahead.bench.burst --memory 6G --requests 12 --n 16 --max-tokens 6000 --duration 1200 \
          --rows $rows ;;
  *) echo "unknown part $1 (short, medium, full)" >&2; exit 2 ;;
esac
