"""summary.md and plots of experiments/mixed_workload from the rows kvr-serve-bench wrote.

Usage: python experiments/mixed_workload/report.py experiments/mixed_workload

Per rate and policy: the short requests' TTFT (p50, p90, p99) and each long request's; the time per output token
(TPOT, a request's mean gap between tokens) of the short requests that decoded while a long prompt was being
prefilled (at least half of their decode inside a long request's window from its arrival to its first token)
against those that decoded while none was; and, for the chunked runs, every chunk's measured seconds against the
cost model's prediction (the server reports both in kvrunahead.chunks).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from kvrunahead.bench.runs import fmt, load, tpot_split
from kvrunahead.bench.serve_bench import percentile
from kvrunahead.sim.simulate import simulate_chunk

POLICIES = ("fcfs", "lars")


def slo_met(out: Path, rate: float, policy: str) -> str:
    """The bench's summary cell: the share of short requests within its --ttft-slo-s, where the run gave one."""
    path = out / f"rate{rate:g}" / policy / "summary.csv"
    rows = list(csv.DictReader(path.read_text().splitlines())) if path.exists() else []
    row = rows[0] if rows else {}
    if not row.get("short_slo_met"):
        return "-"
    return f"{float(row['short_slo_met']):.0%} within {float(row['ttft_slo_s']):g} s"


def chunks(rows: list[dict]) -> list[dict]:
    return [c for r in rows for c in ((r.get("server") or {}).get("chunks") or [])]


def table(runs, out: Path) -> list[str]:
    lines = ["| rate | policy | requests ok | short n | short TTFT p50 | p90 | p99 | short TTFT objective met | long "
             "TTFTs | TPOT p90 during a long prefill (n) | TPOT p90 without (n) | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (rate, policy), rows in sorted(runs.items()):
        ok = [r for r in rows if not r.get("error")]
        short = [r["ttft_s"] for r in ok if r["kind"] == "short"]
        longs = [r["ttft_s"] for r in ok if r["kind"] == "long"]
        during, idle = tpot_split(rows)
        d90, i90 = percentile(during, 90), percentile(idle, 90)
        lines.append(f"| {rate} | {policy} | {len(ok)}/{len(rows)} | {len(short)} | {fmt(percentile(short, 50))} | "
                     f"{fmt(percentile(short, 90))} | {fmt(percentile(short, 99))} | {slo_met(out, rate, policy)} | "
                     f"{', '.join(fmt(x) for x in longs) or '-'} | {fmt(d90)} ({len(during)}) | {fmt(i90)} "
                     f"({len(idle)}) | {fmt(d90 / i90 if d90 and i90 else None)} |")
    return lines


def targets(runs) -> list[str]:
    lines = []
    for rate in sorted({r for r, _ in runs}):
        if (rate, "fcfs") not in runs or (rate, "lars") not in runs:
            lines.append(f"- rate {rate}: {', '.join(p for p in POLICIES if (rate, p) not in runs)} not run")
            continue
        f, c = runs[(rate, "fcfs")], runs[(rate, "lars")]
        p99 = [percentile([r["ttft_s"] for r in rows if r["kind"] == "short" and not r.get("error")], 99)
               for rows in (f, c)]
        lf = {r["index"]: r["ttft_s"] for r in f if r["kind"] == "long" and r.get("ttft_s")}
        lc = {r["index"]: r["ttft_s"] for r in c if r["kind"] == "long" and r.get("ttft_s")}
        ratios = [lc[i] / lf[i] for i in lf if i in lc]
        lines.append(f"- rate {rate}: short TTFT p99 {fmt(p99[0])} s (fcfs) against {fmt(p99[1])} s (lars): "
                     f"**{fmt(p99[0] / p99[1] if p99[1] else None)}x lower** (target 10x); long TTFT lars / fcfs "
                     f"per long request: {', '.join(f'{x:.2f}' for x in ratios) or '-'} (target <= 1.25)")
    return lines


def sim_check(runs, out: Path) -> list[str]:
    all_chunks = [c for (_, policy), rows in runs.items() if policy == "lars" for c in chunks(rows)]
    if not all_chunks:
        return ["- no chunked prefill ran"]
    lines = [_errors("as the server predicted them (profile used by the run)", all_chunks,
                     [c["predicted_s"] for c in all_chunks])]
    if any("correction" in c for c in all_chunks):  # servers that learn the model's error from the chunks run
        lines.append(_errors("as the server sized them (the prediction times the correction learnt from the chunks "
                             "before)", all_chunks, [c["predicted_s"] * c.get("correction", 1.0) for c in all_chunks]))
    over = sum(c["seconds"] > c["budget_s"] for c in all_chunks)
    lines.append(f"- {over} of the {len(all_chunks)} chunks ran over their step budget")
    for path in sorted((out / "profiles").glob("*-chunks.json")):  # a profile calibrated with the chunks' shapes
        cost = _cost(path)
        lines.append(_errors(f"re-priced with {path.name}", all_chunks,
                             [simulate_chunk(cost, tuple(c["cuts"]), "split").ttft_s for c in all_chunks]))
    return lines


def _errors(what: str, measured: list[dict], predicted: list[float]) -> str:
    errors = [p / c["seconds"] - 1 for c, p in zip(measured, predicted)]
    within = sum(abs(e) <= 0.15 for e in errors) / len(errors)
    return (f"- {what}: predicted / measured - 1 over {len(errors)} chunks: median {percentile(errors, 50):+.1%}, "
            f"p10 {percentile(errors, 10):+.1%}, p90 {percentile(errors, 90):+.1%}; **{within:.0%} within 15%**")


def _cost(path: Path):
    from kvrunahead.model.load import DEFAULT_MODEL, resolve_config
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.profile import HardwareProfile
    from kvrunahead.sim.shape import shape_from_config

    profile, used, _ = HardwareProfile.load(path).for_network(None)
    return CostModel(shape_from_config(resolve_config(DEFAULT_MODEL), "float32"), profile, used)


def plot(runs, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r for r, _ in runs})
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for policy, color in zip(POLICIES, ("tab:red", "tab:blue")):
            rows = runs.get((rate, policy), [])
            for kind, style in (("short", "-"), ("long", "--")):
                xs = sorted(r["ttft_s"] for r in rows if r["kind"] == kind and not r.get("error"))
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, color=color, where="post",
                            label=f"{policy} {kind} ({len(xs)})")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{rate} requests/s, 5% long (8k-16k)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=120)
    plt.close(fig)
    cs = [c for (_, policy), rows in runs.items() if policy == "lars" for c in chunks(rows)]
    if cs:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([c["start"] for c in cs], [c["seconds"] for c in cs], s=8, label="measured")
        ax.scatter([c["start"] for c in cs], [c["predicted_s"] for c in cs], s=8, label="cost model")
        ax.set_xlabel("chunk start (positions held before it)")
        ax.set_ylabel("chunk step (s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "chunk_steps.png", dpi=120)
        plt.close(fig)


def main(out: Path) -> None:
    runs = load(out)
    first = next(iter(runs.values()))[0] if runs else {}
    lines = ["# Long and short requests together: fcfs against chunked prefill + LARS", "",
             f"Machine: {json.dumps(first.get('machine'))}; commit {first.get('commit')}.", "",
             "TTFT and TPOT in seconds, client side (kvr-serve-bench). " + __doc__.split("\n\n")[2].replace("\n", " "),
             "", *table(runs, out), "", "## Targets", "", *targets(runs), "", "## The cost model's chunk steps", "",
             *sim_check(runs, out), ""]
    (out / "summary.md").write_text("\n".join(lines))
    plot(runs, out)
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
