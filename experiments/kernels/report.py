"""The tables of experiments/kernels/README.md from the raw rows: medians over the rounds of one commit (the newest
in each file unless --commit), ratios within that run. Prints markdown.

    python experiments/kernels/report.py [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def load(name: str, commit: str | None) -> list[dict]:
    path = HERE / name
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    commit = commit or rows[-1]["commit"]
    return [r for r in rows if r["commit"] == commit]


def med(rows: list[dict], key: str, **match) -> float | None:
    vals = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def kernel_table(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"Kernel alone, 1 thread, SmolLM2's layer shape: {r0['machine']}, isa {r0['isa']}, commit {r0['commit']}, "
          f"{max(r['round'] for r in rows) + 1} interleaved rounds (`{r0['command']}`).\n")
    gemm = {dt: med(rows, "gflops", case="gemm", dtype=dt) for dt in ("float32", "bfloat16")}
    bw = med(rows, "gb_per_s", case="bandwidth")
    print(f"GEMM rate of the thread: float32 {gemm['float32']:.1f}, bfloat16 {gemm['bfloat16']:.1f} GFLOP/s; "
          f"read bandwidth {bw:.1f} GB/s.\n")
    print("| case | dtype | ours GFLOP/s | torch GFLOP/s | ours / torch | ours / GEMM rate | GB/s (ours, torch) |")
    print("|---|---|---|---|---|---|---|")
    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if c not in ("gemm", "bandwidth")]
    for case in cases:
        for dt in ("float32", "bfloat16"):
            o, t = med(rows, "gflops", case=case, dtype=dt, kernel="ours"), med(rows, "gflops", case=case, dtype=dt,
                                                                                  kernel="torch")
            if o is None:
                continue
            gb = med(rows, "gb_per_s", case=case, dtype=dt, kernel="ours")
            gbt = med(rows, "gb_per_s", case=case, dtype=dt, kernel="torch")
            bws = f"{gb:.1f}, {gbt:.1f} (of {bw:.1f})" if gb else ""
            print(f"| {case} | {dt} | {o:.1f} | {t:.1f} | {o / t:.2f}x | {o / gemm[dt]:.0%} | {bws} |")
    print()


def default_table(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"`kvr-prefill --ctx 16k` over 2 ranks of 1 thread: {r0['machine']}, commit {r0['commit']}.\n")
    print("| setting | runs | TTFT (median) | rank 0 GFLOP/s | rank 1 GFLOP/s |")
    print("|---|---|---|---|---|")
    for setting in dict.fromkeys(r["setting"] for r in rows):
        group = [r for r in rows if r["setting"] == setting]
        ttft = statistics.median(r["ttft_s"] for r in group)
        ranks = [statistics.median(r["ranks"][i]["gflops"] for r in group) for i in range(2)]
        print(f"| {setting} | {len(group)} | {ttft:.2f} s | {ranks[0]:.0f} | {ranks[1]:.0f} |")
    print()


def serve_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"`kvr-serve --nproc 2`, time per output token: {rows[0]['machine']}, commit {rows[0]['commit']}.\n")
    print("| dtype | kernel | rounds | one row | 8 rows (150-1550) | ratio |")
    print("|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        for k in ("ours", "torch"):
            group = [r for r in rows if r["dtype"] == dt and r["kernel"] == k]
            if group:
                one = statistics.median(r["tpot_one_row_s"] for r in group)
                many = statistics.median(r["tpot_eight_rows_s"] for r in group)
                print(f"| {dt} | {k} | {len(group)} | {one * 1e3:.1f} ms | {many * 1e3:.1f} ms | {many / one:.2f}x |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    kernel_table(load("rows.jsonl", args.commit))
    default_table(load("default_run.jsonl", args.commit))
    serve_table(load("serve_rows.jsonl", args.commit))


if __name__ == "__main__":
    main()
