"""What a sweep reports: the median TTFT of each measured point with the bounds it is held against, written as
runs.jsonl/csv (one row per run), summary.csv/md (one row per point) and the plots."""

from __future__ import annotations

import csv
import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrunahead.net.spec import parse_net

log = logging.getLogger(__name__)


@dataclass
class SummaryRow:
    """One point of the sweep (network, context, world size, mode, transport) over its timed runs. The fields
    are summary.csv's columns, in order; the five after ``full_chain_bytes`` are filled in by ``add_bounds``."""

    network: str
    context_len: int
    world_size: int
    label: str
    transport: str
    allgather: str | None
    threads_per_rank: int
    kvr_attention: str | None
    runs: int
    ttft_median_s: float
    ttft_min_s: float
    ttft_max_s: float
    boundaries: str  # the partition, as comma-separated token boundaries
    max_wait_s: float  # median over the runs of the longest wait of any rank
    # The busiest rank's own work (compute_s excludes waits and sends): for kvr-nocomm the time the slowest rank
    # needs even when nobody waits for anybody.
    slowest_rank_s: float
    bytes_sent_total: int
    # kvr on a model with sliding-window layers: what the chain would send if every layer were full
    full_chain_bytes: int | None
    ttft_star_s: float | None = None  # TTFT*(p) of eq. (3)
    speedup_over_tsp: float | None = None  # tsp's median TTFT over this one's
    noise_overhead: float | None = None  # fraction over the same point on the same links without noise
    over_nocomm_bound: float | None = None  # fraction over kvr-nocomm's TTFT on the same partition
    over_nocomm_slowest: float | None = None  # fraction over kvr-nocomm's slowest rank on the same partition


def summarize(rows: list[dict]) -> list[SummaryRow]:
    """Median, min and max TTFT of the timed runs of each point."""
    points: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["kind"] == "timed":
            points.setdefault((row.get("network", "loopback"), row["context_len"], row["world_size"], row["label"],
                               row["transport"]), []).append(row)
    out = []
    for (net, ctx, p, label, transport), rs in sorted(points.items()):
        t = [r["ttft_s"] for r in rs]
        out.append(SummaryRow(
            network=net, context_len=ctx, world_size=p, label=label, transport=transport,
            allgather=rs[0].get("allgather"), threads_per_rank=rs[0]["threads_per_rank"],
            kvr_attention=rs[0].get("kvr_attention"), runs=len(t),
            ttft_median_s=statistics.median(t), ttft_min_s=min(t), ttft_max_s=max(t),
            boundaries=",".join(map(str, rs[0]["boundaries"])),
            max_wait_s=statistics.median(max(r["wait_s"] for r in x["ranks"]) for x in rs),
            slowest_rank_s=statistics.median(max(r["compute_s"] for r in x["ranks"]) for x in rs),
            bytes_sent_total=sum(r["bytes_sent"] for r in rs[0]["ranks"]),
            full_chain_bytes=rs[0].get("full_chain_bytes"),
        ))
    return out


def add_bounds(summary: list[SummaryRow]) -> None:
    """TTFT*(p) of eq. (1)-(3) from the measured single-process TTFT at 1 thread, and KVR's distance to the
    practical bound (kvr-nocomm, same partition as kvr-best)."""
    by = {(s.network, s.context_len, s.label, s.transport): s for s in summary}
    for s in summary:
        p = s.world_size
        cap = parse_net(s.network).table_label
        single = next((x for x in summary if x.context_len == s.context_len and x.label == "single-1t"
                       and parse_net(x.network).table_label == cap), None)
        s.ttft_star_s = single.ttft_median_s / 2 * (1 / p + 1 / p**2) if single and p > 1 else None
        tsp = by.get((s.network, s.context_len, "tsp", "torch" if s.transport == "local" else s.transport))
        s.speedup_over_tsp = tsp.ttft_median_s / s.ttft_median_s if tsp else None
        # Noise overhead: this noisy point against the same mode on the same links without the sidecar.
        quiet = by.get((cap, s.context_len, s.label, s.transport)) if s.network != cap else None
        s.noise_overhead = s.ttft_median_s / quiet.ttft_median_s - 1 if quiet else None
        nocomm = by.get((s.network, s.context_len, "kvr-nocomm", s.transport))
        # The bound holds for the partition it ran on: other partitions differ in their work, not their transfers.
        is_kvr = (s.label.startswith("kvr-") and s.label != "kvr-nocomm" and nocomm is not None
                  and s.boundaries == nocomm.boundaries)
        s.over_nocomm_bound = s.ttft_median_s / nocomm.ttft_median_s - 1 if nocomm and is_kvr else None
        # The bound above lets the last rank start with its prefix in hand, so it also removes the wait for the
        # earlier ranks' compute; this one keeps that wait and removes only the transfer.
        s.over_nocomm_slowest = s.ttft_median_s / nocomm.slowest_rank_s - 1 if nocomm and is_kvr else None


def write_outputs(rows: list[dict], summary: list[SummaryRow], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flat = [{k: v for k, v in r.items() if k != "ranks"} | {
        "wait_s_per_rank": ";".join(f"{x['wait_s']:.4f}" for x in r["ranks"]),
        "compute_s_per_rank": ";".join(f"{x['compute_s']:.4f}" for x in r["ranks"]),
        "bytes_sent_per_rank": ";".join(str(x["bytes_sent"]) for x in r["ranks"]),
    } for r in rows]
    _csv(out / "runs.csv", flat)
    _csv(out / "summary.csv", [asdict(s) for s in summary])
    (out / "summary.md").write_text(markdown_table(summary))


def _csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def markdown_table(summary: list[SummaryRow]) -> str:
    lines = ["| network | context | p | mode | transport | TTFT median s | min | max | vs TSP | noise overhead | "
             "over no-comm bound | over slowest no-comm rank | TTFT*(p) s | partition |", "|---" * 14 + "|"]
    for s in summary:
        label = s.label + (" (split)" if s.kvr_attention == "split" and s.label != "kvr-split" else "")
        if s.allgather == "p2p":
            label += " (p2p all-gather)"
        lines.append(
            f"| {s.network} | {s.context_len} | {s.world_size} | {label} | {s.transport} | "
            f"{s.ttft_median_s:.3f} | {s.ttft_min_s:.3f} | {s.ttft_max_s:.3f} | "
            f"{_cell(s.speedup_over_tsp, '.2f', 'x')} | {_cell(s.noise_overhead, '+.1%')} | "
            f"{_cell(s.over_nocomm_bound, '+.1%')} | {_cell(s.over_nocomm_slowest, '+.1%')} | "
            f"{_cell(s.ttft_star_s, '.3f')} | {s.boundaries} |"
        )
    return "\n".join(lines) + "\n"


def _cell(x: float | None, fmt: str, unit: str = "") -> str:
    return "" if x is None else format(x, fmt) + unit
