"""summary.md of experiments/fast_forward: TTFT medians per setting (float32 / bfloat16, eager / compiled) over the
interleaved rounds, the ratios to float32 eager, each rank's counted FLOP/s against the GEMM peak peak.py measured,
the compile's cost in the first prefill, and kvr-serve's start-up (startup.jsonl).

    python experiments/fast_forward/report.py
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from kvrunahead.model.load import resolve_config
from kvrunahead.sim.flops import part_flops

HERE = Path(__file__).parent
SETTINGS = ("float32", "float32 compiled", "bfloat16", "bfloat16 compiled")


def setting(row: dict) -> str:
    return row["dtype"] + (" compiled" if row.get("compiled") else "")


def load_rows() -> list[dict]:
    rows = []
    for path in sorted(HERE.glob("rows/*/runs.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def peaks() -> dict[tuple[int, str], float]:
    """The best GFLOP/s any shape and path reached, by (threads, dtype)."""
    best: dict[tuple[int, str], float] = {}
    path = HERE / "peak.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        key = (r["threads"], r["dtype"])
        best[key] = max(best.get(key, 0.0), r["gflops"])
    return best


def rank_gflops(row: dict, config) -> list[float]:
    """Each rank's counted FLOPs over its compute seconds (GFLOP/s)."""
    b, out = row["boundaries"], []
    attention = "split" if (row.get("kvr_attention") or "split").startswith("split") or row["mode"] == "single" \
        else "masked"
    for r, stats in enumerate(row["ranks"]):
        last = r == len(row["ranks"]) - 1
        flops = part_flops(config, b[r], b[r + 1] - b[r], attention, lm_head_rows=1 if last else 0)
        out.append(flops / stats["compute_s"] / 1e9)
    return out


def main() -> None:
    rows = load_rows()
    timed = [r for r in rows if r["kind"] == "timed"]
    config = resolve_config("smollm2-135m")
    ttft: dict = defaultdict(list)
    gflops: dict = defaultdict(list)
    first: dict = defaultdict(list)
    for r in timed:
        key = (r["context_len"], r["label"], setting(r))
        ttft[key].append(r["ttft_s"])
        gflops[key].append(rank_gflops(r, config))
    for r in rows:
        if r["kind"] == "warmup":
            first[(r["context_len"], r["label"], setting(r))].append(r["ttft_s"])
    machines = sorted({f"{r['cores']}-vCPU {r['cpu']}" for r in rows})
    commits = sorted({r["commit"] for r in rows})
    lines = ["# The forward's levers: dtype and compilation", "",
             f"Machine: {', '.join(machines)}; torch {rows[0]['torch'] if rows else '?'}, transformers "
             f"{rows[0]['transformers'] if rows else '?'}; commits {', '.join(commits)}.",
             "SmolLM2-135M-Instruct, `kvr-default` = p = 2 ranks of 1 thread (the shipped table's or the cost "
             "model's partition), `single-2t` = one process on both cores. Medians of the timed runs (one per "
             "round, each after an untimed warm-up in the same processes); settings interleaved by round "
             "(`bash experiments/fast_forward/run.sh rounds 2`).", "",
             "## TTFT (s), median over rounds; in brackets the ratio to float32 eager", "",
             "| context | run | " + " | ".join(SETTINGS) + " |", "|---|---|" + "---:|" * len(SETTINGS)]
    for ctx, label in sorted({(k[0], k[1]) for k in ttft}):
        base = ttft.get((ctx, label, "float32"))
        cells = []
        for s in SETTINGS:
            v = ttft.get((ctx, label, s))
            if not v:
                cells.append("-")
                continue
            m = statistics.median(v)
            cells.append(f"{m:.2f} (n={len(v)})" + (f" [{m / statistics.median(base):.2f}]" if base else ""))
        lines.append(f"| {ctx} | {label} | " + " | ".join(cells) + " |")
    peak = peaks()
    lines += ["", "## Counted FLOP/s against the measured GEMM peak", "",
              "FLOPs as the cost model counts them (projections, MLP, the attention's visible pairs, one LM-head "
              "row on the emitting rank: 1.45 TFLOP at 4k, 12.8 at 16k), over each rank's compute seconds. The "
              "peak: the best GFLOP/s any of the layer's linear shapes reached on 2048 or 8192 rows, through "
              "torch's default path or oneDNN's (`peak.py`), at 1 thread for a rank and 2 threads for the single "
              "process.", "",
              "| context | run | setting | GFLOP/s per rank (median) | peak GFLOP/s | share of peak |",
              "|---|---|---|---|---:|---|"]
    for (ctx, label, s), values in sorted(gflops.items()):
        per_rank = [statistics.median(v[i] for v in values) for i in range(len(values[0]))]
        threads = 2 if label.startswith("single") else 1
        p = peak.get((threads, s.split()[0]))
        share = ", ".join(f"{g / p:.0%}" for g in per_rank) if p else "-"
        lines.append(f"| {ctx} | {label} | {s} | {', '.join(f'{g:.0f}' for g in per_rank)} | "
                     f"{p:.0f} | {share} |" if p else
                     f"| {ctx} | {label} | {s} | {', '.join(f'{g:.0f}' for g in per_rank)} | - | - |")
    lines += ["", "## The first prefill of a world (the untimed warm-up) against the timed one (s)", "",
              "A compiled world compiles the chain's shape families in its first prefill at each length.", "",
              "| context | run | setting | first | timed (median) |", "|---|---|---|---:|---:|"]
    for (ctx, label, s), v in sorted(first.items()):
        t = ttft.get((ctx, label, s))
        lines.append(f"| {ctx} | {label} | {s} | {statistics.median(v):.2f} | "
                     f"{statistics.median(t):.2f} |" if t else f"| {ctx} | {label} | {s} | "
                     f"{statistics.median(v):.2f} | - |")
    startup = HERE / "startup.jsonl"
    if startup.exists():
        lines += ["", "## kvr-serve --nproc 2: start-up and first requests (s), `python "
                  "experiments/fast_forward/startup.py`", "",
                  "| setting | dtype | start (to /health) | 1024 tokens, first | again | 2048 tokens, first | again |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for line in startup.read_text().splitlines():
            r = json.loads(line)
            lines.append(f"| {r['setting']} | {r['dtype']} | {r['start_s']:.1f} | {r['first_1024_s']:.2f} | "
                         f"{r['second_1024_s']:.2f} | {r['first_2048_s']:.2f} | {r['second_2048_s']:.2f} |")
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
