"""The measured search on the ranks (every rank runs it; rank 0 writes the table after each length).

Two criteria: ``ttft`` (search.algorithm: golden-section for p = 2, the grid of fig. 6 for more, on each
candidate's median TTFT) and ``balance`` (search.balance: root-finding on the ranks' busy times of each run, then
the balanced point and its neighbours timed in interleaved rounds).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvrunahead.decide.tables import Table, TableEntry, TableMeta
from kvrunahead.net.spec import parse_net
from kvrunahead.partition import Partition
from kvrunahead.provenance import environment
from kvrunahead.search.algorithm import Boundaries, refine, search
from kvrunahead.search.balance import balance_search, balanced_boundaries
from kvrunahead.search.model_backend import model_answer
from kvrunahead.search.options import SearchOptions, base_config, check_inputs, table_key
from kvrunahead.version import __version__

if TYPE_CHECKING:
    from kvrunahead.config import RunConfig
    from kvrunahead.ranks.launcher import World


def run_search(opts: SearchOptions) -> None:
    """The measured search on this rank (every rank runs it); rank 0 writes the table after each length."""
    import torch
    import torch.distributed as dist

    from kvrunahead.model.compute import compute_settings
    from kvrunahead.model.device import oversubscribed, resolve_device
    from kvrunahead.oneshot.runner import leave_world
    from kvrunahead.ranks.launcher import detect_launcher, init_world, local_rank_hint, pick_backend, world_size_hint
    from kvrunahead.ranks.mesh import chain_world

    launcher = detect_launcher()
    out = check_inputs(opts, world_size_hint(launcher, 1))
    device = resolve_device(opts.device, local_rank_hint())  # each local rank its own GPU
    world = chain_world(init_world(launcher, pick_backend(device), opts.timeout_s, device), opts.tp)
    p = world.world_size  # with --tp: the chain's TP groups
    lead = world.global_rank == 0
    key = table_key(opts, p, world.local_world_size)
    noise = parse_net(opts.net).noise
    base = dataclasses.replace(base_config(opts), kvr_attention=key.kvr_attention)
    env = environment(opts.model, "torch", opts.threads, key.bandwidth)
    computes = compute_settings(key.dtype, key.device_kind, timing=True)
    table = Table.load(out) if out.exists() else None
    if table is not None and table.stale(computes, out.name):
        if lead:
            click.echo(f"{out.name} was searched with {table.searched_with()}; this search runs {computes}: its "
                       f"{len(table.entries)} entries are replaced by a table of these settings", err=True)
        table = None
    table = table or Table(TableMeta(
        model=opts.model, config_hash=key.config_hash, dtype=key.dtype, world_size=p,
        backend=pick_backend(device), transport="torch", device=env["cpu"] if device.type == "cpu" else
        torch.cuda.get_device_name(device), threads_per_rank=opts.threads,
        bandwidth=key.bandwidth, version=__version__, kvr_attention=key.kvr_attention,
        device_kind=key.device_kind, noise=noise.describe() if noise else None, tp=opts.tp, **computes))
    if oversubscribed(opts.threads, world.host_ranks):
        table.meta.oversubscribed = True
        if lead:
            click.echo(f"warning: OVERSUBSCRIBED: {world.host_ranks} ranks of {opts.threads} thread(s) on "
                       f"{os.cpu_count()} cores; the ranks time-share them, so the timings and the balance "
                       f"measure the scheduler as much as the partition (the table records it)", err=True)
    if lead:
        click.echo(f"searching partitions for {key.describe()}, with {computes['attention_kernel']} attention "
                   f"and {computes['linears']} linears -> {out}", err=True)
    try:
        for ctx in opts.context_lens:
            if opts.resume and any(e.context_len == ctx for e in table.entries):
                if lead:
                    click.echo(f"[ctx {ctx}] already in {out}: kept (--resume)", err=True)
                continue
            if opts.criterion == "balance":
                _balance_length(opts, world, base, table, out, ctx)
            else:
                _search_length(opts, world, base, table, out, ctx)
        if lead:
            click.echo(f"wrote {out}", err=True)
        if world.world_size > 1:
            dist.barrier()
    finally:
        leave_world()


def _search_length(opts: SearchOptions, world: World, base: RunConfig, table: Table, out: Path, ctx: int) -> None:
    """One length's search on the ranks: its entry added to ``table`` on every rank, saved to ``out`` by rank 0."""
    from kvrunahead.search.measure import share, ttft_on_ranks

    p = world.world_size
    lead = world.global_rank == 0
    ckpt = (opts.checkpoints or out.with_suffix(".search")) / f"{ctx}.json" if lead else None
    measure = ttft_on_ranks(base, world, ctx, opts.repeats, opts.warmup_runs)
    seed = _seed(opts, world, table, ctx)
    on_measure, on_level = _progress(ctx, seed, lead)
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        if not opts.resume and ckpt.exists():
            ckpt.unlink()
    # Every rank resumes from rank 0's checkpoint so that all replay the same candidates.
    resumed = share(json.loads(ckpt.read_text()) if ckpt is not None and ckpt.exists() else {}, world)
    if opts.refine:
        result = refine(measure, seed, opts.min_stride_tokens, checkpoint=ckpt, on_measure=on_measure,
                        preload=resumed)
    else:
        result = search(measure, ctx, p, min_stride=opts.min_stride_tokens, seed=seed, window=opts.window_tokens,
                        checkpoint=ckpt, on_measure=on_measure, on_level=on_level, preload=resumed)
    even_t = result.all.get(Partition.even(ctx, p).boundaries)
    # Every rank adds the entry: the next length is seeded from this table, and all ranks must propose
    # the same candidates.
    table.add(TableEntry(context_len=ctx, boundaries=list(result.boundaries),
                         ratios=list(Partition(tuple(result.boundaries)).ratios),
                         ttft_s=result.ttft_s, even_ttft_s=even_t, evaluations=result.evaluations,
                         search_s=round(result.search_s, 1), seeded=seed is not None))
    if lead:
        table.save(out)
        even = f"even {even_t:.3f} s" if even_t is not None else "even not measured"
        click.echo(f"[ctx {ctx}] best {','.join(map(str, result.boundaries))}: TTFT {result.ttft_s:.3f} s "
                   f"({even}), {result.evaluations} candidates, {result.search_s:.0f} s", err=True)


def _seed(opts: SearchOptions, world: World, table: Table, ctx: int) -> Boundaries | None:
    """Where a length's search starts: the cost model's answer (--refine), the interpolation of the seed table
    (--seeded), or nowhere (the whole range)."""
    from kvrunahead.search.measure import share

    lead = world.global_rank == 0
    seeds = Table.load(opts.seed_table) if opts.seed_table else table
    if opts.refine:
        # Rank 0's answer for all: ranks on other hosts may hold other profiles.
        seed = share(model_answer(opts, ctx, world.world_size).boundaries if lead else None, world)
        if lead:
            click.echo(f"[ctx {ctx}] the cost model's partition {','.join(map(str, seed))}: measuring it and "
                       f"its neighbours {opts.min_stride_tokens} tokens away", err=True)
        return seed
    if opts.seeded and seeds.entries:
        return seeds.search_seed(ctx)
    return None


def _carried_seed(opts: SearchOptions, table: Table, ctx: int, work, lead: bool) -> Boundaries | None:
    """Where the per-rank rates measured at the longest shorter balance entry of ``table`` (every rank holds the
    same table) balance ``ctx`` (--carry-rates); None where there is none. Each rank's rate against the FLOP
    model drifts slowly with the length, so this lands closer than the cost model, which prices the ranks
    alike."""
    if not opts.carry_rates:
        return None
    shorter = [e for e in table.entries if e.context_len < ctx and e.busy_s and e.criterion == "balance"]
    if not shorter:
        return None
    prev = max(shorter, key=lambda e: e.context_len)
    seed = balanced_boundaries(tuple(prev.boundaries), prev.busy_s, work, quantum=8, length=ctx)
    if lead:
        click.echo(f"[ctx {ctx}] seeded by the ranks' rates at {prev.context_len} "
                   f"({','.join(map(str, prev.boundaries))}): {','.join(map(str, seed))}", err=True)
    return seed


def _progress(ctx: int, seed, lead: bool):
    """Progress lines on rank 0: each level's grid, each candidate's TTFT and the best so far."""
    state = {"n": 0, "best": float("inf")}

    def on_measure(b, t):
        state["n"] += 1
        state["best"] = min(state["best"], t)
        if lead:
            click.echo(f"  [ctx {ctx}] candidate {state['n']:>3}  {','.join(map(str, b)):<22} "
                       f"TTFT {t:.3f} s   best {state['best']:.3f} s", err=True)

    def on_level(level, stride, points):
        if lead:
            click.echo(f"[ctx {ctx}] level {level}: stride {stride}, up to {points} candidates"
                       + (f", seeded at {','.join(map(str, seed))}" if seed else ""), err=True)

    return on_measure, on_level


def _balance_length(opts: SearchOptions, world: World, base: RunConfig, table: Table, out: Path, ctx: int) -> None:
    """One length by the ranks' balance, from the cost model's answer (--refine), the table's interpolation, else
    the FLOP estimate; its entry records the balance and the candidates measured."""
    from kvrunahead.model.load import resolve_config
    from kvrunahead.search.measure import busy_on_ranks, share
    from kvrunahead.sim.flops import estimated_partition, layer_cost

    p, lead = world.world_size, world.global_rank == 0
    config = resolve_config(opts.model)
    cost = layer_cost(config)

    def work(prefix: float, tokens: float) -> float:
        return cost.rank_flops(prefix, tokens, base.kvr_attention)

    seed = (_carried_seed(opts, table, ctx, work, lead) or _seed(opts, world, table, ctx)
            or estimated_partition(config, ctx, p, base.kvr_attention).boundaries)
    ckpt = (opts.checkpoints or out.with_suffix(".search")) / f"{ctx}.balance.json" if lead else None
    if ckpt is not None and not opts.resume and ckpt.exists():
        ckpt.unlink()
    resumed = share(json.loads(ckpt.read_text())["runs"] if ckpt is not None and ckpt.exists() else [], world)

    def on_measure(phase, b, m):
        if lead:
            busy = ", ".join(f"{x:.2f}" for x in m.busy_s)
            click.echo(f"  [ctx {ctx}] {phase:<7} {','.join(map(str, b)):<22} TTFT {m.ttft_s:.3f} s  busy "
                       f"[{busy}] s  balance {m.balance:.3f}", err=True)

    if lead:
        click.echo(f"[ctx {ctx}] balancing from {','.join(map(str, seed))}", err=True)
    result = balance_search(busy_on_ranks(base, world, ctx, opts.warmup_runs), tuple(seed), work,
                            stride=opts.min_stride_tokens, confirm_rounds=opts.confirm_rounds, checkpoint=ckpt,
                            preload=resumed, on_measure=on_measure, confirm=opts.confirm,
                            confirm_margin=opts.confirm_margin)
    table.add(TableEntry(context_len=ctx, boundaries=list(result.boundaries),
                         ratios=list(Partition(tuple(result.boundaries)).ratios), ttft_s=result.ttft_s,
                         even_ttft_s=None, evaluations=result.candidates, search_s=round(result.search_s, 1),
                         seeded=True, balance=round(result.balance, 4), criterion="balance",
                         busy_s=[round(x, 4) for x in result.busy_s]))
    if lead:
        table.save(out)
        click.echo(f"[ctx {ctx}] balanced {','.join(map(str, result.boundaries))}: TTFT {result.ttft_s:.3f} s "
                   f"(median of {opts.confirm_rounds} interleaved), balance {result.balance:.3f}, "
                   f"{result.candidates} candidates in {result.runs} runs, {result.search_s:.0f} s", err=True)
