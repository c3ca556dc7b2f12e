"""summary.md and crossover.png in a rows folder: per length, the median TTFT of degree 1 and degree 2 (over rounds
and repeats), their ratio per round, and the auto server: the degree it chose and, where it was timed in the same
rounds (rows-interleaved/), its own median TTFT against the faster forced degree's; for the older rows/ (auto
only recorded its choice) the loss of that choice read from the forced medians.

    python experiments/serve_degree/report.py [ROWS]   (default: experiments/serve_degree/rows-interleaved)
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent


def load(rows_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(rows_dir.glob("*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]


def main(rows_dir: Path) -> None:
    rows = load(rows_dir)
    ttft = defaultdict(list)  # (label, length) -> TTFTs
    per_round = defaultdict(list)  # (label, length, round) -> TTFTs
    chosen = defaultdict(set)  # length -> the degrees auto chose
    sources = set()
    for r in rows:
        if r["label"] == "degreeauto":
            chosen[r["length"]].add(r["degree"])
            sources.add(r["degree_source"])
        ttft[r["label"], r["length"]].append(r["ttft_s"])
        per_round[r["label"], r["length"], r["round"]].append(r["ttft_s"])
    timed_auto = any(r["label"] == "degreeauto" and r["round"] > 0 for r in rows)
    lengths = sorted({n for label, n in ttft if label != "degreeauto"})
    rounds = sorted({k[2] for k in per_round if k[2] > 0})

    def ratio_per_round(a: str, b: str, n: int) -> list[float]:
        return [statistics.median(per_round[a, n, k]) / statistics.median(per_round[b, n, k])
                for k in rounds if per_round[a, n, k] and per_round[b, n, k]]

    lines = ["| prompt tokens | degree 1, median TTFT | degree 2, median TTFT | degree 1 / degree 2 (per round) | "
             "auto chose | " + ("auto, median TTFT | auto / the faster forced (per round) |" if timed_auto else
                                "its loss against the faster |"),
             "|---|---|---|---|---|---|" + ("---|" if timed_auto else "")]
    worst = 0.0
    for n in lengths:
        one, two = (statistics.median(ttft[f"degree{d}", n]) for d in (1, 2))
        ratios = ratio_per_round("degree1", "degree2", n)
        picks = "/".join(map(str, sorted(chosen.get(n, ())))) or "-"
        per = ", ".join(f"{x:.2f}" for x in ratios)
        row = f"| {n} | {one:.3f} s | {two:.3f} s | {one / two:.3f} ({per}) | {picks} |"
        if timed_auto:
            auto = statistics.median(ttft["degreeauto", n])
            faster = "degree1" if one <= two else "degree2"
            loss = auto / min(one, two) - 1
            worst = max(worst, loss)
            row += (f" {auto:.3f} s | {auto / min(one, two):.3f} "
                    f"({', '.join(f'{x:.2f}' for x in ratio_per_round('degreeauto', faster, n))}) |")
        else:
            pick = next(iter(chosen.get(n, ())), None)
            loss = ({1: one, 2: two}[pick] / min(one, two) - 1) if pick in (1, 2) else 0.0
            worst = max(worst, loss)
            row += f" {f'{loss:+.1%}' if loss else 'none'} |"
        lines.append(row)
    runs = {k: len(v) for k, v in ttft.items()}
    what = ("the auto server's median TTFT against the faster forced degree's" if timed_auto else
            "the forced median of the degree auto chose against the faster one")
    head = [f"# --degree 1, --degree 2 and --degree auto ({len(rows)} rows, "
            f"{min(runs.values(), default=0)}-{max(runs.values(), default=0)} runs per cell)", "",
            f"Worst loss, {what}: {worst:+.1%} (target: at most 5%).", ""]
    tail = ["", "Why auto chose as it did (the responses' `degree_source`):", ""] + [f"- {s}" for s in sorted(sources)]
    (rows_dir / "summary.md").write_text("\n".join(head + lines + tail) + "\n")
    print("\n".join(head + lines))
    plot(rows_dir, lengths, ttft, chosen, timed_auto)


def plot(rows_dir, lengths, ttft, chosen, timed_auto) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for d, style in ((1, "o-"), (2, "s-")):
        med = [statistics.median(ttft[f"degree{d}", n]) for n in lengths]
        ax.plot(lengths, [m / n * 1000 for m, n in zip(med, lengths)], style,
                label=f"degree {d}" + (" (front alone, 2 threads)" if d == 1 else " (KV chain, 2 ranks x 1 thread)"))
    if timed_auto:
        med = [statistics.median(ttft["degreeauto", n]) for n in lengths]
        ax.plot(lengths, [m / n * 1000 for m, n in zip(med, lengths)], "x--", label="auto (its own runs)")
    for n, ds in chosen.items():
        ax.annotate(f"auto: {'/'.join(map(str, sorted(ds)))}", (n, 0), xycoords=("data", "axes fraction"),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median TTFT per 1000 prompt tokens (s)")
    ax.set_title("kvr-serve --nproc 2: one rank or the chain, by prompt length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(rows_dir / "crossover.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "rows-interleaved")
