#!/usr/bin/env bash
# TTFT of every mode at p = 2 (1 thread per rank, gloo) on three networks, quiet and noisy: unshaped loopback, the
# cap equivalent to the paper's 300 GB/s (650 MB/s) and to its 10 GB/s (22 MB/s), experiments/network_equivalence.
# Needs root (network namespaces, tc). Every part is resumable: rerun the same line and only the missing runs are
# measured. One part at a time (2 cores):
#   bash experiments/ttft_network_p2/run.sh 16k-high    # the headline: 16k at the high cap, quiet
#   bash experiments/ttft_network_p2/run.sh 4k          # every mode, every network, quiet and noisy
#   bash experiments/ttft_network_p2/run.sh 8k          # the same at 8k
#   bash experiments/ttft_network_p2/run.sh 16k-noise   # 16k at both caps, quiet and noisy
#   bash experiments/ttft_network_p2/run.sh short       # 1k and 2k at the low cap: does parallel prefill pay there?
#   bash experiments/ttft_network_p2/run.sh 16k-rest    # 16k at both caps: single, KVR even, KVR on the cap's table
#   bash experiments/ttft_network_p2/run.sh 16k-default # 16k at 650 MB/s, quiet: kvr-prefill's default against the peers
#   bash experiments/ttft_network_p2/run.sh 16k-loopback  # 16k on loopback, every parallel mode, quiet and noisy
set -euo pipefail
cd "$(dirname "$0")/../.."
HIGH=cap=650MB/s
LOW=cap=22MB/s
# "KVR with the table's partition": the shipped loopback table, on every network (as a user who ignores the network
# gets it); kvr-best sweeps rank 0's share on each network's quiet links and runs that partition quiet and noisy.
TABLE=partition_tables/smollm2-135m_p2_float32_cpu_split.json
base=(--nproc 2 --threads 1 --interleave --resume --timeout 1800)
common=("${base[@]}" --table "loopback=$TABLE" --force-table)
all_nets=(--net loopback --net loopback,noise --net "$HIGH" --net "$HIGH,noise" --net "$LOW" --net "$LOW,noise")
out=experiments/ttft_network_p2
case "${1:?which part: 16k-high, 4k, 8k, 16k-noise, short, 16k-rest, 16k-default or 16k-loopback}" in
  16k-high)
    kvr-bench --ctx 16k --modes tsp,cp-allgather,ring,kvr-default,kvr-nocomm --net "$HIGH" --repeats 3 --warmup 0 \
      --out "$out/16k_high" "${common[@]}" ;;
  4k|8k)
    kvr-bench --ctx "$1" --modes single,tsp,cp-allgather,ring,kvr,kvr-best,kvr-nocomm "${all_nets[@]}" \
      --shares 0.50,0.55,0.60,0.65,0.70,0.75 --repeats 3 --warmup 1 --out "$out/$1" "${common[@]}" ;;
  16k-noise)
    kvr-bench --ctx 16k --modes tsp,cp-allgather,ring,kvr-nocomm --net "$HIGH" --net "$HIGH,noise" --net "$LOW" \
      --net "$LOW,noise" --repeats 3 --warmup 0 --out "$out/16k_noise" "${common[@]}" ;;
  16k-rest)
    # KVR even and KVR on the partition searched on that network (the cap's table, kvr-searched: at 16k the
    # hierarchical search on the network stands for kvr-best's share sweep, which four 16k runs per share would
    # make a two-hour part); the single process (1 and 2 threads) in the 650 MB/s world only: it does not use
    # the network. The cap tables must hold 16k (experiments/partition_search_net/run.sh with NET_LONG=1).
    kvr-bench --ctx 16k --modes single,kvr --table "searched=${TABLE%.json}_cap-650mb-s.json" --net "$HIGH" \
      --net "$HIGH,noise" --repeats 3 --warmup 0 --out "$out/16k_rest_high" "${base[@]}"
    kvr-bench --ctx 16k --modes kvr --table "searched=${TABLE%.json}_cap-22mb-s.json" --net "$LOW" \
      --net "$LOW,noise" --repeats 3 --warmup 0 --out "$out/16k_rest_low" "${base[@]}" ;;
  16k-default)
    # The headline again, now that the 650 MB/s table holds 16k: kvr-prefill --net cap=650MB/s takes that table's
    # partition (kvr-default), against the peers in the same interleaved runs.
    kvr-bench --ctx 16k --modes tsp,cp-allgather,ring,kvr-default --net "$HIGH" --repeats 3 --warmup 0 \
      --out "$out/16k_default" "${base[@]}" ;;
  16k-loopback)
    # KVR on the loopback table (searched on loopback) stands for kvr-best, as kvr-searched does at the caps;
    # kvr-nocomm is its bound; the single process is in 16k_rest_high.
    kvr-bench --ctx 16k --modes tsp,cp-allgather,ring,kvr,kvr-nocomm --net loopback --net loopback,noise \
      --repeats 3 --warmup 0 --out "$out/16k_loopback" "${common[@]}" ;;
  short)
    kvr-bench --ctx 1k,2k --modes single,tsp,cp-allgather,ring,kvr,kvr-best,kvr-nocomm --net "$LOW" \
      --shares 0.50,0.55,0.60,0.65,0.70,0.75 --repeats 3 --warmup 1 --out "$out/short_low" "${common[@]}" ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
