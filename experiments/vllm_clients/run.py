"""Issue 46's targets on ``kvr-serve --nproc 2`` (SmolLM2-135M-Instruct, 1 thread per rank), each a pair of request
kinds on a 4k-token prompt, interleaved (the order alternating by round):

- ``--pair n``: ``n = 4`` against ``n = 1`` (``temperature: 1``); rows.jsonl, summary.md.
- ``--pair n32``: the same with 32 tokens per choice (``max_tokens: 32, ignore_eos: true``): the other choices
  decode beside the first, forked from its prompt's K,V; rows_n32.jsonl, summary_n32.md.
- ``--pair echo``: lm-eval's loglikelihood request (``echo: true, logprobs: 1``: the prompt's log-probabilities,
  every position scored) against the same request without them; rows_echo.jsonl, summary_echo.md.

Each request but n32's is answered whole with ``max_tokens: 1``, so its time is that of every choice's first
token; every prompt is new to the server (a different 4k-token window of the shipped text per request), so each
request's first choice prefills the whole prompt and only the other choices of ``n`` can find it in the prefix
cache. Rows: the request's wall time, its first choice's TTFT (the server's figure), the prompt tokens the prefix
cache gave (from /metrics, before and after).

Resumable: a (round, arm) already in the rows is skipped. Then the summary (medians, the ratio per round).
Usage: python experiments/vllm_clients/run.py [--pair n|n32|echo] [--rounds 5] [--summary]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvrunahead.provenance import machine

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


PAIRS = {  # pair -> (base arm, arm, rows, summary, what the arm asks beside the base's body, the base's tokens)
    "n": ("n1", "n4", "rows.jsonl", "summary.md", {"n": 4}, {"max_tokens": 1}),
    "n32": ("n1", "n4", "rows_n32.jsonl", "summary_n32.md", {"n": 4}, {"max_tokens": 32, "ignore_eos": True}),
    "echo": ("plain", "scored", "rows_echo.jsonl", "summary_echo.md", {"echo": True, "logprobs": 1},
             {"max_tokens": 1}),
}


def one(url: str, ids: list[int], extra: dict, seed: int) -> dict:
    before = cached_tokens(url)
    body = {"model": MODEL, "prompt": ids, "temperature": 1.0, "seed": seed, **extra}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    logprobs = out["choices"][0].get("logprobs")
    return {"wall_s": wall, "first_choice_ttft_s": out["kvrunahead"]["ttft_s"], "choices": len(out["choices"]),
            "prompt_tokens": out["usage"]["prompt_tokens"], "cached_tokens": cached_tokens(url) - before,
            "scored_tokens": sum(x is not None for x in logprobs["token_logprobs"]) if logprobs else 0}


def arm_of(row: dict) -> str:
    return row.get("arm") or f"n{row['n']}"  # the first rows (commit 9968c02) named the arm by n alone


def rows_of(pair: str) -> list[dict]:
    path = HERE / PAIRS[pair][2]
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(pair: str, rounds: int) -> None:
    base, arm, rows_name, _, extra, tokens = PAIRS[pair]
    done = {(r["round"], arm_of(r)) for r in rows_of(pair)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    proc, url, _ = start_server()
    try:
        one(url, prompt_ids(url, 999), tokens, 0)  # warm-up: the first request pays the weights' first touch
        for rnd in range(1, rounds + 1):
            for name in (base, arm) if rnd % 2 else (arm, base):
                if (rnd, name) in done:
                    continue
                asks = {**tokens, **(extra if name == arm else {})}
                row = {"round": rnd, "arm": name, **asks, **one(url, prompt_ids(url, 2 * rnd + (name == arm)), asks,
                                                                  rnd),
                       "context": CONTEXT, "model": MODEL, "machine": machine(),
                       "cpus": os.cpu_count(), "commit": commit,
                       "command": f"python experiments/vllm_clients/run.py --pair {pair}",
                       "date": time.strftime("%Y-%m-%d")}
                with (HERE / rows_name).open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def summary(pair: str) -> None:
    base, arm, _, summary_name, extra, tokens = PAIRS[pair]
    rows = rows_of(pair)
    by = {(r["round"], arm_of(r)): r for r in rows}
    rounds = sorted({r for r, _ in by if (r, base) in by and (r, arm) in by})
    keys = ("wall_s", "first_choice_ttft_s")
    ratios = {key: [by[(r, arm)][key] / by[(r, base)][key] for r in rounds] for key in keys}
    med = {(name, key): statistics.median(by[(r, name)][key] for r in rounds)
           for name in (base, arm) for key in keys}
    commits = sorted({by[(r, name)]["commit"] for r in rounds for name in (base, arm)})
    lines = [f"# {arm} ({json.dumps(extra)}) against {base} on a 4k prompt, {json.dumps(tokens)} (kvr-serve "
             "--nproc 2, SmolLM2-135M, "
             "1 thread per rank)", "",
             f"Rounds: {len(rounds)}, interleaved. Commits {', '.join(commits)}; {rows[-1]['date']}.", "",
             f"| round | {base} wall s | {arm} wall s | wall ratio | {base} TTFT s | {arm} TTFT s | TTFT ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rounds):
        a, b = by[(r, base)], by[(r, arm)]
        lines.append(f"| {r} | {a['wall_s']:.3f} | {b['wall_s']:.3f} | {ratios['wall_s'][i]:.3f} | "
                     f"{a['first_choice_ttft_s']:.3f} | {b['first_choice_ttft_s']:.3f} | "
                     f"{ratios['first_choice_ttft_s'][i]:.3f} |")
    wall, ttft = statistics.median(ratios["wall_s"]), statistics.median(ratios["first_choice_ttft_s"])
    lines += ["", f"Medians: {base} {med[(base, 'wall_s')]:.3f} s wall ({med[(base, 'first_choice_ttft_s')]:.3f} s "
              f"TTFT), {arm} {med[(arm, 'wall_s')]:.3f} s wall ({med[(arm, 'first_choice_ttft_s')]:.3f} s TTFT); "
              f"median ratios: wall {wall:.3f}, TTFT {ttft:.3f} (target: within 5%: "
              f"{'met' if wall <= 1.05 else 'missed'})."]
    (HERE / summary_name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair", choices=sorted(PAIRS), default="n")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--summary", action="store_true")
    args = parser.parse_args()
    if not args.summary:
        run(args.pair, args.rounds)
    summary(args.pair)
    sys.exit(0)
