#!/usr/bin/env bash
# One-shot kvr-prefill at 16k through the one-step engine against a checkout of the engine before it (BEFORE, a
# commit: 5b3e448 by default), interleaved, ROUNDS rounds (the order alternating), 2 ranks of 1 thread. The
# checkout goes to /tmp/kvr-before (git worktree) and runs through PYTHONPATH, with this install's packages; each
# row records the package directory its ranks imported.
# Rows (one JSON object per run: which, round, TTFT, partition) to experiments/mixed_steps/oneshot.jsonl.
# Usage: bash experiments/mixed_steps/oneshot.sh  (ROUNDS=3 BEFORE=5b3e448 CTX=16k OUT=experiments/mixed_steps/oneshot.jsonl;
# an existing /tmp/kvr-before checkout is used as it is)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
BEFORE=${BEFORE:-5b3e448}
CTX=${CTX:-16k}
OUT=${OUT:-experiments/mixed_steps/oneshot.jsonl}
[ -d /tmp/kvr-before ] || git worktree add -f /tmp/kvr-before "$BEFORE"
now=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvrunahead || echo -dirty)
run() {  # $1: which (before|now), $2: round
  local pp=""
  [ "$1" = before ] && pp=/tmp/kvr-before
  local commit=$now
  [ "$1" = before ] && commit=$(git -C /tmp/kvr-before rev-parse --short HEAD)
  # From /tmp: the ranks start with their working directory first on sys.path, which must not be this checkout.
  (cd /tmp && PYTHONPATH=$pp OMP_NUM_THREADS=1 kvr-prefill --nproc 2 --threads 1 --ctx "$CTX" --json > /tmp/oneshot.json)
  package=$(cd /tmp && PYTHONPATH=$pp python3 -c "import kvrunahead, os; print(os.path.dirname(kvrunahead.__file__))")
  python3 - "$1" "$2" "$commit" "$package" <<'PY' >> "$OUT"
import json, sys, platform
r = json.load(open("/tmp/oneshot.json"))
print(json.dumps({"which": sys.argv[1], "round": int(sys.argv[2]), "commit": sys.argv[3], "ttft_s": r["ttft_s"],
                  "boundaries": r["boundaries"], "first_token": r.get("first_token"), "package": sys.argv[4],
                  "cpu": platform.processor(),
                  "command": "bash experiments/mixed_steps/oneshot.sh"}))
PY
  tail -1 "$OUT"
}
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then run before "$round"; run now "$round"; else run now "$round"; run before "$round"; fi
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = {w: statistics.median(r["ttft_s"] for r in rows if r["which"] == w) for w in ("before", "now")}
print(f"median TTFT: before {med['before']:.2f} s, now {med['now']:.2f} s: now / before {med['now'] / med['before']:.3f}")
PY
