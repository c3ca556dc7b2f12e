"""Prefill time of a batch of ShareGPT prompts: packed over the KV chain on 2 ranks (1 thread each), packed in one
process (2 threads), transformers' padded batch (one process, 2 threads) and one prompt after another (one
process, 2 threads). SmolLM2-135M-Instruct, float32, each prompt a chat turn, the first token only; the time is
kvr-prefill's own timed region (until every prompt has its first token), peak memory the largest rank's resident
set (model included). Rounds run the modes in turn, the order rotating, so drift hits all alike.

Usage: python experiments/prepacking/run.py [--rounds 3] [--batches 16,64]
Resumable: a (batch, round, mode) already in rows.jsonl is not run again. Then ``--summary`` (or the end of a run)
writes summary.md and speedup.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from kvrunahead.provenance import environment

HERE = Path(__file__).parent
MODES = {
    "packed-2ranks": ["--nproc", "2", "--batching", "packed"],
    "packed-1proc": ["--threads", "2", "--batching", "packed"],
    "padded": ["--threads", "2", "--batching", "padded"],
    "sequential": ["--threads", "2", "--batching", "sequential"],
}


def run_one(batch: int, mode: str) -> dict:
    cmd = ["kvr-prefill", "--prompts", str(HERE / f"sharegpt_{batch}.jsonl"), "--max-new-tokens", "1", "--json",
           *MODES[mode]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return {"command": " ".join(cmd), "prefill_s": d["prefill_s"], "steps": len(d["steps"]),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in d["ranks"]),
            "bytes_sent": sum(r["bytes_sent"] for r in d["ranks"]),
            "prompt_tokens": sum(p["prompt_tokens"] for p in d["prompts"]),
            "first_tokens": [p["tokens"][0] for p in d["prompts"]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--summary", action="store_true", help="only write the summary of the rows there are")
    args = ap.parse_args()
    rows_file = HERE / "rows.jsonl"
    if not args.summary:
        env = environment("smollm2-135m", "torch", 1, "loopback")
        rows = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
        done = {(r["batch"], r["round"], r["mode"]) for r in rows}
        names = list(MODES)
        for rnd in range(args.rounds):
            for batch in map(int, args.batches.split(",")):
                for mode in names[rnd % len(names):] + names[: rnd % len(names)]:
                    if (batch, rnd, mode) in done:
                        continue
                    row = {**env, "batch": batch, "round": rnd, "mode": mode, **run_one(batch, mode)}
                    print(f"batch {batch} round {rnd} {mode:<14} {row['prefill_s']:8.2f} s  "
                          f"{row['peak_mem_bytes'] / 2**20:7.0f} MiB", flush=True)
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    summary(rows_file)


def summary(rows_file: Path) -> None:
    """Median prefill per mode and batch, the packed modes' speed-ups over padded and one by one (the median of
    per-round ratios), peak memory, and how many first tokens equal the one-by-one run's."""
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    by = {(r["batch"], r["round"], r["mode"]): r for r in rows}
    lines = ["| batch | mode | rounds | median prefill s | vs padded | vs one by one | peak MiB | first tokens equal "
             "to one by one |", "|---|---|---|---|---|---|---|---|"]
    ups: dict = {}
    for batch in sorted({r["batch"] for r in rows}):
        for mode in MODES:
            mine = [r for (b, _, m), r in sorted(by.items()) if b == batch and m == mode]
            if not mine:
                continue
            cells = []
            for base in ("padded", "sequential"):
                ratios = [by[(batch, r["round"], base)]["prefill_s"] / r["prefill_s"] for r in mine
                          if (batch, r["round"], base) in by]
                cells.append(f"{statistics.median(ratios):.2f}x" if ratios else "-")
                if ratios:
                    ups[(mode, base, batch)] = statistics.median(ratios)
            same = [sum(a == b for a, b in zip(r["first_tokens"], by[(batch, r["round"], "sequential")]
                                               ["first_tokens"])) for r in mine if (batch, r["round"], "sequential")
                    in by]
            lines.append(f"| {batch} | {mode} | {len(mine)} | {statistics.median(r['prefill_s'] for r in mine):.2f}"
                         f" | {cells[0]} | {cells[1]} | {max(r['peak_mem_bytes'] for r in mine) / 2**20:.0f} | "
                         f"{', '.join(f'{s}/{batch}' for s in same)} |")
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(ups)


def _plot(ups: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, base, title in zip(axes, ("padded", "sequential"), ("over the padded batch", "over one by one")):
        for mode in ("packed-2ranks", "packed-1proc"):
            pts = sorted((b, v) for (m, bb, b), v in ups.items() if m == mode and bb == base)
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=mode)
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xlabel("prompts in the batch")
        ax.set_title(f"speed-up {title}")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("prefill time ratio (median of rounds)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(HERE / "speedup.png", dpi=120)


if __name__ == "__main__":
    main()
