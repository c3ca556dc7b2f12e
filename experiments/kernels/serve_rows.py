"""Decode rows through `kvr-serve --nproc 2` as a user starts it: one stream alone, then 8 streams of unequal
prompts (150-1550 tokens) at once, time per output token from the streamed tokens. The target: 8 rows cost at most
1.5x one row. Servers for float32 and bfloat16, on our attention kernel and on torch's, alternate round by round.

Appends one row per server and round to serve_rows.jsonl, then prints the medians.

    python experiments/kernels/serve_rows.py [--rounds 2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvrunahead.provenance import environment, machine
from kvrunahead.ranks.launcher import free_port

HERE = Path(__file__).parent
ROWS_FILE = HERE / "serve_rows.jsonl"
LENGTHS = [150 + 200 * i for i in range(8)]  # 150, 350, ..., 1550
SETTINGS = [("float32", "ours"), ("bfloat16", "ours"), ("float32", "torch"), ("bfloat16", "torch")]


def stream(url: str, length: int, tokens: int, seed: int) -> dict:
    """One streamed greedy request of ``length`` prompt tokens; its token times."""
    prompt = [(seed * 7919 + i * 104729) % 30000 + 100 for i in range(length)]
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"ttft": times[0] - start, "tpot": (times[-1] - times[0]) / max(1, len(times) - 1), "tokens": len(times)}


def concurrent(url: str, lengths: list[int], tokens: int) -> list[dict]:
    out: list = [None] * len(lengths)

    def one(i: int) -> None:
        out[i] = stream(url, lengths[i], tokens, i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(lengths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serve(dtype: str, kernel: str, port: int) -> subprocess.Popen:
    cmd = ["kvr-serve", "--nproc", "2", "--port", str(port), "--dtype", dtype, "--attention-kernel", kernel,
           "--prefix-cache-tokens", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"kvr-serve exited {proc.returncode}: {' '.join(cmd)}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("kvr-serve did not answer /health in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    env = environment("smollm2-135m", "torch", 1, "loopback")
    done = set()
    if ROWS_FILE.exists():
        done = {(r["round"], r["dtype"], r["kernel"]) for r in map(json.loads, ROWS_FILE.read_text().splitlines())
                if r["commit"] == env["commit"]}
    for rnd in range(args.rounds):
        for dtype, kernel in SETTINGS:
            if (rnd, dtype, kernel) in done:
                continue
            port = free_port()
            proc = serve(dtype, kernel, port)
            try:
                url = f"http://127.0.0.1:{port}"
                stream(url, 64, 8, 99)  # warm-up
                alone = [stream(url, n, args.tokens, i) for i, n in ((0, LENGTHS[0]), (7, LENGTHS[7]))]
                eight = concurrent(url, LENGTHS, args.tokens)
            finally:
                proc.terminate()
                proc.wait(60)
            one = statistics.median(r["tpot"] for r in alone)
            many = statistics.median(r["tpot"] for r in eight)
            row = {**env, "machine": machine(), "round": rnd, "dtype": dtype, "kernel": kernel,
                   "command": "python experiments/kernels/serve_rows.py " + " ".join(sys.argv[1:]),
                   "server": f"kvr-serve --nproc 2 --dtype {dtype} --attention-kernel {kernel} --prefix-cache-tokens 0",
                   "date": time.strftime("%Y-%m-%d"), "tpot_one_row_s": one, "tpot_eight_rows_s": many,
                   "ratio": many / one, "alone": alone, "eight": eight}
            with ROWS_FILE.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"round {rnd} {dtype:<9} {kernel:<6} one row {one * 1e3:6.1f} ms  eight {many * 1e3:6.1f} ms  "
                  f"{many / one:.2f}x", file=sys.stderr)


if __name__ == "__main__":
    main()
