"""summary.md and frontier.png of experiments/mixed_steps from the rows kvr-serve-bench wrote.

Usage: python experiments/mixed_steps/report.py experiments/mixed_steps

Per trace and server (fcfs-separate: one step per prompt, a step a prefill or a decode; lars-B: chunked prefill
within a step budget of B ms with LARS, mixed steps; lars-B-separate: the same with separate steps), medians over
the rounds run: the short requests' TTFT (p50, p99, the share within 2 s), the long request's TTFT, and the time per
output token (TPOT, a request's mean gap between tokens) at p90 of the short requests decoding while the long prompt
was prefilled (at least half of their decode inside its window from arrival to first token), against the idle
server's: the TPOT p90 of the short requests that finished before the long one arrived, pooled over every server
of the trace (the same requests on each).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from kvrunahead.bench.runs import fmt, load, tpot_split
from kvrunahead.bench.serve_bench import percentile

SLO_S = 2.0


def figures(rows: list[dict]) -> dict:
    ok = [r for r in rows if not r.get("error")]
    short = [r["ttft_s"] for r in ok if r["kind"] == "short"]
    longs = [r["ttft_s"] for r in ok if r["kind"] == "long"]
    during, _ = tpot_split(rows)
    within = sum(t <= SLO_S for t in short) / len(short) if short else None
    return {"requests": len(rows), "ok": len(ok), "short_p50": percentile(short, 50),
            "short_p99": percentile(short, 99), "within": within,
            "long": statistics.median(longs) if longs else None, "tpot_during_p90": percentile(during, 90),
            "n_during": len(during), "idle": before_long(rows), "commit": rows[0].get("commit") if rows else None}


def before_long(rows: list[dict]) -> list[float]:
    """The TPOT of the short requests that finished before any long request arrived: the idle server's."""
    first = min((r["arrival_s"] for r in rows if r["kind"] == "long"), default=float("inf"))
    return [r["tpot_s"] for r in rows if r["kind"] == "short" and r.get("tpot_s") is not None and not r.get("error")
            and r["arrival_s"] + r["e2e_s"] <= first]


def collect(out: Path) -> dict:
    """trace -> server -> list of figures, one per round."""
    found: dict = {}
    for trace_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        for round_dir in sorted(trace_dir.glob("round*")):
            for (_, server), rows in load(round_dir).items():
                fig = figures(rows)
                fig["round"] = round_dir.name
                found.setdefault(trace_dir.name, {}).setdefault(server, []).append(fig)
    return found


def median_of(figs: list[dict], key: str):
    xs = [f[key] for f in figs if f[key] is not None]
    return statistics.median(xs) if xs else None


def budget_of(server: str) -> int | None:
    parts = server.split("-")
    return int(parts[1]) if parts[0] == "lars" and len(parts) > 1 else None


def table(servers: dict, idle: float | None) -> list[str]:
    lines = ["| server | rounds | commit | short TTFT p50 | p99 | within 2 s | long TTFT | TPOT p90 during the long "
             "prefill (n) | x idle |", "|---|---|---|---|---|---|---|---|---|"]
    for server in sorted(servers, key=lambda s: (budget_of(s) or 0, s)):
        figs = servers[server]
        during = median_of(figs, "tpot_during_p90")
        within = median_of(figs, "within")
        lines.append(f"| {server} | {len(figs)} | {', '.join(sorted({f['commit'] for f in figs}))} | "
                     f"{fmt(median_of(figs, 'short_p50'))} | {fmt(median_of(figs, 'short_p99'))} | "
                     f"{'-' if within is None else f'{within:.0%}'} | {fmt(median_of(figs, 'long'))} | "
                     f"{fmt(during)} ({sum(f['n_during'] for f in figs)}) | "
                     f"{fmt(during / idle if during and idle else None)} |")
    return lines


def targets(servers: dict, idle: float | None) -> list[str]:
    lines = []
    fcfs_long = median_of(servers.get("fcfs-separate", []), "long")
    budgets = sorted({budget_of(s) for s in servers if budget_of(s)})
    for b in budgets:
        mixed, sep = servers.get(f"lars-{b}"), servers.get(f"lars-{b}-separate")
        if not mixed or not sep:
            lines.append(f"- {b} ms: {'mixed' if not mixed else 'separate'} steps not run")
            continue
        ml, sl = median_of(mixed, "long"), median_of(sep, "long")
        mt, st = median_of(mixed, "tpot_during_p90"), median_of(sep, "tpot_during_p90")
        better = (ml < sl and mt <= st) or (mt < st and ml <= sl) if None not in (ml, sl, mt, st) else None
        lines.append(f"- {b} ms: long TTFT mixed {fmt(ml)} s against separate {fmt(sl)} s ({fmt(ml / sl)}x), TPOT "
                     f"p90 during its prefill {fmt(mt)} against {fmt(st)} s ({fmt(mt / st if mt and st else None)}x): "
                     f"mixed {'dominates' if better else 'does not dominate'} at this budget")
        for name, figs in (("mixed", mixed), ("separate", sep)):
            during, long = median_of(figs, "tpot_during_p90"), median_of(figs, "long")
            if during and idle and long and fcfs_long:
                ok = during <= 4 * idle and long <= 1.5 * fcfs_long
                lines.append(f"  - {name}: TPOT p90 during the prefill {during / idle:.1f}x idle (target 4x), long "
                             f"TTFT {long / fcfs_long:.2f}x fcfs's (target 1.5x): {'both met' if ok else 'not both'}")
    return lines


def plot(found: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(found), figsize=(6 * len(found), 4.5), squeeze=False)
    for ax, (trace, servers) in zip(axes[0], sorted(found.items())):
        for kind, marker, color in (("mixed", "o", "tab:blue"), ("separate", "s", "tab:red")):
            pts = []
            for server, figs in servers.items():
                b = budget_of(server)
                if b is None or server.endswith("-separate") != (kind == "separate"):
                    continue
                x, y = median_of(figs, "tpot_during_p90"), median_of(figs, "long")
                if x and y:
                    pts.append((b, x, y))
            pts.sort()
            if pts:
                ax.plot([p[1] for p in pts], [p[2] for p in pts], marker=marker, color=color, label=f"{kind} steps")
                for b, x, y in pts:
                    ax.annotate(f"{b} ms", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        fcfs = servers.get("fcfs-separate")
        if fcfs and median_of(fcfs, "long"):
            ax.axhline(median_of(fcfs, "long"), color="gray", linestyle="--", label="fcfs (whole prompt) long TTFT")
        ax.set_xlabel("TPOT p90 of the requests decoding during the long prefill (s)")
        ax.set_ylabel("long request's TTFT (s)")
        ax.set_title(f"{trace} trace: the step budget's trade (lower left is better)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)


def main(out: Path) -> None:
    found = collect(out)
    lines = ["# Mixed steps against separate steps: the step budget's trade", "", __doc__.split("\n\n")[1].replace(
        "\n", " "), ""]
    for trace, servers in sorted(found.items()):
        idle = percentile([t for figs in servers.values() for f in figs for t in f["idle"]], 90)
        machine = json.dumps(json.loads((next(out.glob(f"{trace}/round*/rate*/*/rows.jsonl"))).read_text()
                                        .splitlines()[0]).get("machine"))
        n_idle = sum(len(f["idle"]) for figs in servers.values() for f in figs)
        lines += [f"## {trace}", "", f"Machine: {machine}. The idle server's TPOT p90: {fmt(idle)} s (the {n_idle} "
                  "short requests of every server that decoded before the long one arrived).", "",
                  *table(servers, idle), "", "Targets:", "",
                  *targets(servers, idle), ""]
    (out / "summary.md").write_text("\n".join(lines))
    plot(found, out)
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
