"""SmolLM2's linear layers through F.linear (torch's default: MKL's sgemm for float32, oneDNN for bfloat16) and
through oneDNN with the weight prepacked once (model/linears.py's path), per shape, dtype and row count, one
thread (``--threads``), interleaved rounds. The table that decides model/linears.py's policy (which path for which
rows). Two ways to hold the weights: ``hot``, one weight called again and again (it stays in the caches), and
``streamed`` (decode-sized calls, up to 8 rows), a ring of copies larger than the L3 called in turn, as a forward
reads its layers' weights once each from memory.

Appends to linears.jsonl (resumable per commit, round and case), then prints the medians and ratios.

    python experiments/kernels/linears.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrunahead.calibrate.timing import median_time
from kvrunahead.provenance import environment, machine

HERE = Path(__file__).parent
ROWS_FILE = HERE / "linears.jsonl"
SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576),
          "lm_head": (576, 49152)}
ROW_COUNTS = (1, 2, 4, 8, 32, 128, 512, 2048)
STREAMED_ROWS = 8  # the streamed case: decode steps' row counts
RING_BYTES = 96 << 20  # the streamed ring: three times this host's 32 MB L3


def ring(weight: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``weight`` whose bytes together exceed the L3 (at least 2)."""
    return [weight.clone() for _ in range(max(2, -(-RING_BYTES // (weight.numel() * weight.element_size()))))]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment("smollm2-135m linears", "none", args.threads, "none")
    base = {**env, "machine": machine(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
            "command": "python experiments/kernels/linears.py " + " ".join(sys.argv[1:])}
    seen = set()
    if ROWS_FILE.exists():
        for line in ROWS_FILE.read_text().splitlines():
            r = json.loads(line)
            if r["commit"] == env["commit"] and r.get("threads", 1) == args.threads:
                seen.add((r["round"], r["dtype"], r["shape"], r["rows"], r["path"], r.get("weights", "hot")))
    for rnd in range(args.rounds):
        for dtype in (torch.float32, torch.bfloat16):
            dt = str(dtype).removeprefix("torch.")
            for name, (k, n) in SHAPES.items():
                weight = torch.randn(n, k).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                weights = ring(weight)
                packs = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
                for rows, held in [(r, "hot") for r in ROW_COUNTS] + [(r, "streamed") for r in ROW_COUNTS
                                                                       if r <= STREAMED_ROWS]:
                    if name == "lm_head" and rows > 8:  # the head runs on the positions that choose a token
                        continue
                    x = torch.randn(1, rows, k).to(dtype)
                    ws, ps = ([weight], [packed]) if held == "hot" else (weights, packs)
                    for path, fn in (("F.linear", lambda x=x, ws=ws: [F.linear(x, w) for w in ws]),
                                     ("onednn", lambda x=x, ps=ps: [torch.ops.mkldnn._linear_pointwise(
                                         x, w, None, "none", [], "") for w in ps])):
                        if (rnd, dt, name, rows, path, held) in seen:
                            continue
                        s = median_time(fn, 20 if rows <= 32 else 5) / len(ws)
                        row = {**base, "round": rnd, "dtype": dt, "shape": name, "k": k, "n": n, "rows": rows,
                               "path": path, "weights": held, "seconds": s, "gflops": 2 * rows * k * n / s / 1e9}
                        with ROWS_FILE.open("a") as f:
                            f.write(json.dumps(row) + "\n")
    summarise(env["commit"], args.threads)


def summarise(commit: str, threads: int) -> None:
    rows = [json.loads(line) for line in ROWS_FILE.read_text().splitlines()]
    rows = [r for r in rows if r["commit"] == commit and r.get("threads", 1) == threads]
    med = {}
    for r in rows:
        med.setdefault((r["dtype"], r.get("weights", "hot"), r["shape"], r["rows"], r["path"]), []).append(
            r["seconds"])
    print(f"{threads} thread(s)\ndtype     weights   shape    rows   F.linear ms   onednn ms   F.linear/onednn")
    for (dt, held, shape, n, path), times in sorted(med.items()):
        if path != "F.linear":
            continue
        a, b = statistics.median(times), statistics.median(med[(dt, held, shape, n, "onednn")])
        print(f"{dt:<9} {held:<9} {shape:<8} {n:>5}   {a * 1e3:>10.3f}   {b * 1e3:>9.3f}   {a / b:>6.2f}x")


if __name__ == "__main__":
    main()
