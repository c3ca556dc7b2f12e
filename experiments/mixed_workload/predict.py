"""The measured traces replayed on the cost model (kvrunahead/bench/replay.py): on this machine's profile with the
measured policies, to check the simulator's schedule against the measured one, and on 8 GPUs of the built-in
h100-nvlink profile, a prediction of the same mixed workload there.

Usage: python experiments/mixed_workload/predict.py experiments/mixed_workload [--gpu-budget-ms 20]
Writes predicted.md beside summary.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvrunahead.bench.replay import Arrival, replay
from kvrunahead.bench.serve_bench import percentile
from kvrunahead.model.load import DEFAULT_MODEL, resolve_config
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.flops import prompt_work
from kvrunahead.sim.profile import builtin_profiles, resolve_profile
from kvrunahead.sim.shape import shape_from_config

HERE = Path(__file__).resolve().parent


def trace_of(rows: list[dict]) -> list[Arrival]:
    return [Arrival(r["arrival_s"], r["prompt_tokens"], max(1, r["output_tokens"]), r["kind"]) for r in rows
            if not r.get("error")]


def stats(kinds, ttfts, tpots) -> str:
    short = [t for k, t in zip(kinds, ttfts) if k == "short" and t is not None]
    longs = [t for k, t in zip(kinds, ttfts) if k == "long" and t is not None]
    return (f"{percentile(short, 50):.3g} | {percentile(short, 99):.3g} | {', '.join(f'{x:.3g}' for x in longs)} | "
            f"{percentile([t for t in tpots if t], 90):.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget-ms", type=float, default=1000.0, help="the chunked runs' --step-budget-ms")
    ap.add_argument("--gpu-budget-ms", type=float, default=20.0)
    args = ap.parse_args()
    config = resolve_config(DEFAULT_MODEL)
    work = prompt_work(config)
    cpu, which = resolve_profile(None, 1)
    cpu, used, _ = cpu.for_network(None)
    cpu_cost = CostModel(shape_from_config(config, "float32"), cpu, used)
    gpu_cost = CostModel(shape_from_config(config, "bfloat16"), builtin_profiles()["h100-nvlink"])
    lines = ["# The measured traces on the cost model", "",
             f"CPU: {which}, 2 ranks of 1 thread; GPU: built-in h100-nvlink profile (public figures), 8 ranks, "
             f"bfloat16, chunk budget {args.gpu_budget_ms:g} ms. Predictions, not measurements: packing, the "
             "prefix cache and the KVP decode are left out of the replay, and a decode step is priced by "
             "CostModel.decode_step_s, which kvr-calibrate does not fit.", "",
             "| rate | policy | source | short TTFT p50 | short TTFT p99 | long TTFTs | TPOT p90 |",
             "|---|---|---|---|---|---|---|"]
    for rows_path in sorted(args.out.glob("rate*/*/rows.jsonl")):
        policy, rate = rows_path.parent.name, rows_path.parent.parent.name.removeprefix("rate")
        rows = [json.loads(x) for x in rows_path.read_text().splitlines() if x.strip()]
        ok = [r for r in rows if not r.get("error")]
        lines.append(f"| {rate} | {policy} | measured | " + stats([r["kind"] for r in ok], [r["ttft_s"] for r in ok],
                                                                  [r.get("tpot_s") for r in ok]) + " |")
        trace = trace_of(rows)
        budget = args.budget_ms / 1000 if policy == "lars" else 0.0
        for label, cost, p, b in (("CPU model", cpu_cost, 2, budget),
                                  ("8 x H100 predicted", gpu_cost, 8, args.gpu_budget_ms / 1000 if budget else 0)):
            got = replay(trace, cost, p, work, policy, b)
            lines.append(f"| {rate} | {policy} | {label} | " + stats([g.kind for g in got], [g.ttft_s for g in got],
                                                                     [g.tpot_s for g in got]) + " |")
    (args.out / "predicted.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
