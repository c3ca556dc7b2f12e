"""kvr-serve's start-up and first requests, eager and compiled (inductor's cache empty, then filled by the run
before): seconds from the command to /health answering, then a 1024-token prompt's latency (8 new tokens) twice,
then the same for a 2048-token prompt (a new length: does a compiled server compile again?). Each setting is a
fresh `kvr-serve --nproc 2` on port 8311, loopback only. Writes startup.jsonl beside this file.

    python experiments/fast_forward/startup.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrunahead.provenance import environment, machine

HERE = Path(__file__).parent
PORT = 8311
CACHE = Path("/tmp/kvr-fast-forward-cache")
START_S = 1800


def prompt(tokens: int) -> list[int]:
    from kvrunahead.model.load import load_tokenizer

    text = (HERE.parents[1] / "kvrunahead/data/declaration.txt").read_text()
    ids = load_tokenizer("smollm2-135m").encode(text * 8, add_special_tokens=False)
    return ids[:tokens]


def one(url: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2-135m", "prompt": ids, "max_tokens": 8,
                                                   "temperature": 0}, timeout=START_S)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    env = environment("smollm2-135m", "torch", 1, "loopback")
    shutil.rmtree(CACHE, ignore_errors=True)
    for setting, flag in (("eager", []), ("compiled, cache empty", ["--compile"]),
                          ("compiled, cache filled", ["--compile"])):
        cmd = ["kvr-serve", "--nproc", "2", "--threads", "1", "--port", str(PORT), "--dtype", args.dtype, *flag]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=dict(os.environ, KVR_CACHE=str(CACHE)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{PORT}"
        try:
            while True:
                if proc.poll() is not None or time.perf_counter() - t0 > START_S:
                    raise SystemExit(f"kvr-serve ({setting}) did not come up")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            row = {**env, "machine": machine(), "setting": setting, "dtype": args.dtype, "command": " ".join(cmd),
                   "start_s": time.perf_counter() - t0}
            for tokens in (1024, 2048):
                ids = prompt(tokens)
                row[f"first_{tokens}_s"] = one(url, ids)
                row[f"second_{tokens}_s"] = one(url, ids[::-1])
            row["date"] = time.strftime("%Y-%m-%d")
            with (HERE / "startup.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: row[k] for k in row if k.endswith("_s") or k == "setting"}), file=sys.stderr)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)


if __name__ == "__main__":
    main()
