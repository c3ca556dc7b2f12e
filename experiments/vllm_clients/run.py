"""Issue 46's targets on ``kvr-serve --nproc 2`` (SmolLM2-135M-Instruct, 1 thread per rank): ``n = 4`` against
``n = 1`` on a 4k-token prompt, interleaved. Each request is answered whole with ``max_tokens: 1``, so its time is
that of every choice's first token; every prompt is new to the server (a different 4k-token window of the shipped
text per request), so each request's first choice prefills the whole prompt and only the other choices can find it
in the prefix cache. Rows: the request's wall time, its first choice's TTFT (the server's figure), the prompt tokens
the prefix cache gave (from /metrics, before and after).

Resumable: a (round, n) already in rows.jsonl is skipped. Then summary.md (medians, the ratio per round).
Usage: python experiments/vllm_clients/run.py [--rounds 5] [--summary]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROWS = HERE / "rows.jsonl"
MODEL = "smollm2-135m"
CONTEXT = 4096


def start_server() -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen(["kvr-serve", "--nproc", "2", "--threads", "1", "--port", "0", "--model", MODEL],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), cwd="/tmp")
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for line in list(lines):
            if m := re.search(r"serving \S+ on (http://\S+)/v1", line):
                return proc, m.group(1), lines
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("kvr-serve did not start:\n" + "".join(lines))


def prompt_ids(url: str, k: int) -> list[int]:
    """A 4k-token window of the shipped text, starting further in for each k: no two requests share a start."""
    text = (ROOT / "kvrunahead/data/declaration.txt").read_text()
    ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text * 8}, timeout=60).json()["tokens"]
    start = 1 + 97 * k
    return ids[:1] + ids[start:start + CONTEXT - 1]


def cached_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    name = "kvr_prefix_cached_tokens_total"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def one(url: str, ids: list[int], n: int, seed: int) -> dict:
    before = cached_tokens(url)
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "n": n, "max_tokens": 1,
                                                  "temperature": 1.0, "seed": seed}, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return {"wall_s": wall, "first_choice_ttft_s": out["kvrunahead"]["ttft_s"], "choices": len(out["choices"]),
            "prompt_tokens": out["usage"]["prompt_tokens"], "cached_tokens": cached_tokens(url) - before}


def run(rounds: int) -> None:
    done = {(r["round"], r["n"]) for r in map(json.loads, ROWS.read_text().splitlines())} if ROWS.exists() else set()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    proc, url, _ = start_server()
    try:
        one(url, prompt_ids(url, 999), 1, 0)  # warm-up: the first request pays the weights' first touch
        for rnd in range(1, rounds + 1):
            order = (1, 4) if rnd % 2 else (4, 1)  # interleaved, the order alternating
            for n in order:
                if (rnd, n) in done:
                    continue
                row = {"round": rnd, "n": n, **one(url, prompt_ids(url, 2 * rnd + (n == 4)), n, rnd),
                       "context": CONTEXT, "model": MODEL, "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "commit": commit,
                       "command": "python experiments/vllm_clients/run.py", "date": time.strftime("%Y-%m-%d")}
                with ROWS.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def summary() -> None:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    by = {(r["round"], r["n"]): r for r in rows}
    rounds = sorted({r for r, _ in by if (r, 1) in by and (r, 4) in by})
    ratios = [by[(r, 4)]["wall_s"] / by[(r, 1)]["wall_s"] for r in rounds]
    med = {n: statistics.median(by[(r, n)]["wall_s"] for r in rounds) for n in (1, 4)}
    lines = ["# n = 4 against n = 1 on a 4k prompt (kvr-serve --nproc 2, SmolLM2-135M, 1 thread per rank)", "",
             f"Rounds: {len(rounds)}, interleaved. Commit {rows[-1]['commit']}, {rows[-1]['date']}.", "",
             "| round | n = 1 wall s | n = 4 wall s | ratio | n = 4 cached prompt tokens |",
             "|---:|---:|---:|---:|---:|"]
    for r, ratio in zip(rounds, ratios):
        lines.append(f"| {r} | {by[(r, 1)]['wall_s']:.3f} | {by[(r, 4)]['wall_s']:.3f} | {ratio:.3f} | "
                     f"{by[(r, 4)]['cached_tokens']:.0f} |")
    target = statistics.median(ratios) <= 1.05
    lines += ["", f"Medians: n = 1 {med[1]:.3f} s, n = 4 {med[4]:.3f} s; median ratio {statistics.median(ratios):.3f} "
              f"(target: within 5%: {'met' if target else 'missed'})."]
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--summary", action="store_true")
    args = parser.parse_args()
    if not args.summary:
        run(args.rounds)
    summary()
    sys.exit(0)
