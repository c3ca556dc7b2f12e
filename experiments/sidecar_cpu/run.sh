#!/usr/bin/env bash
# The noise sidecar's CPU share at 11 MB/s and 100 MB/s each way, alone: on loopback and, as root, between two
# emulated hosts at the 22 MB/s and 650 MB/s caps, with the sidecar switched off as the floor. 2 runs of 15 s per
# setting, interleaved (about 2.5 minutes, cut at 10); raw rows to experiments/sidecar_cpu/runs.jsonl, a summary on
# stdout. Run it on a quiet machine. Arguments go on to measure.py (--seconds, --repeats, --setting, --out).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec timeout 600 python3 experiments/sidecar_cpu/measure.py --command "bash experiments/sidecar_cpu/run.sh${*:+ $*}" "$@"
