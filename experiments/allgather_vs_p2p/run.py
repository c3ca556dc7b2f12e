"""All-gather against point-to-point, per byte, for gloo and MPI at the block sizes the all-gather modes move.

At p = 2 an all-gather is one exchange each way, as NCCL does it on NVLink, so a fair all-gather costs what a
point-to-point exchange of the same block costs. This measures, on 2 ranks of 1 thread each, for each block size:
  native  the library's collective (gloo all_gather_into_tensor / MPI Iallgather), as the Transport calls it
  p2p     the ring all-gather built from the chain's isend/irecv (Transport.allgather = "p2p")
  send    one isend/irecv of the block in one direction (what one hop of the KV chain costs)
Median of --repeats, the three interleaved. Writes results.json and results.md next to this file.

  python experiments/allgather_vs_p2p/run.py   # gloo and MPI on loopback, gloo on the two caps (needs root)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
# K,V bytes per token of the default model (SmolLM2-135M: 30 layers, 3 K,V heads of 64, float32) per layer.
KV_BYTES_PER_TOKEN_LAYER = 2 * 3 * 64 * 4
# Per-layer blocks of TSP and cp-allgather at p = 2: half the context each.
CONTEXTS = [1024, 4096, 8192, 16384]


def rank_main(transport_name: str, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from kvrunahead.ranks.launcher import detect_launcher, init_world
    from kvrunahead.ranks.transport import make_transport

    torch.set_num_threads(1)
    world = init_world(detect_launcher(), "gloo", 120.0)
    t = make_transport(transport_name, world.rank, world.world_size, "gloo", 120.0)
    rows = []
    for ctx in CONTEXTS:
        tokens = ctx // 2
        block = torch.randn(2, 1, 3, tokens, 64)
        times = {"native": [], "p2p": [], "send": []}
        for i in range(repeats + 1):
            for kind in times:
                dist.barrier()
                start = time.perf_counter()
                if kind in ("native", "p2p"):
                    t.set_allgather(kind)
                    got = t.all_gather(block)
                    assert torch.equal(got[world.rank], block)
                elif world.rank == 0:
                    t.isend(block, 1, tag=7)
                    t.drain()
                else:
                    buf = torch.empty_like(block)
                    t.wait(t.irecv(buf, 0, tag=7))
                elapsed = time.perf_counter() - start
                if i > 0:  # the first round warms the connections
                    times[kind].append(elapsed)
        nbytes = block.numel() * 4
        # The slower rank decides what the mode waits for.
        med = {k: statistics.median(v) for k, v in times.items()}
        gathered = [None] * world.world_size
        dist.all_gather_object(gathered, med)
        worst = {k: max(g[k] for g in gathered) for k in med}
        rows.append({"context_len": ctx, "block_bytes": nbytes, **{f"{k}_s": v for k, v in worst.items()},
                     **{f"{k}_MBps": nbytes / v / 1e6 for k, v in worst.items()},
                     "native_over_send": worst["native"] / worst["send"],
                     "p2p_over_send": worst["p2p"] / worst["send"]})
    if world.rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def launch(transport_name: str, repeats: int, net: str = "loopback") -> list[dict]:
    from kvrunahead.net.session import network
    from kvrunahead.net.spec import parse_net
    from kvrunahead.ranks.launcher import free_port, rank_env

    out = HERE / f".{transport_name}.json"
    cmd = [sys.executable, __file__, "--rank", transport_name, str(repeats), str(out)]
    if transport_name == "mpi":
        procs = [subprocess.Popen(["mpirun", "--allow-run-as-root", "--bind-to", "none", "-n", "2", *cmd])]
    else:
        with network(parse_net(net), 2) as hosts:  # a cap: each rank on an emulated host of its own
            port = free_port()
            procs = [subprocess.Popen(hosts.prefix(r) + cmd, env=rank_env(r, 2, port, hosts.master_addr,
                                                                          OMP_NUM_THREADS="1", **hosts.env))
                     for r in range(2)]
            codes = [p.wait() for p in procs]
    if any(p.wait() for p in procs) or (transport_name != "mpi" and any(codes)):
        raise SystemExit(f"{transport_name} ranks failed")
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def main() -> None:
    repeats = int(os.environ.get("REPEATS", "25"))
    import platform

    import torch

    result = {"machine": platform.node(), "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                                      if line.startswith("model name")), ""),
              "torch": torch.__version__, "repeats": repeats, "ranks": 2, "threads_per_rank": 1,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=HERE).stdout.strip(),
              "date": time.strftime("%Y-%m-%d"), "transports": {}}
    transports = ["torch"] + (["mpi"] if shutil.which("mpirun") else [])
    for name in transports:
        result["transports"]["gloo" if name == "torch" else "mpi"] = launch(name, repeats)
    # On capped links (experiments/network_equivalence: the caps equivalent to the paper's 300 and 10 GB/s) each
    # direction has a link of its own, as on NVLink: a fair exchange costs what one send costs.
    for cap in os.environ.get("CAPS", "cap=650MB/s,cap=22MB/s").split(","):
        if cap:
            result["transports"][f"gloo {cap}"] = launch("torch", repeats, cap)
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    lines = ["| transport | context | block MB | native all-gather ms | p2p ring all-gather ms | one send ms | "
             "native / send | p2p / send |", "|---" * 8 + "|"]
    for name, rows in result["transports"].items():
        for r in rows:
            lines.append(f"| {name} | {r['context_len']} | {r['block_bytes'] / 1e6:.1f} | {r['native_s'] * 1e3:.2f} | "
                         f"{r['p2p_s'] * 1e3:.2f} | {r['send_s'] * 1e3:.2f} | {r['native_over_send']:.2f} | "
                         f"{r['p2p_over_send']:.2f} |")
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
