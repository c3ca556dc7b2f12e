"""One decode step of n requests on one 4k prompt (SmolLM2-135M, float32, one process): each request decoding on
a copy of the prompt's K,V of its own, against requests forked from the prefix cache's entry (the shared prompt's
blocks held by reference in the decoder's pool, model/paged.PagedKV.fork, each one's own tokens after them; until
the pool, serve/rows.ForkedKV read the shared prompt once per step for all of them).

Rows (fork_step.jsonl): per round and layout, the median of 6 timed steps (2 untimed before them). The layouts are
interleaved, the order rotating by round.

Usage: python experiments/vllm_clients/fork_step.py [--rounds 3] [--threads 2] [--context 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.provenance import machine
from kvrunahead.ranks.setup import loaded_model
from kvrunahead.serve.prefix_cache import PrefixCache
from kvrunahead.serve.step.batch_decode import BatchDecoder

HERE = Path(__file__).resolve().parent
LAYOUTS = {"1 copy": ["copy"], "4 copies": ["copy"] * 4, "1 fork": ["fork"], "4 forks": ["fork"] * 4,
           "1 copy + 3 forks": ["copy"] + ["fork"] * 3}


def step_ms(model, layout, prefixes, entry, n: int, kinds: list[str], steps: int = 8) -> float:
    """The median seconds (ms) of a decode step of ``kinds`` (a copy or a fork each), after 2 untimed."""
    decoder = BatchDecoder(model, batched=True, layout=layout)
    for i, kind in enumerate(kinds):
        decoder.add(f"r{i}", prefixes.cache_of(entry, n, model.config), fork=kind == "fork")
    tokens = {f"r{i}": 5 + i for i in range(len(kinds))}
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        decoder.step(tokens, {rid: n + s for rid in tokens})
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = loaded_model("smollm2-135m", torch.float32, torch.device("cpu"), 0).model
    layout = probe_kv_layout(model)
    ids = list(range(100, 100 + args.context))
    cache = DynamicCache(config=model.config)
    prefixes = PrefixCache(4 * args.context)
    prefixes.put(ids, cache, last_token_logits(model, torch.tensor([ids]), cache=cache))
    entry = prefixes.whole(ids)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    names = list(LAYOUTS)
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            row = {"round": rnd + 1, "layout": name, "step_ms": step_ms(model, layout, prefixes, entry, len(ids),
                                                                          LAYOUTS[name]),
                   "context": args.context, "threads": args.threads, "model": "smollm2-135m",
                   "machine": machine(), "cpus": os.cpu_count(), "commit": commit,
                   "command": f"python experiments/vllm_clients/fork_step.py --rounds {args.rounds} "
                              f"--threads {args.threads} --context {args.context}",
                   "date": time.strftime("%Y-%m-%d")}
            with (HERE / "fork_step.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
