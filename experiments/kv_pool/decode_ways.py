"""One decode step of SmolLM2-135M's rows (``--model``: another model's) in the server's decoder
(serve/step/batch_decode.BatchDecoder, paged) four ways, in one process, the ways taking turns step by step: through
the model's forward (``forward``, as every step ran before model/direct_rows.py) or over its weights (``direct``),
each with the linears packed one by one or a layer's q, k, v and its gate, up packed together (``grouped``,
model/linears.PackedGroup). 2 threads (the front's), one row over 1024 positions, 8 rows of 150-1550 and 32 rows of
512; float32 and bfloat16. One JSON row per dtype, batch and way (the median step) to decode_ways.jsonl beside this
file.

    python experiments/kv_pool/decode_ways.py [--steps 30] [--dtypes float32,bfloat16] [--model M] [--batches B,..]
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

from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.linears import groups, prepack, unpack
from kvrunahead.model.load import load_model
from kvrunahead.model.paged import PagedKV
from kvrunahead.provenance import environment, machine
from kvrunahead.serve.step.batch_decode import BatchDecoder

ROWS = Path(__file__).with_name("decode_ways.jsonl")
BATCHES = {"1 row (1024)": [1024], "8 rows (150-1550)": [150 + 200 * i for i in range(8)],
           "32 rows (512)": [512] * 32}


def decoder(model, contexts: list[int], direct: bool) -> BatchDecoder:
    layout = probe_kv_layout(model)
    d = BatchDecoder(model, batched=True, layout=layout, kv=PagedKV(layout, sum(contexts) // 16 + 200, layout.dtype))
    d.direct = direct and d.direct
    g = torch.Generator().manual_seed(len(contexts))
    for i, n in enumerate(contexts):
        cache = DynamicCache(config=model.config)
        last_token_logits(model, torch.randint(0, model.config.vocab_size, (1, n), generator=g), cache)
        d.add(f"r{i}", cache)
    return d


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default=",".join(BATCHES), help="which of BATCHES, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(2)
    base = {**environment(args.model, "none", 2, "none"), "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python experiments/kv_pool/decode_ways.py " + " ".join(sys.argv[1:])}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        models = {}
        for grouped in (False, True):
            model = load_model(args.model, dtype, torch.device("cpu")).model
            unpack(model)
            prepack(model, group=grouped)
            models[grouped] = model
        for batch in args.batches.split(","):
            contexts = BATCHES[batch]
            ways = {f"{'direct' if direct else 'forward'}{', grouped' if grouped else ''}":
                    decoder(models[grouped], contexts, direct) for direct in (False, True) for grouped in (False, True)}
            times: dict[str, list[float]] = {w: [] for w in ways}
            for step in range(args.steps + 2):  # 2 warm-up steps
                order = list(ways) if step % 2 else list(ways)[::-1]
                for way in order:
                    d = ways[way]
                    t0 = time.perf_counter()
                    d.step({f"r{i}": 1000 + step for i in range(len(contexts))},
                           {f"r{i}": n + step for i, n in enumerate(contexts)})
                    if step >= 2:
                        times[way].append(time.perf_counter() - t0)
            for way, ts in times.items():
                row = {**base, "model": args.model, "dtype": name, "batch": batch, "way": way,
                       "direct_taken": ways[way].direct,
                       "grouped_taken": bool(groups(ways[way].model)),
                       "step_s": statistics.median(ts), "times_s": ts}
                with ROWS.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name:<9} {batch:<18} {way:<18} {row['step_s'] * 1e3:7.1f} ms", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
