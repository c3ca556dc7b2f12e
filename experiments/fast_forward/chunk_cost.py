"""What a chunk's tokens cost: SmolLM2-135M in one process, ``n`` new tokens after ``S`` positions through the split
attention a chain chunk runs (modes/kvr.py), at 1 thread (a rank of the chain, which gets half a chunk) and 2
threads (the front alone with both cores); the median of 3 after a warm-up. Rows to chunk_cost.jsonl.

    python experiments/fast_forward/chunk_cost.py [--dtype float32] [--prefix 6000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvrunahead.model.attention import attention_mode
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.load import load_model
from kvrunahead.modes.kvr import SPLIT
from kvrunahead.provenance import environment, machine

HERE = Path(__file__).parent


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix", type=int, default=6000)
    args = ap.parse_args()
    model = load_model("smollm2-135m", getattr(torch, args.dtype), torch.device("cpu")).model
    ids = torch.randint(0, 1000, (1, args.prefix + 400), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(2)
    prefix = DynamicCache(config=model.config)
    last_token_logits(model, ids[:, :args.prefix], prefix)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in (25, 50, 100, 200, 400):
            times = []
            for _ in range(4):
                cache = DynamicCache(config=model.config)
                for layer, kv in enumerate(prefix.layers):
                    cache.update(kv.keys, kv.values, layer)
                with attention_mode(model, SPLIT, None):
                    t0 = time.perf_counter()
                    last_token_logits(model, ids[:, args.prefix:args.prefix + n], cache)
                    times.append(time.perf_counter() - t0)
            median = statistics.median(times[1:])
            row = {**environment("smollm2-135m", "none", threads, "none"), "machine": machine(), "dtype": args.dtype,
                   "prefix": args.prefix, "tokens": n, "threads": threads, "median_s": median,
                   "ms_per_token": 1e3 * median / n, "times_s": times[1:],
                   "command": "python experiments/fast_forward/chunk_cost.py " + " ".join(sys.argv[1:]),
                   "date": time.strftime("%Y-%m-%d %H:%M")}
            with (HERE / "chunk_cost.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{args.dtype} {threads} thread(s): {n} tokens after {args.prefix}: {median * 1e3:.0f} ms, "
                  f"{row['ms_per_token']:.2f} ms a token", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
