"""KV-Runahead against Megatron TP at 16k, p = 2: the measured medians of run.sh's parts (interleaved rounds) beside
the simulator's predictions at the same points (the shipped CPU profile, the partition each KVR run used; TP's
all-reduces priced on the same link as the chain).

Usage: python experiments/tp_vs_kvr/report.py   (writes summary.md here)
Reads each part's runs.jsonl, or for a part still running or interrupted its rows_*.jsonl (said so).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = {"16k_loopback": "loopback", "16k_loopback_shm": "loopback, TP in shared memory", "16k_cap650": "cap=650MB/s",
         "16k_cap22": "cap=22MB/s"}
# TP's all-reduces are not in a run's transfer counts (its chain has one group): two per layer of the tokens' hidden
# states, which a two-rank ring all-reduce sends once per rank (half in its reduce-scatter, half in its all-gather)
TP_BYTES = 2 * 30 * 16384 * 576 * 4
LABELS = ["kvr-default", "tp", "ring", "tsp"]
GB = 1e9


def rows_of(part: str) -> tuple[list[dict], str]:
    folder = HERE / part
    done = folder / "runs.jsonl"
    if done.exists():
        return [json.loads(x) for x in done.read_text().splitlines() if x.strip()], "complete"
    rows = [json.loads(x) for f in sorted(folder.glob("rows_*.jsonl")) for x in f.read_text().splitlines()
            if x.strip()]
    return rows, ("partial: the part has not finished, rows so far" if rows else "not run")


def predicted(label: str, net: str, boundaries: list[int]) -> float | None:
    from kvrunahead.cli.sim import resolve_shape
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.profile import resolve_profile
    from kvrunahead.sim.simulate import simulate

    prof, _ = resolve_profile("cpu")
    cost = CostModel(resolve_shape("smollm2-135m", "float32"), prof, net)
    n = boundaries[-1]
    if label == "tp":
        return simulate(cost.over_tp(2, net), "single", n, 1).ttft_s
    mode = "kvr" if label.startswith("kvr") else label
    return simulate(cost, mode, n, 2, tuple(boundaries) if mode == "kvr" else None).ttft_s


def main() -> None:
    lines = ["# KV-Runahead against Megatron TP: SmolLM2-135M, 16k tokens, float32, p = 2 ranks of 1 thread", "",
             "Medians of the timed runs of each mode, interleaved within each network's world (run.sh). TP: one "
             "TP group of both ranks (SmolLM2's 3 K,V heads split 2 and 1: 6 and 3 query heads), its all-reduces on "
             "gloo over the same link as the chain. Predicted: `kvrunahead.sim` on the shipped CPU profile (another "
             "2-vCPU host, 2026-11-25), the measured KVR partition.", "",
             "| network | mode | runs | TTFT median s | min | max | predicted s | bytes sent per rank (GB) | "
             "wait s (max rank) |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for part, net in PARTS.items():
        rows, state = rows_of(part)
        timed = [r for r in rows if r.get("kind") == "timed"]
        medians = {}
        for label in LABELS:
            rs = [r for r in timed if r["label"] == label]
            if not rs and part.endswith("_shm") and label in ("ring", "tsp"):
                continue  # that part runs KVR and TP only
            if not rs:
                lines.append(f"| {net} | {label} | 0 | not run ({state}) | | | | | |")
                continue
            ttfts = [r["ttft_s"] for r in rs]
            medians[label] = statistics.median(ttfts)
            sent = statistics.median([max(x["bytes_sent"] for x in r["ranks"]) for r in rs]) / GB
            sent = f"{TP_BYTES / GB:.2f} (all-reduces, counted from the shape)" if label == "tp" else f"{sent:.2f}"
            wait = statistics.median([max(x["wait_s"] for x in r["ranks"]) for r in rs])
            pred = predicted(label, net.split(",")[0], rs[0]["boundaries"])
            lines.append(f"| {net} | {label} | {len(rs)} | {medians[label]:.1f} | {min(ttfts):.1f} | "
                         f"{max(ttfts):.1f} | {pred:.1f} | {sent} | {wait:.1f} |")
        if "kvr-default" in medians and "tp" in medians:
            ratios.append(f"- {net}: TP / KVR = {medians['tp'] / medians['kvr-default']:.2f}x "
                          f"({medians['tp']:.1f} s against {medians['kvr-default']:.1f} s; {state})")
    lines += ["", "KVR against TP (TTFT ratio, above 1: KVR faster):", *ratios, ""]
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
