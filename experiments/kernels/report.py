"""The tables of experiments/kernels/README.md from the raw rows: medians over the rounds of one commit (the newest
in each file unless --commit), ratios within that run (vs_vllm.sh's parts: per round, each server against the other
in the same round). Prints markdown.

    python experiments/kernels/report.py [--commit SHA]
"""

from __future__ import annotations

import argparse
import csv
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


def floor_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"One decode step (serve/decode.BatchDecoder's unpadded rows) against its floor: {rows[0]['machine']}, "
          f"commit {rows[0]['commit']}, {max(r['round'] for r in rows) + 1} interleaved rounds "
          f"(`{rows[0]['command']}`).\n")
    print("| dtype | rows | threads | step (median) | bytes read | read bandwidth | floor | step / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        for batch in dict.fromkeys(r["batch"] for r in rows):
            for threads in (1, 2):
                group = [r for r in rows if r["dtype"] == dt and r["batch"] == batch and r["threads"] == threads]
                if not group:
                    continue
                step = statistics.median(r["step_s"] for r in group)
                bw = statistics.median(r["read_bandwidth_Bps"] for r in group)
                ratio = statistics.median(r["over_floor"] for r in group)
                print(f"| {dt} | {batch} | {threads} | {step * 1e3:.1f} ms | {group[0]['bytes_read'] / 1e6:.0f} MB | "
                      f"{bw / 1e9:.1f} GB/s | {group[0]['bytes_read'] / bw * 1e3:.1f} ms | {ratio:.2f}x |")
    print()


def split_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"Where a decode step's time goes, 2 threads (`{rows[0]['command']}`; the kernels' times by torch's "
          f"profiler over 5 steps, the rest is the unprofiled step's median less them): {rows[0]['machine']}, "
          f"commit {rows[0]['commit']}.\n")
    print("| dtype | rows | step | linears (oneDNN) | attention (kvr::attention) | the rest |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['step_s'] * 1e3:.1f} ms | {r['linears_s'] * 1e3:.1f} ms | "
              f"{r['attention_s'] * 1e3:.1f} ms | {r['rest_s'] * 1e3:.1f} ms ({r['rest_s'] / r['step_s']:.0%}) |")
    print()


def _per_round(rows: list[dict], key: str, a: dict, b: dict) -> tuple[float, float, float, int] | None:
    """Medians of ``key`` over the rows matching ``a`` and ``b``, and the median of the per-round ratios b / a."""
    def pick(match):
        return {r["round"]: r[key] for r in rows if all(r.get(k) == v for k, v in match.items())
                and r.get(key) is not None}
    x, y = pick(a), pick(b)
    both = sorted(set(x) & set(y))
    if not both:
        return None
    return (statistics.median(x.values()), statistics.median(y.values()),
            statistics.median(y[r] / x[r] for r in both), len(both))


TARGET = {"float32": 1.0, "bfloat16": 1.25}  # vLLM's TTFT over ours, at least (issue 82)
BENCH_WITHIN = 1.05  # kvr-serve's TTFT over kvr-bench's chain, at most


def single_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"One request at a time, TTFT (client's, streamed): kvr-serve --nproc 2 --threads 1 against vLLM CPU on "
          f"both cores, and kvr-bench's chain at the same length (`kvr-bench --modes kvr-default`, where run): "
          f"{rows[0]['machine']}, commit {rows[0]['commit']}.\n")
    print("| dtype | prompt tokens | rounds | kvr-serve | vLLM | vLLM / kvr (median of rounds) | target | kvr-bench | "
          "kvr-serve / kvr-bench | within 5% |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        for n in sorted({r["tokens"] for r in rows}):
            vllm = "vllm" if n <= 8192 else "vllm-yarn"
            got = _per_round(rows, "ttft_s", {"server": "kvr", "tokens": n, "dtype": dt},
                             {"server": vllm, "tokens": n, "dtype": dt})
            bench = _per_round(rows, "ttft_s", {"server": "kvr-bench", "tokens": n, "dtype": dt},
                               {"server": "kvr", "tokens": n, "dtype": dt})
            if got:
                k, v, ratio, count = got
                against = (f"{bench[0]:.2f} s | {bench[2]:.2f}x | {'met' if bench[2] <= BENCH_WITHIN else 'missed'}"
                           if bench else " | | ")
                print(f"| {dt} | {n} | {count} | {k:.2f} s | {v:.2f} s | {ratio:.2f}x | {TARGET[dt]:.2f}x "
                      f"{'met' if ratio >= TARGET[dt] else 'missed'} | {against} |")
    print()


def load_table(folder: Path) -> None:
    found = {}
    for dt in ("float32", "bfloat16"):
        for part, name in (("concurrency", "c{}"), ("vbench", "rate{}")):
            for who in ("kvr", "vllm"):
                for level in ((1, 8) if part == "concurrency" else (0.25, 0.5)):
                    path = folder / dt / part / f"{who}-{name.format(level)}.json"
                    if path.exists():
                        found[(dt, part, who, level)] = json.loads(path.read_text())
    if not found:
        return
    any_row = next(iter(found.values()))
    print(f"Under load, `vllm bench serve` against both servers (kvr-serve --nproc 2, vLLM CPU on both cores, "
          f"prefix caching off): {any_row.get('machine')} ({folder.name}/). Concurrency: random 512-token prompts, "
          f"64 tokens each (ignore_eos); ShareGPT: 30 prompts, 64 output tokens, Poisson arrivals. One round; each "
          f"row names its pieces' commits (kvr, vLLM).\n")
    print("| dtype | load | kvr-serve | vLLM | kvr / vLLM | target | commits |")
    print("|---|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        for part, level, metric, label in (("concurrency", 1, "median_ttft_ms", "TTFT p50, 1 concurrent"),
                                           ("concurrency", 8, "median_ttft_ms", "TTFT p50, 8 concurrent"),
                                           ("concurrency", 1, "median_tpot_ms", "TPOT p50, 1 concurrent"),
                                           ("concurrency", 8, "median_tpot_ms", "TPOT p50, 8 concurrent"),
                                           ("vbench", 0.25, "median_ttft_ms", "ShareGPT TTFT p50, 0.25/s"),
                                           ("vbench", 0.5, "median_ttft_ms", "ShareGPT TTFT p50, 0.5/s"),
                                           ("vbench", 0.25, "median_tpot_ms", "ShareGPT TPOT p50, 0.25/s"),
                                           ("vbench", 0.5, "median_tpot_ms", "ShareGPT TPOT p50, 0.5/s")):
            k, v = found.get((dt, part, "kvr", level)), found.get((dt, part, "vllm", level))
            if k and v:
                ratio = k[metric] / v[metric]
                print(f"| {dt} | {label} | {k[metric]:.1f} ms | {v[metric]:.1f} ms | {ratio:.2f}x | "
                      f"{'met' if ratio <= 1 else 'missed'} (no worse) | {k.get('commit')}, {v.get('commit')} |")
    print()


def chunks_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"A 16k prompt alone on kvr-serve --nproc 2, whole against chunked at a 500 ms step budget: "
          f"{rows[0]['machine']}, commit {rows[0]['commit']}.\n")
    print("| dtype | rounds | whole | chunked | chunks | chunked / whole | target 1.15x |")
    print("|---|---|---|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        got = _per_round(rows, "ttft_s", {"setting": "whole", "dtype": dt}, {"setting": "chunked 500 ms", "dtype": dt})
        if got:
            whole, chunked, ratio, count = got
            chunks = med(rows, "chunks", setting="chunked 500 ms", dtype=dt)
            print(f"| {dt} | {count} | {whole:.2f} s | {chunked:.2f} s | {chunks:.0f} | {ratio:.2f}x | "
                  f"{'met' if ratio <= 1.15 else 'missed'} |")
    print()


def compile_table(folder: Path) -> None:
    runs = {}
    for summary in sorted(folder.glob("*_r*/summary.csv")):
        setting = summary.parent.name.rsplit("_r", 1)[0]
        with summary.open() as f:
            for row in csv.DictReader(f):
                runs.setdefault(setting, []).append(float(row["ttft_median_s"]))
    if not runs:
        return
    print(f"`kvr-bench --ctx 4k --modes kvr-default --nproc 2 --threads 1`, eager against `--compile` (one timed "
          f"run a round after an untimed warm-up; {folder.name}/, rounds interleaved):\n")
    print("| setting | rounds | TTFT (median) | against its dtype's eager |")
    print("|---|---|---|---|")
    for setting, ttfts in runs.items():
        eager = statistics.median(runs[setting.removesuffix("-compiled")])
        t = statistics.median(ttfts)
        print(f"| {setting} | {len(ttfts)} | {t:.2f} s | {t / eager:.2f}x |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    kernel_table(load("rows.jsonl", args.commit))
    default_table(load("default_run.jsonl", args.commit))
    serve_table(load("serve_rows.jsonl", args.commit))
    floor_table(load("decode_floor.jsonl", args.commit))
    split_table(load("decode_split.jsonl", args.commit))
    single_table(load("vs_vllm_single.jsonl", args.commit))
    load_table(HERE / "vs_vllm_load")
    load_table(HERE / "vs_vllm_load_xeon")
    chunks_table(load("chunks.jsonl", args.commit))
    compile_table(HERE / "compile")


if __name__ == "__main__":
    main()
