"""Decode after a long chain prefill: the KVP decode (every rank attends its own part of the cache, the partial
outputs merged per layer; kvrunahead/decode/kvp.py) against the gathered decode (the last rank alone with the whole
cache, as kvr-serve runs it: on both cores while the other rank idles, and on one core for reference).

Per context length the prompt is prefilled once over 2 ranks (KV-Runahead, the partition kvr-prefill would choose);
then every round decodes the same greedy tokens with each method in turn (the order rotating), from the same
cache: the gathered decode crops the cache back after itself, the KVP decode starts from fresh shards. Rows: time
per output token (the tokens after the first), the K,V each rank holds for the decode (bytes of the cache tensors
it keeps), the tokens (the methods must agree). SmolLM2-135M-Instruct, float32, 1 thread per rank in KVP.

Usage: python experiments/kvp_decode/run.py [--ctx 16k,32k] [--rounds 5] [--new-tokens 33] [--out DIR]
It starts its own 2 ranks. Resumable: a context length whose rounds are all in DIR/rows.jsonl is not run again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
METHODS = ("gathered-2-threads", "kvp", "gathered-1-thread", "kvp-chain-parts")
# kvp: as kvr-serve and kvr-prefill run it, the shards levelled to an even share per rank first (kvp.level_shards,
# timed apart as level_s); kvp-chain-parts: each rank keeps the chain's part. Rows of an older run (before the
# levelling) hold the first three methods, and their "kvp" kept the chain's parts.


def kv_bytes(layers) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)


def kv_capacity_bytes(layers) -> int:
    """What the layers' buffers take after a decode, the room they grow into included (kvrunahead/model/growing.py)."""
    return sum(layer.held.capacity_bytes if getattr(layer, "held", None) is not None
               else layer.keys.nbytes + layer.values.nbytes for layer in layers)


def rank_main(args) -> None:
    from kvrunahead.config import RunConfig
    from kvrunahead.decide.policy import prepare
    from kvrunahead.decode.kvp import kvp_decode, level_shards, shard_cache
    from kvrunahead.model.forward import greedy_decode
    from kvrunahead.model.layout import probe_kv_layout
    from kvrunahead.modes import MODES, Step
    from kvrunahead.net import liveness
    from kvrunahead.oneshot.runner import timed_prefill
    from kvrunahead.prompt import parse_tokens
    from kvrunahead.provenance import environment
    from kvrunahead.ranks.launcher import init_world
    from kvrunahead.ranks.setup import cached_transport, loaded_model

    world = init_world("torchrun", "gloo", timeout_s=3600)
    rank, front = world.rank, world.rank == world.world_size - 1
    rows_file = args.out / "rows.jsonl"
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
    for ctx in [parse_tokens(c) for c in args.ctx.split(",")]:
        done = {(r["round"], r["method"]) for r in rows if r["context"] == ctx}
        if all((rnd, m) in done for rnd in range(args.rounds) for m in METHODS):
            continue
        cfg = RunConfig(model=args.model, context_len=ctx, threads=1, chat=False)
        prepared = prepare(cfg, world.world_size, world.world_size)
        torch.set_num_threads(1)
        lm = loaded_model(cfg.model, torch.float32, torch.device("cpu"), 0, prepared.rope)
        layout = probe_kv_layout(lm.model)
        transport = cached_transport("torch", rank, world.world_size, torch.device("cpu"), 3600.0, "auto")
        mode = MODES["kvr"]
        ranges = mode.token_ranges(prepared.partition)
        ids = prepared.ids
        mine = torch.tensor([[t for a, e in ranges[rank] for t in ids[a:e]]])
        step = Step(lm.model, mine, ids, ranges, transport, layout, len(ids), prepared.kvr_attention)
        logits, cache, first, prefill_s = timed_prefill(mode, step, mode.setup(step), torch.device("cpu"), front)
        part = ranges[rank][0]
        env = environment(cfg.model, "local", 1, "loopback")
        for rnd in range(args.rounds):
            for method in METHODS[rnd % len(METHODS):] + METHODS[: rnd % len(METHODS)]:
                if (rnd, method) in done:
                    continue
                liveness.patient_barrier("the other rank to start the method")
                level_s = 0.0
                if method.startswith("kvp"):
                    torch.set_num_threads(1)
                    shards = shard_cache(cache, layout, part, len(ids), owner=front)
                    if method == "kvp":
                        t0 = time.perf_counter()
                        level_shards(shards, prepared.partition.boundaries, transport)
                        level_s = time.perf_counter() - t0
                    held = kv_bytes(shards.layers)
                    liveness.patient_barrier("the other rank's shard")
                    t0 = time.perf_counter()
                    tokens = kvp_decode(lm.model, shards, transport, first if front else None, args.new_tokens,
                                        set())
                    seconds = time.perf_counter() - t0
                    capacity = kv_capacity_bytes(shards.layers)
                    del shards
                elif front:
                    torch.set_num_threads(2 if method == "gathered-2-threads" else 1)
                    held = kv_bytes(cache.layers)
                    t0 = time.perf_counter()
                    tokens = greedy_decode(lm.model, first, cache, len(ids), args.new_tokens, set())
                    seconds = time.perf_counter() - t0
                    capacity = kv_capacity_bytes(cache.layers)
                    cache.crop(len(ids) - cache.get_seq_length())  # back to the prompt (a negative count)
                else:
                    tokens, seconds, held, capacity = None, 0.0, 0, 0  # the gathered decode needs nothing here
                held_all, capacity_all = zip(*liveness.gather_objects((held, capacity), "the other rank's figures"))
                if front:
                    row = {**env, "context": len(ids), "boundaries": list(prepared.partition.boundaries),
                           "rope": prepared.rope.describe() if prepared.rope else None, "prefill_s": prefill_s,
                           "round": rnd, "method": method, "new_tokens": len(tokens) - 1, "decode_s": seconds,
                           "tpot_s": seconds / (len(tokens) - 1), "kv_bytes_per_rank": list(held_all),
                           "kv_capacity_bytes_per_rank": list(capacity_all), "tokens": tokens,
                           "level_s": level_s}
                    print(f"{len(ids)} round {rnd} {method:<19} {row['tpot_s'] * 1e3:8.1f} ms/token  K,V per rank "
                          f"{[round(b / 2**20) for b in held_all]} MiB", flush=True)
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        del cache
    liveness.patient_barrier("the other rank to finish")


def summary(rows_file: Path) -> None:
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    lines = ["| context | method | rounds | time per output token, ms (median) | KVP's reduction (median of rounds) "
             "| K,V held per rank, MiB | most on one rank / the gathered decode's | levelling, s | tokens equal to "
             "kvp's |", "|---|---|---|---|---|---|---|---|---|"]
    for ctx in sorted({r["context"] for r in rows}):
        by = {(r["round"], r["method"]): r for r in rows if r["context"] == ctx}
        gathered = max((max(r["kv_bytes_per_rank"]) for (_, m), r in by.items() if m.startswith("gathered")),
                       default=None)
        for method in METHODS:
            mine = [r for (rnd, m), r in sorted(by.items()) if m == method]
            if not mine:
                continue
            cuts = [1 - by[(r["round"], "kvp")]["tpot_s"] / r["tpot_s"] for r in mine if (r["round"], "kvp") in by]
            same = sum(r["tokens"] == by[(r["round"], "kvp")]["tokens"] for r in mine if (r["round"], "kvp") in by)
            most = max(mine[0]["kv_bytes_per_rank"])
            level = statistics.median(r["level_s"] for r in mine) if "level_s" in mine[0] and method == "kvp" else None
            lines.append(f"| {ctx} | {method} | {len(mine)} | {statistics.median(r['tpot_s'] for r in mine) * 1e3:.1f}"
                         f" | {'' if method == 'kvp' else f'{statistics.median(cuts):.1%}'} | "
                         f"{' / '.join(str(round(b / 2**20)) for b in mine[0]['kv_bytes_per_rank'])} | "
                         f"{f'{most / gathered:.0%}' if gathered else '-'} | "
                         f"{'-' if level is None else f'{level:.2f}'} | {same}/{len(mine)} |")
    (rows_file.parent / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="16k,32k")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=33, help="tokens per decode, the first included")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--summary", action="store_true", help="only the summary of the rows there are")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rank:
        rank_main(args)
        return
    if not args.summary:
        from kvrunahead.ranks.launcher import free_port, rank_env

        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", *sys.argv[1:]],
                                  env=rank_env(r, 2, port, OMP_NUM_THREADS="1")) for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"ranks exited with {codes}")
    summary(args.out / "rows.jsonl")


if __name__ == "__main__":
    main()
