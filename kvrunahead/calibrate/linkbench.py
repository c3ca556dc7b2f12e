"""Link microbenchmark for ``kvr-calibrate``: one rank of two, started by ``launcher.spawn`` (inside the
emulated hosts when a cap is asked for). Times one point-to-point transfer of each size through the
runtime's own ``Transport`` (what one hop of the KV chain costs) and its all-gather, and rank 0 writes the
medians as JSON: ``python -m kvrunahead.calibrate.linkbench OUT REPEATS SIZE...``."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvrunahead.calibrate.timing import fit
from kvrunahead.net.spec import parse_net
from kvrunahead.sim.profile import LinkProfile

LINK_SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
LARGE_MESSAGE = 1 << 22


def measure_link(net: str | None, repeats: int, sizes=LINK_SIZES) -> tuple[LinkProfile, float, list[dict]]:
    """Latency and bandwidth of one direction between two ranks, and the all-gather's efficiency."""
    from kvrunahead.ranks.launcher import spawn

    spec = parse_net(net)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "link.json"
        code = spawn(2, [str(out), str(repeats), *map(str, sizes)], module="kvrunahead.calibrate.linkbench", net=spec)
        if code != 0 or not out.exists():
            raise RuntimeError(f"the link benchmark failed (exit {code}) on {spec.label}")
        data = json.loads(out.read_text())
    rows = data["rows"]
    # Bandwidth from the messages of the sizes the modes move (a layer's K,V: megabytes), latency from the
    # smallest; tbf lets a short burst through faster than the rate, which a fit over all sizes would take in.
    big = [r for r in rows if r["bytes"] >= LARGE_MESSAGE] or rows[-1:]
    coef, _ = fit([[r["bytes"] for r in big]], [r["send_s"] for r in big])
    bandwidth = 1.0 / max(float(coef[0]), 1e-30)
    latency = max(0.0, min(r["send_s"] - r["bytes"] / bandwidth for r in rows if r["bytes"] < LARGE_MESSAGE))
    worst = max(abs(latency + r["bytes"] / bandwidth - r["send_s"]) / r["send_s"] for r in big)
    # At p = 2 an all-gather is one exchange each way: its efficiency is one transfer's time over its own.
    efficiency = statistics.median(r["send_s"] / r["allgather_s"] for r in big)
    kind = "ring" if data["allgather"] == "p2p" else "native"
    penalty = statistics.mean(data["compute_s_per_byte"])
    return LinkProfile(bandwidth, latency, kind, round(min(1.0, efficiency), 3), penalty), worst, rows


def main(out: str, repeats: int, sizes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from kvrunahead.ranks.launcher import detect_launcher, init_world, leave_world
    from kvrunahead.ranks.transport import make_transport

    torch.set_num_threads(1)
    world = init_world(detect_launcher(), "gloo", 300.0)
    t = make_transport("torch", world.rank, world.world_size, "gloo", 300.0)
    rows = []
    for size in sizes:
        block = torch.zeros(size // 4, dtype=torch.float32)
        send, gather = [], []
        for i in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if world.rank == 0:
                t.isend(block, 1, tag=i)
                t.drain()
            else:
                t.wait(t.irecv(torch.empty_like(block), 0, tag=i), "the link benchmark's block")
            dist.barrier()  # the receiver's completion, seen by both
            elapsed = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            t.all_gather(block)
            gathered = time.perf_counter() - start
            if i:
                send.append(elapsed)
                gather.append(gathered)
        rows.append({"bytes": size, "send_s": statistics.median(send), "allgather_s": statistics.median(gather)})
    penalty = _compute_penalty(t, world.rank, sizes[-1], repeats)
    penalties = [None] * world.world_size
    dist.all_gather_object(penalties, penalty)
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "allgather": t.allgather, "compute_s_per_byte": penalties}, f)
    dist.barrier()
    leave_world()


def _compute_penalty(t, rank: int, size: int, repeats: int) -> float:
    """Seconds a rank's compute loses per byte it sends or receives meanwhile: the same matrix products timed
    alone and while a block crosses the link (the copies run on the same cores, and share their caches)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(384, 384)
    block = torch.zeros(size // 4, dtype=torch.float32)

    def work() -> float:
        start = time.perf_counter()
        for _ in range(400):
            a @ a
        return time.perf_counter() - start

    alone, busy = [], []
    for i in range(repeats + 1):
        dist.barrier()
        quiet = work()
        dist.barrier()
        if rank == 0:
            t.isend(block, 1, tag=10_000 + i)
        else:
            req = t.irecv(torch.empty_like(block), 0, tag=10_000 + i)
        loaded = work()
        if rank == 0:
            t.drain()
        else:
            t.wait(req, "the link benchmark's block")
        if i:
            alone.append(quiet)
            busy.append(loaded)
    return max(0.0, statistics.median(busy) - statistics.median(alone)) / size


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3:]])
