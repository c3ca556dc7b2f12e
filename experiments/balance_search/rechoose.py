"""Replay every balance search's recorded runs under the search's current confirmation rule and rewrite the entries
whose choice it changes, without a run on the ranks.

A neighbour now replaces the balanced point only where its median TTFT is lower by more than kvr-search's
``--confirm-margin`` (1%); the searches here ran when the lowest median won by any margin. A search is deterministic
given its figures, so replaying its checkpoint (``tables/<name>.search/<ctx>.balance.json``) makes the same runs
in the same order and only the final choice can differ. The entry keeps its candidates and search time (the runs
are the same); later lengths of a table searched with carried rates were seeded by the rates of the entry chosen
then, which the replay reports and leaves as it was (a seed places a search's start, not its answer).

Usage: python experiments/balance_search/rechoose.py [--margin 0.01] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvrunahead.model.load import resolve_config
from kvrunahead.partition import Partition
from kvrunahead.search.balance import CONFIRM, balance_search
from kvrunahead.search.options import SearchOptions
from kvrunahead.sim.flops import layer_cost

HERE = Path(__file__).resolve().parent


class _Unrecorded(Exception):
    """The replay asked for a run the checkpoint does not hold."""


def _never(b):
    raise _Unrecorded(b)


def replay(runs: list[dict], work, margin: float):
    """The search's result on its recorded runs, under whichever confirmation (toward, both) made them."""
    for confirm in CONFIRM:
        try:
            return balance_search(_never, tuple(runs[0]["boundaries"]), work, preload=list(runs), confirm=confirm,
                                  confirm_margin=margin), confirm
        except _Unrecorded:
            continue
    raise SystemExit("a checkpoint no confirmation rule replays")


def rechoose(table_path: Path, margin: float, dry_run: bool) -> list[str]:
    data = json.loads(table_path.read_text())
    cost = layer_cost(resolve_config(data["meta"]["model"]))
    attention = data["meta"]["kvr_attention"]

    def work(prefix: float, tokens: float) -> float:
        return cost.rank_flops(prefix, tokens, attention)

    lines, changed = [], False
    for entry in data["entries"]:
        ckpt = table_path.with_suffix(".search") / f"{entry['context_len']}.balance.json"
        if entry.get("criterion") != "balance" or not ckpt.exists():
            continue
        result, confirm = replay(json.loads(ckpt.read_text())["runs"], work, margin)
        if list(result.boundaries) == entry["boundaries"]:
            continue
        before = f"{','.join(map(str, entry['boundaries']))} (balance {entry['balance']:.3f}, {entry['ttft_s']:.3f} s)"
        entry.update(boundaries=list(result.boundaries), ratios=list(Partition(result.boundaries).ratios),
                     ttft_s=result.ttft_s, balance=round(result.balance, 4),
                     busy_s=[round(x, 4) for x in result.busy_s])
        changed = True
        lines.append(f"{table_path.name} {entry['context_len']}: {before} -> "
                     f"{','.join(map(str, result.boundaries))} (balance {result.balance:.3f}, {result.ttft_s:.3f} s; "
                     f"confirm {confirm})")
    if changed and not dry_run:
        table_path.write_text(json.dumps(data, indent=1) + "\n")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--margin", type=float, default=SearchOptions.confirm_margin)
    ap.add_argument("--dry-run", action="store_true", help="report the changes, write nothing")
    args = ap.parse_args()
    for path in sorted((HERE / "tables").glob("*.json")):
        for line in rechoose(path, args.margin, args.dry_run):
            print(line)


if __name__ == "__main__":
    main()
