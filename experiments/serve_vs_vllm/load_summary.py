"""Tables and the Pareto plot from load/ (load.py's results): load_summary.md and pareto.png.

Usage: python experiments/serve_vs_vllm/load_summary.py
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOAD = HERE / "load"
SERVERS = {"kvr": "kvr-serve --nproc 2", "kvr-lars": "kvr-serve, chunked prefill 1000 ms + LARS",
           "vllm": "vLLM CPU, both cores",
           "vllm-reserved": "vLLM CPU, default placement (1 core reserved)"}
ALWAYS = ("kvr", "vllm")  # the families every table names, measured or not; the others only where they ran
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2  # the goodput objectives, as given to vllm bench serve (ttft:2000 tpot:200)


def _vbench(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x / 1000:.3f}"


def concurrency_table(part: str = "concurrency") -> tuple[list[str], dict]:
    lines = ["| concurrent requests | server | TTFT p50 / p99 s | TPOT p50 / p99 s | ITL p50 s | E2EL p50 s | "
             "output tok/s | tok/s per user | requests |",
             "|---:|---|---|---|---|---|---:|---:|---:|"]
    points: dict[str, list[tuple[float, float, int]]] = {}
    for c in (1, 2, 4, 8):
        for who in SERVERS:
            r = _vbench(LOAD / part / f"{who}-c{c}.json")
            if r is None:
                if who in ALWAYS:
                    lines.append(f"| {c} | {SERVERS[who]} | not measured | | | | | | |")
                continue
            per_user = 1000 / r["median_tpot_ms"]
            points.setdefault(who, []).append((r["output_throughput"], per_user, c))
            lines.append(f"| {c} | {SERVERS[who]} | {_ms(r['p50_ttft_ms'])} / {_ms(r['p99_ttft_ms'])} | "
                         f"{_ms(r['p50_tpot_ms'])} / {_ms(r['p99_tpot_ms'])} | {_ms(r['p50_itl_ms'])} | "
                         f"{_ms(r['p50_e2el_ms'])} | {r['output_throughput']:.1f} | {per_user:.1f} | "
                         f"{r['completed']}/{r['num_prompts']} |")
    return lines, points


def vbench_table() -> list[str]:
    lines = ["| rate | server | TTFT p50 / p90 / p99 s | TPOT p50 / p99 s | ITL p50 / p99 s | E2EL p50 s | "
             "requests/s | output tok/s | goodput req/s (ttft<=2 s, tpot<=0.2 s) |",
             "|---:|---|---|---|---|---|---:|---:|---:|"]
    for rate in (0.25, 0.5):
        for who in SERVERS:
            r = _vbench(LOAD / "vbench" / f"{who}-rate{rate}.json")
            if r is None:
                if who not in ALWAYS:
                    continue
                lines.append(f"| {rate} | {SERVERS[who]} | not measured | | | | | | |")
                continue
            lines.append(f"| {rate} | {SERVERS[who]} | {_ms(r['p50_ttft_ms'])} / {_ms(r['p90_ttft_ms'])} / "
                         f"{_ms(r['p99_ttft_ms'])} | {_ms(r['p50_tpot_ms'])} / {_ms(r['p99_tpot_ms'])} | "
                         f"{_ms(r['p50_itl_ms'])} / {_ms(r['p99_itl_ms'])} | {_ms(r['p50_e2el_ms'])} | "
                         f"{r['request_throughput']:.3f} | {r['output_throughput']:.2f} | "
                         f"{r.get('request_goodput') or 0:.3f} |")
    return lines


def _ours(part: str, rate: float, who: str) -> tuple[dict | None, list[dict]]:
    folder = LOAD / part / f"rate{rate}" / who
    if not (folder / "done").exists():
        return None, []
    with (folder / "summary.csv").open() as f:
        summary = next(csv.DictReader(f))
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    return summary, rows


def _goodput(rows: list[dict], wall_s: float) -> float:
    good = [r for r in rows if not r["error"] and r["ttft_s"] is not None and r["ttft_s"] <= SLO_TTFT_S
            and (r["tpot_s"] is None or r["tpot_s"] <= SLO_TPOT_S)]
    return len(good) / wall_s


def ours_table(part: str, rates: tuple[float, ...]) -> list[str]:
    lines = ["| rate | server | short TTFT p50 / p90 / p99 s | long: n, TTFT each s | TPOT p50 s | "
             "output tok/s | goodput req/s | errors |", "|---:|---|---|---|---|---:|---:|---|"]
    for rate in rates:
        for who in SERVERS:
            s, rows = _ours(part, rate, who)
            if s is None:
                if who not in ALWAYS:
                    continue
                lines.append(f"| {rate} | {SERVERS[who]} | not measured | | | | | |")
                continue
            longs = sorted(r["ttft_s"] for r in rows if r["kind"] == "long" and r["ttft_s"] is not None)
            errors = {}
            for r in rows:
                if r["error"]:
                    errors[r["error"]] = errors.get(r["error"], 0) + 1
            lines.append(f"| {rate} | {SERVERS[who]} | {float(s['ttft_short_p50_s']):.3f} / "
                         f"{float(s['ttft_short_p90_s']):.3f} / {float(s['ttft_short_p99_s']):.3f} | "
                         f"{s['long_n']}: {', '.join(f'{t:.1f}' for t in longs) or '-'} | "
                         f"{float(s['tpot_p50_s']):.3f} | {float(s['output_tokens_per_s']):.2f} | "
                         f"{_goodput(rows, float(s['wall_s'])):.3f} | "
                         f"{', '.join(f'{k} {v}' for k, v in errors.items()) or 'none'} |")
    return lines


def pareto(points: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for who, pts in points.items():
        pts = sorted(pts, key=lambda p: p[2])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=SERVERS[who])
        for x, y, c in pts:
            ax.annotate(f"{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output tokens/s (server)")
    ax.set_ylabel("output tokens/s per user (1 / TPOT p50)")
    ax.set_title("512-token prompts, 64 tokens out; labels: concurrent requests")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "pareto.png", dpi=120)


def main() -> None:
    conc, points = concurrency_table()
    cold, _ = concurrency_table("concurrency-cold")
    out = ["# kvr-serve against vLLM CPU under load (generated by load_summary.py from load/)", "",
           "## Decode and the Pareto front: `vllm bench serve`, random 512-token prompts, 64 tokens (ignore_eos)",
           "", *conc, "", "The first pass (`concurrency-cold/`: no warm-up requests, vLLM compiling batch shapes as "
           "they first came):", "", *cold, "",
           "## ShareGPT, `vllm bench serve` (30 prompts, 64 output tokens, Poisson arrivals)", "",
           *vbench_table(), "", "## ShareGPT, kvr-serve-bench (30 requests, replies capped at 64 tokens)", "",
           *ours_table("sharegpt", (0.25, 0.5)), "",
           "## Mixed load, kvr-serve-bench (5% long documents of 8k-16k tokens, 80 requests)", "",
           *ours_table("mixed", (0.25,)), "", "The same, another draw (`--seed 1`: 4 long documents)", "",
           *ours_table("mixed-seed1", (0.25,)), ""]
    (HERE / "load_summary.md").write_text("\n".join(out))
    if points:
        pareto(points)
    print("\n".join(out))


if __name__ == "__main__":
    main()
