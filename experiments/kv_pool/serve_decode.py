"""kvr-serve's decode as a user starts it (the default model, ``--nproc 2 --threads 1``), from a checkout of the
commit before a change (``--before``, a ``git worktree``) and from this one, the order alternating by round: at 1
and 8 concurrent streams, each a 512-token prompt (its own window of the shipped text) and 64 tokens
(``ignore_eos``), the time per output token of each request, (end - first token) / 63. Rows are appended as
measured; the medians and after / before at the end, and by ``--report``.

    git worktree add /tmp/before e758211^
    python experiments/kv_pool/serve_decode.py --before /tmp/before --rounds 2
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from kvrunahead import provenance
from kvrunahead.bench.peers import MODEL, before_after, checkout_commit, checkout_server, one, prompt_ids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOKENS = 64


def tpots(url: str, concurrency: int, rnd: int) -> list[float]:
    """Two requests per stream, ``concurrency`` streams at once: each request's time per output token."""
    def stream(i: int) -> list[float]:
        out = []
        for j in range(2):
            got = one(url, prompt_ids(512, 100 * rnd + 10 * i + j), max_tokens=TOKENS, ignore_eos=True)
            assert got["completion_tokens"] == TOKENS, got
            out.append((got["e2e_s"] - got["ttft_s"]) / (TOKENS - 1))
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return [t for ts in pool.map(stream, range(concurrency)) for t in ts]


def report(out: Path) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["concurrency"], r["tree"]), []).extend(r["tpot_s"])
    print(f"{'concurrent':>10} {'before ms':>10} {'after ms':>9} {'after/before':>12} requests")
    for (c,), b, a, nb, na in before_after(cells):
        print(f"{c:>10} {b * 1e3:>10.1f} {a * 1e3:>9.1f} {a / b:>12.3f} {nb}+{na}")


@click.command()
@click.option("--before", "before", type=click.Path(exists=True, file_okay=False), required=True,
              help="A checkout of the commit before the change (git worktree add DIR COMMIT).")
@click.option("--rounds", type=int, default=2, show_default=True)
@click.option("--concurrency", default="1,8", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=str(HERE / "serve_decode.jsonl"), show_default=True)
@click.option("--report", "only_report", is_flag=True, help="Print the medians of the rows there and stop.")
def main(before, rounds, concurrency, out, only_report) -> None:
    out = Path(out)
    if only_report:
        report(out)
        return
    trees = {"before": Path(before).resolve(), "after": ROOT}
    commits = {name: checkout_commit(tree) for name, tree in trees.items()}
    common = {"cpu": provenance.cpu_name(), "machine": provenance.machine(), "command": provenance.command(),
              "model": MODEL, "dtype": "default", "ranks": 2, "threads_per_rank": 1, "commit": commits["after"],
              "before_commit": commits["before"], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for rnd in range(rounds):
        for name in (list(trees) if rnd % 2 == 0 else list(reversed(trees))):
            server = checkout_server(trees[name], name, 8412)
            try:
                one(server.url, prompt_ids(512, 99), max_tokens=TOKENS, ignore_eos=True)  # its one-time work
                for c in (int(x) for x in concurrency.split(",")):
                    row = {**common, "tree": name, "tree_commit": commits[name], "round": rnd, "concurrency": c,
                           "tpot_s": tpots(server.url, c, rnd)}
                    with out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(name, rnd, c, f"{statistics.median(row['tpot_s']) * 1e3:.1f} ms", flush=True)
            finally:
                server.stop()
    report(out)


if __name__ == "__main__":
    main()
