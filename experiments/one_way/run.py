"""The one-shot tools through the engine against their own paths before (a checkout of BEFORE), interleaved:
``kvr-prefill --prompts`` (64 ShareGPT prompts packed over 2 ranks, 16 new tokens each, and the first token only as
the Prepacking experiment runs it), ``kvr-ask`` (16 questions on
the shipped 2k text over 2 ranks, 32 new tokens each) and ``kvr-prefill --ctx 4k`` in one process, each run's
figures, wall time and tokens (compared between the two versions).

The checkout goes to /tmp/kvr-before (a git worktree) and runs through PYTHONPATH with this install's packages;
every run starts from /tmp, so no rank imports this checkout by its working directory. Resumable: a (round, tool,
which) already in rows.jsonl is skipped. Then summary.md.

Usage: python experiments/one_way/run.py [--rounds 3] [--first-round 1] [--before 93613c2]
       [--tools batch,batch1,ask,single] [--summary]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROWS = HERE / "rows.jsonl"
BEFORE_DIR = Path("/tmp/kvr-before")
TOOLS = {
    "batch": ["kvr-prefill", "--nproc", "2", "--threads", "1", "--prompts",
              str(ROOT / "experiments/prepacking/sharegpt_64.jsonl"), "--max-new-tokens", "16", "--json"],
    "batch1": ["kvr-prefill", "--nproc", "2", "--threads", "1", "--prompts",
               str(ROOT / "experiments/prepacking/sharegpt_64.jsonl"), "--max-new-tokens", "1", "--json"],
    "ask": ["kvr-ask", "--nproc", "2", "--threads", "1", "--context", str(ROOT / "kvrunahead/data/declaration.txt"),
            "--questions", str(ROOT / "kvrunahead/data/declaration_questions.txt"), "--max-new-tokens", "32",
            "--json"],
    "single": ["kvr-prefill", "--threads", "1", "--ctx", "4k", "--max-new-tokens", "16", "--json"],
}


def commit_of(path: Path) -> str:
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(path), "diff", "--quiet", "HEAD", "--", "kvrunahead"]).returncode
    return head + ("-dirty" if dirty else "")


def figures(tool: str, r: dict) -> dict:
    """What each tool reports of its own time, and its tokens."""
    if tool.startswith("batch"):
        return {"prefill_s": r["prefill_s"], "tokens": [p["tokens"] for p in r["prompts"]],
                "steps": [s["prompts"] for s in r["steps"]]}
    if tool == "ask":
        return {"prefill_s": r["context_s"] + r["questions_s"], "context_s": r["context_s"],
                "decode_s": r["decode_s"], "tokens": [a["tokens"] for a in r["answers"]]}
    return {"prefill_s": r["ttft_s"], "tokens": r["generated_tokens"], "boundaries": r["boundaries"]}


def run_one(tool: str, which: str, round_: int, before: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(BEFORE_DIR) if which == "before" else str(ROOT))
    t0 = time.monotonic()
    out = subprocess.run(TOOLS[tool], capture_output=True, text=True, cwd="/tmp", env=env, timeout=1800)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"{tool} ({which}) failed: {out.stderr[-2000:]}")
    return {"round": round_, "tool": tool, "which": which,
            "commit": commit_of(BEFORE_DIR if which == "before" else ROOT), "wall_s": wall,
            **figures(tool, json.loads(out.stdout)), "cpu": platform.processor() or platform.machine(),
            "command": f"python experiments/one_way/run.py --before {before}",
            "argv": " ".join(TOOLS[tool]), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def summary(rows: list[dict]) -> str:
    """Per tool, the before runs and each commit's now runs: medians, now / before (the median of each round's
    ratio, a now run against the before run of its round), and whether its tokens equal that run's."""
    lines = ["| tool | which | commit | runs | median own time s | median wall s | now / before, median of the "
             "rounds' ratios (own, wall) | "
             "tokens equal to before's |", "|---|---|---|---|---|---|---|---|"]
    for tool in TOOLS:
        before = [r for r in rows if r["tool"] == tool and r["which"] == "before"]
        if not before:
            continue
        base = statistics.median(r["prefill_s"] for r in before), statistics.median(r["wall_s"] for r in before)
        lines.append(f"| {tool} | before | {', '.join(sorted({r['commit'] for r in before}))} | {len(before)} | "
                     f"{base[0]:.2f} | {base[1]:.2f} | | |")
        for commit in sorted({r["commit"] for r in rows if r["tool"] == tool and r["which"] == "now"}):
            rs = [r for r in rows if r["tool"] == tool and r["which"] == "now" and r["commit"] == commit]
            own, wall = statistics.median(r["prefill_s"] for r in rs), statistics.median(r["wall_s"] for r in rs)
            pairs = [(a, b) for a in rs for b in before if b["round"] == a["round"]]
            same = ", ".join("yes" if a["tokens"] == b["tokens"] else "NO" for a, b in pairs)
            ratio = (statistics.median(a["prefill_s"] / b["prefill_s"] for a, b in pairs),
                     statistics.median(a["wall_s"] / b["wall_s"] for a, b in pairs))
            lines.append(f"| {tool} | now | {commit} | {len(rs)} | {own:.2f} | {wall:.2f} | "
                         f"{ratio[0]:.3f}, {ratio[1]:.3f} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--first-round", type=int, default=1, help="number the rounds from here (a later run's rounds)")
    ap.add_argument("--before", default="93613c2")
    ap.add_argument("--tools", default="batch,batch1,ask,single")
    ap.add_argument("--summary", action="store_true", help="only the summary of the rows there are")
    args = ap.parse_args()
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()] if ROWS.exists() else []
    if not args.summary:
        if not BEFORE_DIR.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", str(BEFORE_DIR), args.before],
                           check=True)
        commits = {"before": commit_of(BEFORE_DIR), "now": commit_of(ROOT)}
        done = {(r["round"], r["tool"], r["which"], r["commit"]) for r in rows}
        for round_ in range(args.first_round, args.first_round + args.rounds):
            order = ("before", "now") if round_ % 2 else ("now", "before")
            for tool in args.tools.split(","):
                for which in order:
                    if (round_, tool, which, commits[which]) in done:
                        continue
                    row = run_one(tool, which, round_, args.before)
                    with ROWS.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    rows.append(row)
                    print(f"round {round_} {tool} {which}: own {row['prefill_s']:.2f} s, wall {row['wall_s']:.1f} s",
                          flush=True)
    (HERE / "summary.md").write_text(summary(rows))
    print(summary(rows))


if __name__ == "__main__":
    main()
