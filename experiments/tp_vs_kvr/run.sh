#!/usr/bin/env bash
# KV-Runahead against Megatron tensor parallelism (tp) at 16k on SmolLM2-135M (float32), p = 2 ranks of 1 thread each
# (gloo), with ring attention and TSP riding in the same worlds: every mode's timed runs alternate, the order
# rotating by round. One part per network; each resumable (rerun the same line: only the missing runs are measured).
#   bash experiments/tp_vs_kvr/run.sh loopback    # 127.0.0.1
#   bash experiments/tp_vs_kvr/run.sh cap650      # every rank on an emulated host, links capped at 650 MB/s
#   bash experiments/tp_vs_kvr/run.sh cap22       # ... at 22 MB/s (the paper's 10 GB/s, network_equivalence)
#   bash experiments/tp_vs_kvr/run.sh loopback-shm  # KVR and TP again, TP's all-reduce in shared memory (mesh.py)
#   python experiments/tp_vs_kvr/report.py        # summary.md: measured medians and the simulator's predictions
# The caps need root (network namespaces, veth, tc). ROUNDS (default 3) sets the timed runs per mode.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/tp_vs_kvr
rounds=${ROUNDS:-3}
base=(--ctx 16k --modes kvr-default,tp,ring,tsp --nproc 2 --threads 1 --interleave --resume --timeout 1800
      --warmup 0 --repeats "$rounds")
case "${1:?which part: loopback, cap650, cap22 or loopback-shm}" in
  loopback) kvr-bench "${base[@]}" --net loopback --out "$out/16k_loopback" ;;
  cap650) kvr-bench "${base[@]}" --net cap=650MB/s --out "$out/16k_cap650" ;;
  cap22) kvr-bench "${base[@]}" --net cap=22MB/s --out "$out/16k_cap22" ;;
  # the loopback part ran TP's all-reduce on gloo (before ShmCollective); this one on shared memory
  loopback-shm) kvr-bench "${base[@]/kvr-default,tp,ring,tsp/kvr-default,tp}" --net loopback \
    --out "$out/16k_loopback_shm" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
