"""Where kvr-search's --carry-rates would have started each length of the balance re-search, from the runs it
recorded: the rates every rank showed at the previous length's chosen partition (median busy time of its runs,
against the FLOP model), carried to the next length (``balanced_boundaries(..., length=n)``), against the cost
model's seed that search started from and the partition it found.

Usage: python experiments/balance_search/carried_seeds.py   (reads tables/loopback.json and its checkpoints)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvrunahead.model.load import resolve_config
from kvrunahead.search.balance import balanced_boundaries
from kvrunahead.sim.flops import layer_cost

HERE = Path(__file__).parent


def main() -> None:
    cost = layer_cost(resolve_config("smollm2-135m"))

    def work(prefix: float, tokens: float) -> float:
        return cost.rank_flops(prefix, tokens, "split")

    table = {e["context_len"]: e for e in json.loads((HERE / "tables/loopback.json").read_text())["entries"]}
    print("| context | cost model's seed | carried from the length before | found | seed off by (share of the "
          "context): model / carried |\n|---|---|---|---|---|")
    prev = None
    for n in sorted(table):
        runs = json.loads((HERE / f"tables/loopback.search/{n}.balance.json").read_text())["runs"]
        found = tuple(table[n]["boundaries"])
        model = tuple(runs[0]["boundaries"])
        carried = None
        if prev is not None:
            b, busy = prev
            carried = balanced_boundaries(b, busy, work, quantum=8, length=n)
        mine = [r["busy_s"] for r in runs if tuple(r["boundaries"]) == found]
        prev = found, [statistics.median(x[i] for x in mine) for i in range(len(found) - 1)]
        off = f"{(model[1] - found[1]) / n:+.2%} / " + (f"{(carried[1] - found[1]) / n:+.2%}" if carried else "-")
        print(f"| {n} | {model[1]} | {carried[1] if carried else '-'} | {found[1]} | {off} |")


if __name__ == "__main__":
    main()
