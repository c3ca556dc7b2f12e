"""``kvr-search``: measure TTFT on the target ranks and write a partition lookup table.

The ranks stay up for the whole search: the model is loaded once; every rank runs the same search code,
and the emitting rank's measured TTFT is shared with all, so every rank proposes the same next candidate.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import click

log = logging.getLogger("kvrunahead.search")


def _share(value, world) -> object:
    """The value of whichever rank has one (the emitting rank), on every rank."""
    from kvrunahead.net.liveness import gather_objects

    if world.world_size == 1:
        return value
    gathered = gather_objects(value, "the other ranks' measurement")
    return next(v for v in gathered if v is not None)


def _base_config(opts: dict):
    from kvrunahead.policy import RunConfig

    return RunConfig(model=opts["model"], threads=opts["threads"], device=opts["device"], dtype=opts["dtype"],
                     max_new_tokens=1, allow_long_context=opts["allow_long_context"], timeout_s=opts["timeout_s"],
                     kvr_attention=opts["kvr_attention"], net=opts["net"])


def table_key(opts: dict, world_size: int, local_world_size: int | None = None, config=None):
    """What the table being written is for (and what an existing --out must have been made for); ``config``:
    the model's config where the caller has resolved it already."""
    from kvrunahead.model.load import resolve_config
    from kvrunahead.policy import resolve_attention, table_key

    base = _base_config(opts)
    config = config if config is not None else resolve_config(opts["model"])
    attention, _ = resolve_attention(base, config)
    return table_key(base, config, world_size, attention, local_world_size or world_size)


def check_inputs(opts: dict, world_size: int) -> Path:
    """One-line errors before any rank starts; returns the table path."""
    from kvrunahead.errors import InputError
    from kvrunahead.model.load import ModelError, resolve_config
    from kvrunahead.model.rope import ContextError, plan_extension
    from kvrunahead.search.tables import TABLES_DIR, Table, TableError, table_filename

    for name, least in (("threads", 1), ("repeats", 1), ("warmup", 0), ("min_stride", 1), ("window", 1)):
        if opts[name] < least:
            raise InputError(f"--{name.replace('_', '-')} must be at least {least}, got {opts[name]}")
    if world_size < 2:
        raise InputError(f"a partition search needs at least 2 ranks, got {world_size}")
    if not opts["contexts"]:
        raise InputError("--ctx names no context length")
    try:
        config = resolve_config(opts["model"])
        key = table_key(opts, world_size, config=config)
        for ctx in opts["contexts"]:
            plan_extension(config, ctx, opts["allow_long_context"], opts["model"])
    except (ModelError, ContextError) as e:
        raise InputError(str(e)) from None
    out = Path(opts["out"]) if opts["out"] else TABLES_DIR / table_filename(key)
    if out.exists() and not (opts["backend"] == "model" and not opts["refine"]):  # model_search checks its own
        try:
            existing = Table.load(out)
            existing.check(key, name=str(out))
        except TableError as e:
            raise InputError(f"{e}; --out must be a new table or one made for the same setting") from None
        if existing.meta.source != "measured":
            raise InputError(f"{out} holds the cost model's predictions ({existing.meta.source}); a measured "
                             f"search writes a table of its own (--out)")
    for ctx in opts["contexts"]:
        if ctx < world_size * opts["min_stride"]:
            raise InputError(f"context of {ctx} tokens is too short for {world_size} ranks at --min-stride "
                             f"{opts['min_stride']}")
    return out


def run_search(opts: dict) -> None:
    import torch.distributed as dist

    from kvrunahead import __version__
    from kvrunahead.launcher import detect_launcher, init_world, pick_backend, world_size_hint
    from kvrunahead.net.spec import parse_net
    from kvrunahead.policy import resolve_device
    from kvrunahead.provenance import environment
    from kvrunahead.runner import leave_world
    from kvrunahead.search.tables import Table, TableMeta

    launcher = detect_launcher()
    out = check_inputs(opts, world_size_hint(launcher, 1))
    device = resolve_device(opts["device"], 0)
    world = init_world(launcher, pick_backend(device), opts["timeout_s"])
    p = world.world_size
    lead = world.rank == 0
    key = table_key(opts, p, world.local_world_size)
    noise = parse_net(opts["net"]).noise
    base = _base_config(opts)
    base.kvr_attention = key.kvr_attention
    env = environment(opts["model"], "torch", opts["threads"], key.bandwidth)
    table = Table.load(out) if out.exists() else Table(TableMeta(
        model=opts["model"], config_hash=key.config_hash, dtype=key.dtype, world_size=p,
        backend=pick_backend(device), transport="torch", device=env["cpu"] if device.type == "cpu" else
        __import__("torch").cuda.get_device_name(device), threads_per_rank=opts["threads"],
        bandwidth=key.bandwidth, version=__version__, kvr_attention=key.kvr_attention,
        device_kind=key.device_kind, noise=noise.describe() if noise else None))
    if lead:
        click.echo(f"searching partitions for {key.describe()} -> {out}", err=True)
    try:
        _search_lengths(opts, world, base, table, out, lead)
        if world.world_size > 1:
            dist.barrier()
    finally:
        leave_world()


def _search_lengths(opts: dict, world, base, table, out: Path, lead: bool) -> None:
    from kvrunahead.policy import RunConfig
    from kvrunahead.runner import run_on_world
    from kvrunahead.search.algorithm import even_boundaries, refine, search
    from kvrunahead.search.tables import Table, TableEntry

    p = world.world_size
    ckpt_dir = Path(opts["checkpoints"]) if opts["checkpoints"] else out.with_suffix(".search")
    for ctx in opts["contexts"]:
        if opts["resume"] and any(e.context_len == ctx for e in table.entries):
            if lead:
                click.echo(f"[ctx {ctx}] already in {out}: kept (--resume)", err=True)
            continue

        warm = {"runs": opts["warmup"]}

        def measure(b, ctx=ctx, warm=warm) -> float:
            # The warm-up runs precede a length's first candidate only: the model stays loaded and warm
            # between candidates, and the median of the repeats absorbs a slower first run of a new shape.
            cfg = RunConfig(**{**base.__dict__, "context_len": ctx, "partition": ",".join(map(str, b))})
            times = []
            for i in range(warm["runs"] + opts["repeats"]):
                result = run_on_world(cfg, world)
                t = _share(result.ttft_s if result is not None else None, world)
                if i >= warm["runs"]:
                    times.append(t)
            warm["runs"] = 0
            return statistics.median(times)

        seed = None
        seeds = Table.load(Path(opts["seed_table"])) if opts["seed_table"] else table
        if opts["refine"]:
            # Rank 0's answer for all: ranks on other hosts may hold other profiles.
            seed = _share(_model_answer(opts, ctx, p).boundaries if lead else None, world)
            if lead:
                click.echo(f"[ctx {ctx}] the cost model's partition {','.join(map(str, seed))}: measuring it and "
                           f"its neighbours {opts['min_stride']} tokens away", err=True)
        elif opts["seeded"] and seeds.entries:
            seed = seeds.search_seed(ctx)
        on_measure, on_level = _progress(ctx, seed, lead)
        ckpt = ckpt_dir / f"{ctx}.json" if lead else None
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            if not opts["resume"] and ckpt.exists():
                ckpt.unlink()
        # Every rank resumes from rank 0's checkpoint so that all replay the same candidates.
        resumed = _share(json.loads(ckpt.read_text()) if ckpt is not None and ckpt.exists() else {}, world)
        if opts["refine"]:
            result = refine(measure, seed, opts["min_stride"], checkpoint=ckpt, on_measure=on_measure,
                            preload=resumed)
        else:
            result = search(measure, ctx, p, min_stride=opts["min_stride"], seed=seed, window=opts["window"],
                            checkpoint=ckpt, on_measure=on_measure, on_level=on_level, preload=resumed)
        even_t = result.all.get(even_boundaries(ctx, p))
        # Every rank adds the entry: the next length is seeded from this table, and all ranks must propose
        # the same candidates.
        table.add(TableEntry(context_len=ctx, boundaries=list(result.boundaries),
                             ratios=[(hi - lo) / ctx for lo, hi in zip(result.boundaries, result.boundaries[1:])],
                             ttft_s=result.ttft_s, even_ttft_s=even_t, evaluations=result.evaluations,
                             search_s=round(result.search_s, 1), seeded=seed is not None))
        if lead:
            table.save(out)
            even = f"even {even_t:.3f} s" if even_t is not None else "even not measured"
            click.echo(f"[ctx {ctx}] best {','.join(map(str, result.boundaries))}: TTFT {result.ttft_s:.3f} s "
                       f"({even}), {result.evaluations} candidates, {result.search_s:.0f} s", err=True)
    if lead:
        click.echo(f"wrote {out}", err=True)


def _cost_model(opts: dict, world_size: int):
    """The table's key and its cost model: the model's shape on the chosen profile, over the table's link.
    With --device auto the table is for the profile's device kind (a GPU profile writes a cuda table)."""
    from kvrunahead.model.load import ModelError, resolve_config
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.profile import resolve_profile
    from kvrunahead.sim.shape import shape_from_config

    profile, which = resolve_profile(opts["profile"], opts["threads"])
    if opts["device"] == "auto":
        opts = {**opts, "device": profile.device_kind}
    key = table_key(opts, world_size)
    profile, link, link_note = profile.for_network(key.bandwidth)
    try:
        shape = shape_from_config(resolve_config(opts["model"]), key.dtype, opts["model"])
    except ModelError as e:
        from kvrunahead.errors import InputError

        raise InputError(f"--backend model: {e}") from None
    return key, CostModel(shape, profile, link), which, link_note


def _model_answer(opts: dict, ctx: int, world_size: int):
    from kvrunahead.sim.optimize import search_partition

    key, cost, _, _ = _cost_model(opts, world_size)
    return search_partition(cost, ctx, world_size, key.kvr_attention, min_stride=opts["min_stride"])


def model_search(opts: dict, world_size: int) -> None:
    """``--backend model``: the table from the cost model, without starting a rank."""
    from kvrunahead import __version__
    from kvrunahead.errors import InputError
    from kvrunahead.search.tables import TABLES_DIR, Table, TableEntry, TableMeta, table_filename
    from kvrunahead.sim.optimize import search_partition

    key, cost, which, link_note = _cost_model(opts, world_size)
    # Its own file: a prediction never lands in (or is read as) the measured table of the same setting.
    out = Path(opts["out"]) if opts["out"] else TABLES_DIR / table_filename(key).replace(".json", "_model.json")
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
        model=opts["model"], config_hash=key.config_hash, dtype=key.dtype, world_size=world_size, backend="model",
        transport="model", device=cost.profile.device, threads_per_rank=opts["threads"], bandwidth=key.bandwidth,
        version=__version__, kvr_attention=key.kvr_attention, device_kind=key.device_kind,
        source=f"cost model: {cost.profile.name}"))
    for ctx in opts["contexts"]:
        r = search_partition(cost, ctx, world_size, key.kvr_attention, min_stride=opts["min_stride"])
        table.add(TableEntry(context_len=ctx, boundaries=list(r.boundaries),
                             ratios=[(hi - lo) / ctx for lo, hi in zip(r.boundaries, r.boundaries[1:])],
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


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--nproc", type=int, default=2, show_default=True, help="Ranks to spawn (unless under torchrun/mpirun).")
@click.option("--ctx", "contexts", required=True, help="Context lengths, e.g. 2k,4k,6k,8k.")
@click.option("--min-stride", type=int, default=64, show_default=True, help="Finest step of a boundary, in tokens.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per candidate (median).")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Untimed runs before the first candidate of each length.")
@click.option("--kvr-attention", type=click.Choice(["auto", "masked", "split"]), default="auto", show_default=True,
              help="The attention the table is searched for (recorded in it; kvr-prefill uses a table only with "
                   "the same attention). auto: split where the model allows it, else masked.")
@click.option("--seeded/--no-seeded", default=True, show_default=True,
              help="Start each length from the table's interpolation and search only --window around it.")
@click.option("--window", type=int, default=256, show_default=True, help="Tokens either side of a seed to search.")
@click.option("--seed-table", type=click.Path(exists=True, dir_okay=False),
              help="Seed from this table's interpolation instead of the one being written.")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Table to write (extended if it exists). Default: partition_tables/ under the name of the "
                   "setting, e.g. smollm2-135m_p2_float32_cpu_split.json, where kvr-prefill finds it.")
@click.option("--resume", is_flag=True, help="Continue an interrupted search from its checkpoints.")
@click.option("--checkpoints", type=click.Path(file_okay=False),
              help="Directory of the per-length checkpoints (every candidate measured). Default: next to --out, "
                   "as <table>.search/.")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--net", default=None,
              help="The network to search on: loopback (default on one host), cap=400MB/s (every rank on an "
                   "emulated host of its own, links capped each way; needs root), ',noise' for the sidecar too. "
                   "The table is keyed on the cap (kvr-prefill uses it only on the same cap); noise is recorded.")
@click.option("--backend", type=click.Choice(["measured", "model"]), default="measured", show_default=True,
              help="measured: time candidates on the ranks; model: find the partition with the cost model and "
                   "simulator (seconds, any --nproc, no ranks started).")
@click.option("--profile", default=None,
              help="Hardware profile for --backend model: cpu (this machine's kvr-calibrate profile, else the "
                   "shipped one), a100-nvlink, h100-nvlink, ... or a file.")
@click.option("--refine", is_flag=True,
              help="With --backend model: then measure on the real ranks only the model's answer and its "
                   "neighbours --min-stride tokens away, moving while a neighbour is faster.")
@click.option("--allow-long-context", is_flag=True)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True)
def main(nproc: int, contexts: str, **opts) -> None:
    """Search TTFT-minimising partitions on the target ranks and write a partition lookup table.

    \b
    For two ranks: golden-section search over rank 0's share (fig. 6a of the paper); for more: the
    hierarchical grid search of fig. 6 b-d down to --min-stride. Each candidate is measured with
    --repeats runs (median) after --warmup runs per length, logged, checkpointed next to the table
    (--resume continues), and never measured twice. Example:
      kvr-search --ctx 1k,2k,4k,8k --nproc 2 --kvr-attention split
      kvr-search --backend model --nproc 8 --ctx 16k --out /tmp/t.json
    """
    from kvrunahead.errors import InputError, LaunchError, PeerTimeout
    from kvrunahead.launcher import detect_launcher, spawn
    from kvrunahead.net.spec import NetError, parse_net
    from kvrunahead.prompt import PromptError, parse_tokens
    from kvrunahead.sim.profile import ProfileError

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    launcher = detect_launcher()
    try:
        opts["contexts"] = [parse_tokens(c) for c in contexts.split(",") if c.strip()]
        if opts["refine"] and opts["backend"] != "model":
            raise InputError("--refine refines the model's answer: add --backend model")
        if launcher == "single":
            check_inputs(opts, nproc)  # once here, not once per rank
        net = parse_net(opts["net"])
        if opts["backend"] == "model" and not opts["refine"]:
            model_search(opts, nproc)
            return
    except (PromptError, InputError, NetError, ProfileError) as e:
        click.echo(f"kvr-search: error: {e}", err=True)
        sys.exit(2)
    if launcher == "single" and nproc > 1:
        t = time.perf_counter()
        try:
            code = spawn(nproc, sys.argv[1:], module="kvrunahead.search.cli", net=net)
        except NetError as e:
            click.echo(f"kvr-search: error: {e}", err=True)
            sys.exit(2)
        click.echo(f"search took {time.perf_counter() - t:.0f} s", err=True)
        sys.exit(code)
    try:
        run_search(opts)
    except (InputError, LaunchError) as e:
        click.echo(f"kvr-search: error: {e}", err=True)
        sys.exit(2)
    except PeerTimeout as e:
        # The candidates measured so far are in the checkpoints: --resume continues from them.
        click.echo(f"kvr-search: {e}; the candidates measured so far are kept (--resume continues)", err=True)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
