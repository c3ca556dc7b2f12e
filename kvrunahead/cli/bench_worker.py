"""A benchmark rank: joins its world, walks the world's plan and writes one row per run it emits.

Started by ``run_world`` on every rank as ``python -m kvrunahead.cli.bench_worker PLAN OUT_PREFIX``; the ranks stay
up for their whole share of the sweep (the model is loaded once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from kvrunahead.bench.plan import Job, WorldPlan, job_groups, run_key
from kvrunahead.cli import common
from kvrunahead.config import RunConfig
from kvrunahead.model.device import resolve_device
from kvrunahead.net import liveness
from kvrunahead.net.noise import switch
from kvrunahead.net.spec import parse_net
from kvrunahead.oneshot.runner import RunResult, leave_world, prefill_on_world
from kvrunahead.ranks.launcher import World, detect_launcher, init_world, local_rank_hint, pick_backend
from kvrunahead.ranks.mesh import chain_world


def rotated(items: list, by: int) -> list:
    """``items`` started at ``by`` (modulo their number): round i of an interleaved group runs its modes from the
    i-th on, so that no mode always runs first or right after the same other one."""
    k = by % len(items) if items else 0
    return items[k:] + items[:k]


class BenchRank:
    """One rank's walk through its world's plan. Every rank measures every run (the single process on rank 0
    alone), so the collectives line up; the rank that emits a result writes its row to ``out``."""

    def __init__(self, plan: WorldPlan, world: World, out: TextIO) -> None:
        self.plan, self.world, self.out = plan, world, out
        self.noise_control = os.environ.get("KVR_NOISE_CONTROL")
        self.noise_on: bool | None = None
        self.done = 0
        self.rewarm = bool(plan.recorded)  # fresh ranks after a resume: one untimed run before the first recorded one
        self.best: dict[tuple[int, str], str] = {}  # (context length, links) -> the partition kvr-best settled on

    def run(self) -> None:
        for group in job_groups(self.plan.jobs, self.plan.env["interleaved"]):
            partitions = [self.prepare(job) for job in group]
            for i in range(max(job.repeats for job in group)):
                for job, partition in rotated(list(zip(group, partitions)), i):
                    if i < job.repeats:
                        self.measure(job, partition, "timed", i)

    def prepare(self, job: Job) -> str:
        """The job's partition (after its sweep, if any), then its warm-up runs."""
        partition = job.partition
        if partition == "@best":
            partition = self.best.get((job.context_len, parse_net(job.net).table_label), "even")
        if job.sweep:
            # Rank 0's share; the rest split evenly. Every rank sees the same TTFTs, so all pick the same best.
            p = self.world.world_size
            tried = {}
            for share in job.sweep:
                rest = (1 - share) / (p - 1)
                spec = ",".join(f"{x:.6f}" for x in [share] + [rest] * (p - 1))
                tried[spec] = self.measure(job, spec, "sweep", len(tried))
            partition = min(tried, key=tried.get)
            self.best[(job.context_len, parse_net(job.net).table_label)] = partition
        for i in range(job.warmup):
            self.measure(job, partition, "warmup", i)
        return partition

    def measure(self, job: Job, partition: str, kind: str, index: int) -> float:
        """TTFT of one run, the same on every rank (or the one recorded before an interruption)."""
        key = run_key(job.context_len, job.label, kind, index, job.net)
        if key in self.plan.recorded:
            self.done += 1
            return self.plan.recorded[key]
        cfg = RunConfig(**{**self.plan.config, "mode": job.mode, "context_len": job.context_len,
                           "partition": partition, "table": job.table, "kvr_attention": job.kvr_attention,
                           "net": job.net, "chunk_tokens": job.chunk_tokens})
        self._set_noise(job.net)
        if self.rewarm:
            self._one_run(cfg, job)
            self.rewarm = False
        result = self._one_run(cfg, job)
        ttft = [result.ttft_s if result is not None else None]
        if self.world.world_size > 1:
            gathered = liveness.gather_objects(ttft[0], "the other ranks' TTFT")
            ttft = [t for t in gathered if t is not None]
        self.done += 1
        if result is not None:
            self._record(job, kind, index, result)
        return ttft[0]

    def _set_noise(self, net: str) -> None:
        """Rank 0 switches the sidecar to the run's setting before the run (its start barrier follows)."""
        on = parse_net(net).noise is not None
        if self.world.rank == 0 and self.noise_control and self.noise_on != on:
            switch(self.noise_control, on)
            self.noise_on = on

    def _one_run(self, cfg: RunConfig, job: Job) -> RunResult | None:
        if job.mode == "tp":  # the world's ranks as one TP group (its transport and collective made untimed)
            p = self.world.world_size
            return prefill_on_world(dataclasses.replace(cfg, tp=p), chain_world(self.world, p))
        if job.mode != "single" or self.world.world_size == 1:
            return prefill_on_world(cfg, self.world)
        # A single process among the timed runs of the ranks (interleaved): rank 0 runs it alone at the job's
        # threads while the other ranks wait idle in a barrier, so it has the cores a lone process would.
        result = None
        if self.world.rank == 0:
            cfg.threads = job.threads
            result = prefill_on_world(cfg, World(0, 1, 0, 1, "single"))
        liveness.patient_barrier("rank 0's single-process run")
        return result

    def _record(self, job: Job, kind: str, index: int, result: RunResult) -> None:
        """The run's row (flushed at once, so that an interrupted sweep keeps it) and a progress line."""
        row = {**self.plan.env, "label": job.label, "mode": job.mode, "kind": kind, "index": index,
               **{k: v for k, v in result.to_dict().items() if k not in ("ranks", "verification")},
               # the attention that ran (an "auto" job records what it resolved to)
               "kvr_attention": result.kvr_attention.split()[0] if result.kvr_attention else None,
               "ranks": [asdict(r) for r in result.ranks]}
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        print(f"[{self.done}/{self.plan.total_runs}] ctx {job.context_len:>6} {job.label:<14} {kind:<7} "
              f"partition {','.join(map(str, result.boundaries))}: TTFT {result.ttft_s:.3f} s",
              file=sys.stderr, flush=True)


def worker(plan_file: str, out_prefix: str) -> None:
    """Run the plan in ``plan_file`` on this rank, appending rows to ``{out_prefix}.{rank}.jsonl``."""
    plan = WorldPlan.from_json(Path(plan_file).read_text())
    # The runs resolve their device as any run does (a GPU where there is one): the world's backend follows it.
    device = resolve_device(plan.config.get("device", "auto"), local_rank_hint())
    world = init_world(detect_launcher(), pick_backend(device), timeout_s=plan.timeout_s, device=device)
    if world.world_size > 1:
        liveness.patient_barrier()  # the group singles wait in, made by every rank before any other
    # Runs recorded by an interrupted sweep (--resume): every rank skips the same ones.
    with open(f"{out_prefix}.{world.rank}.jsonl", "a" if plan.recorded else "w") as out:
        BenchRank(plan, world, out).run()
    if world.world_size > 1:
        dist.barrier()
    leave_world()


def worker_main(plan_file: str, out_prefix: str) -> None:
    """A benchmark rank: a fault (a stopped peer, a link down) ends it with one line and a non-zero exit, the
    rows it wrote before kept; interpreter teardown is skipped, as it can block on a broken process group."""
    with common.rank_ending("kvr-bench"):
        worker(plan_file, out_prefix)


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2])
