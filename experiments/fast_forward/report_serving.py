"""serving.md of experiments/fast_forward: the serving targets, each from its raw rows, stated as met, missed or not
measured: the batch decoder's step (decode_step.jsonl), a chunked prefill against the whole prompt (chunks.jsonl),
kvr-serve's start-up (startup.jsonl) and kvr-serve against vLLM CPU (vs_vllm_single.jsonl, vs_vllm_load/).

    python experiments/fast_forward/report_serving.py
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent


def rows(name: str) -> list[dict]:
    path = HERE / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**missed**")


def decode_section() -> list[str]:
    out = ["## One decode step: 8 requests of unequal contexts against one (decode_step.py)", "",
           "One process, 1 thread; medians of 12 steps after 2 warm-ups, the settings' decoders taking turns step by "
           "step. Target: 8 rows at most 1.8x one row.", "",
           "| dtype | forward | path | commit | 8 rows (150-1550) | 1 row (150) | 1 row (750) | 1 row (1550) | "
           "8 rows / 1 row (750) | target |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    by = defaultdict(dict)
    for r in rows("decode_step.jsonl"):
        by[(r["dtype"], r["compiled"], r["path"], r["commit"])][r["batch"]] = r["median_s"]
    for (dtype, compiled, path, commit), t in sorted(by.items()):
        ratio = t["8 rows"] / t["1 row (750)"]
        out.append(f"| {dtype} | {'compiled' if compiled else 'eager'} | {path} | {commit} | "
                   f"{t['8 rows'] * 1e3:.1f} ms | "
                   f"{t['1 row (150)'] * 1e3:.1f} ms | {t['1 row (750)'] * 1e3:.1f} ms | "
                   f"{t['1 row (1550)'] * 1e3:.1f} ms | {ratio:.2f}x | {verdict(ratio <= 1.8)} |")
    return out + [""]


def chunks_section() -> list[str]:
    out = ["## A long prompt alone: chunked at a 500 ms step budget against whole (chunks.py)", "",
           "`kvr-serve --nproc 2 --threads 1`, the prompt alone on the idle server, 1 new token; the settings take "
           "turns round by round, a fresh server each. Target: chunked at most 1.15x whole.", "",
           "| dtype | tokens | whole TTFT (runs) | chunked TTFT (runs) | chunks | mean chunk | chunk steps / TTFT | "
           "chunked / whole | target |", "|---|---:|---|---|---:|---:|---:|---:|---|"]
    by = defaultdict(lambda: defaultdict(list))
    for r in rows("chunks.jsonl"):
        by[(r["dtype"], r["tokens"])][r["setting"]].append(r)
    for (dtype, n), settings in sorted(by.items()):
        whole = settings.get("whole", [])
        chunked = next((v for k, v in settings.items() if k.startswith("chunked")), [])
        if not whole or not chunked:
            continue
        w = statistics.median(r["ttft_s"] for r in whole)
        c = statistics.median(r["ttft_s"] for r in chunked)
        steps = statistics.median(r["chunk_steps_s"] / r["ttft_s"] for r in chunked)
        count = statistics.median(r["chunks"] for r in chunked)
        runs = lambda rs: ", ".join(f"{r['ttft_s']:.2f}" for r in rs)  # noqa: E731
        out.append(f"| {dtype} | {n} | {w:.2f} s ({runs(whole)}) | {c:.2f} s ({runs(chunked)}) | {count:.0f} | "
                   f"{n / count:.0f} | {steps:.1%} | {c / w:.2f}x | {verdict(c / w <= 1.15)} |")
    for r in rows("chunks-kvp.jsonl"):  # before --decode auto stopped chunking KV-parallel
        out += ["", f"At {r['commit']}, where `--decode auto` still chunked a long prompt KV-parallel (an "
                    f"all-gather per layer per chunk), a {r['tokens']}-token {r['dtype']} prompt took {r['chunks']} "
                    f"chunks of {r['tokens'] / r['chunks']:.0f} tokens on average: {r['ttft_s']:.1f} s, chunked "
                    "(chunks-kvp.jsonl)."]
    return out + [""]


def startup_section() -> list[str]:
    out = ["## kvr-serve's start-up (startup.py)", "",
           "`kvr-serve --nproc 2 --threads 1`, float32: seconds from the command to /health answering, then two "
           "1024-token prompts and two of 2048 tokens (8 new tokens each, latency).", "",
           "| setting | start-up | 1024 first / second | 2048 first / second | commit | date |",
           "|---|---:|---|---|---|---|"]
    for r in rows("startup.jsonl"):
        out.append(f"| {r['setting']} | {r['start_s']:.1f} s | {r['first_1024_s']:.2f} / {r['second_1024_s']:.2f} s "
                   f"| {r['first_2048_s']:.2f} / {r['second_2048_s']:.2f} s | {r['commit']} | {r.get('date', '')} |")
    return out + [""]


def vbench(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def vllm_section() -> list[str]:
    out = ["## Against vLLM CPU 0.32 on both cores (serve_vs_vllm/single.py and load.py)", "",
           "One request at a time (streamed, 8 new tokens), the servers taking turns round by round; both servers "
           "in the dtype named. Target: kvr-serve's TTFT at least 1.1x better (vLLM's / ours >= 1.1).", "",
           "| dtype | tokens | kvr-serve --nproc 2 (runs) | vLLM CPU (runs) | vLLM / kvr | target |",
           "|---|---:|---|---|---:|---|"]
    by = defaultdict(lambda: defaultdict(list))
    for r in rows("vs_vllm_single.jsonl"):
        by[(r["dtype"], r["tokens"])]["kvr" if r["server"] == "kvr" else "vllm"].append(r["ttft_s"])
    for (dtype, n), s in sorted(by.items()):
        if not s["kvr"] or not s["vllm"]:
            continue
        k, v = statistics.median(s["kvr"]), statistics.median(s["vllm"])
        fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        out.append(f"| {dtype} | {n} | {k:.2f} s ({fmt(s['kvr'])}) | {v:.2f} s ({fmt(s['vllm'])}) | {v / k:.2f} | "
                   f"{verdict(v / k >= 1.1)} |")
    out += ["", "Decode: `vllm bench serve`, random 512-token prompts, 64 output tokens; TPOT p50. Target: kvr-serve's "
            "no worse than vLLM's. ShareGPT first turns (kvr-serve-bench, Poisson arrivals, 30 requests): TTFT p50; "
            "target no worse than vLLM's.", "",
            "| dtype | measure | kvr-serve | vLLM CPU | kvr / vLLM | target |", "|---|---|---:|---:|---:|---|"]
    for dtype_dir in sorted((HERE / "vs_vllm_load").glob("*")):
        for c in (1, 8):
            k = vbench(dtype_dir / "concurrency" / f"kvr-c{c}.json")
            v = vbench(dtype_dir / "concurrency" / f"vllm-c{c}.json")
            if k and v:
                kt, vt = k["median_tpot_ms"] / 1000, v["median_tpot_ms"] / 1000
                out.append(f"| {dtype_dir.name} | TPOT p50, {c} concurrent | {kt:.3f} s | {vt:.3f} s | "
                           f"{kt / vt:.2f} | {verdict(kt <= vt)} |")
        for rate in (0.25, 0.5):
            got = {}
            for who in ("kvr", "vllm"):
                path = dtype_dir / "sharegpt" / f"rate{rate}" / who / "summary.csv"
                if path.exists():
                    got[who] = float(next(csv.DictReader(path.open()))["ttft_short_p50_s"])
            if len(got) == 2:
                out.append(f"| {dtype_dir.name} | ShareGPT TTFT p50 at {rate}/s | {got['kvr']:.3f} s | "
                           f"{got['vllm']:.3f} s | {got['kvr'] / got['vllm']:.2f} | "
                           f"{verdict(got['kvr'] <= got['vllm'])} |")
    return out + [""]


def main() -> None:
    text = ["# The serving targets of the fast forward, from the raw rows", "",
            "Written by `python experiments/fast_forward/report_serving.py`; the rows carry their command, machine "
            "and commit.", "", *decode_section(), *chunks_section(), *startup_section(), *vllm_section()]
    (HERE / "serving.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
