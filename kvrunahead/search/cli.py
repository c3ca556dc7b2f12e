"""``kvr-search``: measure TTFT on the target ranks and write a partition lookup table.

Every option of a search is one ``SearchOptions``, built once from the command line; spawned ranks re-parse the
same argv into theirs. The ranks stay up for the whole search and measure each candidate together
(``search.measure``); ``--backend model`` writes the cost model's table without starting a rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvrunahead import __version__
from kvrunahead.choices import DEFAULT_MODEL
from kvrunahead.cli import common
from kvrunahead.errors import InputError
from kvrunahead.model.rope import ContextError, plan_extension
from kvrunahead.net.spec import parse_net
from kvrunahead.partition import Partition
from kvrunahead.prompt import parse_tokens
from kvrunahead.provenance import environment
from kvrunahead.search.algorithm import Boundaries, refine, search
from kvrunahead.search.tables import TABLES_DIR, Table, TableEntry, TableError, TableKey, TableMeta, table_filename
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.optimize import ModelSearch, search_partition
from kvrunahead.sim.profile import resolve_profile
from kvrunahead.sim.shape import shape_from_config

# The launcher, the policy, the runner, model loading and search.measure import torch: they are imported in the
# functions that use them, so that --help and the input checks answer before torch is loaded.
if TYPE_CHECKING:
    from kvrunahead.launcher import World
    from kvrunahead.policy import RunConfig

PEER_TIMEOUT_NOTE = "; the candidates measured so far are kept (--resume continues)"


@dataclass(frozen=True)
class SearchOptions:
    """What one search is asked for: every ``kvr-search`` option but ``--nproc``."""

    context_lens: tuple[int, ...]
    model: str = DEFAULT_MODEL
    min_stride_tokens: int = 64  # the finest step of a boundary
    repeats: int = 3  # timed runs per candidate (their median is its TTFT)
    warmup_runs: int = 1  # untimed runs before the first candidate of each length
    kvr_attention: str = "auto"
    seeded: bool = True  # start from the table's interpolation and search only the window around it
    window_tokens: int = 256  # either side of a seed
    seed_table: Path | None = None  # seed from this table instead of the one being written
    out: Path | None = None  # None: partition_tables/ under the setting's name
    resume: bool = False
    checkpoints: Path | None = None  # None: next to the table, as <table>.search/
    threads: int = 1
    device: str = "auto"
    dtype: str | None = None
    net: str | None = None
    backend: str = "measured"  # or "model": the cost model's table, no rank started
    profile: str | None = None  # the hardware profile of --backend model
    refine: bool = False  # measure only around the cost model's answer
    allow_long_context: bool = False
    timeout_s: float = 600.0

    @classmethod
    def from_cli(cls, contexts: str, **options) -> SearchOptions:
        """From kvr-search's arguments: ``--ctx`` as typed (e.g. ``2k,4k``), paths as strings (empty: none)."""
        for name in ("seed_table", "out", "checkpoints"):
            options[name] = Path(options[name]) if options[name] else None
        return cls(context_lens=tuple(parse_tokens(c) for c in contexts.split(",") if c.strip()), **options)


def _base_config(opts: SearchOptions) -> RunConfig:
    from kvrunahead.policy import RunConfig

    return RunConfig(model=opts.model, threads=opts.threads, device=opts.device, dtype=opts.dtype,
                     max_new_tokens=1, allow_long_context=opts.allow_long_context, timeout_s=opts.timeout_s,
                     kvr_attention=opts.kvr_attention, net=opts.net)


def table_key(opts: SearchOptions, world_size: int, local_world_size: int | None = None, config=None) -> TableKey:
    """What the table being written is for (and what an existing --out must have been made for); ``config``:
    the model's config where the caller has resolved it already."""
    from kvrunahead.model.load import resolve_config
    from kvrunahead.policy import resolve_attention
    from kvrunahead.policy import table_key as policy_table_key

    base = _base_config(opts)
    config = config if config is not None else resolve_config(opts.model)
    attention, _ = resolve_attention(base, config)
    return policy_table_key(base, config, world_size, attention, local_world_size or world_size)


def check_inputs(opts: SearchOptions, world_size: int) -> Path:
    """One-line errors before any rank starts; returns the table path."""
    from kvrunahead.model.load import ModelError, resolve_config

    for flag, value, least in (("--threads", opts.threads, 1), ("--repeats", opts.repeats, 1),
                               ("--warmup", opts.warmup_runs, 0), ("--min-stride", opts.min_stride_tokens, 1),
                               ("--window", opts.window_tokens, 1)):
        if value < least:
            raise InputError(f"{flag} must be at least {least}, got {value}")
    if world_size < 2:
        raise InputError(f"a partition search needs at least 2 ranks, got {world_size}")
    if not opts.context_lens:
        raise InputError("--ctx names no context length")
    try:
        config = resolve_config(opts.model)
        key = table_key(opts, world_size, config=config)
        for ctx in opts.context_lens:
            plan_extension(config, ctx, opts.allow_long_context, opts.model)
    except (ModelError, ContextError) as e:
        raise InputError(str(e)) from None
    out = opts.out or TABLES_DIR / table_filename(key)
    if out.exists() and not (opts.backend == "model" and not opts.refine):  # model_search checks its own
        try:
            existing = Table.load(out)
            existing.check(key, name=str(out))
        except TableError as e:
            raise InputError(f"{e}; --out must be a new table or one made for the same setting") from None
        if existing.meta.source != "measured":
            raise InputError(f"{out} holds the cost model's predictions ({existing.meta.source}); a measured "
                             f"search writes a table of its own (--out)")
    for ctx in opts.context_lens:
        if ctx < world_size * opts.min_stride_tokens:
            raise InputError(f"context of {ctx} tokens is too short for {world_size} ranks at --min-stride "
                             f"{opts.min_stride_tokens}")
    return out


def run_search(opts: SearchOptions) -> None:
    """The measured search on this rank (every rank runs it); rank 0 writes the table after each length."""
    import torch
    import torch.distributed as dist

    from kvrunahead.launcher import detect_launcher, init_world, pick_backend, world_size_hint
    from kvrunahead.policy import resolve_device
    from kvrunahead.runner import leave_world

    launcher = detect_launcher()
    out = check_inputs(opts, world_size_hint(launcher, 1))
    device = resolve_device(opts.device, 0)
    world = init_world(launcher, pick_backend(device), opts.timeout_s)
    p = world.world_size
    lead = world.rank == 0
    key = table_key(opts, p, world.local_world_size)
    noise = parse_net(opts.net).noise
    base = dataclasses.replace(_base_config(opts), kvr_attention=key.kvr_attention)
    env = environment(opts.model, "torch", opts.threads, key.bandwidth)
    table = Table.load(out) if out.exists() else Table(TableMeta(
        model=opts.model, config_hash=key.config_hash, dtype=key.dtype, world_size=p,
        backend=pick_backend(device), transport="torch", device=env["cpu"] if device.type == "cpu" else
        torch.cuda.get_device_name(device), threads_per_rank=opts.threads,
        bandwidth=key.bandwidth, version=__version__, kvr_attention=key.kvr_attention,
        device_kind=key.device_kind, noise=noise.describe() if noise else None))
    if lead:
        click.echo(f"searching partitions for {key.describe()} -> {out}", err=True)
    try:
        for ctx in opts.context_lens:
            if opts.resume and any(e.context_len == ctx for e in table.entries):
                if lead:
                    click.echo(f"[ctx {ctx}] already in {out}: kept (--resume)", err=True)
                continue
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
    lead = world.rank == 0
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
    table.add(TableEntry(context_len=ctx, boundaries=list(result.boundaries), ratios=_ratios(result.boundaries),
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

    lead = world.rank == 0
    seeds = Table.load(opts.seed_table) if opts.seed_table else table
    if opts.refine:
        # Rank 0's answer for all: ranks on other hosts may hold other profiles.
        seed = share(_model_answer(opts, ctx, world.world_size).boundaries if lead else None, world)
        if lead:
            click.echo(f"[ctx {ctx}] the cost model's partition {','.join(map(str, seed))}: measuring it and "
                       f"its neighbours {opts.min_stride_tokens} tokens away", err=True)
        return seed
    if opts.seeded and seeds.entries:
        return seeds.search_seed(ctx)
    return None


def _ratios(boundaries: Boundaries) -> list[float]:
    return [(hi - lo) / boundaries[-1] for lo, hi in zip(boundaries, boundaries[1:])]


def _cost_model(opts: SearchOptions, world_size: int) -> tuple[TableKey, CostModel, str, str]:
    """The table's key and its cost model: the model's shape on the chosen profile, over the table's link.
    With --device auto the table is for the profile's device kind (a GPU profile writes a cuda table)."""
    from kvrunahead.model.load import ModelError, resolve_config

    profile, which = resolve_profile(opts.profile, opts.threads)
    if opts.device == "auto":
        opts = dataclasses.replace(opts, device=profile.device_kind)
    key = table_key(opts, world_size)
    profile, link, link_note = profile.for_network(key.bandwidth)
    try:
        shape = shape_from_config(resolve_config(opts.model), key.dtype, opts.model)
    except ModelError as e:
        raise InputError(f"--backend model: {e}") from None
    return key, CostModel(shape, profile, link), which, link_note


def _model_answer(opts: SearchOptions, ctx: int, world_size: int) -> ModelSearch:
    key, cost, _, _ = _cost_model(opts, world_size)
    return search_partition(cost, ctx, world_size, key.kvr_attention, min_stride=opts.min_stride_tokens)


def model_search(opts: SearchOptions, world_size: int) -> None:
    """``--backend model``: the table from the cost model, without starting a rank."""
    key, cost, which, link_note = _cost_model(opts, world_size)
    # Its own file: a prediction never lands in (or is read as) the measured table of the same setting.
    out = opts.out or TABLES_DIR / table_filename(key).replace(".json", "_model.json")
    click.echo(f"model search for {key.describe()} on {which}, {link_note} -> {out}", err=True)
    if cost.link_label != key.bandwidth:
        click.echo(f"warning: the profile has no link {key.bandwidth!r}; its {cost.link_label!r} link is used",
                   err=True)
    if out.exists():
        existing = Table.load(out)
        existing.check(key, name=str(out))
        if existing.meta.source == "measured":
            raise InputError(f"{out} holds measured entries; a model-backed search writes a table of its own "
                             f"(--out)")
    table = Table.load(out) if out.exists() else Table(TableMeta(
        model=opts.model, config_hash=key.config_hash, dtype=key.dtype, world_size=world_size, backend="model",
        transport="model", device=cost.profile.device, threads_per_rank=opts.threads, bandwidth=key.bandwidth,
        version=__version__, kvr_attention=key.kvr_attention, device_kind=key.device_kind,
        source=f"cost model: {cost.profile.name}"))
    for ctx in opts.context_lens:
        r = search_partition(cost, ctx, world_size, key.kvr_attention, min_stride=opts.min_stride_tokens)
        table.add(TableEntry(context_len=ctx, boundaries=list(r.boundaries), ratios=_ratios(r.boundaries),
                             ttft_s=r.ttft_s, even_ttft_s=r.even_ttft_s, evaluations=r.simulations,
                             search_s=round(r.search_s, 2)))
        click.echo(f"[ctx {ctx}] predicted best {','.join(map(str, r.boundaries))}: TTFT {r.ttft_s:.3f} s "
                   f"(even {r.even_ttft_s:.3f} s), {r.simulations} simulations, {r.search_s:.1f} s", err=True)
    table.save(out)
    click.echo(f"wrote {out}", err=True)


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


@click.command(context_settings=common.SETTINGS)
@common.model_option()
@click.option("--nproc", type=int, default=2, show_default=True, help="Ranks to spawn (unless under torchrun/mpirun).")
@click.option("--ctx", "contexts", required=True, help="Context lengths, e.g. 2k,4k,6k,8k.")
@click.option("--min-stride", "min_stride_tokens", type=int, default=SearchOptions.min_stride_tokens,
              show_default=True, help="Finest step of a boundary, in tokens.")
@click.option("--repeats", type=int, default=SearchOptions.repeats, show_default=True,
              help="Timed runs per candidate (median).")
@click.option("--warmup", "warmup_runs", type=int, default=SearchOptions.warmup_runs, show_default=True,
              help="Untimed runs before the first candidate of each length.")
@common.kvr_attention_option(
    help="The attention the table is searched for (recorded in it; kvr-prefill uses a table only with the same "
         "attention). auto: split where the model allows it, else masked.")
@click.option("--seeded/--no-seeded", default=SearchOptions.seeded, show_default=True,
              help="Start each length from the table's interpolation and search only --window around it.")
@click.option("--window", "window_tokens", type=int, default=SearchOptions.window_tokens, show_default=True,
              help="Tokens either side of a seed to search.")
@click.option("--seed-table", type=click.Path(exists=True, dir_okay=False),
              help="Seed from this table's interpolation instead of the one being written.")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Table to write (extended if it exists). Default: partition_tables/ under the name of the "
                   "setting, e.g. smollm2-135m_p2_float32_cpu_split.json, where kvr-prefill finds it.")
@click.option("--resume", is_flag=True, help="Continue an interrupted search from its checkpoints.")
@click.option("--checkpoints", type=click.Path(file_okay=False),
              help="Directory of the per-length checkpoints (every candidate measured). Default: next to --out, "
                   "as <table>.search/.")
@click.option("--threads", type=int, default=SearchOptions.threads, show_default=True)
@common.device_option()
@common.dtype_option()
@common.net_option(
    help="The network to search on: loopback (default on one host), cap=400MB/s (every rank on an emulated host "
         "of its own, links capped each way; needs root), ',noise' for the sidecar too. The table is keyed on the "
         "cap (kvr-prefill uses it only on the same cap); noise is recorded.")
@click.option("--backend", type=click.Choice(["measured", "model"]), default=SearchOptions.backend, show_default=True,
              help="measured: time candidates on the ranks; model: find the partition with the cost model and "
                   "simulator (seconds, any --nproc, no ranks started).")
@click.option("--profile", default=None,
              help="Hardware profile for --backend model: cpu (this machine's kvr-calibrate profile, else the "
                   "shipped one), a100-nvlink, h100-nvlink, ... or a file.")
@click.option("--refine", is_flag=True,
              help="With --backend model: then measure on the real ranks only the model's answer and its "
                   "neighbours --min-stride tokens away, moving while a neighbour is faster.")
@common.allow_long_context_option()
@common.timeout_option(SearchOptions.timeout_s)
def main(nproc: int, contexts: str, **options) -> None:
    """Search TTFT-minimising partitions on the target ranks and write a partition lookup table.

    \b
    For two ranks: golden-section search over rank 0's share (fig. 6a of the paper); for more: the
    hierarchical grid search of fig. 6 b-d down to --min-stride. Each candidate is measured with
    --repeats runs (median) after --warmup runs per length, logged, checkpointed next to the table
    (--resume continues), and never measured twice. Example:
      kvr-search --ctx 1k,2k,4k,8k --nproc 2 --kvr-attention split
      kvr-search --backend model --nproc 8 --ctx 16k --out /tmp/t.json
    """
    from kvrunahead.launcher import detect_launcher, spawn

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    launcher = detect_launcher()
    # A peer that stops answering ends a measured search; its checkpoints hold every candidate measured.
    with common.failure_ending("kvr-search", timeout_note=PEER_TIMEOUT_NOTE):
        opts = SearchOptions.from_cli(contexts, **options)
        if opts.refine and opts.backend != "model":
            raise InputError("--refine refines the model's answer: add --backend model")
        if launcher == "single":
            check_inputs(opts, nproc)  # once here, not once per rank
        net = parse_net(opts.net)
        if opts.backend == "model" and not opts.refine:
            model_search(opts, nproc)
        elif launcher == "single" and nproc > 1:
            t = time.perf_counter()
            code = spawn(nproc, sys.argv[1:], module="kvrunahead.search.cli", net=net)
            click.echo(f"search took {time.perf_counter() - t:.0f} s", err=True)
            sys.exit(code)
        else:
            run_search(opts)


if __name__ == "__main__":
    main()
