#!/usr/bin/env bash
# KV-Runahead against Medha's stream pipeline (spp) on SmolLM2-135M, p = 2 ranks of 1 thread each (gloo), with ring,
# TSP and one process on both cores, interleaved (every mode's timed runs alternate, the order rotating by round).
# Every part is resumable: rerun the same line and only the missing runs are measured. One part at a time (2 cores):
#   bash experiments/spp_vs_kvr/run.sh chunks      # spp's chunk: 256-2048 tokens and the cost model's, at 8k and 16k
#   bash experiments/spp_vs_kvr/run.sh 16k         # 16k on loopback and at 650 MB/s, 5 rounds
#   bash experiments/spp_vs_kvr/run.sh 8k-12k      # 8k and 12k on loopback and at 650 MB/s, 3 rounds
#   bash experiments/spp_vs_kvr/run.sh memory      # peak memory per rank at 16k, each run in fresh processes
#   python experiments/spp_vs_kvr/report.py        # summary.md (+ plot): measured, and the simulator's predictions
# The 650 MB/s cap needs root (network namespaces, veth, tc). Peak memory per rank is each run's peak resident
# set from its prefill's start (VmHWM reset there), the weights included.
set -euo pipefail
cd "$(dirname "$0")/../.."
CAP=cap=650MB/s
CHUNK=${SPP_CHUNK:-512}  # the best chunk of the `chunks` part (summary.md says which and why)
base=(--nproc 2 --threads 1 --interleave --resume --timeout 1800 --warmup 0)
out=experiments/spp_vs_kvr
case "${1:?which part: chunks, 16k or 8k-12k}" in
  chunks)
    kvr-bench --ctx 8k --modes spp-256,spp-512,spp-1024,spp-2048,spp --repeats 2 --out "$out/chunks_8k" "${base[@]}"
    kvr-bench --ctx 16k --modes spp-512,spp-1024,spp-2048 --repeats 1 --out "$out/chunks_16k" "${base[@]}" ;;
  16k|8k-12k)
    ctx=$([ "$1" = 16k ] && echo 16k || echo 8k,12k)
    repeats=$([ "$1" = 16k ] && echo 5 || echo 3)
    kvr-bench --ctx "$ctx" --modes "single-pt,ring,tsp,kvr-default,spp-$CHUNK" --net loopback --repeats "$repeats" \
      --out "$out/${1}_loopback" "${base[@]}"
    # the single process does not use the network: timed in the loopback world only
    kvr-bench --ctx "$ctx" --modes "ring,tsp,kvr-default,spp-$CHUNK" --net "$CAP" --repeats "$repeats" \
      --out "$out/${1}_cap650" "${base[@]}" ;;
  memory)
    # kvr-bench's ranks run every mode in one process, where what an earlier run left for the collector can sit in
    # a later run's peak: here every run is a kvr-prefill of its own. 2 runs of each, alternating; resumable.
    mkdir -p "$out/memory"
    for i in 1 2; do
      for mode in kvr spp; do
        row="$out/memory/${mode}_$i.json"
        [ -s "$row" ] && continue
        extra=$([ $mode = spp ] && echo "--chunk-tokens $CHUNK" || true)
        kvr-prefill --mode $mode --nproc 2 --threads 1 --ctx 16k --max-new-tokens 1 --json $extra > "$row.tmp"
        mv "$row.tmp" "$row"
      done
    done ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
