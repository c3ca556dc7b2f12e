"""summary.md and learned.png for the learned server's rows (run.sh with SERVERS="1 2 learned"): per length, the
median TTFT of the forced degrees and of the server that corrects its choice by its own timings (after its warm-up),
the learned one against the faster forced one per round, and the cold start: the warm-up requests' total TTFT
against what the best forced degree takes for the same requests (its per-length medians).

    python experiments/serve_degree/report_learned.py [ROWS]   (default: experiments/serve_degree/rows-learned)
"""

import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).parent
AUTO_WITHIN = 1.03  # the target: the learned layout within 3% of the faster forced one at every length
COLD_WITHIN = 1.10  # the first requests' total within 10% of the best forced layout's


def load(rows_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(rows_dir.glob("*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]


def main(rows_dir: Path) -> None:
    rows = load(rows_dir)
    ttft, per_round, chosen = defaultdict(list), defaultdict(list), defaultdict(Counter)
    for r in rows:
        ttft[r["label"], r["length"]].append(r["ttft_s"])
        per_round[r["label"], r["length"], r["round"]].append(r["ttft_s"])
        if r["label"] == "degreelearned":
            chosen[r["length"]][(r["degree"], r.get("layout_basis"))] += 1
    lengths = sorted({r["length"] for r in rows})
    rounds = sorted({r["round"] for r in rows if r["label"] == "degreelearned"})
    med = {k: statistics.median(v) for k, v in ttft.items()}
    lines = ["| prompt tokens | degree 1 | degree 2 | learned chose (basis: requests) | learned | learned / the faster "
             "(per round) | within 3% |", "|---|---|---|---|---|---|---|"]
    worst, missing = 0.0, []
    for n in lengths:
        one, two, got = med.get(("degree1", n)), med.get(("degree2", n)), med.get(("degreelearned", n))
        if None in (one, two, got):
            lines.append(f"| {n} | missing rows |  |  |  |  |  |")
            missing.append(n)
            continue
        ratios = []
        for rd in rounds:
            parts = [per_round.get((label, n, rd)) for label in ("degree1", "degree2", "degreelearned")]
            if all(parts):
                ratios.append(statistics.median(parts[2]) / min(map(statistics.median, parts[:2])))
        ratio = got / min(one, two)
        worst = max(worst, ratio)
        picks = ", ".join(f"{d} {b}: {c}" for (d, b), c in sorted(chosen[n].items()))
        lines.append(f"| {n} | {'**' if one <= two else ''}{one:.3f} s{'**' if one <= two else ''} | "
                     f"{'**' if two < one else ''}{two:.3f} s{'**' if two < one else ''} | {picks} | {got:.3f} s | "
                     f"{ratio:.3f} ({', '.join(f'{x:.2f}' for x in ratios)}) | "
                     f"{'yes' if ratio <= AUTO_WITHIN else 'no'} |")
    warm = [r for r in rows if r["label"] == "degreelearned-warmup"]
    cold = ""
    if warm and all(("degree1", r["length"]) in med and ("degree2", r["length"]) in med for r in warm):
        total = sum(r["ttft_s"] for r in warm)
        forced = {d: sum(med[f"degree{d}", r["length"]] for r in warm) for d in (1, 2)}
        best = min(forced, key=forced.get)
        explored = sum(r.get("layout_basis") == "exploring" for r in warm)
        cold = (f"\n**Cold start**: the first {len(warm)} requests (after one of 1 token) took {total:.1f} s in all; "
                f"degree 1 forced would take {forced[1]:.1f} s, degree 2 {forced[2]:.1f} s (their medians); the "
                f"learned server against the best forced: **{total / forced[best]:.3f}** (target <= "
                f"{COLD_WITHIN}: {'met' if total / forced[best] <= COLD_WITHIN else 'missed'}); {explored} of them "
                f"explored.\n")
    env = rows[0] if rows else {}
    host = f"{env.get('cores', '')}-vCPU {env.get('cpu', '')}"
    commits = sorted({r.get("commit") for r in rows} - {None})
    text = (f"# The learned server against both forced degrees\n\n{host}, torch {env.get('torch', '')}, commit "
            f"{commits}\n\n"
            + "\n".join(lines)
            + (f"\n\n**Auto within 3% of the faster forced degree at every length**: worst {worst:.3f} "
               f"({'met' if worst <= AUTO_WITHIN else 'missed'}).\n" if not missing else
               f"\n\nNot every server timed {', '.join(map(str, missing))} tokens: no verdict.\n") + cold)
    (rows_dir / "summary.md").write_text(text)
    print(text)
    plot(rows_dir, lengths, med)


def plot(rows_dir: Path, lengths: list[int], med: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, name in (("degree1", "degree 1"), ("degree2", "degree 2"), ("degreelearned", "learned")):
        xs = [n for n in lengths if (label, n) in med]
        ax.plot(xs, [1000 * med[label, n] / n for n in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT per 1000 tokens (s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(rows_dir / "learned.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "rows-learned")
