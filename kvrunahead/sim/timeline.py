"""Per-rank timeline of a simulated prefill (like the paper's fig. 3 and 5): compute, waits, transfers."""

from __future__ import annotations

from pathlib import Path

from kvrunahead.sim.simulate import SimResult

COLOURS = {"compute": "#4c72b0", "wait": "#dd8452", "send": "#55a868"}


def plot_timeline(result: SimResult, out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = result.world_size
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * p * 2))
    for span in result.spans:
        # Two lanes per rank: its compute and waits above, its outgoing link below.
        lane = 2 * (p - 1 - span.rank) + (0 if span.kind == "send" else 1)
        # White edges mark where one layer's step ends and the next begins.
        ax.broken_barh([(span.start_s, span.end_s - span.start_s)], (lane + 0.1, 0.8),
                       facecolors=COLOURS[span.kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks([2 * (p - 1 - r) + lane + 0.5 for r in range(p) for lane in (1, 0)],
                  [f"rank {r} {what}" for r in range(p) for what in ("compute", "link")])
    ax.set_xlabel("seconds")
    ax.axvline(result.ttft_s, color="k", lw=0.8)
    ax.set_xlim(0, result.ttft_s * 1.02)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", fontsize=8, ncol=3)
    ax.set_title(title or f"{result.mode}, {result.context_len} tokens on {p} ranks: TTFT {result.ttft_s:.3f} s",
                 fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
