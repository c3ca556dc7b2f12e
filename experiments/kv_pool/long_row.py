"""One decode row's attention after a long prompt (SmolLM2-135M's shape: 9 query heads on 3 K,V heads of 64), timed
in our kernel (``kvr::attention``) on 1 and 2 threads, float32 and bfloat16, 4k, 8k and 16k keys: whether one row
keeps both threads busy. ``--source`` builds the kernel from another ``attention.cpp`` (the one before a change, so
both run on the same machine in turn). Appends one row per setting to long_row.jsonl beside this file.

    python experiments/kv_pool/long_row.py [--source PATH] [--label NAME] [--repeats 200]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from kernel_source import parsed  # beside this file (run as a script)

from kvrunahead.provenance import machine

HERE = Path(__file__).parent


def main() -> None:
    args = parsed(200)
    from kvrunahead.kernels import attention as kernel

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for dtype in (torch.float32, torch.bfloat16):
        for keys in (4096, 8192, 16384):
            q = torch.randn(1, 9, 1, 64).to(dtype)
            k, v = torch.randn(1, 3, keys, 64).to(dtype), torch.randn(1, 3, keys, 64).to(dtype)
            rows = [kernel.Row(0, 0, 1, keys - 1, [kernel.Piece(k, v, 0)])]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                times = []
                for i in range(args.repeats + 10):
                    t0 = time.perf_counter()
                    kernel.varlen(q, rows)
                    if i >= 10:
                        times.append(time.perf_counter() - t0)
                us = statistics.median(times) * 1e6
                row = {"label": args.label, "source": str(args.source or "package"), "commit": commit,
                       "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": str(dtype)[6:],
                       "keys": keys, "threads": threads, "median_us": us,
                       "command": "python experiments/kv_pool/long_row.py " + " ".join(sys.argv[1:])}
                with (HERE / "long_row.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{args.label:<8} {row['dtype']:<9} {keys:>6} keys {threads} thr {us:8.1f} us", file=sys.stderr)


if __name__ == "__main__":
    main()
