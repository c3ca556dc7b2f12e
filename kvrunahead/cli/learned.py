"""What kvr-serve learned of its layouts: the prefills it timed, per length bucket and degree, and what it now chooses.

\b
  kvr-learned                                   # every file kvr-serve --learn auto kept on this machine
  kvr-learned FILE --export partition_tables    # the timings as measured tables (degree 1 and the chain)
  kvr-learned FILE --reset                      # forget that setting's timings (every file kept: no FILE)
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
@click.option("--reset", is_flag=True,
              help="Remove the files (a server started after it learns its setting afresh; one running keeps what "
                   "it holds and writes it back at its next timing).")
def main(files: tuple[Path, ...], out: Path | None, reset: bool) -> None:
    from kvrunahead.serve import learning
    from kvrunahead.serve.degree import learned_folder

    if reset and out is not None:
        common.fail(PROG, "--reset and --export: one at a time")
    if not files:
        files = tuple(sorted(learned_folder().glob("*.json")))
        if not files:
            common.fail(PROG, f"no learned timings in {learned_folder()}: kvr-serve --learn auto keeps them")
    if reset:
        for path in files:
            if not path.is_file():
                common.fail(PROG, f"no learned timings at {path}")
        for path in files:
            path.unlink()
            click.echo(f"reset {path}")
        return
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
    if learner.ignored:
        lines.insert(1, f"ignored {len(learner.ignored)} timing(s) that cannot serve: {'; '.join(learner.ignored)}")
    for edge, b in sorted(learner.buckets.items()):
        for degree, ts in sorted(b.timings.items()):
            if ts:
                lines.append(f"| {edge} | {degree} | {len(ts)} | {statistics.median(t.seconds for t in ts):.3f} | "
                             f"{statistics.median(t.ratio for t in ts):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
