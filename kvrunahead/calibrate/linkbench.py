"""Link microbenchmark for ``kvr-calibrate``: one rank of two, started by ``launcher.spawn`` (inside the
emulated hosts when a cap is asked for). Times one point-to-point transfer of each size through the
runtime's own ``Transport`` (what one hop of the KV chain costs) and its all-gather, and rank 0 writes the
medians as JSON: ``python -m kvrunahead.calibrate.linkbench OUT REPEATS SIZE...``."""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(out: str, repeats: int, sizes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from kvrunahead.launcher import detect_launcher, init_world, leave_world
    from kvrunahead.transport import make_transport

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
