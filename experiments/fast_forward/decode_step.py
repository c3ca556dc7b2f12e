"""One decode step of the server's batch decoder (serve/decode.BatchDecoder) on SmolLM2-135M in one process:
8 requests of unequal contexts (150 to 1550 tokens) against one request, through the unpadded rows (each row
attends its own K,V) and through the left-padded batch (the path before, kept for models whose attention cannot
be plugged), eager and compiled, float32 and bfloat16. Steps alternate between the settings' decoders, so every
median sees the same machine. Writes decode_step.jsonl beside this file.

    python experiments/fast_forward/decode_step.py [--threads 1] [--steps 12] [--compile]
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

from kvrunahead.model.compiled import compile_model
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.load import load_model
from kvrunahead.provenance import environment, machine
from kvrunahead.serve.step.batch_decode import BatchDecoder

HERE = Path(__file__).parent
CONTEXTS = [150 + 200 * i for i in range(8)]  # 150, 350, ..., 1550


def filled(model, n: int, seed: int) -> DynamicCache:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
    cache = DynamicCache(config=model.config)
    last_token_logits(model, ids, cache)
    return cache


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", getattr(torch, args.dtype), torch.device("cpu"))
    model = lm.model
    layout = probe_kv_layout(model)
    if args.compile:
        compile_model(model)
    caches = [filled(model, n, i) for i, n in enumerate(CONTEXTS)]
    env = environment("smollm2-135m", "none", args.threads, "none")
    batches = {"8 rows": list(range(8)), "1 row (150)": [0], "1 row (750)": [3], "1 row (1550)": [7]}
    decoders = {}
    for path, layout_arg in (("unpadded", layout), ("padded", None)):
        for name, members in batches.items():
            d = BatchDecoder(model, batched=True, layout=layout_arg)
            for i in members:  # each decoder its own copy of the requests' K,V: steps grow them
                c = DynamicCache(config=model.config)
                for layer, src in enumerate(caches[i].layers):
                    c.update(src.keys.clone(), src.values.clone(), layer)
                d.add(f"r{i}", c)
            decoders[(path, name)] = (d, members)
    times: dict = {k: [] for k in decoders}
    for step in range(args.steps + 2):  # 2 warm-up steps (the padded batch is built in the first)
        for key, (d, members) in decoders.items():
            tokens = {f"r{i}": 1000 + step for i in members}
            positions = {f"r{i}": CONTEXTS[i] + step for i in members}
            t0 = time.perf_counter()
            d.step(tokens, positions)
            if step >= 2:
                times[key].append(time.perf_counter() - t0)
    for (path, name), ts in times.items():
        row = {**env, "machine": machine(), "dtype": args.dtype, "compiled": args.compile, "path": path,
               "batch": name, "contexts": [CONTEXTS[i] for i in batches[name]], "median_s": statistics.median(ts),
               "times_s": ts, "command": "python experiments/fast_forward/decode_step.py " + " ".join(sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d")}
        with (HERE / "decode_step.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{args.dtype} {'compiled' if args.compile else 'eager'} {path:<9} {name:<13} "
              f"{row['median_s'] * 1e3:7.1f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
