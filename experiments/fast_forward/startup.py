"""kvr-serve's start-up and first requests, eager and compiled (inductor's cache empty, then filled by the run
before): seconds from the command to /health answering (serve_vs_vllm/single.py's Server), then two 1024-token
prompts' latencies (8 new tokens each), then two of 2048 tokens (a new length: does a compiled server compile
again?). Each setting is a fresh `kvr-serve --nproc 2` on port 8311, loopback only. Rows to startup.jsonl.

    python experiments/fast_forward/startup.py [--dtype float32] [--rows FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import httpx

from kvrunahead.bench.peers import MODEL, Server, prompt_ids
from kvrunahead.provenance import environment, machine

HERE = Path(__file__).resolve().parent

PORT = 8311
CACHE = Path("/tmp/kvr-fast-forward-cache")


def one(url: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0},
                   timeout=1800)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default=str(HERE / "startup.jsonl"), help="the rows file (appended to)")
    args = ap.parse_args()
    env = environment("smollm2-135m", "torch", 1, "loopback")
    shutil.rmtree(CACHE, ignore_errors=True)
    for setting, flag in (("eager", ()), ("compiled, cache empty", ("--compile",)),
                          ("compiled, cache filled", ("--compile",))):
        t0 = time.perf_counter()
        up = Server("kvr", PORT, flag, args.dtype, env={"KVR_CACHE": str(CACHE)}, log_dir=HERE)
        try:
            row = {**env, "machine": machine(), "setting": setting, "dtype": args.dtype, "command": up.command,
                   "start_s": time.perf_counter() - t0}
            for i, tokens in enumerate((1024, 2048)):
                row[f"first_{tokens}_s"] = one(up.url, prompt_ids(tokens, 2 * i))
                row[f"second_{tokens}_s"] = one(up.url, prompt_ids(tokens, 2 * i + 1))
            row["date"] = time.strftime("%Y-%m-%d %H:%M")
            with Path(args.rows).open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: row[k] for k in row if k.endswith("_s") or k == "setting"}), file=sys.stderr)
        finally:
            up.stop()


if __name__ == "__main__":
    main()
