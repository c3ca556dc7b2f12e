"""kvr-serve and vLLM CPU under load, measured by both clients: ours (`kvr-serve-bench`) and vLLM's own
(`vllm bench serve`, run from vLLM's venv through vllm_cli.py). One server up at a time (an idle one beside the
other would take CPU), both with prefix caching off; within a part the servers take turns, the first one
alternating from part to part.

Parts (rows under load/<part>/; a piece whose result file exists is skipped, so a cut run resumes):
- ``sharegpt``: kvr-serve-bench, ShareGPT first turns (<= 2048 tokens, replies capped at 64 tokens), Poisson
  arrivals at 0.25 and 0.5 requests/s, 30 requests, chat completions.
- ``mixed``: the same with 5% long documents of 8k-16k tokens (16 new tokens), 80 requests at 0.25/s; vLLM serves
  it with YaRN x2 and --max-model-len 16640 (``vllm-yarn``), as the long documents need.
- ``vbench``: `vllm bench serve --dataset-name sharegpt` at 0.25 and 0.5 requests/s, 30 prompts, 64 output
  tokens, goodput under ttft:2000 tpot:200 (ms), TTFT/TPOT/ITL/E2EL percentiles 50, 90, 99.
- ``concurrency``: `vllm bench serve --dataset-name random`, 512 prompt tokens, 64 output tokens (ignore_eos), at
  1, 2, 4 and 8 concurrent requests (``--concurrency`` to choose; 2 x concurrency prompts, at least 4, after as
  many warm-up requests as the concurrency, at least 2: vLLM compiles its CPU kernels for new batch shapes on
  first use): decode TPOT at 1 and 8 and the Pareto front (output tokens/s per user against output tokens/s).

Usage: python experiments/serve_vs_vllm/load.py [PART ...] [--servers kvr,kvr-lars,kvr-tp2,vllm,vllm-reserved,vllm-tp2]
       [--seed N] [--concurrency 1,8] [--out DIR]
       (default: every part, kvr and vllm; ``vllm-reserved`` is vLLM's default placement, one core kept for its
       API process)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvrunahead.bench.peers import MODEL, VENV, Server, model_dir
from kvrunahead.provenance import machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

OUT = HERE / "load"
PORT = 8302
SHAREGPT_RATES = (0.25, 0.5)
CONCURRENCY = (1, 2, 4, 8)
PARTS = ("concurrency", "vbench", "sharegpt", "mixed")


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def sharegpt_json() -> Path:
    """The shipped ShareGPT file's complete records as a valid JSON array (the package's file is cut in the middle
    of its last record, which vLLM's loader refuses): written once into the cache, not committed."""
    path = Path.home() / ".cache/kvrunahead/sharegpt-complete.json"
    if not path.exists():
        from kvrunahead.bench.serve_bench import open_sharegpt, read_json_records

        with open_sharegpt() as fp:
            records = read_json_records(fp, limit=20000).items
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.rename(path)
    return path


def vllm_bench(url: str, server: str, result: Path, args: list[str]) -> None:
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(VENV / "bin/python"), str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", model_dir(),
           "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--goodput", "ttft:2000", "tpot:200", "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name + ".tmp", "--metadata", f"server={server}", f"commit={commit()}",
           f"machine={machine()}", f"dtype={DTYPE}", *args]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd="/tmp", env=dict(os.environ, PYTHONUNBUFFERED="1"))
    (result.parent / (result.name + ".tmp")).rename(result)


# kvr-lars: kvr-serve with its long-context scheduling (Medha's chunked prefill at a 1000 ms step budget, least
# relative slack first): the short requests' tail traded for the long ones' TTFT (experiments/mixed_steps)
# kvr-tp2: kvr-serve's two ranks as one TP group (--tp 2: every decode step on both); vllm-tp2: vLLM's own -tp 2
KVR_OPTIONS = {"kvr-lars": ("--step-budget-ms", "1000", "--schedule", "lars"), "kvr-tp2": ("--tp", "2")}
FAMILIES = ("kvr", "kvr-lars", "kvr-tp2", "vllm", "vllm-reserved", "vllm-tp2")
LEVELS = CONCURRENCY  # --concurrency: the levels the concurrency part runs
SEED = 0  # --seed: another draw of kvr-serve-bench's prompts, arrivals and long documents (folders <part>-seedN)
DTYPE = "float32"  # --dtype: both servers'


def our_bench(url: str, server: str, out: Path, args: list[str]) -> None:
    cmd = ["kvr-serve-bench", "--base-url", f"{url}/v1", "--label", server, "--out", str(out), "--resume",
           "--tokenizer", MODEL, "--seed", str(SEED), *args]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    (out / "done").write_text(commit() + "\n")


def folder(part: str) -> str:
    return part if SEED == 0 else f"{part}-seed{SEED}"


def pieces(part: str, who: str) -> tuple[list[tuple[Path, Callable[[str], None]]], str]:
    """(result file, how to make it) for every piece of a part still to run on one family, and its server."""
    server = who.replace("vllm", "vllm-yarn") if part == "mixed" else who
    todo = []
    if part == "concurrency":
        for c in LEVELS:
            todo.append((OUT / part / f"{who}-c{c}.json", lambda url, c=c: vllm_bench(
                url, server, OUT / part / f"{who}-c{c}.json",
                ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64",
                 "--ignore-eos", "--max-concurrency", str(c), "--num-prompts", str(max(4, 2 * c)),
                 "--num-warmups", str(max(2, c)), "--request-rate", "inf"])))
    elif part == "vbench":
        for rate in SHAREGPT_RATES:
            todo.append((OUT / part / f"{who}-rate{rate}.json", lambda url, rate=rate: vllm_bench(
                url, server, OUT / part / f"{who}-rate{rate}.json",
                ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_json()), "--num-prompts", "30",
                 "--sharegpt-output-len", "64", "--request-rate", str(rate)])))
    elif part == "sharegpt":
        for rate in SHAREGPT_RATES:
            out = OUT / folder(part) / f"rate{rate}" / who
            todo.append((out / "done", lambda url, rate=rate, out=out: our_bench(
                url, server, out, ["--rate", str(rate), "--requests", "30", "--duration", "150", "--long-share",
                                   "0", "--max-tokens-cap", "64", "--timeout", "300"])))
    elif part == "mixed":
        out = OUT / folder(part) / "rate0.25" / who
        todo.append((out / "done", lambda url, out=out: our_bench(
            url, server, out, ["--rate", "0.25", "--requests", "80", "--duration", "320", "--long-share", "0.05",
                               "--long-tokens", "8k-16k", "--long-max-tokens", "16", "--max-tokens-cap", "64",
                               "--timeout", "600"])))
    return [(path, make) for path, make in todo if not path.exists()], server


def main(parts: list[str], families: list[str]) -> None:
    for i, part in enumerate(parts):
        order = families if i % 2 == 0 else families[::-1]
        for who in order:
            todo, server = pieces(part, who)
            if not todo:
                continue
            t0 = time.monotonic()
            # prefix caching off on both (vLLM runs with --no-enable-prefix-caching): the seeded clients send the
            # same prompts at each rate and concurrency, which a prefix cache would answer from the last piece
            up = Server("kvr" if who.startswith("kvr") else server, PORT,
                        ("--prefix-cache-tokens", "0", *KVR_OPTIONS.get(who, ())), DTYPE, log_dir=HERE)
            print(f"[{part}] {server} up in {time.monotonic() - t0:.0f} s", flush=True)
            try:
                for _, make in todo:
                    make(up.url)
            finally:
                up.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="kvr-serve and vLLM CPU under load (see the module's text).")
    parser.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--servers", default="kvr,vllm",
                        help="families: kvr, kvr-lars (chunked prefill and LARS), kvr-tp2 (--tp 2), vllm (both "
                             "cores), vllm-reserved (vLLM's default placement), vllm-tp2 (vLLM's -tp 2)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="the concurrency part's levels")
    parser.add_argument("--seed", type=int, default=0, help="kvr-serve-bench's seed (sharegpt, mixed); N > 0 writes "
                        "<part>-seedN/")
    parser.add_argument("--dtype", default="float32", help="both servers' dtype")
    parser.add_argument("--out", default=str(OUT), help="the folder of the parts' results (resumed from)")
    args = parser.parse_args()
    SEED, DTYPE, OUT = args.seed, args.dtype, Path(args.out).resolve()  # vllm bench runs from /tmp
    LEVELS = tuple(int(c) for c in args.concurrency.split(","))
    families = args.servers.split(",")
    if not set(args.parts) <= set(PARTS):
        parser.error(f"parts: {', '.join(PARTS)}")
    if not set(families) <= set(FAMILIES):
        parser.error(f"--servers takes {', '.join(FAMILIES)}")
    main(args.parts or list(PARTS), families)
