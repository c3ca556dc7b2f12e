"""The plan of a sweep: the jobs of each world of ranks, the worlds the network settings need, and the input
checks made once before any world starts. Torch-free, so that ``kvr-bench --help`` and bad input answer fast.

A world's plan travels to its ranks as a JSON file (``WorldPlan``); every rank walks the same jobs in the same
order, so the collectives line up.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from kvrunahead.net.spec import parse_net

DEFAULT_MODES = ("single", "tsp", "cp-allgather", "ring", "kvr-default", "kvr", "kvr-best", "kvr-nocomm")
# kvr-best's partition with --kvr-attention split; the pipeline (Medha); the single process at the world's threads
# only (with --interleave)
EXTRA_MODES = ("kvr-split", "spp", "single-pt", "tp")  # tp: Megatron TP, every rank of the world one TP group
SPP_MODE = re.compile(r"^spp(-([1-9]\d*))?$")  # spp: the cost model's chunk; spp-512: chunks of 512 tokens


def spp_chunk(mode: str) -> int | None:
    """The chunk of an ``spp`` or ``spp-N`` mode (None: ``spp``, the cost model's)."""
    n = SPP_MODE.match(mode).group(2)
    return int(n) if n else None


@dataclass
class Job:
    """One measured point: a mode at a context length, with its repeats."""

    label: str  # mode as reported: single-1t, kvr-even, kvr-best, ...
    mode: str
    context_len: int
    partition: str
    repeats: int
    warmup: int
    sweep: list[float] | None = None  # kvr-best: rank 0's share candidates to try first
    table: str | None = None  # kvr-<label>: partition interpolated from this table
    kvr_attention: str = "auto"
    threads: int | None = None  # single-Nt inside a world of ranks: rank 0 runs it at N threads, the rest idle
    net: str = "loopback"  # the network setting of the run; runs of one world differ at most in noise
    chunk_tokens: int | None = None  # spp-N: the pipeline's chunk (spp: the cost model's)


@dataclass
class WorldPlan:
    """What the ranks of one world run: ``config`` (RunConfig's fields common to every job), the jobs, the
    environment recorded in every row, and the runs an interrupted sweep already recorded (run key -> TTFT)."""

    config: dict
    jobs: list[Job]
    env: dict
    timeout_s: float
    total_runs: int
    recorded: dict[str, float]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorldPlan:
        plan = json.loads(text)
        return cls(**{**plan, "jobs": [Job(**job) for job in plan["jobs"]]})


def runs_in(jobs: list[Job]) -> int:
    """Runs the jobs make: sweep, warm-up and timed."""
    return sum(j.repeats + j.warmup + len(j.sweep or []) for j in jobs)


def run_key(context_len: int, label: str, kind: str, index: int, net: str = "loopback") -> str:
    """A run's identity across an interruption: what --resume matches recorded rows by."""
    return f"{context_len}|{label}|{kind}|{index}" + ("" if net == "loopback" else f"|{net}")


def job_groups(jobs: list[Job], interleave: bool) -> list[list[Job]]:
    """Jobs measured together: alone, or (interleave) every job of one context length, whose timed runs then
    alternate, the order rotating by round (a, b, c, b, c, a, c, a, b, ...; bench/worker.py), so that a drift of
    the machine's speed, and the place in a round, hits every mode alike."""
    if not interleave:
        return [[job] for job in jobs]
    groups: dict[int, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.context_len, []).append(job)
    return list(groups.values())


def check_inputs(config: dict, contexts: list[int], world_sizes: list[int], tables: dict[str, str],
                 kvr_attention: str, nets: list[str] = ("loopback",)) -> None:
    """What every rank would find wrong (the model, a context, a table made for another setting, a network
    setting), found here once before any world starts; raises InputError."""
    from kvrunahead.decide.policy import RunConfig, prepare  # imports torch: only when a sweep is about to run

    for ctx in contexts:
        for p in world_sizes:
            for net in nets:
                cfg = dict(config, context_len=ctx, kvr_attention=kvr_attention, threads=1, net=net)
                prepare(RunConfig(**cfg), p)
                for path in tables.values():
                    prepare(RunConfig(**cfg, table=path), p)


def net_worlds(nets: list[str]) -> list[tuple[str, list[str]]]:
    """Settings grouped by their links: those differing only in noise share one world (one emulation), where
    their runs alternate and the sidecar is switched run by run. Returns (the world's setting, its settings)."""
    groups: dict[str, list[str]] = {}
    for net in nets:
        groups.setdefault(parse_net(net).table_label, []).append(parse_net(net).label)
    out = []
    for cap, members in groups.items():
        noisy = next((m for m in members if m != cap), None)
        # The world's sidecar takes the noise of the noisy setting (one per world).
        world_net = next(n for n in nets if parse_net(n).label == noisy) if noisy else cap
        out.append((world_net, list(dict.fromkeys(members))))
    return out


def build_jobs(contexts: list[int], modes: list[str], repeats: int, warmup: int, shares: list[float],
               nproc: int, tables: dict[str, str] | None = None, kvr_attention: str = "auto",
               singles_in_world: bool = False, nets: list[str] = ("loopback",)) -> list[Job]:
    """The jobs of one world of ``nproc`` ranks, for each of the network settings ``nets`` (which differ at most
    in noise). With ``singles_in_world`` (interleaved sweeps) the single process at 1 and at ``nproc`` threads is
    measured among them, under the first setting; otherwise in worlds of its own."""
    jobs = []
    for i, net in enumerate(nets):
        for job in _jobs_of(contexts, modes, repeats, warmup, shares, nproc, tables, kvr_attention,
                            singles_in_world and i == 0):
            job.net = net
            if i > 0 and job.label == "kvr-best":
                # Searched on the quiet links only, as the paper's KVR-S (fig. 11): the noisy setting reuses the
                # partition the first setting's sweep found.
                job.sweep, job.partition = None, "@best"
            jobs.append(job)
    # Interleaved sweeps group jobs by context: keep each context's jobs of every setting together.
    return sorted(jobs, key=lambda j: contexts.index(j.context_len))


def _jobs_of(contexts, modes, repeats, warmup, shares, nproc, tables, kvr_attention, singles_in_world) -> list[Job]:
    jobs = []
    for ctx in contexts:
        if singles_in_world and {"single", "single-pt"} & set(modes) and nproc > 1:
            for t in sorted({1, nproc}) if "single" in modes else [nproc]:
                jobs.append(Job(f"single-{t}t", "single", ctx, "even", repeats, warmup, threads=t))
        for label, path in (tables or {}).items():
            jobs.append(Job(f"kvr-{label}", "kvr", ctx, "table", repeats, warmup, table=path))
        for mode in modes:
            if mode == "kvr-default":
                jobs.append(Job("kvr-default", "kvr", ctx, "auto", repeats, warmup))
            elif mode == "kvr":
                jobs.append(Job("kvr-even", "kvr", ctx, "even", repeats, warmup))
            elif mode == "kvr-best":
                jobs.append(Job("kvr-best", "kvr", ctx, "even", repeats, warmup, sweep=shares if nproc > 1 else None))
            elif mode == "kvr-nocomm" and tables and "kvr-best" not in modes:
                # The bound on the first table's partition, where no kvr-best sweep picks one.
                label, path = next(iter(tables.items()))
                jobs.append(Job("kvr-nocomm", "kvr-nocomm", ctx, "table", repeats, warmup, table=path))
            elif mode == "kvr-nocomm":
                jobs.append(Job("kvr-nocomm", "kvr-nocomm", ctx, "@best", repeats, warmup))
            elif mode == "kvr-split":
                jobs.append(Job("kvr-split", "kvr", ctx, "@best", repeats, warmup, kvr_attention="split"))
            elif mode.startswith("spp"):
                chunk = spp_chunk(mode)
                jobs.append(Job(mode, "spp", ctx, "even", repeats, warmup, chunk_tokens=chunk))
            elif mode not in ("single", "single-pt"):
                jobs.append(Job(mode, mode, ctx, "even", repeats, warmup))
    for job in jobs:
        if job.mode in ("kvr", "kvr-nocomm") and job.label not in ("kvr-split", "kvr-default"):
            job.kvr_attention = kvr_attention
    return jobs
