#!/usr/bin/env bash
# Open MPI: rank, size and the rendezvous address come from MPI through mpi4py.
#   bash launch/mpirun.sh 2 --ctx 4k
# Needs: apt-get install -y openmpi-bin libopenmpi-dev && pip install mpi4py
set -euo pipefail
NP=${1:-2}; shift || true
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
[ "$NP" -gt "$(nproc)" ] && extra+=(--oversubscribe)  # more ranks than cores: timings are not meaningful
exec mpirun "${extra[@]}" -n "$NP" --bind-to none kvr-prefill "$@"
