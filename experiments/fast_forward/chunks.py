"""A long prompt alone on an idle `kvr-serve --nproc 2`, whole against chunked at a step budget: its TTFT, and where a
chunked prefill's time goes (each chunk's own step seconds, from the response's ``kvrunahead.chunks``, against the
TTFT: what is left is the steps' set-up and the engine between them). The settings take turns round by round
(the first alternating), each a fresh server; one untimed 512-token request first. Rows to chunks.jsonl.

    python experiments/fast_forward/chunks.py [--rounds 2] [--lengths 8184,16376] [--budget-ms 500]
           [--dtype float32] [--kvr-args "--compile"] [--rows FILE]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrunahead.bench.peers import MODEL, Server, prompt_ids
from kvrunahead.provenance import machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

ROWS = HERE / "chunks.jsonl"


def ask(url: str, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0},
                   timeout=1800)
    r.raise_for_status()
    body = r.json()
    return {"e2e_s": time.perf_counter() - t0, "text": body["choices"][0]["text"], "kvrunahead": body["kvrunahead"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lengths", default="8184,16376")
    ap.add_argument("--budget-ms", type=float, default=500)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kvr-args", default="", help="more kvr-serve options for both settings")
    ap.add_argument("--rows", default=str(ROWS), help="the rows file (resumed from)")
    args = ap.parse_args()
    rows_file = Path(args.rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    common = shlex.split(args.kvr_args)
    settings = {"whole": common, f"chunked {args.budget_ms:g} ms": [*common, "--step-budget-ms", str(args.budget_ms)]}
    done = {(r["round"], r["setting"], r["tokens"], r["dtype"], r["kvr_args"])
            for r in map(json.loads, rows_file.read_text().splitlines())} if rows_file.exists() else set()
    for rnd in range(1, args.rounds + 1):
        order = list(settings) if rnd % 2 else list(settings)[::-1]
        for setting in order:
            todo = [n for n in map(int, args.lengths.split(","))
                    if (rnd, setting, n, args.dtype, args.kvr_args) not in done]
            if not todo:
                continue
            up = Server("kvr", 8302, tuple(settings[setting]), args.dtype, log_dir=HERE)
            try:
                ask(up.url, prompt_ids(512, 99))
                for n in todo:
                    got = ask(up.url, prompt_ids(n, rnd))
                    figures = got.pop("kvrunahead")
                    chunks = figures.get("chunks") or []
                    row = {"round": rnd, "setting": setting, "tokens": n, "dtype": args.dtype,
                           "kvr_args": args.kvr_args, "ttft_s": figures["ttft_s"], **got,
                           "chunks": len(chunks), "chunk_steps_s": sum(c["seconds"] for c in chunks),
                           "chunk_sizes": [c["end"] - c["start"] for c in chunks],
                           "chunk_seconds": [round(c["seconds"], 4) for c in chunks],
                           "chunk_predicted_s": [round(c["predicted_s"], 4) for c in chunks],
                           "machine": machine(), "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M"),
                           "command": "python experiments/fast_forward/chunks.py " + shlex.join(sys.argv[1:])}
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"round {rnd} {setting:<16} {n:>6} TTFT {row['ttft_s']:7.2f} s  chunks {len(chunks)}"
                          f" (their steps {row['chunk_steps_s']:.2f} s)", file=sys.stderr, flush=True)
            finally:
                up.stop()


if __name__ == "__main__":
    main()
