"""KV-Runahead against Medha's stream pipeline: the measured runs of run.sh's parts (medians of the interleaved
rounds), the simulator's predictions at the same points, and its predictions at the paper's setting.

Usage: python experiments/spp_vs_kvr/report.py   (writes summary.md, ttft.png and sim_paper.json here)
Reads every part folder's runs.jsonl, or, for a part still running or interrupted, its rows_*.jsonl (said so).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = ["16k_loopback", "16k_cap650", "8k-12k_loopback", "8k-12k_cap650", "chunks_8k", "chunks_16k"]
ORDER = ["single-2t", "tsp", "ring", "kvr-default", "spp"]
MIB = 2**20


def rows_of(part: str) -> tuple[list[dict], str]:
    folder = HERE / part
    done = folder / "runs.jsonl"
    if done.exists():
        return [json.loads(line) for line in done.read_text().splitlines() if line.strip()], "complete"
    rows = []
    for f in sorted(folder.glob("rows_*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows, "partial (the part has not finished: rows so far)" if rows else "not run"


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(rows: list[dict]) -> dict:
    """(network, context, label) -> the medians of its timed runs."""
    groups: dict = {}
    for r in rows:
        if r.get("kind") != "timed":
            continue
        groups.setdefault((r["network"], r["context_len"], r["label"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        p = len(rs[0]["ranks"])
        out[key] = {
            "runs": len(rs),
            "ttft_s": median([r["ttft_s"] for r in rs]),
            "busy_s": [median([r["ranks"][i]["compute_s"] for r in rs]) for i in range(p)],
            "wait_s": [median([r["ranks"][i]["wait_s"] for r in rs]) for i in range(p)],
            "sent_mib": [rs[0]["ranks"][i]["bytes_sent"] / MIB for i in range(p)],
            "peak_mib": [median([r["ranks"][i]["peak_mem_bytes"] for r in rs]) / MIB for i in range(p)],
            "boundaries": rs[0]["boundaries"], "stages": rs[0].get("stages"), "chunk": rs[0].get("chunk_tokens"),
            "commits": sorted({r["commit"] for r in rs}), "cpu": rs[0]["cpu"],
        }
    return out


def family(label: str) -> str:
    return "spp" if label.startswith("spp") else label


def predicted(ctx: int, net: str, label: str, s: dict) -> float | None:
    """The simulator's TTFT for a measured point, on the shipped CPU profile at one thread per rank."""
    from kvrunahead.model.load import resolve_config
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.profile import resolve_profile
    from kvrunahead.sim.shape import shape_from_config
    from kvrunahead.sim.simulate import simulate

    if family(label) not in ("spp", "kvr-default", "ring", "tsp"):
        return None
    profile, _ = resolve_profile("cpu", 1)
    profile, link, _ = profile.for_network(None if net == "loopback" else net)
    cost = CostModel(shape_from_config(resolve_config("smollm2-135m"), "float32"), profile, link)
    mode = {"kvr-default": "kvr"}.get(family(label), family(label))
    r = simulate(cost, mode, ctx, 2, tuple(s["boundaries"]), "split", stages=s["stages"] and tuple(s["stages"]),
                 chunk_tokens=s["chunk"])
    return r.ttft_s


def paper_predictions() -> list[dict]:
    """kvr-plan at the paper's setting (Llama-7B, 8 A100s, NVLink 300 GB/s and PCIe 10 GB/s, 4k-16k) and at a
    million tokens on 64 H100s (spp at most 32 stages: Llama-7B has 32 layers)."""
    runs = [("a100-nvlink", "4k,8k,16k", ["--ranks", "8"]), ("a100-pcie", "4k,8k,16k", ["--ranks", "8"]),
            ("h100-nvlink", "1M", ["--ranks", "32,64"])]
    out = []
    for profile, ctx, ranks in runs:
        r = subprocess.run(["kvr-plan", "--ctx", ctx, "--profile", profile, "--model", "llama-7b",
                            "--modes", "kvr,tsp,ring,spp", "--json", *ranks],
                           capture_output=True, text=True, check=True)
        for point in json.loads(r.stdout):
            out.append({"profile": profile, **point})
    return out


def memory_section() -> list[str]:
    """The memory part: each run a kvr-prefill of its own (fresh processes), peak resident memory per rank."""
    runs = {}
    for f in sorted((HERE / "memory").glob("*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["mode"], []).append(r)
    if not runs:
        return ["## memory: not run", ""]
    out = ["## memory: 16k, every run in fresh processes (`run.sh memory`)", "",
           "| mode | runs | TTFT s | peak MiB per rank (median) | weights and K,V the rank holds |",
           "|---|---|---|---|---|"]
    peaks = {}
    for mode, rs in runs.items():
        p = len(rs[0]["ranks"])
        peaks[mode] = [median([r["ranks"][i]["peak_mem_bytes"] for r in rs]) / MIB for i in range(p)]
        holds = ("each: its stage's 15 of 30 layers and their K,V of all 16k positions" if mode == "spp" else
                 "each: every layer; rank r the K,V of [0, b_{r+1})")
        out.append(f"| {mode} | {len(rs)} | {median([r['ttft_s'] for r in rs]):.2f} | "
                   f"{' / '.join(f'{x:.0f}' for x in peaks[mode])} | {holds} |")
    if {"spp", "kvr"} <= set(peaks):
        ratios = [a / b for a, b in zip(peaks["spp"], peaks["kvr"])]
        out += ["", f"spp / kvr per rank: {' / '.join(f'{x:.2f}' for x in ratios)}; the largest rank's: "
                f"{max(peaks['spp']) / max(peaks['kvr']):.2f}"]
    return out + [""]


def main() -> None:
    lines = ["# KV-Runahead against the stream pipeline (spp): measured and predicted", "",
             "Written by `python experiments/spp_vs_kvr/report.py` from the parts of `run.sh` "
             "(SmolLM2-135M float32, p = 2 ranks of 1 thread, gloo; the single process at 2 threads). "
             "TTFT: median of the interleaved rounds; busy = a rank's compute (its time less waits and sends); "
             "peak = the rank's peak resident memory during the prefill, the weights included.", ""]
    allsum = {}
    for part in PARTS:
        rows, state = rows_of(part)
        s = summarize(rows)
        allsum.update({(part, *k): v for k, v in s.items()})
        lines.append(f"## {part}: {state}, {len(rows)} rows")
        if not s:
            lines.append("")
            continue
        commits = sorted({c for v in s.values() for c in v["commits"]})
        lines.append(f"commit(s) {', '.join(commits)}; machine {next(iter(s.values()))['cpu']}, 2 cores")
        lines.append("")
        lines.append("| network | ctx | mode | runs | TTFT s | vs kvr-default | busy s per rank | wait s per rank | "
                     "sent MiB per rank | peak MiB per rank | predicted s (error) |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for key in sorted(s, key=lambda k: (k[0], k[1], ORDER.index(family(k[2])) if family(k[2]) in ORDER
                                           else 9, k[2])):
            net, ctx, label = key
            v = s[key]
            kvr = s.get((net, ctx, "kvr-default"))
            ratio = f"{v['ttft_s'] / kvr['ttft_s']:.3f}" if kvr else ""
            pred = predicted(ctx, net, label, v)
            pred_s = f"{pred:.2f} ({pred / v['ttft_s'] - 1:+.1%})" if pred else ""
            name = label + (f" (stages {','.join(map(str, v['stages']))})" if v["stages"] else "")
            lines.append(f"| {net} | {ctx} | {name} | {v['runs']} | {v['ttft_s']:.2f} | {ratio} | "
                         f"{' / '.join(f'{x:.1f}' for x in v['busy_s'])} | "
                         f"{' / '.join(f'{x:.2f}' for x in v['wait_s'])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['sent_mib'])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['peak_mib'])} | {pred_s} |")
        lines.append("")
    lines += memory_section()
    paper = paper_predictions()
    (HERE / "sim_paper.json").write_text(json.dumps(paper, indent=1))
    lines += ["## Predicted at the paper's setting (kvr-plan, Llama-7B)", "",
              "| profile | ctx | option | TTFT s | vs single | layout |", "|---|---|---|---|---|---|"]
    for point in paper:
        for o in point["options"]:
            layout = (f"stages {len(o['boundaries']) - 1}, chunks of {o['chunk_tokens']}" if o["mode"] == "spp"
                      else "partition searched" if o["mode"] == "kvr" else "even/zigzag")
            lines.append(f"| {point['profile']} | {point['context_len']} | {o['mode']} x{o['ranks']} | "
                         f"{o['ttft_s']:.3f} | {o['speedup_vs_single']:.2f}x | {layout} |")
    lines.append("")
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    plot(allsum)
    print("\n".join(lines))


def plot(allsum: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted({(k[1], k[2]) for k in allsum if not k[0].startswith("chunks")}, key=lambda x: (x[0] != "loopback",
                                                                                                  x[1]))
    if not points:
        return
    fig, axes = plt.subplots(1, len(points), figsize=(4 * len(points), 4), squeeze=False)
    for ax, (net, ctx) in zip(axes[0], points):
        got = {family(k[3]): v for k, v in allsum.items() if k[1] == net and k[2] == ctx and not k[0].startswith(
            "chunks")}
        names = [n for n in ORDER if n in got]
        ax.bar(names, [got[n]["ttft_s"] for n in names], color=["#999", "#c96", "#69c", "#3a3", "#c33"][:len(names)])
        ax.set_title(f"{ctx // 1024}k, {net}")
        ax.set_ylabel("TTFT s (median)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(HERE / "ttft.png", dpi=110)


if __name__ == "__main__":
    main()
