"""Draw what a partition search measured, from its checkpoints (``<table>.search/<ctx>.json``).

    python -m kvrunahead.search.plot partition_tables/smollm2-135m_p2_float32_cpu.search -o curves.png

Left: TTFT of every candidate relative to the even partition, against rank 0's share of the context (p = 2;
for more ranks, against the share of the first rank), the chosen candidate ringed. Right: the best TTFT found
so far against the number of candidates measured, i.e. how fast the search converged.
"""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path

import click

from kvrunahead.partition import Partition


def load_checkpoints(dirs: list[Path]) -> dict[str, list[tuple[list[int], float]]]:
    """``label -> [(boundaries, ttft), ...]`` in measurement order; the label is ``<dir name>/<context>``."""
    curves = {}
    for d in dirs:
        files = sorted(d.glob("*.json"), key=lambda f: int(f.stem)) if d.is_dir() else [d]
        for f in files:
            evals = json.loads(f.read_text())["evaluations"]
            label = f"{d.name}/{f.stem}" if len(dirs) > 1 else f.stem
            curves[label] = [(list(b), float(t)) for b, t in evals]
    return curves


def plot(curves: dict[str, list[tuple[list[int], float]]], png: Path) -> None:
    # matplotlib is optional (the bench extra): imported only where a plot is drawn.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, evals in curves.items():
        ctx, p = evals[0][0][-1], len(evals[0][0]) - 1
        # Relative to the even partition (a search measures it first); to the best if it is missing.
        even = Partition.even(ctx, p).boundaries
        base = next((t for b, t in evals if tuple(b) == even), min(t for _, t in evals))
        pts = sorted((b[1] / ctx, t / base) for b, t in evals)
        line = left.plot([x for x, _ in pts], [y for _, y in pts], "o-", ms=3, label=label)[0]
        bx, by = min(pts, key=lambda pt: pt[1])
        left.plot([bx], [by], "o", ms=10, mfc="none", color=line.get_color())
        run = list(accumulate((t for _, t in evals), min))  # best TTFT after each candidate
        right.plot(range(1, len(run) + 1), run, "o-", ms=3, color=line.get_color(), label=label)
    left.set_xlabel("share of the context on rank 0")
    left.set_ylabel("TTFT / TTFT of the even partition")
    left.set_title("every measured candidate (chosen one ringed)")
    left.axhline(1.0, color="grey", lw=0.5)
    left.legend(fontsize=8)
    right.set_xlabel("candidates measured")
    right.set_ylabel("best TTFT so far (s)")
    right.set_yscale("log")
    right.set_title("convergence")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", "png", required=True, type=click.Path(path_type=Path), help="PNG to write.")
def main(checkpoints: tuple[Path, ...], png: Path) -> None:
    """Plot the candidates of partition searches from their checkpoint directories (or single files)."""
    curves = load_checkpoints(list(checkpoints))
    if not curves:
        raise click.ClickException("no checkpoints (<context>.json) found in " + ", ".join(map(str, checkpoints)))
    plot(curves, png)
    click.echo(f"wrote {png}", err=True)


if __name__ == "__main__":
    main()
