"""``kvr-search``: measure on the target ranks and write a partition lookup table.

Every option of a search is one ``SearchOptions`` (search/options.py), built once from the command line; spawned
ranks re-parse the same argv into theirs. The ranks stay up for the whole search and measure each candidate
together (search/ranks.py, search/measure.py); ``--backend model`` writes the cost model's table without starting
a rank (search/model_backend.py).
"""

from __future__ import annotations

import logging
import sys
import time

import click

from kvrunahead.cli import common
from kvrunahead.errors import InputError
from kvrunahead.net.spec import parse_net
from kvrunahead.search.balance import CONFIRM
from kvrunahead.search.model_backend import model_search
from kvrunahead.search.options import PEER_TIMEOUT_NOTE, SearchOptions, check_inputs
from kvrunahead.search.ranks import run_search


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
@common.attention_kernel_option()
@common.linears_option()
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
@click.option("--criterion", type=click.Choice(["ttft", "balance"]), default=SearchOptions.criterion,
              show_default=True,
              help="ttft: search on each candidate's median TTFT; balance: move the boundaries to where the ranks' "
                   "busy times of one run are equal (immune to the machine's drift between runs), then time the "
                   "balanced point and its neighbours --min-stride away in --confirm-rounds interleaved rounds.")
@click.option("--confirm-rounds", type=int, default=SearchOptions.confirm_rounds, show_default=True,
              help="--criterion balance: interleaved rounds of the final comparison.")
@click.option("--confirm", type=click.Choice(CONFIRM), default=SearchOptions.confirm, show_default=True,
              help="--criterion balance: the neighbours timed against the balanced point: toward, per boundary the "
                   "one on the side the measured imbalance points to; both, either side.")
@click.option("--confirm-margin", type=float, default=SearchOptions.confirm_margin, show_default=True,
              help="--criterion balance: how much lower (a fraction) a neighbour's median TTFT must be to replace "
                   "the balanced point; within it the noise decides, and the balance is the better witness.")
@click.option("--carry-rates/--no-carry-rates", default=SearchOptions.carry_rates, show_default=True,
              help="--criterion balance: start each length where the per-rank rates measured at the next shorter "
                   "length of the same table balance it (before the cost model's answer or the interpolation).")
@click.option("--refine", is_flag=True,
              help="With --backend model: then measure on the real ranks only the model's answer and its "
                   "neighbours --min-stride tokens away, moving while a neighbour is faster.")
@common.tp_option()
@common.allow_long_context_option()
@common.timeout_option(SearchOptions.timeout_s)
def main(nproc: int, contexts: str, **options) -> None:
    """Search TTFT-minimising partitions on the target ranks and write a partition lookup table.

    \b
    --criterion ttft: for two ranks golden-section search over rank 0's share (fig. 6a of the paper); for
    more the hierarchical grid search of fig. 6 b-d down to --min-stride; each candidate measured with
    --repeats runs (median) after --warmup runs per length, never twice. --criterion balance: from where
    the rates a shorter entry measured balance the length (--carry-rates), else the cost model's answer
    (--backend model --refine), the seed table's (--seeded) or the FLOP estimate, each run's per-rank busy
    times move every boundary toward balance; the entry records the balance, the ranks' busy times and the
    candidates. Both log and checkpoint every run next to the table (--resume continues). --nproc 1: no
    search, the one-rank TTFT at each length (a degree-1 table, which kvr-serve's degree policy compares with
    the chain's; measure it at the threads the front takes alone, all the node's cores).
    Example:
      kvr-search --ctx 1k,2k,4k,8k --nproc 2 --kvr-attention split
      kvr-search --ctx 1k,2k,4k,8k --nproc 1 --threads 2
      kvr-search --ctx 2k --nproc 2 --criterion balance --out /tmp/t.json
      kvr-search --backend model --nproc 8 --ctx 16k --out /tmp/t.json
      kvr-search --ctx 4k --nproc 4 --tp 2          # a chain of two TP groups of 2: a table keyed on --tp 2
    """
    from kvrunahead.ranks.launcher import detect_launcher, spawn

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    launcher = detect_launcher()
    # A peer that stops answering ends a measured search; its checkpoints hold every candidate measured.
    with common.failure_ending("kvr-search", timeout_note=PEER_TIMEOUT_NOTE):
        opts = SearchOptions.from_cli(contexts, **options)
        if opts.refine and opts.backend != "model":
            raise InputError("--refine refines the model's answer: add --backend model")
        if opts.criterion == "balance" and opts.backend == "model" and not opts.refine:
            raise InputError("--criterion balance reads the balance of runs on the ranks: drop --backend model, "
                             "or add --refine to start from the model's answer")
        if launcher == "single":
            check_inputs(opts, nproc)  # once here, not once per rank
        net = parse_net(opts.net)
        if opts.backend == "model" and not opts.refine:
            model_search(opts, nproc)
        elif launcher == "single" and nproc > 1:
            t = time.perf_counter()
            code = spawn(nproc, sys.argv[1:], module="kvrunahead.cli.search", net=net, fork=True)
            click.echo(f"search took {time.perf_counter() - t:.0f} s", err=True)
            sys.exit(code)
        else:
            run_search(opts)


if __name__ == "__main__":
    main()
