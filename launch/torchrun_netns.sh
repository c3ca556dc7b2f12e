#!/usr/bin/env bash
# Several emulated hosts on this machine, one torchrun per host, c10d rendezvous across them: a multi-node job
# in miniature, over links capped at NET (tc tbf each way; needs root). Everything is removed on exit.
#   NET=cap=400MB/s HOSTS=2 bash launch/torchrun_netns.sh --ctx 2k --verify
#   NET=cap=13MB/s,noise bash launch/torchrun_netns.sh --ctx 4k
# Arguments go to kvr-prefill, which is told the network (--net) so that it labels its result and picks the
# partition table of that cap. Host 0's torchrun hosts the rendezvous store (is_host: the emulated hosts share
# one hostname, so torchrun cannot tell which host the endpoint names); --local-addr gives each agent its
# emulated host's address.
set -euo pipefail
NET="${NET:-cap=400MB/s}"
HOSTS="${HOSTS:-2}"
# The emulated hosts share this machine's cores: one thread per rank unless told otherwise.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec kvr-net run --hosts "$HOSTS" --net "$NET" -- \
  torchrun --nnodes "$HOSTS" --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --rdzv-backend c10d --rdzv-endpoint "{addr0}:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-kvrunahead-netns}" \
  --rdzv-conf "is_host={is_host0}" --local-addr "{addr}" \
  --no-python kvr-prefill --net "$NET" "$@"
