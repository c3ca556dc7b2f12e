"""summary.md and crossover.png from rows/: per length, the median TTFT of degree 1 and degree 2 (over rounds and
repeats), their ratio per round, the degree --degree auto chose, and what that choice loses against the faster one.

    python experiments/serve_degree/report.py
"""

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent


def load() -> list[dict]:
    return [json.loads(line) for f in sorted((HERE / "rows").glob("*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]


def main() -> None:
    rows = load()
    ttft = defaultdict(list)  # (label, length) -> TTFTs
    per_round = defaultdict(list)  # (label, length, round) -> TTFTs
    chosen = {}
    for r in rows:
        if r["label"] == "degreeauto":
            chosen[r["length"]] = (r["degree"], r["degree_source"])
            continue
        ttft[r["label"], r["length"]].append(r["ttft_s"])
        per_round[r["label"], r["length"], r["round"]].append(r["ttft_s"])
    lengths = sorted({n for _, n in ttft})
    rounds = sorted({k[2] for k in per_round})
    lines = ["| prompt tokens | degree 1, median TTFT | degree 2, median TTFT | degree 1 / degree 2 (per round) | "
             "auto chose | its loss against the faster |", "|---|---|---|---|---|---|"]
    worst = 0.0
    for n in lengths:
        one, two = (statistics.median(ttft[f"degree{d}", n]) for d in (1, 2))
        ratios = [statistics.median(per_round["degree1", n, k]) / statistics.median(per_round["degree2", n, k])
                  for k in rounds if per_round["degree1", n, k] and per_round["degree2", n, k]]
        pick = chosen.get(n, (None, ""))[0]
        loss = ({1: one, 2: two}[pick] / min(one, two) - 1) if pick in (1, 2) else None
        worst = max(worst, loss or 0.0)
        lines.append(f"| {n} | {one:.3f} s | {two:.3f} s | {one / two:.3f} ({', '.join(f'{x:.2f}' for x in ratios)})"
                     f" | {pick if pick is not None else '-'} | "
                     f"{'-' if loss is None else f'{loss:+.1%}' if loss else 'none'} |")
    runs = {k: len(v) for k, v in ttft.items()}
    sources = sorted({s for _, s in chosen.values()})
    head = [f"# --degree 1 against --degree 2, and what --degree auto chose ({len(rows)} rows, "
            f"{min(runs.values(), default=0)}-{max(runs.values(), default=0)} runs per cell)", "",
            f"Worst loss of the auto choice: {worst:.1%} (target: at most 5%).", ""]
    tail = ["", "Why auto chose as it did (the responses' `degree_source`):", ""] + [f"- {s}" for s in sources]
    (HERE / "summary.md").write_text("\n".join(head + lines + tail) + "\n")
    print("\n".join(head + lines))
    plot(lengths, ttft, chosen)


def plot(lengths, ttft, chosen) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for d, style in ((1, "o-"), (2, "s-")):
        med = [statistics.median(ttft[f"degree{d}", n]) for n in lengths]
        ax.plot(lengths, [m / n * 1000 for m, n in zip(med, lengths)], style,
                label=f"degree {d}" + (" (front alone, 2 threads)" if d == 1 else " (KV chain, 2 ranks x 1 thread)"))
    for n, (d, _) in chosen.items():
        ax.annotate(f"auto: {d}", (n, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median TTFT per 1000 prompt tokens (s)")
    ax.set_title("kvr-serve --nproc 2: one rank or the chain, by prompt length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "crossover.png", dpi=120)


if __name__ == "__main__":
    main()
