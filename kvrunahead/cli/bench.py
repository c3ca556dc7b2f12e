"""``kvr-bench``: TTFT of every prefill mode over context lengths, world sizes and transports.

The orchestrator starts one world of ranks per (world size, threads, transport); the ranks stay up for
their whole share of the sweep (the model is loaded once) and every rank walks the same plan, so the
collectives line up. Each run becomes one row; the emitting rank writes it.

Torch-free: the ranks import torch, this process only plans, checks, starts worlds and reports.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from kvrunahead.bench.orchestrate import clean_partial_rows, run_world
from kvrunahead.bench.plan import (
    DEFAULT_MODES,
    EXTRA_MODES,
    SPP_MODE,
    Job,
    build_jobs,
    check_inputs,
    net_worlds,
    runs_in,
)
from kvrunahead.bench.plots import write_plots
from kvrunahead.bench.report import add_bounds, markdown_table, summarize, write_outputs
from kvrunahead.cli import common
from kvrunahead.errors import InputError
from kvrunahead.net.emulation import check_permission
from kvrunahead.net.spec import NetError, parse_net
from kvrunahead.prompt import PromptError, parse_tokens
from kvrunahead.provenance import command, environment

PROG = "kvr-bench"


def _list(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


@click.command(context_settings=common.SETTINGS)
@common.model_option()
@click.option("--ctx", "contexts", default="1k,2k,4k,8k", show_default=True, help="Context lengths.")
@click.option("--nproc", "nprocs", default="2", show_default=True, help="World sizes.")
@click.option("--modes", default=",".join(DEFAULT_MODES), show_default=True,
              help="single runs at 1 thread and at p threads (with --interleave among the ranks' runs, the "
                   "other ranks idle); kvr-default is kvr-prefill's defaults (--partition auto, "
                   "--kvr-attention auto); kvr is the even partition; kvr-best sweeps rank 0's share (--shares) "
                   "and keeps the fastest; kvr-nocomm is the bound on kvr-best's partition (without kvr-best: "
                   "on the first --table's); kvr-split (not default) is kvr-best's partition with "
                   "--kvr-attention split; spp (not default) is Medha's stream pipeline with the cost model's "
                   "chunk, spp-N the same with chunks of N tokens; single-pt (not default, with --interleave) the "
                   "single process at p threads only.")
@click.option("--transports", default="torch", show_default=True, help="torch and/or mpi (mpi needs mpirun).")
@click.option("--repeats", default=3, show_default=True, help="Timed runs per point.")
@click.option("--warmup", default=1, show_default=True, help="Untimed runs per point before the timed ones.")
@click.option("--shares", default="0.50,0.56,0.62,0.68,0.74,0.80", show_default=True,
              help="kvr-best: rank 0's share of the context to try (the other ranks split the rest evenly).")
@click.option("--threads", default=1, show_default=True, help="Intra-op threads per rank.")
# Repeatable, unlike the other CLIs' --net (common.net_option): one sweep measures several settings.
@click.option("--net", "nets", multiple=True, default=["loopback"], show_default=True,
              help="Network setting, repeatable: loopback, cap=400MB/s (one emulated host per rank, links capped "
                   "each way; needs root), cap=400MB/s,noise (the noise sidecar as well). Settings that differ "
                   "only in noise share one world and, with --interleave, alternate run by run with the sidecar "
                   "switched on and off; the summary gives each mode's noise overhead. Recorded in every row.")
@common.allgather_option("All-gather of tsp and cp-allgather (see kvr-prefill --help); recorded in every row.")
@click.option("--table", "tables", multiple=True, metavar="LABEL=PATH",
              help="Also run kvr with the partition interpolated from a table, reported as kvr-LABEL.")
@click.option("--force-table", is_flag=True,
              help="Use the --table tables on every network (e.g. the loopback table on a capped network).")
@common.kvr_attention_option("Attention of the kvr jobs (kvr-even, kvr-best and its sweep, kvr-nocomm, tables; "
                             "kvr-default always takes auto); what ran is recorded in every row.")
@common.allow_long_context_option()
@common.dtype_option()
@common.attention_kernel_option()
@common.linears_option()
@common.compile_option()
@common.timeout_option(600.0)
@click.option("--out", "out_dir", default="experiments/results", show_default=True, type=click.Path())
@click.option("--resume", is_flag=True,
              help="Keep the runs an interrupted sweep with the same arguments left in --out and measure "
                   "only the missing ones (the fresh ranks get one untimed run first).")
@click.option("--interleave", is_flag=True,
              help="Alternate the timed runs of all modes at one context length (after every mode's sweep "
                   "and warm-up), each round starting one mode later, instead of running each mode's repeats "
                   "back to back: fairer ratios on a machine whose speed drifts. Recorded in every row.")
@click.option("--replot", is_flag=True,
              help="Measure nothing: rebuild summary.csv/md and the plots from the runs.jsonl in --out.")
def cli(model, contexts, nprocs, modes, transports, repeats, warmup, shares, threads, nets, allgather, tables,
        force_table, kvr_attention, allow_long_context, dtype, compile, timeout_s, out_dir, resume, interleave,
        replot):
    """Measure TTFT of every prefill mode; write runs.csv/jsonl, summary.csv/md and plots to --out.

    \b
    Example (the committed CPU experiment):
      kvr-bench --ctx 1k,2k,4k,8k --nproc 2 --out experiments/ttft_cpu_p2
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ctxs, world_sizes, mode_list, table_paths = _checked_lists(contexts, nprocs, modes, tables, threads, repeats,
                                                               warmup, replot)
    try:
        nets = [parse_net(n).label for n in nets]
        worlds = net_worlds(list(nets))
    except NetError as e:
        common.fail(PROG, str(e))
    config = {"model": model, "allow_long_context": allow_long_context, "max_new_tokens": 1,
              "timeout_s": timeout_s, "device": "cpu", "allgather": allgather, "force_table": force_table,
              "dtype": dtype, "compile": compile}
    out = Path(out_dir)
    if replot:
        _replot(out)
        return
    try:
        check_inputs(config, ctxs, world_sizes, table_paths, kvr_attention, nets)
        if any(parse_net(n).emulated for n in nets):
            check_permission()
    except (InputError, NetError) as e:
        common.fail(PROG, str(e))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    singles_left = {1, *world_sizes} if "single" in mode_list else set(world_sizes) if "single-pt" in mode_list \
        else set()
    for transport in _list(transports):
        for p in world_sizes:
            for world_net, members in worlds:
                # Interleaved: the single process at 1 and p threads is timed among the ranks' runs, in every
                # network's world (it does not communicate, but the machine drifts between worlds).
                in_world = interleave and p > 1 and bool({"single", "single-pt"} & set(mode_list))
                jobs = build_jobs(ctxs, mode_list, repeats, warmup, _list(shares, float), p, table_paths,
                                  kvr_attention, singles_in_world=in_world, nets=members)
                if in_world:
                    singles_left -= {1, p}
                click.echo(f"world p={p} threads={threads} transport={transport} network {world_net}: "
                           f"{runs_in(jobs)} runs", err=True)
                env = {**environment(model, transport, threads, world_net), "command": command()}
                try:
                    rows += run_world(p, threads, transport, jobs, config, env, out, timeout_s, resume,
                                      interleave, net=world_net)
                except (RuntimeError, ValueError, NetError) as e:
                    common.fail(PROG, str(e))
    for t in sorted(singles_left):
        jobs = [Job(f"single-{t}t", "single", c, "even", repeats, warmup) for c in ctxs]
        click.echo(f"single process, {t} thread(s): {runs_in(jobs)} runs", err=True)
        env = {**environment(model, "none", t, "loopback"), "command": command()}
        rows += run_world(1, t, "torch", jobs, config, env, out, timeout_s, resume)
    _report(rows, out)
    clean_partial_rows(out)
    click.echo(f"wrote {out}/runs.csv, summary.md and plots", err=True)


def _checked_lists(contexts: str, nprocs: str, modes: str, tables: tuple[str, ...], threads: int, repeats: int,
                   warmup: int, replot: bool) -> tuple[list[int], list[int], list[str], dict[str, str]]:
    """The comma-separated options as lists, and the tables by label; bad input ends the command (exit 2)."""
    try:
        ctxs = [parse_tokens(c) for c in _list(contexts)]
        world_sizes = _list(nprocs, int)
    except (PromptError, ValueError) as e:
        common.fail(PROG, str(e))
    for name, value, least in (("--threads", threads, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0)):
        if value < least:
            common.fail(PROG, f"{name} must be at least {least}, got {value}")
    if not replot and (not ctxs or not world_sizes or min(world_sizes) < 1):
        common.fail(PROG, "--ctx and --nproc need at least one value each, and world sizes of at least 1")
    mode_list = _list(modes)
    if any("=" not in t for t in tables):
        common.fail(PROG, "--table takes LABEL=PATH")
    table_paths = dict(t.split("=", 1) for t in tables)
    bad = {m for m in set(mode_list) - set(DEFAULT_MODES) - set(EXTRA_MODES) if not SPP_MODE.match(m)}
    if bad:
        common.fail(PROG, f"unknown modes {sorted(bad)}; choose from {', '.join(DEFAULT_MODES + EXTRA_MODES)} "
                          "or spp-N (the pipeline with chunks of N tokens)")
    for label, path in table_paths.items():
        if not Path(path).is_file():
            common.fail(PROG, f"--table {label}={path}: no such file")
    return ctxs, world_sizes, mode_list, table_paths


def _replot(out: Path) -> None:
    runs = out / "runs.jsonl"
    if not runs.exists():
        raise click.UsageError(f"--replot: no {runs}")
    _report([json.loads(line) for line in runs.read_text().splitlines()], out)


def _report(rows: list[dict], out: Path) -> None:
    """The summary with its bounds, written to ``out`` with the runs, and shown."""
    summary = summarize(rows)
    add_bounds(summary)
    write_outputs(rows, summary, out)
    write_plots(summary, out)
    click.echo(markdown_table(summary))


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
