"""``kvr-search``: measure TTFT on the target ranks and write a partition lookup table.

The ranks stay up for the whole search: the model is loaded once; every rank runs the same search code,
and the emitting rank's measured TTFT is shared with all, so every rank proposes the same next candidate.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import click

log = logging.getLogger("kvrunahead.search")


def _share(value, world) -> object:
    """The value of whichever rank has one (the emitting rank), on every rank."""
    import torch.distributed as dist

    if world.world_size == 1:
        return value
    gathered = [None] * world.world_size
    dist.all_gather_object(gathered, value)
    return next(v for v in gathered if v is not None)


def run_search(opts: dict) -> None:
    import torch.distributed as dist

    from kvrunahead import __version__
    from kvrunahead.bench import environment
    from kvrunahead.launcher import detect_launcher, init_world, pick_backend
    from kvrunahead.models import resolve_config
    from kvrunahead.runner import RunConfig, leave_world, resolve_device
    from kvrunahead.tables import Table, TableMeta, config_hash

    device = resolve_device(opts["device"], 0)
    world = init_world(detect_launcher(), pick_backend(device), opts["timeout_s"])
    p = world.world_size
    lead = world.rank == 0
    base = RunConfig(model=opts["model"], threads=opts["threads"], device=opts["device"], dtype=opts["dtype"],
                     max_new_tokens=1, allow_long_context=opts["allow_long_context"], timeout_s=opts["timeout_s"])
    dtype = base.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    env = environment(opts["model"], "torch", opts["threads"], opts["bandwidth"])
    out = Path(opts["out"])
    table = Table.load(out) if out.exists() else Table(TableMeta(
        model=opts["model"], config_hash=config_hash(resolve_config(opts["model"])), dtype=dtype, world_size=p,
        backend=pick_backend(device), transport="torch", device=env["cpu"] if device.type == "cpu" else
        __import__("torch").cuda.get_device_name(device), threads_per_rank=opts["threads"],
        bandwidth=opts["bandwidth"], version=__version__))
    if table.meta.world_size != p:
        raise click.ClickException(f"{out} is a table for world size {table.meta.world_size}, not {p}")
    try:
        _search_lengths(opts, world, base, table, out, lead)
        if world.world_size > 1:
            dist.barrier()
    finally:
        leave_world()


def _search_lengths(opts: dict, world, base, table, out: Path, lead: bool) -> None:
    from kvrunahead.runner import RunConfig, run_on_world
    from kvrunahead.search import even_boundaries, search
    from kvrunahead.tables import Table, TableEntry

    p = world.world_size
    ckpt_dir = out.with_suffix(".search")
    for ctx in opts["contexts"]:
        if opts["resume"] and any(e.context_len == ctx for e in table.entries):
            if lead:
                click.echo(f"[ctx {ctx}] already in {out}: kept (--resume)", err=True)
            continue

        def measure(b, ctx=ctx) -> float:
            cfg = RunConfig(**{**base.__dict__, "context_len": ctx, "partition": ",".join(map(str, b))})
            times = []
            for i in range(opts["warmup"] + opts["repeats"]):
                result = run_on_world(cfg, world)
                t = _share(result.ttft_s if result is not None else None, world)
                if i >= opts["warmup"]:
                    times.append(t)
            return statistics.median(times)

        seed = None
        seeds = Table.load(Path(opts["seed_table"])) if opts["seed_table"] else table
        if opts["seeded"] and seeds.entries:
            seed = seeds.search_seed(ctx)
        on_measure, on_level = _progress(ctx, seed, lead)
        ckpt = ckpt_dir / f"{ctx}.json" if lead else None
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            if not opts["resume"] and ckpt.exists():
                ckpt.unlink()
        # Every rank resumes from rank 0's checkpoint so that all replay the same candidates.
        resumed = _share(json.loads(ckpt.read_text()) if ckpt is not None and ckpt.exists() else {}, world)
        result = search(measure, ctx, p, min_stride=opts["min_stride"], seed=seed, window=opts["window"],
                        checkpoint=ckpt, on_measure=on_measure, on_level=on_level, preload=resumed)
        even_t = result.all[even_boundaries(ctx, p)]
        # Every rank adds the entry: the next length is seeded from this table, and all ranks must propose
        # the same candidates.
        table.add(TableEntry(context_len=ctx, boundaries=list(result.boundaries),
                             ratios=[(hi - lo) / ctx for lo, hi in zip(result.boundaries, result.boundaries[1:])],
                             ttft_s=result.ttft_s, even_ttft_s=even_t, evaluations=result.evaluations,
                             search_s=round(result.search_s, 1), seeded=seed is not None))
        if lead:
            table.save(out)
            click.echo(f"[ctx {ctx}] best {','.join(map(str, result.boundaries))}: TTFT {result.ttft_s:.3f} s "
                       f"(even {even_t:.3f} s), {result.evaluations} candidates, {result.search_s:.0f} s", err=True)
    if lead:
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
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs per candidate.")
@click.option("--seeded/--no-seeded", default=True, show_default=True,
              help="Start each length from the table's interpolation and search only --window around it.")
@click.option("--window", type=int, default=256, show_default=True, help="Tokens either side of a seed to search.")
@click.option("--seed-table", type=click.Path(exists=True, dir_okay=False),
              help="Seed from this table's interpolation instead of the one being written.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Table to write (extended if it exists).")
@click.option("--resume", is_flag=True, help="Continue an interrupted search from its checkpoints.")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--bandwidth", default="loopback", show_default=True, help="Label of the network setting.")
@click.option("--allow-long-context", is_flag=True)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True)
def main(nproc: int, contexts: str, **opts) -> None:
    """Search TTFT-minimising partitions on the target ranks and write a partition lookup table.

    \b
    For two ranks: golden-section search over rank 0's share (fig. 6a of the paper); for more: the
    hierarchical grid search of fig. 6 b-d down to --min-stride. Each candidate is measured with
    --warmup and --repeats runs (median), logged, checkpointed next to the table (--resume continues),
    and never measured twice. Example:
      kvr-search --ctx 2k,4k,6k,8k --nproc 2 --out partition_tables/smollm2-135m_p2_cpu.json
    """
    from kvrunahead.launcher import detect_launcher, spawn
    from kvrunahead.prompt import parse_tokens

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    opts["contexts"] = [parse_tokens(c) for c in contexts.split(",") if c.strip()]
    if detect_launcher() == "single" and nproc > 1:
        t = time.perf_counter()
        code = spawn(nproc, sys.argv[1:], module="kvrunahead.search_cli")
        click.echo(f"search took {time.perf_counter() - t:.0f} s", err=True)
        sys.exit(code)
    run_search(opts)


if __name__ == "__main__":
    main()
