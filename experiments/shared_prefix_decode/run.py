"""Decode attention per step for questions sharing one context: the prefix read once for all (PAT's two blocks,
decode/shared_prefix.py) against per-sequence attention over a copy of the prefix per sequence (one SDPA call with
a padding mask and grouped K,V heads, the best per-sequence form torch has). One layer of SmolLM2-135M (9 query
heads, 3 K,V heads of 64), float32, 1 thread; every question's own block holds 48 slots (a 16-token question and
32 new tokens, some left-padded). Rounds alternate the two, so drift hits both alike; medians of the rounds.

Usage: python experiments/shared_prefix_decode/run.py [--rounds 15] [--threads 1] [--out DIR]
Rows go to rows.jsonl (1 thread) or rows_<N>threads.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrunahead.decode.shared_prefix import padded_attention, prefix_attention
from kvrunahead.modes.attention import merge_lse
from kvrunahead.provenance import environment

HEADS, KV_HEADS, DIM, SLOTS = 9, 3, 64, 48


def inputs(questions: int, prefix: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(questions, HEADS, 1, DIM, generator=g)
    pk, pv = (torch.randn(1, KV_HEADS, prefix, DIM, generator=g) for _ in range(2))
    own_k, own_v = (torch.randn(questions, KV_HEADS, SLOTS, DIM, generator=g) for _ in range(2))
    valid = torch.arange(SLOTS)[None, :] >= torch.arange(questions)[:, None] % 8  # up to 7 slots of padding
    # The per-sequence form: every sequence's own copy of the prefix before its keys (made once, not timed).
    k = torch.cat((pk.expand(questions, -1, -1, -1), own_k), dim=2).contiguous()
    v = torch.cat((pv.expand(questions, -1, -1, -1), own_v), dim=2).contiguous()
    mask = torch.cat((valid.new_ones(questions, prefix), valid), dim=1)[:, None, None, :]
    return q, pk, pv, own_k, own_v, valid, k, v, mask


def shared(q, pk, pv, own_k, own_v, valid):
    out, lse = prefix_attention(q, pk, pv, None)
    own_out, own_lse = padded_attention(q, own_k, own_v, valid, None)
    return merge_lse(own_out, own_lse, out, lse)[0]


def copied(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (kvr-ask's front decodes on both cores)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment("smollm2-135m", "local", args.threads, "none")
    rows = []
    for prefix in (2048, 8192):
        for questions in (16, 64):
            q, pk, pv, own_k, own_v, valid, k, v, mask = inputs(questions, prefix)
            assert torch.allclose(shared(q, pk, pv, own_k, own_v, valid), copied(q, k, v, mask), atol=1e-5)
            for _ in range(2):  # warm-up
                shared(q, pk, pv, own_k, own_v, valid), copied(q, k, v, mask)
            times = {"shared": [], "copied": []}
            calls = {"shared": functools.partial(shared, q, pk, pv, own_k, own_v, valid),
                     "copied": functools.partial(copied, q, k, v, mask)}
            for r in range(args.rounds):
                for name in ("shared", "copied") if r % 2 == 0 else ("copied", "shared"):
                    times[name].append(timed(calls[name]))
            kv_bytes = {"shared": (pk.numel() + pv.numel() + own_k.numel() + own_v.numel()) * 4,
                        "copied": (k.numel() + v.numel()) * 4}
            row = {**env, "prefix": prefix, "questions": questions, "slots": SLOTS, "rounds": args.rounds,
                   **{f"{n}_step_s": times[n] for n in times},
                   **{f"{n}_median_s": statistics.median(times[n]) for n in times},
                   **{f"{n}_kv_bytes": kv_bytes[n] for n in times}}
            row["speedup"] = row["copied_median_s"] / row["shared_median_s"]
            rows.append(row)
            print(f"prefix {prefix:>5}  questions {questions:>3}: shared {row['shared_median_s'] * 1e3:8.2f} ms  "
                  f"copied {row['copied_median_s'] * 1e3:8.2f} ms  x{row['speedup']:.1f}  K,V held "
                  f"{kv_bytes['shared'] / 2**20:.1f} MiB against {kv_bytes['copied'] / 2**20:.1f} MiB", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "rows.jsonl" if args.threads == 1 else f"rows_{args.threads}threads.jsonl"
    (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
