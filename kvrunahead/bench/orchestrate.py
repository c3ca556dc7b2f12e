"""The orchestrator: one world of ranks per (world size, threads, transport, links), started on its network
and supervised; the rows its ranks wrote, and what an interrupted sweep left for --resume.

Each world's ranks append their rows to ``rows_{tag}.{rank}.jsonl`` in the output folder as they go, so a
failed world keeps the runs it measured; the files are removed once the whole sweep's outputs are written.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from kvrunahead.bench.plan import Job, WorldPlan, run_key, runs_in
from kvrunahead.net import session
from kvrunahead.net.noise import NoiseReport
from kvrunahead.net.spec import parse_net
from kvrunahead.ranks.supervise import supervise

log = logging.getLogger(__name__)


def recorded_rows(out_prefix: Path, nproc: int) -> dict[str, float]:
    """TTFT of every run an interrupted sweep already wrote (for --resume). A torn last line is dropped."""
    recorded = {}
    for r in range(nproc):
        path = Path(f"{out_prefix}.{r}.jsonl")
        if not path.exists():
            continue
        good = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            good.append(line)
            recorded[run_key(row["context_len"], row["label"], row["kind"], row["index"],
                             row.get("network", "loopback"))] = row["ttft_s"]
        path.write_text("".join(x + "\n" for x in good))
    return recorded


def run_world(nproc: int, threads: int, transport: str, jobs: list[Job], config: dict, env: dict, workdir: Path,
              timeout_s: float, resume: bool = False, interleave: bool = False, net: str = "loopback") -> list[dict]:
    """One world of ranks for ``jobs``, on the network ``net`` (a cap: one emulated host per rank; noise: the
    sidecar, switched on and off run by run as the jobs' settings say). A failed rank ends the world within the
    timeout; the rows recorded before stay in ``workdir`` for --resume."""
    # launcher imports torch: only once a world is about to start, so that the CLI's --help stays torch-free
    from kvrunahead.ranks.launcher import free_port, rank_env

    spec = parse_net(net)
    tag = f"p{nproc}_t{threads}_{transport}" + ("" if spec.table_label == "loopback" else
                                                 "_" + spec.table_label.replace("=", "").replace("/", ""))
    plan_file, out_prefix = workdir / f"plan_{tag}.json", workdir / f"rows_{tag}"
    recorded = recorded_rows(out_prefix, nproc) if resume else {}
    if recorded and len(recorded) >= runs_in(jobs):
        log.info("world %s: all %d runs already recorded, nothing to run", tag, len(recorded))
        return world_rows(out_prefix, nproc)
    noise_file = workdir / f"noise_{tag}.json"
    if recorded:
        log.info("resuming world %s: %d of %d runs already recorded", tag, len(recorded), runs_in(jobs))
    else:
        noise_file.unlink(missing_ok=True)  # a fresh world: a report left by an earlier sweep is not this one's
    plan = WorldPlan(config={**config, "threads": threads, "transport": transport}, jobs=jobs,
                     env={**env, "threads_per_rank": threads, "transport": transport, "interleaved": interleave},
                     timeout_s=timeout_s, total_runs=runs_in(jobs), recorded=recorded)
    plan_file.write_text(plan.to_json())
    cmd = [sys.executable, "-m", "kvrunahead.cli.bench_worker", str(plan_file), str(out_prefix)]
    if transport == "mpi" and spec.emulated:
        raise ValueError("the MPI transport runs on loopback only (mpirun starts its ranks itself)")
    with session.network(spec, nproc, noise_on=False) as hosts:
        if transport == "mpi":
            extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
            procs = [subprocess.Popen(["mpirun", *extra, "--bind-to", "none", "-n", str(nproc),
                                       *[x for k, v in hosts.env.items() for x in ("-x", f"{k}={v}")], *cmd])]
        else:
            port = free_port()
            procs = [
                subprocess.Popen(hosts.prefix(r) + cmd, env=rank_env(r, nproc, port, hosts.master_addr,
                                                                     OMP_NUM_THREADS=str(threads), **hosts.env))
                for r in range(nproc)
            ]
        code = supervise(procs, grace_s=10.0)
        report = hosts.noise.stop() if hosts.noise else None
    if report is not None:
        if recorded and noise_file.exists():  # the part before the interruption ran a sidecar of its own
            report = NoiseReport.from_json(noise_file.read_text()) + report
        log.info("%s", report.describe())
        noise_file.write_text(report.to_json())
    if code:
        raise RuntimeError(f"benchmark world {tag} failed (exit code {code}); the runs measured before are kept in "
                           f"{out_prefix}.*.jsonl: rerun with --resume to measure only the missing ones")
    plan_file.unlink()
    return world_rows(out_prefix, nproc)


def world_rows(out_prefix: Path, nproc: int) -> list[dict]:
    """The rows every rank of a world wrote, rank by rank."""
    rows = []
    for r in range(nproc):
        path = Path(f"{out_prefix}.{r}.jsonl")
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def clean_partial_rows(workdir: Path) -> None:
    """The per-rank rows every world left for --resume, once the whole sweep's outputs are written."""
    for path in workdir.glob("rows_*.jsonl"):
        path.unlink()
