"""``kvr-bench``: TTFT of every prefill mode over context lengths, world sizes and transports.

The orchestrator starts one world of ranks per (world size, threads, transport); the ranks stay up for
their whole share of the sweep (the model is loaded once) and every rank walks the same plan, so the
collectives line up. Each run becomes one row; the emitting rank writes it.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrunahead.provenance import environment

log = logging.getLogger(__name__)

DEFAULT_MODES = ("single", "tsp", "cp-allgather", "ring", "kvr-default", "kvr", "kvr-best", "kvr-nocomm")
EXTRA_MODES = ("kvr-split",)  # kvr-best's partition with --kvr-attention split


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


# ---------------------------------------------------------------- worker (runs on every rank)

def worker(plan_file: str, out_prefix: str) -> None:
    import torch.distributed as dist

    from kvrunahead.launcher import World, detect_launcher, init_world
    from kvrunahead.net import liveness
    from kvrunahead.net.noise import switch
    from kvrunahead.net.spec import parse_net
    from kvrunahead.policy import RunConfig
    from kvrunahead.runner import leave_world, run_on_world

    plan = json.loads(Path(plan_file).read_text())
    world = init_world(detect_launcher(), "gloo", timeout_s=plan["timeout_s"])
    base = plan["config"]
    noise_control = os.environ.get("KVR_NOISE_CONTROL")
    noise_state = [None]

    def set_noise(net: str) -> None:
        """Rank 0 switches the sidecar to the run's setting before the run (its start barrier follows)."""
        on = parse_net(net).noise is not None
        if world.rank == 0 and noise_control and noise_state[0] != on:
            switch(noise_control, on)
            noise_state[0] = on

    if world.world_size > 1:
        liveness.patient_barrier()  # the group singles wait in, made by every rank before any other
    # Runs recorded by an interrupted sweep (--resume): every rank skips the same ones.
    recorded: dict[str, float] = plan.get("recorded", {})
    out = open(f"{out_prefix}.{world.rank}.jsonl", "a" if recorded else "w")
    total = plan["total_runs"]
    done = 0
    rewarm = bool(recorded)  # fresh ranks after a resume: one untimed run before the first recorded one

    def measure(job: dict, partition: str, kind: str, index: int) -> float:
        nonlocal done, rewarm
        key = run_key(job["context_len"], job["label"], kind, index, job["net"])
        if key in recorded:
            done += 1
            return recorded[key]
        cfg = RunConfig(**{**base, "mode": job["mode"], "context_len": job["context_len"], "partition": partition,
                           "table": job["table"], "kvr_attention": job["kvr_attention"], "net": job["net"]})
        set_noise(job["net"])
        if rewarm:
            one_run(cfg, job)
            rewarm = False
        result = one_run(cfg, job)
        ttft = [result.ttft_s if result is not None else None]
        if world.world_size > 1:
            gathered = liveness.gather_objects(ttft[0], "the other ranks' TTFT")
            ttft = [t for t in gathered if t is not None]
        done += 1
        if result is not None:
            row = {**plan["env"], "label": job["label"], "mode": job["mode"], "kind": kind, "index": index,
                   **{k: v for k, v in result.to_dict().items() if k not in ("ranks", "verification")},
                   # the attention that ran (an "auto" job records what it resolved to)
                   "kvr_attention": result.kvr_attention.split()[0] if result.kvr_attention else None,
                   "ranks": [asdict(r) for r in result.ranks]}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"[{done}/{total}] ctx {job['context_len']:>6} {job['label']:<14} {kind:<7} "
                  f"partition {','.join(map(str, result.boundaries))}: TTFT {result.ttft_s:.3f} s",
                  file=sys.stderr, flush=True)
        return ttft[0]

    def one_run(cfg, job: dict):
        if job["mode"] != "single" or world.world_size == 1:
            return run_on_world(cfg, world)
        # A single process among the timed runs of the ranks (interleaved): rank 0 runs it alone at the job's
        # threads while the other ranks wait idle in a barrier, so it has the cores a lone process would.
        result = None
        if world.rank == 0:
            cfg.threads = job["threads"]
            result = run_on_world(cfg, World(0, 1, 0, 1, "single"))
        liveness.patient_barrier("rank 0's single-process run")
        return result

    best: dict[tuple, str] = {}  # (context length, links) -> the partition kvr-best settled on

    def prepare(job: dict) -> str:
        """The job's partition (after its sweep, if any), then its warm-up runs."""
        partition = job["partition"]
        if partition == "@best":
            partition = best.get((job["context_len"], parse_net(job["net"]).table_label), "even")
        if job["sweep"]:
            # Rank 0's share; the rest split evenly. Every rank sees the same TTFTs, so all pick the same best.
            p = world.world_size
            tried = {}
            for share in job["sweep"]:
                rest = (1 - share) / (p - 1)
                spec = ",".join(f"{x:.6f}" for x in [share] + [rest] * (p - 1))
                tried[spec] = measure(job, spec, "sweep", len(tried))
            partition = min(tried, key=tried.get)
            best[(job["context_len"], parse_net(job["net"]).table_label)] = partition
        for i in range(job["warmup"]):
            measure(job, partition, "warmup", i)
        return partition

    for group in job_groups(plan["jobs"], plan["env"]["interleaved"]):
        partitions = [prepare(job) for job in group]
        for i in range(max(job["repeats"] for job in group)):
            for job, partition in zip(group, partitions):
                if i < job["repeats"]:
                    measure(job, partition, "timed", i)
    out.close()
    if world.world_size > 1:
        dist.barrier()
    leave_world()


# ---------------------------------------------------------------- orchestrator

def job_groups(jobs: list[dict], interleave: bool) -> list[list[dict]]:
    """Jobs measured together: alone, or (interleave) every job of one context length, whose timed runs then
    alternate (a, b, c, a, b, c, ...) so that a drift of the machine's speed hits every mode alike."""
    if not interleave:
        return [[job] for job in jobs]
    groups: dict[int, list[dict]] = {}
    for job in jobs:
        groups.setdefault(job["context_len"], []).append(job)
    return list(groups.values())


def run_key(context_len: int, label: str, kind: str, index: int, net: str = "loopback") -> str:
    return f"{context_len}|{label}|{kind}|{index}" + ("" if net == "loopback" else f"|{net}")


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


def _runs_in(jobs: list[Job]) -> int:
    return sum(j.repeats + j.warmup + len(j.sweep or []) for j in jobs)


def run_world(nproc: int, threads: int, transport: str, jobs: list[Job], config: dict, env: dict, workdir: Path,
              timeout_s: float, resume: bool = False, interleave: bool = False, net: str = "loopback") -> list[dict]:
    """One world of ranks for ``jobs``, on the network ``net`` (a cap: one emulated host per rank; noise: the
    sidecar, switched on and off run by run as the jobs' settings say). A failed rank ends the world within the
    timeout; the rows recorded before stay in ``workdir`` for --resume."""
    from kvrunahead.launcher import free_port, rank_env
    from kvrunahead.net.noise import NoiseReport
    from kvrunahead.net.session import network
    from kvrunahead.net.spec import parse_net
    from kvrunahead.supervise import supervise

    spec = parse_net(net)
    tag = f"p{nproc}_t{threads}_{transport}" + ("" if spec.table_label == "loopback" else
                                                 "_" + spec.table_label.replace("=", "").replace("/", ""))
    plan_file, out_prefix = workdir / f"plan_{tag}.json", workdir / f"rows_{tag}"
    recorded = recorded_rows(out_prefix, nproc) if resume else {}
    if recorded and len(recorded) >= _runs_in(jobs):
        log.info("world %s: all %d runs already recorded, nothing to run", tag, len(recorded))
        return _world_rows(out_prefix, nproc)
    noise_file = workdir / f"noise_{tag}.json"
    if recorded:
        log.info("resuming world %s: %d of %d runs already recorded", tag, len(recorded), _runs_in(jobs))
    else:
        noise_file.unlink(missing_ok=True)  # a fresh world: a report left by an earlier sweep is not this one's
    plan = {"config": {**config, "threads": threads, "transport": transport}, "jobs": [asdict(j) for j in jobs],
            "env": {**env, "threads_per_rank": threads, "transport": transport, "interleaved": interleave},
            "timeout_s": timeout_s,
            "total_runs": _runs_in(jobs), "recorded": recorded}
    plan_file.write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "kvrunahead.bench.cli", "--worker", str(plan_file), str(out_prefix)]
    if transport == "mpi" and spec.emulated:
        raise ValueError("the MPI transport runs on loopback only (mpirun starts its ranks itself)")
    with network(spec, nproc, noise_on=False) as hosts:
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
    return _world_rows(out_prefix, nproc)


def _world_rows(out_prefix: Path, nproc: int) -> list[dict]:
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


def summarize(rows: list[dict]) -> list[dict]:
    """Median, min and max TTFT of the timed runs of each point."""
    points: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["kind"] == "timed":
            points.setdefault((row.get("network", "loopback"), row["context_len"], row["world_size"], row["label"],
                               row["transport"]), []).append(row)
    out = []
    for (net, ctx, p, label, transport), rs in sorted(points.items()):
        t = [r["ttft_s"] for r in rs]
        ranks = rs[0]["ranks"]
        out.append({
            "network": net, "context_len": ctx, "world_size": p, "label": label, "transport": transport,
            "allgather": rs[0].get("allgather"),
            "threads_per_rank": rs[0]["threads_per_rank"], "kvr_attention": rs[0].get("kvr_attention"),
            "runs": len(t),
            "ttft_median_s": statistics.median(t), "ttft_min_s": min(t), "ttft_max_s": max(t),
            "boundaries": ",".join(map(str, rs[0]["boundaries"])),
            "max_wait_s": statistics.median(max(r["wait_s"] for r in x["ranks"]) for x in rs),
            # The busiest rank's own work (compute_s excludes waits and sends): for kvr-nocomm the time
            # the slowest rank needs even when nobody waits for anybody.
            "slowest_rank_s": statistics.median(max(r["compute_s"] for r in x["ranks"]) for x in rs),
            "bytes_sent_total": sum(r["bytes_sent"] for r in ranks),
            # kvr on a model with sliding-window layers: what the chain would send if every layer were full
            "full_chain_bytes": rs[0].get("full_chain_bytes"),
        })
    return out


def add_bounds(summary: list[dict]) -> None:
    """TTFT*(p) of eq. (1)-(3) from the measured single-process TTFT at 1 thread, and KVR's distance to the
    practical bound (kvr-nocomm, same partition as kvr-best)."""
    from kvrunahead.net.spec import parse_net

    by = {(s.get("network", "loopback"), s["context_len"], s["label"], s["transport"]): s for s in summary}
    for s in summary:
        p = s["world_size"]
        net = s.get("network", "loopback")
        cap = parse_net(net).table_label
        single = next((x for x in summary if x["context_len"] == s["context_len"] and x["label"] == "single-1t"
                       and parse_net(x.get("network", "loopback")).table_label == cap), None)
        s["ttft_star_s"] = single["ttft_median_s"] / 2 * (1 / p + 1 / p**2) if single and p > 1 else None
        tsp = by.get((net, s["context_len"], "tsp", "torch" if s["transport"] == "local" else s["transport"]))
        s["speedup_over_tsp"] = tsp["ttft_median_s"] / s["ttft_median_s"] if tsp else None
        # Noise overhead: this noisy point against the same mode on the same links without the sidecar.
        quiet = by.get((cap, s["context_len"], s["label"], s["transport"])) if net != cap else None
        s["noise_overhead"] = s["ttft_median_s"] / quiet["ttft_median_s"] - 1 if quiet else None
        nocomm = by.get((net, s["context_len"], "kvr-nocomm", s["transport"]))
        # The bound holds for the partition it ran on: other partitions differ in their work, not their transfers.
        is_kvr = (s["label"].startswith("kvr-") and s["label"] != "kvr-nocomm" and nocomm is not None
                  and s["boundaries"] == nocomm["boundaries"])
        s["over_nocomm_bound"] = s["ttft_median_s"] / nocomm["ttft_median_s"] - 1 if nocomm and is_kvr else None
        # The bound above lets the last rank start with its prefix in hand, so it also removes the wait for the
        # earlier ranks' compute; this one keeps that wait and removes only the transfer.
        s["over_nocomm_slowest"] = (s["ttft_median_s"] / nocomm["slowest_rank_s"] - 1
                                    if nocomm and is_kvr else None)


def write_outputs(rows: list[dict], summary: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flat = [{k: v for k, v in r.items() if k != "ranks"} | {
        "wait_s_per_rank": ";".join(f"{x['wait_s']:.4f}" for x in r["ranks"]),
        "compute_s_per_rank": ";".join(f"{x['compute_s']:.4f}" for x in r["ranks"]),
        "bytes_sent_per_rank": ";".join(str(x["bytes_sent"]) for x in r["ranks"]),
    } for r in rows]
    _csv(out / "runs.csv", flat)
    _csv(out / "summary.csv", summary)
    (out / "summary.md").write_text(markdown_table(summary))
    try:
        plot(summary, out)
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'kvrunahead[bench]')")


def _csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def markdown_table(summary: list[dict]) -> str:
    lines = ["| network | context | p | mode | transport | TTFT median s | min | max | vs TSP | noise overhead | "
             "over no-comm bound | over slowest no-comm rank | TTFT*(p) s | partition |", "|---" * 14 + "|"]
    for s in summary:
        def f(x, fmt, unit=""):
            return "" if x is None else format(x, fmt) + unit
        label = s["label"] + (" (split)" if s.get("kvr_attention") == "split" and s["label"] != "kvr-split" else "")
        if s.get("allgather") == "p2p":
            label += " (p2p all-gather)"
        lines.append(
            f"| {s.get('network', 'loopback')} | {s['context_len']} | {s['world_size']} | {label} | {s['transport']} | "
            f"{s['ttft_median_s']:.3f} | {s['ttft_min_s']:.3f} | {s['ttft_max_s']:.3f} | "
            f"{f(s['speedup_over_tsp'], '.2f', 'x')} | {f(s.get('noise_overhead'), '+.1%')} | "
            f"{f(s['over_nocomm_bound'], '+.1%')} | "
            f"{f(s.get('over_nocomm_slowest'), '+.1%')} | "
            f"{f(s['ttft_star_s'], '.3f')} | {s['boundaries']} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Single-process rows have no transport ("local") and appear in every figure of their network.
    nets = sorted({s.get("network", "loopback") for s in summary})
    for transport, net in ((t, n) for t in sorted({s["transport"] for s in summary} - {"local"}) for n in nets):
        rows = [s for s in summary if s["transport"] in (transport, "local") and s.get("network", "loopback") == net]
        if not any(s["transport"] == transport for s in rows):
            continue
        labels = list(dict.fromkeys(s["label"] for s in rows))
        # The third panel only where a no-communication bound was measured.
        bounded = any(s["over_nocomm_bound"] is not None for s in rows)
        fig, axes = plt.subplots(1, 3 if bounded else 2, figsize=(17, 5) if bounded else (11.5, 5))
        for label in labels:
            pts = sorted(((s["context_len"], s) for s in rows if s["label"] == label), key=lambda x: x[0])
            x = [c / 1024 for c, _ in pts]
            axes[0].errorbar(x, [s["ttft_median_s"] for _, s in pts],
                             yerr=[[s["ttft_median_s"] - s["ttft_min_s"] for _, s in pts],
                                   [s["ttft_max_s"] - s["ttft_median_s"] for _, s in pts]],
                             marker="o", capsize=3, label=label)
            if label not in ("tsp",) and all(s["speedup_over_tsp"] for _, s in pts):
                axes[1].plot(x, [s["speedup_over_tsp"] for _, s in pts], marker="o", label=label)
        star = sorted((s["context_len"], s["ttft_star_s"]) for s in rows
                      if s["label"] == "kvr-best" and s["ttft_star_s"])
        if star:
            axes[0].plot([c / 1024 for c, _ in star], [t for _, t in star], "k--", label="TTFT*(p), eq. 3")
        for label in [lb for lb in labels if any(s["label"] == lb and s["over_nocomm_bound"] is not None
                                                 for s in rows)]:
            pts = sorted(((s["context_len"], s) for s in rows
                          if s["label"] == label and s["over_nocomm_bound"] is not None), key=lambda x: x[0])
            if pts:
                axes[2].plot([c / 1024 for c, _ in pts], [100 * s["over_nocomm_bound"] for _, s in pts], marker="o",
                             label=f"{label} over kvr-nocomm")
                axes[2].plot([c / 1024 for c, _ in pts], [100 * s["over_nocomm_slowest"] for _, s in pts],
                             marker="x", ls="--", label=f"{label} over kvr-nocomm's slowest rank")
        p = max(s["world_size"] for s in rows)
        axes[0].set(title=f"TTFT, p={p} ({transport}, {net})", xlabel="context (k tokens)", ylabel="seconds")
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set(title="speedup over TSP (median / median)", xlabel="context (k tokens)", ylabel="x")
        if bounded:
            axes[2].axhline(0.0, color="grey", lw=0.8)
            axes[2].set(title="distance to the no-communication bound", xlabel="context (k tokens)", ylabel="%")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"ttft_{transport}{_net_slug(net)}.png", dpi=110)
        plt.close(fig)
    plot_noise(summary, out)


def _net_slug(net: str) -> str:
    return "" if net == "loopback" else "_" + "".join(c if c.isalnum() else "-" for c in net).strip("-")


def plot_noise(summary: list[dict], out: Path) -> None:
    """Fig. 11 of the paper: TTFT overhead of each mode on a noisy network against the same links quiet."""
    import matplotlib.pyplot as plt

    noisy = [s for s in summary if s.get("noise_overhead") is not None]
    if not noisy:
        return
    nets = sorted({s["network"] for s in noisy})
    fig, axes = plt.subplots(1, len(nets), figsize=(6.5 * len(nets), 4.5), squeeze=False)
    for ax, net in zip(axes[0], nets):
        rows = [s for s in noisy if s["network"] == net]
        labels = list(dict.fromkeys(s["label"] for s in rows))
        ctxs = sorted({s["context_len"] for s in rows})
        width = 0.8 / len(ctxs)
        for i, ctx in enumerate(ctxs):
            by = {s["label"]: s for s in rows if s["context_len"] == ctx}
            ax.bar([j + i * width for j in range(len(labels))],
                   [100 * by[lb]["noise_overhead"] if lb in by else 0 for lb in labels], width,
                   label=f"{ctx // 1024}k")
        ax.set_xticks([j + width * (len(ctxs) - 1) / 2 for j in range(len(labels))], labels, rotation=30,
                      ha="right", fontsize=8)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(title=f"TTFT overhead from noise ({net})", ylabel="% over quiet (median / median)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "noise_overhead.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- CLI

def _list(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def check_inputs(config: dict, contexts: list[int], world_sizes: list[int], tables: dict[str, str],
                 kvr_attention: str, nets: list[str] = ("loopback",)) -> None:
    """What every rank would find wrong (the model, a context, a table made for another setting, a network
    setting), found here once before any world starts; raises InputError."""
    from kvrunahead.policy import RunConfig, prepare

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
    from kvrunahead.net.spec import parse_net

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
        if singles_in_world and "single" in modes and nproc > 1:
            for t in sorted({1, nproc}):
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
            elif mode != "single":
                jobs.append(Job(mode, mode, ctx, "even", repeats, warmup))
    for job in jobs:
        if job.mode in ("kvr", "kvr-nocomm") and job.label not in ("kvr-split", "kvr-default"):
            job.kvr_attention = kvr_attention
    return jobs


def main() -> None:
    import click

    from kvrunahead.errors import InputError
    from kvrunahead.prompt import PromptError, parse_tokens

    @click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
    @click.option("--model", default="smollm2-135m", show_default=True)
    @click.option("--ctx", "contexts", default="1k,2k,4k,8k", show_default=True, help="Context lengths.")
    @click.option("--nproc", "nprocs", default="2", show_default=True, help="World sizes.")
    @click.option("--modes", default=",".join(DEFAULT_MODES), show_default=True,
                  help="single runs at 1 thread and at p threads (with --interleave among the ranks' runs, the "
                       "other ranks idle); kvr-default is kvr-prefill's defaults (--partition auto, "
                       "--kvr-attention auto); kvr is the even partition; kvr-best sweeps rank 0's share (--shares) "
                       "and keeps the fastest; kvr-nocomm is the bound on kvr-best's partition (without kvr-best: "
                       "on the first --table's); kvr-split (not default) is kvr-best's partition with "
                       "--kvr-attention split.")
    @click.option("--transports", default="torch", show_default=True, help="torch and/or mpi (mpi needs mpirun).")
    @click.option("--repeats", default=3, show_default=True, help="Timed runs per point.")
    @click.option("--warmup", default=1, show_default=True, help="Untimed runs per point before the timed ones.")
    @click.option("--shares", default="0.50,0.56,0.62,0.68,0.74,0.80", show_default=True,
                  help="kvr-best: rank 0's share of the context to try (the other ranks split the rest evenly).")
    @click.option("--threads", default=1, show_default=True, help="Intra-op threads per rank.")
    @click.option("--net", "nets", multiple=True, default=["loopback"], show_default=True,
                  help="Network setting, repeatable: loopback, cap=400MB/s (one emulated host per rank, links capped "
                       "each way; needs root), cap=400MB/s,noise (the noise sidecar as well). Settings that differ "
                       "only in noise share one world and, with --interleave, alternate run by run with the sidecar "
                       "switched on and off; the summary gives each mode's noise overhead. Recorded in every row.")
    @click.option("--allgather", type=click.Choice(["auto", "native", "p2p"]), default="auto", show_default=True,
                  help="All-gather of tsp and cp-allgather (see kvr-prefill --help); recorded in every row.")
    @click.option("--table", "tables", multiple=True, metavar="LABEL=PATH",
                  help="Also run kvr with the partition interpolated from a table, reported as kvr-LABEL.")
    @click.option("--force-table", is_flag=True,
                  help="Use the --table tables on every network (e.g. the loopback table on a capped network).")
    @click.option("--kvr-attention", type=click.Choice(["auto", "masked", "split"]), default="auto",
                  show_default=True,
                  help="Attention of the kvr jobs (kvr-even, kvr-best and its sweep, kvr-nocomm, tables; "
                       "kvr-default always takes auto); what ran is recorded in every row.")
    @click.option("--allow-long-context", is_flag=True)
    @click.option("--timeout", "timeout_s", default=600.0, show_default=True)
    @click.option("--out", "out_dir", default="experiments/results", show_default=True, type=click.Path())
    @click.option("--resume", is_flag=True,
                  help="Keep the runs an interrupted sweep with the same arguments left in --out and measure "
                       "only the missing ones (the fresh ranks get one untimed run first).")
    @click.option("--interleave", is_flag=True,
                  help="Alternate the timed runs of all modes at one context length (after every mode's sweep "
                       "and warm-up) instead of running each mode's repeats back to back: fairer ratios on a "
                       "machine whose speed drifts. Recorded in every row.")
    @click.option("--replot", is_flag=True,
                  help="Measure nothing: rebuild summary.csv/md and the plots from the runs.jsonl in --out.")
    def cli(model, contexts, nprocs, modes, transports, repeats, warmup, shares, threads, nets, allgather, tables,
            force_table, kvr_attention, allow_long_context, timeout_s, out_dir, resume, interleave, replot):
        """Measure TTFT of every prefill mode; write runs.csv/jsonl, summary.csv/md and plots to --out.

        \b
        Example (the committed CPU experiment):
          kvr-bench --ctx 1k,2k,4k,8k --nproc 2 --out experiments/ttft_cpu_p2
        """
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        def fail(message: str):
            click.echo(f"kvr-bench: error: {message}", err=True)
            sys.exit(2)

        try:
            ctxs = [parse_tokens(c) for c in _list(contexts)]
            world_sizes = _list(nprocs, int)
        except (PromptError, ValueError) as e:
            fail(str(e))
        for name, value, least in (("--threads", threads, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0)):
            if value < least:
                fail(f"{name} must be at least {least}, got {value}")
        if not replot and (not ctxs or not world_sizes or min(world_sizes) < 1):
            fail("--ctx and --nproc need at least one value each, and world sizes of at least 1")
        mode_list = _list(modes)
        if any("=" not in t for t in tables):
            fail("--table takes LABEL=PATH")
        table_paths = dict(t.split("=", 1) for t in tables)
        bad = set(mode_list) - set(DEFAULT_MODES) - set(EXTRA_MODES)
        if bad:
            fail(f"unknown modes {sorted(bad)}; choose from {', '.join(DEFAULT_MODES + EXTRA_MODES)}")
        for label, path in table_paths.items():
            if not Path(path).is_file():
                fail(f"--table {label}={path}: no such file")
        from kvrunahead.net.spec import NetError, parse_net

        try:
            nets = [parse_net(n).label for n in nets]
            worlds = net_worlds(list(nets))
        except NetError as e:
            fail(str(e))
        config = {"model": model, "allow_long_context": allow_long_context, "max_new_tokens": 1,
                  "timeout_s": timeout_s, "device": "cpu", "allgather": allgather, "force_table": force_table}
        if not replot:
            try:
                check_inputs(config, ctxs, world_sizes, table_paths, kvr_attention, nets)
                if any(parse_net(n).emulated for n in nets):
                    from kvrunahead.net.emulation import check_permission

                    check_permission()
            except (InputError, NetError) as e:
                fail(str(e))
        out = Path(out_dir)
        if replot:
            runs = out / "runs.jsonl"
            if not runs.exists():
                raise click.UsageError(f"--replot: no {runs}")
            rows = [json.loads(line) for line in runs.read_text().splitlines()]
            summary = summarize(rows)
            add_bounds(summary)
            write_outputs(rows, summary, out)
            click.echo(markdown_table(summary))
            return
        out.mkdir(parents=True, exist_ok=True)
        rows: list[dict] = []
        singles_left = {1, *world_sizes} if "single" in mode_list else set()
        for transport in _list(transports):
            for p in world_sizes:
                for world_net, members in worlds:
                    # Interleaved: the single process at 1 and p threads is timed among the ranks' runs, in every
                    # network's world (it does not communicate, but the machine drifts between worlds).
                    in_world = interleave and p > 1 and "single" in mode_list
                    jobs = build_jobs(ctxs, mode_list, repeats, warmup, _list(shares, float), p, table_paths,
                                      kvr_attention, singles_in_world=in_world, nets=members)
                    if in_world:
                        singles_left -= {1, p}
                    click.echo(f"world p={p} threads={threads} transport={transport} network {world_net}: "
                               f"{_runs_in(jobs)} runs", err=True)
                    env = environment(model, transport, threads, world_net)
                    try:
                        rows += run_world(p, threads, transport, jobs, config, env, out, timeout_s, resume,
                                          interleave, net=world_net)
                    except (RuntimeError, ValueError, NetError) as e:
                        fail(str(e))
        if singles_left:
            for t in sorted(singles_left):
                jobs = [Job(f"single-{t}t", "single", c, "even", repeats, warmup) for c in ctxs]
                click.echo(f"single process, {t} thread(s): {_runs_in(jobs)} runs", err=True)
                rows += run_world(1, t, "torch", jobs, config, environment(model, "none", t, "loopback"), out,
                                  timeout_s, resume)
        summary = summarize(rows)
        add_bounds(summary)
        write_outputs(rows, summary, out)
        clean_partial_rows(out)
        click.echo(markdown_table(summary))
        click.echo(f"wrote {out}/runs.csv, summary.md and plots", err=True)

    cli()


def worker_main(plan_file: str, out_prefix: str) -> None:
    """A benchmark rank: a fault (a stopped peer, a link down) ends it with one line and a non-zero exit, the
    rows it wrote before kept; interpreter teardown is skipped, as it can block on a broken process group."""
    from kvrunahead.errors import PeerTimeout

    try:
        worker(plan_file, out_prefix)
    except PeerTimeout as e:
        print(f"kvr-bench: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    except Exception as e:  # noqa: BLE001
        print(f"kvr-bench: rank failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              file=sys.stderr, flush=True)
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main()
