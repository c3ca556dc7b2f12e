"""TP decode TPOT with the per-step plan on gloo against shared memory, beside ``--tp 1``: ``kvr-serve --nproc 2``
at ``--tp 1``, at ``--tp 2`` from another checkout whose front broadcasts each step's plan on gloo (``--old``), and
at ``--tp 2`` from this one (the plan in mesh.ShmMailbox). Each round starts each server in turn (the order rotating
from round to round), sends 2 warm-up requests, then at each concurrency ``2 x concurrency`` streamed greedy
requests of a 512-token prompt and 64 new tokens (ignore_eos); TPOT of a request is (last token - first token) /
63. A row per request goes to rows.jsonl; a round already there is skipped, so a cut run resumes.

Usage: python experiments/tp_vs_kvr/plan_channel.py --old /path/to/checkout [--rounds 3] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from kvrunahead.bench.peers import MODEL, Server, prompt_ids
from kvrunahead.provenance import machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PORT = 8311
NEW_TOKENS = 64


def command(tp: int, checkout: Path) -> tuple[list[str], dict]:
    args = [sys.executable, "-m", "kvrunahead.cli.serve", "--nproc", "2", "--tp", str(tp), "--threads", "1",
            "--port", str(PORT), "--model", MODEL, "--dtype", "float32", "--prefix-cache-tokens", "0"]
    return args, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(checkout))


def commit(checkout: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                          text=True).stdout.strip()


def one(api: openai.OpenAI, ids: list[int]) -> float:
    stamps = []
    stream = api.completions.create(model=MODEL, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.monotonic())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="a checkout whose --tp front broadcasts plans on gloo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--out", type=Path, default=HERE / "plan_channel")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows_path = a.out / "rows.jsonl"
    done = {(r["round"], r["server"]) for r in map(json.loads, rows_path.read_text().splitlines())} \
        if rows_path.exists() else set()
    servers = {"tp1": command(1, ROOT), "tp2-gloo-plan": command(2, a.old), "tp2-shm-plan": command(2, ROOT)}
    commits = {"tp1": commit(ROOT), "tp2-gloo-plan": commit(a.old), "tp2-shm-plan": commit(ROOT)}
    names = list(servers)
    levels = [int(c) for c in a.concurrency.split(",")]
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            if (rnd, name) in done:
                continue
            server = Server(name, PORT, log_dir=a.out, command=servers[name])
            try:
                api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="any", max_retries=0, timeout=600)
                for w in range(2):
                    one(api, prompt_ids(512, 100 + w))
                rows = []
                for c in levels:
                    prompts = [prompt_ids(512, rnd * 100 + i) for i in range(2 * c)]
                    with ThreadPoolExecutor(c) as pool:
                        tpots = list(pool.map(one, [api] * len(prompts), prompts))
                    rows += [{"round": rnd, "server": name, "concurrency": c, "tpot_s": t, "at": time.time(),
                              "command": server.command,
                              "commit": commits[name], "machine": machine()} for t in tpots]
            finally:
                server.stop()
            with open(rows_path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()]
    for c in levels:
        line = [f"concurrency {c}:"]
        for name in names:
            got = [r["tpot_s"] for r in rows if r["server"] == name and r["concurrency"] == c]
            if got:
                line.append(f"{name} {1e3 * statistics.median(got):.1f} ms (n={len(got)})")
        print("  ".join(line))


if __name__ == "__main__":
    main()
