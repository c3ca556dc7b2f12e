"""Validation 1: the simulator against every p = 2 point this project measured on the AMD machine (and, with
``--machine xeon``, on the 2-vCPU Intel Xeon since, against the shipped profiles of that machine).

Every timed group of runs (same experiment, length, mode, partition, attention and network) in
experiments/ttft_cpu_p2, ttft_cpu_p2_split, ttft_cpu_p2_16k and ttft_network_p2 (quiet and noisy), and the
kvr-best sweeps' partitions; and every entry of the partition tables searched on the ranks
(partition_tables/smollm2-135m_p2_*). The prediction uses one calibrated profile (default: cpu-t1-amd-epyc.json
here, the profile shipped until the project moved to an Intel machine, measured by `kvr-calibrate` on the AMD
machine that made these rows) and nothing measured by these runs. Single at 2 threads is p = 1 and needs a
2-thread profile; MPI rows are left out (the profile's links are gloo's).

  python experiments/sim_validation/own.py [--profile FILE]   # writes own.json, own.md, own.png here
  python experiments/sim_validation/own.py --machine xeon     # the Xeon's runs: own-xeon.json, .md, .png

On the Xeon, one process at 2 threads (``single`` at 2 threads, the bench's ``single-2t``) is predicted from the
2-thread profile (``cpu-t2.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kvrunahead.model.load import resolve_config
from kvrunahead.net.spec import parse_net
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.links import NoiseModel
from kvrunahead.sim.optimize import search_partition
from kvrunahead.sim.profile import resolve_profile
from kvrunahead.sim.shape import shape_from_config
from kvrunahead.sim.simulate import simulate

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SOURCES = {
    "ttft_cpu_p2": "masked",  # kvr runs of this experiment used --kvr-attention masked
    "ttft_cpu_p2_split": "split",
    "ttft_cpu_p2_16k": "split",
    "ttft_network_p2/4k": "split",
    "ttft_network_p2/8k": "split",
    "ttft_network_p2/16k_high": "split",
    "ttft_network_p2/16k_noise": "split",
}
XEON = {  # the runs on the 2-vCPU Xeon, all split attention, and the tables searched there
    "sources": {"balance_search/bench-12k16k-xeon": "split", "balance_search/bench-14k-xeon": "split",
                "balance_search/bench-cap650-xeon": "split", "balance_search/bench-margin-xeon": "split",
                "balance_search/bench-14k-margin-xeon": "split", "balance_search/bench-cap22-xeon": "split",
                "balance_search/bench-cap650-tsp-xeon": "split"},
    "tables": ("balance_search/tables/loopback-carry-xeon.json", "balance_search/tables/loopback-14k-xeon.json",
               "balance_search/tables/cap650-xeon.json", "balance_search/tables/cap22-xeon.json"),
    "profile": "kvrunahead/sim/profiles/cpu-t1.json", "profile_t2": "kvrunahead/sim/profiles/cpu-t2.json",
}
TABLES = ("partition_tables/smollm2-135m_p2_float32_cpu_masked.json",  # the AMD's tables (the 650 MB/s one since
          "experiments/balance_search/old_tables/loopback.json",  # replaced by the Xeon's: its AMD table, kept)
          "partition_tables/smollm2-135m_p2_float32_cpu_split.json",
          "experiments/balance_search/old_tables/cap650.json",
          "experiments/balance_search/old_tables/cap22.json")


def measured_groups(sources: dict[str, str], two_threads: bool = False) -> dict[tuple, list[dict]]:
    """Runs grouped by (source, length, mode, partition, attention, network, threads per rank); one process at 2
    threads only where ``two_threads`` (a 2-thread profile to predict it)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for source, attention in sources.items():
        path = ROOT / "experiments" / source / "runs.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["kind"] not in ("timed", "sweep") or r.get("transport") == "mpi":
                continue
            if r["mode"] == "single" and r["threads_per_rank"] != 1 and not two_threads:
                continue
            att = r.get("kvr_attention") or attention
            key = (source, r["context_len"], r["mode"], tuple(r["boundaries"]), att if r["mode"].startswith("kvr")
                   else "-", r.get("network") or r.get("bandwidth") or "loopback",
                   r["threads_per_rank"] if r["mode"] == "single" else 1)
            groups[key].append(r)
    return groups


def noise_model(spec) -> NoiseModel | None:
    n = spec.noise
    return None if n is None else NoiseModel(n.rate_bytes_per_s, n.interval_s, n.duty)


def load_profile(name: str):
    profile, _ = resolve_profile(name if Path(name).exists() else str(ROOT / name))
    return profile


def predicted_points(groups, shape, profile, profile_t2=None) -> list[dict]:
    rows = []
    for (source, ctx, mode, bounds, att, network, threads), runs in sorted(groups.items()):
        spec = parse_net(network)
        prof = profile_t2 if threads == 2 else profile
        cost = CostModel(shape, prof, spec.table_label if spec.table_label in prof.links else None)
        sim = simulate(cost, mode, ctx, len(bounds) - 1, bounds, att if att != "-" else "split", noise_model(spec))
        measured = statistics.median(r["ttft_s"] for r in runs)
        per_rank = [{"rank": i, "measured_compute_s": statistics.median(r["ranks"][i]["compute_s"] for r in runs),
                     "measured_wait_s": statistics.median(r["ranks"][i]["wait_s"] for r in runs),
                     "sim_compute_s": sim.ranks[i].compute_s, "sim_wait_s": sim.ranks[i].wait_s}
                    for i in range(len(bounds) - 1)]
        rows.append({"source": source, "commit": runs[0].get("commit", "?"), "context": ctx,
                     "mode": mode if threads == 1 else f"{mode}-{threads}t", "boundaries": list(bounds),
                     "attention": att, "network": network, "runs": len(runs), "measured_s": measured,
                     "sim_s": sim.ttft_s, "error": sim.ttft_s / measured - 1, "ranks": per_rank,
                     "link_used": cost.link_label or prof.default_link})
    return rows


def predicted_partitions(tables, shape, profile) -> list[dict]:
    parts = []
    for path in tables:
        if not path.exists():
            continue
        table = json.loads(path.read_text())
        meta = table["meta"]
        label = meta["bandwidth"]
        cost = CostModel(shape, profile, label if label in profile.links else None)
        for e in table["entries"]:
            ctx = e["context_len"]
            r = search_partition(cost, ctx, 2, meta["kvr_attention"], min_stride=64)
            parts.append({"table": str(path.relative_to(ROOT)),
                          "context": ctx, "searched": e["boundaries"][1], "model": r.boundaries[1],
                          "difference_of_context": (r.boundaries[1] - e["boundaries"][1]) / ctx,
                          "searched_ttft_s": e["ttft_s"], "sim_ttft_at_searched_s":
                          simulate(cost, "kvr", ctx, 2, tuple(e["boundaries"]), meta["kvr_attention"]).ttft_s,
                          "sim_ttft_at_model_s": r.ttft_s})
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", choices=("amd", "xeon"), default="amd",
                    help="amd: the runs before the move (default profile: the AMD's); xeon: the Xeon's runs since, "
                         "against the shipped 1- and 2-thread profiles")
    ap.add_argument("--profile", help="1-thread profile to predict with (default: the machine's)")
    ap.add_argument("--profile-t2", help="--machine xeon: 2-thread profile of the one-process runs (default: the "
                                         "shipped cpu-t2.json)")
    ap.add_argument("--stem", help="name of the outputs (default: own, own-xeon)")
    args = ap.parse_args()
    xeon = args.machine == "xeon"
    default = XEON["profile"] if xeon else str((HERE / "cpu-t1-amd-epyc.json").relative_to(ROOT))
    profile = load_profile(args.profile or default)
    which = f"{args.profile or default} ({profile.device}, calibrated {profile.date[:10]})"
    shape = shape_from_config(resolve_config("smollm2-135m"), "float32", "smollm2-135m")
    if xeon:
        t2 = load_profile(args.profile_t2 or XEON["profile_t2"])
        rows = predicted_points(measured_groups(XEON["sources"], True), shape, profile, t2)
        parts = predicted_partitions([ROOT / "experiments" / t for t in XEON["tables"]], shape, profile)
    else:
        rows = predicted_points(measured_groups(SOURCES), shape, profile)
        parts = predicted_partitions([ROOT / t for t in TABLES], shape, profile)
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    worst_part = max(parts, key=lambda p: abs(p["difference_of_context"])) if parts else None
    result = {"profile": which, "points": rows, "partitions": parts, "worst_error": worst["error"],
              "within_10pct": within, "total": len(rows)}
    stem = args.stem or ("own-xeon" if xeon else "own")
    (HERE / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    command = " ".join(["python experiments/sim_validation/own.py", *sys.argv[1:]])
    write_md(rows, parts, which, worst, within, worst_part, stem, command)
    plot(rows, stem)


def write_md(rows, parts, which, worst, within, worst_part, stem: str, command: str) -> None:
    lines = ["# The simulator against this project's p = 2 measurements", "",
             f"Command: `{command}` (seconds). Profile: {which}.", "",
             f"Within 10%: {within} of {len(rows)} measured groups; worst {worst['error']:+.1%} "
             f"({worst['source']}, {worst['context']} tokens, {worst['mode']}, {worst['network']}).", "",
             "| experiment (commit) | groups | within 10% | median error | worst |", "|---|---|---|---|---|"]
    by_source = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    for source, group in by_source.items():
        errors = [g["error"] for g in group]
        lines.append(f"| {source} ({group[0]['commit']}) | {len(group)} | {sum(abs(e) <= 0.10 for e in errors)} | "
                     f"{statistics.median(errors):+.1%} | {max(errors, key=abs):+.1%} |")
    lines += ["", "| experiment | context | mode | attention | network | partition | runs | measured s | simulated s | "
              "error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        part = ",".join(map(str, r["boundaries"])) if r["mode"].startswith("kvr") else ""
        lines.append(f"| {r['source']} | {r['context']} | {r['mode']} | {r['attention']} | {r['network']} | {part} | "
                     f"{r['runs']} | {r['measured_s']:.2f} | {r['sim_s']:.2f} | {r['error']:+.1%} |")
    lines += ["", "## Per-rank breakdown where the prediction misses by more than 10%", "",
              "| experiment | context | mode | network | rank | compute measured / simulated s | wait measured / "
              "simulated s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if abs(r["error"]) > 0.10:
            for k in r["ranks"]:
                lines.append(f"| {r['source']} | {r['context']} | {r['mode']} | {r['network']} | {k['rank']} | "
                             f"{k['measured_compute_s']:.2f} / {k['sim_compute_s']:.2f} | "
                             f"{k['measured_wait_s']:.2f} / {k['sim_wait_s']:.2f} |")
    lines += ["", "## Best partition: the model's against the searched one (rank 0's boundary)", "",
              "| table | context | searched | model | difference (of the context) | simulated TTFT at searched / "
              "model s |", "|---|---|---|---|---|---|"]
    for p in parts:
        lines.append(f"| {p['table']} | {p['context']} | {p['searched']} | {p['model']} | "
                     f"{p['difference_of_context']:+.1%} | {p['sim_ttft_at_searched_s']:.2f} / "
                     f"{p['sim_ttft_at_model_s']:.2f} |")
    lines += ["", "## The same configuration measured in two experiments (the machine's drift between days)", "",
              "Groups whose simulated TTFTs agree within 2% (the same run, on networks that do not matter to it):",
              "", "| context | mode | partition | experiments | measured s | spread |", "|---|---|---|---|---|---|"]
    same = defaultdict(list)
    for r in rows:
        if "noise" not in r["network"]:
            same[(r["context"], r["mode"], tuple(r["boundaries"]), r["attention"])].append(r)
    for (ctx, mode, bounds, _), group in sorted(same.items()):
        sims = [g["sim_s"] for g in group]
        if len({g["source"] for g in group}) > 1 and max(sims) / min(sims) < 1.02:
            times = [g["measured_s"] for g in group]
            lines.append(f"| {ctx} | {mode} | {','.join(map(str, bounds))} | "
                         + ", ".join(f"{g['source']} ({g['network']})" for g in group) + " | "
                         + ", ".join(f"{t:.2f}" for t in times) + f" | {max(times) / min(times) - 1:.0%} |")
    if parts:
        close = sum(abs(p["difference_of_context"]) <= 0.03 for p in parts)
        lines += ["", f"Within 3% of the context: {close} of {len(parts)} entries."]
    if worst_part:
        lines += ["", f"Worst partition difference: {worst_part['difference_of_context']:+.1%} of the context "
                  f"({worst_part['table']}, {worst_part['context']})."]
    (HERE / f"{stem}.md").write_text("\n".join(lines) + "\n")


def plot(rows, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    modes = sorted({r["mode"] for r in rows})
    for i, m in enumerate(modes):
        sel = [r for r in rows if r["mode"] == m]
        ax.scatter([r["measured_s"] for r in sel], [r["sim_s"] for r in sel], s=14, color=f"C{i}", label=m)
    top = max(max(r["measured_s"], r["sim_s"]) for r in rows) * 1.1
    ax.plot([0.5, top], [0.5, top], "k-", lw=0.8)
    ax.fill_between([0.5, top], [0.45, top * 0.9], [0.55, top * 1.1], color="k", alpha=0.08, label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured TTFT s (median)")
    ax.set_ylabel("simulated TTFT s")
    ax.legend(fontsize=7)
    ax.set_title("p = 2 CPU ranks: every measured group", fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
