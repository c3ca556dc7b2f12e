"""What one all-reduce costs between two local CPU ranks, by backend and message size: the collective Megatron TP
needs twice per layer (a SmolLM2 token: 60 calls of 576 float32 values, 2.3 KB; a 512-token prompt's: 1.2 MB).
Run under mpirun (the rank's MPI world gives the MPI backend; torch's gloo is set up over the same ranks):

    mpirun --allow-run-as-root -np 2 python experiments/tp_collective/allreduce.py [--calls 200]

Per size: `calls` timed all-reduces after 20 untimed, both backends taking turns size by size; rank 0 appends the
medians and 90th percentiles to allreduce.jsonl beside this file with the command, machine and commit. Each rank
keeps one thread (the benchmark's own; OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from kvrunahead.calibrate.timing import timed_runs
from kvrunahead.provenance import environment, machine

HERE = Path(__file__).resolve().parent
SIZES_B = [2 ** k for k in range(11, 22, 2)]  # 2 KB .. 2 MB


def timed(call, calls: int) -> list[float]:
    """``calls`` timed calls after 20 untimed (the last of them ``timed_runs``' own warm-up)."""
    for _ in range(19):
        call()
    return timed_runs(call, calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(29600 + os.getpid() % 1000 if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    rows = []
    for nbytes in SIZES_B:
        t = torch.ones(nbytes // 4)
        a = np.ones(nbytes // 4, dtype=np.float32)
        out = np.empty_like(a)
        results = {}
        for backend, call in (("gloo", lambda t=t: dist.all_reduce(t)),
                              ("mpi", lambda a=a, out=out: comm.Allreduce(a, out, op=MPI.SUM))):
            comm.Barrier()
            results[backend] = timed(call, args.calls)
        for backend, ts in results.items():
            ts.sort()
            rows.append({"backend": backend, "bytes": nbytes, "calls": args.calls,
                         "median_ms": statistics.median(ts) * 1e3, "p90_ms": ts[int(0.9 * len(ts))] * 1e3})
    if rank == 0:
        env = environment("none", "gloo and mpi", 1, "loopback (one host)")
        mpi = MPI.Get_library_version().splitlines()[0].rstrip("\x00")
        command = f"mpirun --allow-run-as-root -np {size} python {' '.join(sys.argv)}"
        with (HERE / "allreduce.jsonl").open("a") as f:
            for r in rows:
                f.write(json.dumps({**env, "machine": machine(), "mpi": mpi, "ranks": size, "command": command,
                                    "date": time.strftime("%Y-%m-%d %H:%M"), **r}) + "\n")
        for r in rows:
            print(f"{r['backend']:5} {r['bytes']:>8} B  median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
