#!/usr/bin/env bash
# One decode step of the server's decoder (experiments/kernels/decode_floor.py: SmolLM2-135M, float32 and bfloat16,
# 1 and 2 threads, one row over 1024 positions and 8 rows of 150-1550) before the paged pool (commit $BEFORE, in a
# worktree) and after it (this tree), one round of each in turn, the first alternating by round. Rows append to
# decode_step.jsonl here, each with "code": before|after and its commit; a cut run resumes by running more rounds.
#   bash experiments/kv_pool/decode_step.sh            (BEFORE=8658541 ROUNDS=3)
set -euo pipefail
BEFORE=${BEFORE:-8658541}
ROUNDS=${ROUNDS:-3}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tree=${TMPDIR:-/tmp}/kvr-before-$BEFORE
[ -d "$tree" ] || git -C "$root" worktree add --detach "$tree" "$BEFORE" >&2
for r in $(seq 1 "$ROUNDS"); do
  sides=(before after)
  [ $((r % 2)) -eq 0 ] && sides=(after before)
  for side in "${sides[@]}"; do
    dir=$root
    [ "$side" = before ] && dir=$tree
    rows=$dir/experiments/kernels/decode_floor.jsonl
    n=$(wc -l < "$rows")
    (cd "$dir" && PYTHONPATH=$dir python experiments/kernels/decode_floor.py --rounds 1 --steps 10)
    commit=$(git -C "$dir" rev-parse --short HEAD)
    tail -n +$((n + 1)) "$rows" | SIDE=$side ROUND=$r COMMIT=$commit python -c '
import json, os, sys
for line in sys.stdin:
    print(json.dumps({**json.loads(line), "code": os.environ["SIDE"], "code_commit": os.environ["COMMIT"],
                      "round": int(os.environ["ROUND"])}))' >> "$here/decode_step.jsonl"
    head -n "$n" "$rows" > "$rows.tmp" && mv "$rows.tmp" "$rows"  # that script's own file left as it was
  done
done
