"""One-shot and serving TTFT before and after a restructure, interleaved: ``kvr-prefill`` and ``kvr-serve`` of the
default model (SmolLM2-135M-Instruct, float32, 2 ranks of 1 thread) at 4k and 16k tokens, each run from a checkout
of the commit before (``--before``, a ``git worktree``) and from this one, the order alternating by round.

    git worktree add /tmp/before a0c3433^
    python experiments/house/timing.py --before /tmp/before --rounds 3

Each tree runs as ``python -m kvrunahead.cli.*`` with its folder first on PYTHONPATH, so the ranks it starts import
it too. Rows are appended as they are measured (a run cut short keeps them); the medians and the after / before
ratios are printed at the end, and by ``--report``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from kvrunahead import provenance
from kvrunahead.bench.peers import MODEL, before_after, checkout_commit, checkout_env, checkout_server, one, prompt_ids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def prefill_s(tree: Path, tokens: int) -> float:
    """A ``kvr-prefill`` of ``tokens`` from ``tree``: its reported TTFT."""
    args = [sys.executable, "-m", "kvrunahead.cli.prefill", "--nproc", "2", "--threads", "1", "--model", MODEL,
            "--ctx", str(tokens), "--json"]
    done = subprocess.run(args, env=checkout_env(tree), cwd="/tmp", capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"kvr-prefill from {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])["ttft_s"]


def _row(out: Path, **row) -> None:
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def report(out: Path) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["tool"], r["tokens"], r["tree"]), []).append(r["ttft_s"])
    print(f"{'tool':<12} {'tokens':>6} {'before s':>9} {'after s':>8} {'after/before':>12} runs")
    for (tool, tokens), b, a, nb, na in before_after(cells):
        print(f"{tool:<12} {tokens:>6} {b:>9.3f} {a:>8.3f} {a / b:>12.3f} {nb}+{na}")


@click.command()
@click.option("--before", "before", type=click.Path(exists=True, file_okay=False), required=True,
              help="A checkout of the commit before the change (git worktree add DIR COMMIT).")
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--tokens", default="4096,16384", show_default=True)
@click.option("--tools", default="kvr-prefill,kvr-serve", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=str(HERE / "rows.jsonl"), show_default=True)
@click.option("--report", "only_report", is_flag=True, help="Print the medians of the rows there and stop.")
def main(before, rounds, tokens, tools, out, only_report) -> None:
    out = Path(out)
    if only_report:
        report(out)
        return
    trees = {"before": Path(before).resolve(), "after": ROOT}
    commits = {name: checkout_commit(tree) for name, tree in trees.items()}
    lengths = [int(t) for t in tokens.split(",")]
    chosen = tools.split(",")
    common = {"cpu": provenance.cpu_name(), "machine": provenance.machine(), "command": provenance.command(),
              "model": MODEL, "dtype": "float32", "ranks": 2, "threads_per_rank": 1, "commit": commits["after"],
              "before_commit": commits["before"], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for tree in trees.values():  # untimed: the kernel built or found, the model converted, caches warm
        prefill_s(tree, 512)
    for rnd in range(rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        if "kvr-prefill" in chosen:
            for n in lengths:
                for name in order:
                    _row(out, **common, tool="kvr-prefill", tree=name, tree_commit=commits[name], round=rnd,
                         tokens=n, ttft_s=prefill_s(trees[name], n))
        if "kvr-serve" in chosen:
            for name in order:
                server = checkout_server(trees[name], name, 8411)
                try:
                    one(server.url, prompt_ids(512, rnd))  # the server's first request: its one-time work
                    for n in lengths:
                        got = one(server.url, prompt_ids(n, rnd))
                        _row(out, **common, tool="kvr-serve", tree=name, tree_commit=commits[name], round=rnd,
                             tokens=n, ttft_s=got["ttft_s"], text=got["text"])
                finally:
                    server.stop()
    report(out)


if __name__ == "__main__":
    main()
