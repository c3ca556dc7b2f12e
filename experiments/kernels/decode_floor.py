"""One decode step of the server's batch decoder (serve/decode.BatchDecoder, the unpadded rows kvr-serve runs) on
SmolLM2-135M in one process, against its floor: the bytes a step must read (every weight once, the LM head being
the tied embedding, plus the rows' K,V) over the read bandwidth measured on the same threads. float32 and
bfloat16, 1 and 2 threads (the front decodes on both cores while the worker waits: serve/rank.solo_threads), one
row over a 1024-token cache and 8 rows of 150-1550; the settings' steps interleave, so every median sees the same
machine. Appends to decode_floor.jsonl beside this file (one row per setting and round). ``--split``: instead, where
a step's time goes, on 2 threads: the linears', the attention kernel's and the K,V write's time by torch's profiler
over 5 steps, and the rest of the unprofiled step's median (the per-op work between them) to decode_split.jsonl.

    python experiments/kernels/decode_floor.py [--rounds 3] [--steps 10] [--split]
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

from kvrunahead.calibrate.timing import read_bandwidth
from kvrunahead.model.device import weight_bytes
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.load import load_model
from kvrunahead.provenance import environment, machine
from kvrunahead.serve.step.batch_decode import BatchDecoder

HERE = Path(__file__).parent
ROWS_FILE = HERE / "decode_floor.jsonl"
SPLIT_FILE = HERE / "decode_split.jsonl"
# torch's ops for each part of a step (the linears: oneDNN's packed where the server packs them, ATen's GEMMs here)
KERNELS = {"linears": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"), "attention": ("kvr::attention",),
           "kv_write": ("aten::index_copy_",)}
BATCHES = {"1 row (1024)": [1024], "8 rows (150-1550)": [150 + 200 * i for i in range(8)]}


def decoder(model, layout, contexts: list[int]) -> BatchDecoder:
    d = BatchDecoder(model, batched=True, layout=layout)
    g = torch.Generator().manual_seed(len(contexts))
    for i, n in enumerate(contexts):
        cache = DynamicCache(config=model.config)
        last_token_logits(model, torch.randint(0, model.config.vocab_size, (1, n), generator=g), cache)
        d.add(f"r{i}", cache)
    return d


def advance(s: dict, step: int, offset: int = 0) -> None:
    """One decode step of setting ``s``'s rows: token ``1000 + step`` at each row's next position (every setting's
    rows grow by one a step, whichever thread count runs it)."""
    s["decoder"].step({f"r{i}": 1000 + step for i in range(len(s["contexts"]))},
                      {f"r{i}": n for i, n in enumerate(s["next"])})
    s["next"] = [n + 1 for n in s["next"]]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--split", action="store_true", help="where a step's time goes (decode_split.jsonl)")
    args = ap.parse_args()
    env = environment("smollm2-135m", "none", 0, "none")
    base = {**env, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python experiments/kernels/decode_floor.py " + " ".join(sys.argv[1:])}
    settings = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model("smollm2-135m", dtype, torch.device("cpu")).model
        layout = probe_kv_layout(model)
        kv_per_token = sum(2 * h * d for h, d in zip(layout.heads, layout.head_dim)) * dtype.itemsize
        for name, contexts in BATCHES.items():
            settings[(dtype, name)] = {"decoder": decoder(model, layout, contexts), "contexts": contexts,
                                       "next": list(contexts),
                                       "bytes": weight_bytes(model) + kv_per_token * sum(contexts)}
    if args.split:
        split(settings, args.steps, base)
        return
    for rnd in range(args.rounds):
        bandwidth = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            bandwidth[t] = read_bandwidth(15)
        times: dict = {(key, t): [] for key in settings for t in (1, 2)}
        for step in range(args.steps + 2):  # 2 warm-up steps
            for (key, threads), ts in times.items():
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                advance(settings[key], step, rnd * (args.steps + 2))
                if step >= 2:
                    ts.append(time.perf_counter() - t0)
        for ((dtype, name), threads), ts in times.items():
            s = settings[(dtype, name)]
            step_s = statistics.median(ts)
            floor_s = s["bytes"] / bandwidth[threads]
            row = {**base, "round": rnd, "dtype": str(dtype).removeprefix("torch."), "batch": name,
                   "contexts": s["contexts"], "threads": threads, "step_s": step_s, "times_s": ts,
                   "bytes_read": s["bytes"], "read_bandwidth_Bps": bandwidth[threads], "floor_s": floor_s,
                   "over_floor": step_s / floor_s}
            with ROWS_FILE.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"round {rnd} {row['dtype']:<9} {name:<18} {threads} thr  {step_s * 1e3:6.1f} ms  floor "
                  f"{floor_s * 1e3:5.1f} ms ({bandwidth[threads] / 1e9:.1f} GB/s)  {row['over_floor']:.2f}x",
                  file=sys.stderr, flush=True)


def split(settings: dict, steps: int, base: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(2)
    for (dtype, name), s in settings.items():
        times = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            advance(s, i, 100)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[2:])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(5):
                advance(s, steps + 2 + i, 100)
        self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        parts = {k: sum(self_us.get(op, 0.0) for op in ops) / 5 / 1e6 for k, ops in KERNELS.items()}
        row = {**base, "dtype": str(dtype).removeprefix("torch."), "batch": name, "contexts": s["contexts"],
               "threads": 2, "step_s": step_s, **{f"{k}_s": v for k, v in parts.items()},
               "rest_s": step_s - sum(parts.values())}
        with SPLIT_FILE.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['dtype']:<9} {name:<18} step {step_s * 1e3:5.1f} ms: linears {parts['linears'] * 1e3:5.1f}, "
              f"attention {parts['attention'] * 1e3:5.1f}, K,V write {parts['kv_write'] * 1e3:4.1f}, the rest "
              f"{row['rest_s'] * 1e3:5.1f} ({row['rest_s'] / step_s:.0%})", file=sys.stderr)


if __name__ == "__main__":
    main()
