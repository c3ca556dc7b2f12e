"""The sweep's figures: TTFT, speedup over TSP and the distance to the no-communication bound per transport and
network (``ttft_{transport}[_{network}].png``), and the noise overhead (``noise_overhead.png``, fig. 11)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvrunahead.bench.report import SummaryRow

log = logging.getLogger(__name__)


def write_plots(summary: list[SummaryRow], out: Path) -> None:
    """A sweep's plots beside its summary; none, with a warning, where matplotlib is not installed."""
    try:
        plot(summary, out)
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'kvrunahead[bench]')")



def plot(summary: list[SummaryRow], out: Path) -> None:
    # matplotlib is optional (the bench extra) and slow to import: only when a sweep's outputs are written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Single-process rows have no transport ("local") and appear in every figure of their network.
    nets = sorted({s.network for s in summary})
    for transport, net in ((t, n) for t in sorted({s.transport for s in summary} - {"local"}) for n in nets):
        rows = [s for s in summary if s.transport in (transport, "local") and s.network == net]
        if not any(s.transport == transport for s in rows):
            continue
        labels = list(dict.fromkeys(s.label for s in rows))
        # The third panel only where a no-communication bound was measured.
        bounded = any(s.over_nocomm_bound is not None for s in rows)
        fig, axes = plt.subplots(1, 3 if bounded else 2, figsize=(17, 5) if bounded else (11.5, 5))
        for label in labels:
            pts = sorted(((s.context_len, s) for s in rows if s.label == label), key=lambda x: x[0])
            x = [c / 1024 for c, _ in pts]
            axes[0].errorbar(x, [s.ttft_median_s for _, s in pts],
                             yerr=[[s.ttft_median_s - s.ttft_min_s for _, s in pts],
                                   [s.ttft_max_s - s.ttft_median_s for _, s in pts]],
                             marker="o", capsize=3, label=label)
            if label not in ("tsp",) and all(s.speedup_over_tsp for _, s in pts):
                axes[1].plot(x, [s.speedup_over_tsp for _, s in pts], marker="o", label=label)
        star = sorted((s.context_len, s.ttft_star_s) for s in rows if s.label == "kvr-best" and s.ttft_star_s)
        if star:
            axes[0].plot([c / 1024 for c, _ in star], [t for _, t in star], "k--", label="TTFT*(p), eq. 3")
        for label in [lb for lb in labels if any(s.label == lb and s.over_nocomm_bound is not None for s in rows)]:
            pts = sorted(((s.context_len, s) for s in rows
                          if s.label == label and s.over_nocomm_bound is not None), key=lambda x: x[0])
            if pts:
                axes[2].plot([c / 1024 for c, _ in pts], [100 * s.over_nocomm_bound for _, s in pts], marker="o",
                             label=f"{label} over kvr-nocomm")
                axes[2].plot([c / 1024 for c, _ in pts], [100 * s.over_nocomm_slowest for _, s in pts],
                             marker="x", ls="--", label=f"{label} over kvr-nocomm's slowest rank")
        p = max(s.world_size for s in rows)
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


def plot_noise(summary: list[SummaryRow], out: Path) -> None:
    """Fig. 11 of the paper: TTFT overhead of each mode on a noisy network against the same links quiet."""
    import matplotlib.pyplot as plt  # see plot()

    noisy = [s for s in summary if s.noise_overhead is not None]
    if not noisy:
        return
    nets = sorted({s.network for s in noisy})
    fig, axes = plt.subplots(1, len(nets), figsize=(6.5 * len(nets), 4.5), squeeze=False)
    for ax, net in zip(axes[0], nets):
        rows = [s for s in noisy if s.network == net]
        labels = list(dict.fromkeys(s.label for s in rows))
        ctxs = sorted({s.context_len for s in rows})
        width = 0.8 / len(ctxs)
        for i, ctx in enumerate(ctxs):
            by = {s.label: s for s in rows if s.context_len == ctx}
            ax.bar([j + i * width for j in range(len(labels))],
                   [100 * by[lb].noise_overhead if lb in by else 0 for lb in labels], width,
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
