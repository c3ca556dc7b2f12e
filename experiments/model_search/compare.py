"""The model-backed search (with --refine) beside the measured search: candidates, search time and the TTFT
of the partitions each found, the latter measured interleaved in compare/ (run.sh). Writes results.md."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
SEARCHED = ROOT / "partition_tables" / "smollm2-135m_p2_float32_cpu_split.json"


def main() -> None:
    searched = {e["context_len"]: e for e in json.loads(SEARCHED.read_text())["entries"]}
    model = {e["context_len"]: e for e in json.loads((HERE / "model_only.json").read_text())["entries"]}
    refined = {e["context_len"]: e for e in json.loads((HERE / "refined.json").read_text())["entries"]}
    runs = defaultdict(list)
    path = HERE / "compare" / "runs.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if r["kind"] == "timed":
            runs[(r["context_len"], r["label"])].append(r["ttft_s"])
    lines = ["# Model-backed partition search against the measured search (p = 2, this machine)", "",
             "Command: `bash experiments/model_search/run.sh`. The measured search is the shipped table "
             f"`{SEARCHED.relative_to(ROOT)}` (golden section over rank 0's share in [1/2, 7/8], then polish; "
             "3 timed runs per candidate). The model-backed search takes the cost model's answer on the shipped CPU "
             "profile and measures only it and its neighbours 64 tokens away (`--refine`). The TTFT of each found "
             "partition is the median of 3 interleaved runs in compare/.", "",
             "| context | measured search: boundary, candidates, search s | model only: boundary, s | refined: "
             "boundary, candidates, search s | TTFT searched s | TTFT refined s | refined vs searched |",
             "|---|---|---|---|---|---|---|"]
    total_s = total_r = 0
    for ctx in sorted(refined):
        s, m, r = searched[ctx], model[ctx], refined[ctx]
        total_s += s["evaluations"]
        total_r += r["evaluations"]
        ts, tr = runs.get((ctx, "kvr-searched")), runs.get((ctx, "kvr-refined"))
        ts, tr = (statistics.median(ts) if ts else None), (statistics.median(tr) if tr else None)
        same = s["boundaries"] == r["boundaries"]
        ratio = "same partition" if same else f"{tr / ts - 1:+.1%}" if ts and tr else "not measured"
        lines.append(f"| {ctx} | {s['boundaries'][1]}, {s['evaluations']}, {s['search_s']:.0f} | "
                     f"{m['boundaries'][1]}, {m['search_s']:.2f} | {r['boundaries'][1]}, {r['evaluations']}, "
                     f"{r['search_s']:.0f} | {f'{ts:.3f}' if ts else '-'} | {f'{tr:.3f}' if tr else '-'} | {ratio} |")
    lines += ["", f"Candidates measured on the ranks: {total_r} (refined) against {total_s} (measured search), "
              f"{total_r / total_s:.0%}."]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
