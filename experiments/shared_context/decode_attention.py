"""Decode attention time per step: PAT's shared-prefix attention against per-sequence attention over copied
prefixes, one layer of SmolLM2-135M's shape (9 query heads, 3 K,V heads, head dim 64), float32, 2 threads.

Shared prefix (kvr-ask's decode, ``kvrunahead.questions``): every question's query stacked per K,V head in one
product against the one prefix, each question's own block (its question and the tokens decoded so far, left-padded)
separately, the two merged by log-sum-exp. Per-sequence (a prefix-cached batch, as transformers decodes it): each
question's row holds a copy of the prefix followed by its own block, and transformers' SDPA attention runs over the
batch with the padding mask. Both give the same output (checked every round).

Usage: python experiments/shared_context/decode_attention.py [--rounds 5] [--out DIR]
Resumable: a (round, prefix, questions) already in DIR/decode_attention.jsonl is not run again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvrunahead.modes.attention import merge_lse
from kvrunahead.provenance import environment
from kvrunahead.questions import padded_attention, prefix_attention

HEADS, KV_HEADS, DIM = 9, 3, 64
OWN = 48  # slots of each question's own block: its question and the tokens decoded so far, left-padded
CASES = [(2048, 16), (2048, 64), (8192, 16), (8192, 64)]
CALLS = 20  # attention calls per timing


def inputs(prefix: int, questions: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(questions, HEADS, 1, DIM, generator=g)
    pk, pv = (torch.randn(1, KV_HEADS, prefix, DIM, generator=g) for _ in range(2))
    own_k, own_v = (torch.randn(questions, KV_HEADS, OWN, DIM, generator=g) for _ in range(2))
    lengths = torch.randint(8, OWN + 1, (questions,), generator=g)
    valid = torch.arange(OWN)[None, :] >= (OWN - lengths)[:, None]
    return q, pk, pv, own_k, own_v, valid


def shared(q, pk, pv, own_k, own_v, valid, scale):
    out, lse = prefix_attention(q, pk, pv, scale)
    own_out, own_lse = padded_attention(q, own_k, own_v, valid, scale)
    return merge_lse(own_out, own_lse, out, lse)[0]


def copied(q, keys, values, mask, scale):
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=False, training=False)
    return sdpa_attention_forward(module, q, keys, values, mask, scaling=scale)[0].transpose(1, 2)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        out = fn(*args)
    return (time.perf_counter() - t0) / CALLS, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "decode_attention")
    ap.add_argument("--summary", action="store_true", help="only the summary of the rows there are")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_file = args.out / "decode_attention.jsonl"
    if not args.summary:
        torch.set_num_threads(2)
        rows = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
        done = {(r["round"], r["prefix"], r["questions"]) for r in rows}
        env = environment("smollm2-135m", "local", 2, "none")
        scale = DIM ** -0.5
        with torch.no_grad():
            for rnd in range(args.rounds):
                for prefix, n in CASES:
                    if (rnd, prefix, n) in done:
                        continue
                    q, pk, pv, own_k, own_v, valid = inputs(prefix, n, rnd)
                    keys = torch.cat((pk.expand(n, -1, -1, -1), own_k), dim=2).contiguous()
                    values = torch.cat((pv.expand(n, -1, -1, -1), own_v), dim=2).contiguous()
                    mask = torch.cat((torch.ones(n, prefix, dtype=torch.bool), valid), dim=1)[:, None, None, :]
                    first = "shared" if rnd % 2 == 0 else "copied"  # the order alternates by round
                    times = {}
                    for name in (first, "copied" if first == "shared" else "shared"):
                        if name == "shared":
                            times[name], a = timed(shared, q, pk, pv, own_k, own_v, valid, scale)
                        else:
                            times[name], b = timed(copied, q, keys, values, mask, scale)
                    diff = (a - b).abs().max().item()
                    row = {**env, "round": rnd, "prefix": prefix, "questions": n, "own_slots": OWN,
                           "shared_ms": times["shared"] * 1e3, "copied_ms": times["copied"] * 1e3,
                           "copied_cache_mib": 2 * keys.numel() * 4 / 2**20,
                           "shared_cache_mib": 2 * (pk.numel() + own_k.numel()) * 4 / 2**20, "max_abs_diff": diff}
                    print(f"round {rnd} prefix {prefix} x {n}: shared {row['shared_ms']:.2f} ms, copied "
                          f"{row['copied_ms']:.2f} ms, diff {diff:.1e}", flush=True)
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    summary(rows_file)


def summary(rows_file: Path) -> None:
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    lines = ["| prefix | questions | rounds | shared-prefix ms/step/layer | copied prefixes ms/step/layer | speed-up "
             "(median of rounds) | cache MiB/layer shared / copied | max abs diff |", "|---|---|---|---|---|---|---|---|"]
    for prefix, n in CASES:
        mine = [r for r in rows if r["prefix"] == prefix and r["questions"] == n]
        if not mine:
            continue
        lines.append(f"| {prefix} | {n} | {len(mine)} | {statistics.median(r['shared_ms'] for r in mine):.2f} | "
                     f"{statistics.median(r['copied_ms'] for r in mine):.2f} | "
                     f"{statistics.median(r['copied_ms'] / r['shared_ms'] for r in mine):.2f}x | "
                     f"{mine[0]['shared_cache_mib']:.1f} / {mine[0]['copied_cache_mib']:.1f} | "
                     f"{max(r['max_abs_diff'] for r in mine):.1e} |")
    (rows_file.parent / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
