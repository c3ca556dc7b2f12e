"""summary.md from rows.jsonl (and exactness.jsonl where it exists): per prompt length, each server's TTFT in every
round, the medians, and the ratio vLLM / kvr-serve per round (above 1: kvr-serve first), with whether each
server's 8 tokens were all streamed and equal the single process's.

Usage: python experiments/serve_vs_vllm/summary.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    rows = [json.loads(line) for line in (HERE / "rows.jsonl").read_text().splitlines()]
    exact_path = HERE / "exactness.jsonl"
    exact = {(r["round"], r["tokens"]): r for r in map(json.loads, exact_path.read_text().splitlines())} \
        if exact_path.exists() else {}
    by = {(r["round"], r["server"], r["tokens"]): r for r in rows}
    lines = ["# Single long request: kvr-serve --nproc 2 against vLLM CPU 0.32.0 (SmolLM2-135M float32, 2 cores)", "",
             "TTFT seconds (client side). vllm: both cores bound to the model; vllm-reserved: vLLM's default (one "
             "core kept for its API process); vllm-yarn*: the same with YaRN x2 for the prompt beyond 8192 (-notheta: "
             "the first rows, whose override dropped SmolLM2's rope_theta, README). "
             "Ratio: vLLM's TTFT / kvr-serve's in the same round.", "",
             "| tokens | server | TTFT per round | median | ratio per round | median ratio | 8 tokens streamed | "
             "equal to one process |", "|---:|---|---|---:|---|---:|---|---|"]
    for tokens in sorted({r["tokens"] for r in rows}):
        servers = sorted({s for _, s, t in by if t == tokens}, key=lambda s: (s != "kvr", s))
        for server in servers:
            mine = sorted((rnd, r) for (rnd, s, t), r in by.items() if s == server and t == tokens)
            ttfts = [r["ttft_s"] for _, r in mine]
            ratios = [r["ttft_s"] / by[(rnd, "kvr", tokens)]["ttft_s"] for rnd, r in mine
                      if server != "kvr" and (rnd, "kvr", tokens) in by]
            streamed = [r.get("completion_tokens") == 8 if "completion_tokens" in r else None for _, r in mine]
            equal = [exact[(rnd, tokens)].get(f"{server}_equal") if (rnd, tokens) in exact else None
                     for rnd, _ in mine]
            lines.append(
                f"| {tokens} | {server} | {', '.join(f'{t:.2f}' for t in ttfts)} | {statistics.median(ttfts):.2f} | "
                f"{', '.join(f'{x:.2f}' for x in ratios) or '-'} | "
                f"{f'{statistics.median(ratios):.2f}' if ratios else '-'} | {_flags(streamed)} | {_flags(equal)} |")
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _flags(values: list) -> str:
    return ", ".join("?" if v is None else "yes" if v else "no" for v in values)


if __name__ == "__main__":
    main()
