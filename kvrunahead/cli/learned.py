"""What kvr-serve learned of its layouts: the prefills it timed, per length bucket and degree, and what it now chooses.

\b
  kvr-learned                                   # every file kvr-serve --learn auto kept on this machine
  kvr-learned FILE --export partition_tables    # the timings as measured tables (degree 1 and the chain)
"""

from __future__ import annotations

import statistics
from pathlib import Path

import click

from kvrunahead.cli import common

PROG = "kvr-learned"


@click.command(context_settings=common.SETTINGS, help=__doc__)
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--export", "out", type=click.Path(file_okay=False, path_type=Path),
              help="Write each file's timings as partition tables into this folder (read by the degree policy and "
                   "the partition policy when the folder is partition_tables/, or by --table).")
def main(files: tuple[Path, ...], out: Path | None) -> None:
    from kvrunahead.model.load import cache_dir
    from kvrunahead.serve import learning

    if not files:
        files = tuple(sorted((cache_dir() / "learned").glob("*.json")))
        if not files:
            common.fail(PROG, f"no learned timings in {cache_dir() / 'learned'}: kvr-serve --learn auto keeps them")
    learners = []
    for path in files:
        try:
            learners.append((path, learning.load(path)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            common.fail(PROG, f"cannot read {path}: {e}")
    for path, learner in learners:
        click.echo(_describe(path, learner))
        if out is None:
            continue
        if learner.key.get("tp", 1) > 1 or learner.key.get("prefill") != "chain":
            common.fail(PROG, f"{path}: timings over TP groups or the pipeline export no table (the tables are of "
                              "the chain of whole-model ranks)")
        for written in learning.export(learner, out, _work(learner.key)):
            click.echo(f"wrote {written}")


def _work(key: dict):
    """The modelled work of a chain rank (partition.Work) of the file's model, which its ranks' rates are against."""
    from kvrunahead.model.load import resolve_config
    from kvrunahead.sim.flops import layer_cost

    cost = layer_cost(resolve_config(key["model"]))
    return lambda prefix, tokens: cost.rank_flops(prefix, tokens, key["kvr_attention"])


def _describe(path: Path, learner) -> str:
    k = learner.key
    lines = [f"{path}: {k['model']} {k['dtype']}, {k['world_size']} ranks of {k['threads']} thread(s) "
             f"(one rank: {k['solo_threads']}), {k['bandwidth']}, {k['prefill']}, on {k.get('machine', '?')}",
             "| bucket (tokens) | degree | timings | median s | median s / prior |", "|---|---|---|---|---|"]
    for edge, b in sorted(learner.buckets.items()):
        for degree, ts in sorted(b.timings.items()):
            if ts:
                lines.append(f"| {edge} | {degree} | {len(ts)} | {statistics.median(t.seconds for t in ts):.3f} | "
                             f"{statistics.median(t.ratio for t in ts):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
