"""summary.md of the balance-guided re-search: the tables (balance, candidates against the old search's) and the
interleaved benchmark (medians, and per-round ratios of the default KVR against every other row).

Usage: python experiments/balance_search/report.py   (reads tables/, old_tables/, bench*/runs.jsonl)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent


def entries(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    return {e["context_len"]: e for e in json.loads(path.read_text())["entries"]}


def timed_rows() -> list[dict]:
    rows = []
    for runs in sorted(HERE.glob("bench*/runs.jsonl")):
        rows += [{**r, "bench": runs.parent.name} for r in map(json.loads, runs.read_text().splitlines())
                 if r.get("kind") == "timed"]
    return rows


def balance(row: dict) -> float:
    """max / min of the ranks' busy time (compute without waits and blocked sends) in one run."""
    busy = [r["compute_s"] for r in row["ranks"]]
    return max(busy) / max(min(busy), 1e-9)


OLD_REPEATS, WARMUP = 3, 1  # the golden-section search's --repeats per candidate; both searches' --warmup per length


def runs_of(ctx: int, searches: tuple[str, ...] = ("loopback.search", "loopback-14k.search")) -> int | None:
    """Prefills the balance search ran for one length: its checkpoint's timed runs and the warm-up."""
    for name in searches:
        path = HERE / "tables" / name / f"{ctx}.balance.json"
        if path.exists():
            return len(json.loads(path.read_text())["runs"]) + WARMUP
    return None


def old_runs_of(entry: dict) -> int:
    """Prefills the golden-section search ran for one entry: every candidate --repeats times and the warm-up."""
    return entry["evaluations"] * OLD_REPEATS + WARMUP


def table_section(new: dict[int, dict], old: dict[int, dict], heldout: dict[int, dict]) -> list[str]:
    lines = ["## Tables", "",
             "| context | re-searched partition | balance (median of its runs) | candidates | runs | old partition "
             "| old candidates | old runs | candidates new / old | runs new / old |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for ctx in sorted(set(new) | set(heldout)):
        e = new.get(ctx) or heldout[ctx]
        o = old.get(ctx)
        ratio = f"{e['evaluations'] / o['evaluations']:.2f}" if o else "(no old entry: held out)"
        runs, old_runs = runs_of(ctx), old_runs_of(o) if o else None
        lines.append(f"| {ctx} | {','.join(map(str, e['boundaries']))} | {e['balance']:.3f} | {e['evaluations']} "
                     f"| {runs or '-'} | {','.join(map(str, o['boundaries'])) if o else '-'} "
                     f"| {o['evaluations'] if o else '-'} | {old_runs or '-'} | {ratio} "
                     f"| {f'{runs / old_runs:.2f}' if runs and old_runs else '-'} |")
    both = [c for c in new if c in old]
    runs = f"; runs {sum(runs_of(c) or 0 for c in both)} against {sum(old_runs_of(old[c]) for c in both)}"
    return lines + candidates_summary(new, old, runs)


def candidates_summary(table: dict[int, dict], old: dict[int, dict], runs: str = "") -> list[str]:
    """The candidates a search measured over the lengths the old search has too, against the old search's."""
    both = sorted(c for c in table if c in old)
    if not both:
        return []
    total, total_old = (sum(t[c]["evaluations"] for c in both) for t in (table, old))
    return ["", f"Candidates over {', '.join(map(str, both))}: {total} against the old search's {total_old} "
            f"({total / total_old:.2f}; target at most 0.33){runs}. Entries within 2% balance: "
            f"{sum(e['balance'] <= 1.02 for e in table.values())} of {len(table)}."]


def carry_section(name: str, carry: dict[int, dict], new: dict[int, dict], old: dict[int, dict]) -> list[str]:
    """The search seeded by the shorter length's rates, confirming one neighbour (kvr-search's defaults), of
    tables/<name>.json."""
    if not carry:
        return []
    lines = [f"## The search with carried rates and one-sided confirmation (tables/{name}.json)", "",
             "| context | partition | balance | candidates | runs | first re-search: candidates | old: candidates |",
             "|---|---|---|---|---|---|---|"]
    for ctx, e in sorted(carry.items()):
        runs = runs_of(ctx, (f"{name}.search",))
        lines.append(f"| {ctx} | {','.join(map(str, e['boundaries']))} | {e['balance']:.3f} | {e['evaluations']} "
                     f"| {runs or '-'} | {new[ctx]['evaluations'] if ctx in new else '-'} "
                     f"| {old[ctx]['evaluations'] if ctx in old else '-'} |")
    return lines + candidates_summary(carry, old) + [""]


OTHERS = (  # the other re-searched tables: (title, table, the table it replaced)
    ("At the 650 MB/s cap on the Xeon", "tables/cap650-xeon.json", "old_tables/cap650.json"),
    ("At the 22 MB/s cap on the Xeon", "tables/cap22-xeon.json", "old_tables/cap22.json"),
    ("Gemma 3 270M on the Xeon (loopback)", "tables/gemma3-xeon.json", "old_tables/gemma3.json"),
)


def other_section(title: str, table: dict[int, dict], old: dict[int, dict]) -> list[str]:
    if not table:
        return []
    lines = [f"## {title}", "", "| context | partition | balance | candidates | old partition | old candidates |",
             "|---|---|---|---|---|---|"]
    for ctx, e in sorted(table.items()):
        o = old.get(ctx)
        lines.append(f"| {ctx} | {','.join(map(str, e['boundaries']))} | {e['balance']:.3f} | {e['evaluations']} "
                     f"| {','.join(map(str, o['boundaries'])) if o else '-'} | {o['evaluations'] if o else '-'} |")
    return lines + candidates_summary(table, old) + [""]


def bench_section(rows: list[dict]) -> list[str]:
    """One table per benchmark directory: its rows' runs were interleaved with each other only (``kvr-default``
    is the table shipped when that benchmark ran)."""
    by = defaultdict(list)  # (bench, ctx, label) -> rows in order
    for r in rows:
        by[(r["bench"], r["context_len"], r["label"])].append(r)
    lines = ["## Benchmark (interleaved: one run of every row per round)", "",
             "| bench | context | row | partition | runs | median TTFT s | median per-round ratio kvr-default / row "
             "| median balance |", "|---|---|---|---|---|---|---|---|"]
    for bench, ctx in sorted({(b, c) for b, c, _ in by}):
        default = {r["index"]: r["ttft_s"] for r in by.get((bench, ctx, "kvr-default"), [])}
        for (b, c, label), rs in sorted(by.items()):
            if (b, c) != (bench, ctx):
                continue
            own = {r["index"]: r["ttft_s"] for r in rs}
            ratios = [default[i] / own[i] for i in own if i in default]
            ratio = f"{statistics.median(ratios):.3f} ({len(ratios)} rounds)" if label != "kvr-default" else "-"
            bal = f"{statistics.median(balance(r) for r in rs):.3f}" if label.startswith("kvr") else "-"
            part = ",".join(map(str, rs[0]["boundaries"]))
            lines.append(f"| {bench} | {ctx} | {label} | {part} | {len(rs)} | {statistics.median(own.values()):.2f} "
                         f"| {ratio} | {bal} |")
    return lines


def main() -> None:
    new, old = entries(HERE / "tables/loopback.json"), entries(HERE / "old_tables/loopback.json")
    heldout = entries(HERE / "tables/loopback-14k.json")
    carried = [line for path in sorted(HERE.glob("tables/loopback-carry*.json"))
               for line in carry_section(path.stem, entries(path), new, old)]
    others = [line for title, path, before in OTHERS
              for line in other_section(title, entries(HERE / path), entries(HERE / before))]
    rows = timed_rows()
    text = ["# Balance-guided re-search (loopback, 2 ranks of 1 thread, SmolLM2-135M, split attention)", "",
            "Made by `python experiments/balance_search/report.py` from the files beside it.", "",
            *table_section(new, old, heldout), "", *carried, *others, *bench_section(rows), ""]
    (HERE / "summary.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
