"""One long request at a time against kvr-serve and vLLM CPU, the servers taking turns round by round (one server up
at a time: an idle server beside the other would take CPU). Each round sends both servers the same token ids (a
new window of the shipped text per round and length, so no server's prefix cache sees a prompt twice), greedy,
8 tokens, streamed; TTFT is the client's (request sent to the first chunk with a choice).

Servers, all on both cores of this machine, SmolLM2-135M-Instruct float32 (the folder install.sh prints):
- ``kvr``: ``kvr-serve --nproc 2 --threads 1`` (YaRN x2 only on prompts beyond the 8192 trained positions);
- ``vllm``: vLLM CPU, ``--max-model-len 8448``, no RoPE override (the prompts up to 8k);
- ``vllm-yarn``: vLLM CPU with ``--hf-overrides`` YaRN x2 over 8192 and ``--max-model-len 16640`` (the 16k prompt,
  as kvr-serve extends it).
- ``kvr-bench``: no server: ``kvr-bench --modes kvr-default --nproc 2 --threads 1`` at the same length, one warm-up
  and one timed run (its TTFT: the chain's alone, what the server's path to a first token is measured against).
vLLM runs with ``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (both cores for the model) and
prefix caching off; the family ``vllm-reserved`` (``vllm-reserved``, ``vllm-yarn-reserved``) keeps vLLM's default,
one core kept for its API process.

Resumable: a (round, server, tokens) already in rows.jsonl is skipped; a server with nothing left in a round is not
started. Usage: python experiments/serve_vs_vllm/single.py [--rounds 3] [--lengths 4096,8184,16376]
       [--servers kvr,vllm,vllm-reserved] [--first-round N]   (families; the order rotates round by round)
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvrunahead.bench.peers import FAMILIES, Server, one, prompt_ids, server_for
from kvrunahead.provenance import machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROWS = HERE / "rows.jsonl"


def run(rounds: int, lengths: list[int], families: list[str], first: int = 1, dtype: str = "float32",
        kvr_args: tuple[str, ...] = ()) -> None:
    rows = map(json.loads, ROWS.read_text().splitlines()) if ROWS.exists() else ()
    done = {(r["round"], r["server"], r["tokens"], r.get("dtype", "float32"), r.get("kvr_args", "")) for r in rows}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for rnd in range(first, rounds + 1):
        shift = (rnd - 1) % len(families)  # the order rotates round by round
        for family in families[shift:] + families[:shift]:
            if family == BENCH:
                for tokens in lengths:
                    if (rnd, BENCH, tokens, dtype, "") not in done:
                        record(rnd, BENCH, tokens, dtype, (), bench_ttft(tokens, dtype), commit)
                continue
            servers = {}
            for tokens in lengths:
                if (rnd, server_for(tokens, family), tokens, dtype, " ".join(kvr_args) * (family == "kvr")) not in done:
                    servers.setdefault(server_for(tokens, family), []).append(tokens)
            for server, todo in servers.items():
                up = Server(server, 8301, kvr_args if server == "kvr" else (), dtype, log_dir=HERE)
                try:
                    one(up.url, prompt_ids(512, 99))  # warm-up: the first request pays the weights' first touch
                    for tokens in todo:
                        record(rnd, server, tokens, dtype, kvr_args, one(up.url, prompt_ids(tokens, rnd)), commit)
                finally:
                    up.stop()


def record(rnd: int, server: str, tokens: int, dtype: str, kvr_args: tuple[str, ...], measured: dict,
           commit: str) -> None:
    row = {"round": rnd, "server": server, "tokens": tokens, "dtype": dtype,
           "kvr_args": " ".join(kvr_args) * (server == "kvr"), **measured, "machine": machine(), "commit": commit,
           "command": "python experiments/serve_vs_vllm/single.py " + shlex.join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d")}
    with ROWS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: row.get(k) for k in ("round", "server", "tokens", "ttft_s", "text")}), flush=True)


BENCH = "kvr-bench"


def bench_ttft(tokens: int, dtype: str) -> dict:
    """The chain's TTFT at ``tokens`` from kvr-bench (one warm-up, one timed run; its default partition)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(["kvr-bench", "--ctx", str(tokens), "--modes", "kvr-default", "--nproc", "2", "--threads", "1",
                        "--repeats", "1", "--warmup", "1", "--dtype", dtype, "--allow-long-context", "--timeout",
                        "1800", "--out", out], check=True, cwd=ROOT, capture_output=True)
        row = next(csv.DictReader((Path(out) / "summary.csv").open()))
    return {"ttft_s": float(row["ttft_median_s"]), "boundaries": row["boundaries"], "text": ""}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    # 8 tokens short of 8192 and 16384: the 8 new tokens stay within the positions each server's rotary table
    # covers (vLLM CPU's engine dies decoding past them, README)
    parser.add_argument("--lengths", default="4096,8184,16376")
    parser.add_argument("--servers", default="kvr,vllm", help=f"families, of {', '.join((*FAMILIES, BENCH))}")
    parser.add_argument("--first-round", type=int, default=1, help="rounds from this one to --rounds")
    parser.add_argument("--rows", default=str(ROWS), help="the rows file (resumed from)")
    parser.add_argument("--dtype", default="float32", help="both servers' (rows record it)")
    parser.add_argument("--kvr-args", default="", help="more kvr-serve options, e.g. --compile (rows record them)")
    args = parser.parse_args()
    families = args.servers.split(",")
    if not set(families) <= {*FAMILIES, BENCH}:
        parser.error(f"--servers takes {', '.join((*FAMILIES, BENCH))}")
    ROWS = Path(args.rows)
    run(args.rounds, [int(x) for x in args.lengths.split(",")], families, args.first_round, args.dtype,
        tuple(shlex.split(args.kvr_args)))
    sys.exit(0)
