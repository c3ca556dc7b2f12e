"""A decode step's attention over rows whose keys are runs of 16-position blocks, as a paged decode leaves them
(every row grows a block at a time, so its blocks are scattered among the others'), against the same rows in one
run each: our kernel (``kvr::attention``) on 2 threads, SmolLM2-135M's shape (9 query heads on 3 K,V heads of 64),
80 rows (the burst of ``run.sh``) of 500 and 1000 keys and 8 rows of 1500, float32 and bfloat16. ``--source`` builds
the kernel from another ``attention.cpp`` (the one before a change, so both run on the same machine in turn).
Appends one row per setting to runs.jsonl beside this file.

    python experiments/kv_pool/runs.py [--source PATH] [--label NAME] [--repeats 30]
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

from kvrunahead.model.layout import KVLayout
from kvrunahead.model.paged import PagedKV
from kvrunahead.provenance import machine

HERE = Path(__file__).parent
SETTINGS = [(80, 500), (80, 1000), (8, 1500)]  # rows, keys per row


def pool(dtype: torch.dtype, rows: int, keys: int, scattered: bool) -> tuple[PagedKV, tuple]:
    """``rows`` holders of ``keys`` positions: grown together one position at a time (``scattered``: runs of one
    block each), else each written whole (one run); the kernel's views and tables of their last positions."""
    kv = PagedKV(KVLayout(heads=(3,), head_dim=(64,), dtype=dtype), rows * (keys // 16 + 2), dtype)
    owners = [f"r{i}" for i in range(rows)]
    first = 1 if scattered else keys
    for owner in owners:
        kv.add(owner, [(torch.zeros(1, 3, first, 64, dtype=dtype),) * 2])
    for _ in range(keys - first):
        for owner in owners:
            kv.grow(owner)
    kv.keys[0].normal_()
    kv.values[0].normal_()
    return kv, (*kv.kernel_views(0), *kv.tables(owners))


def main() -> None:
    args = parsed(30)
    from kvrunahead.kernels import attention as kernel

    torch.set_num_threads(2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for dtype in (torch.float32, torch.bfloat16):
        for rows, keys in SETTINGS:
            q = torch.randn(1, 9, rows, 64).to(dtype)
            for scattered in (False, True):
                kv, paged = pool(dtype, rows, keys, scattered)
                times = []
                for i in range(args.repeats + 5):
                    t0 = time.perf_counter()
                    kernel.varlen(q, [], causal=True, scale=0.125, out_float=False, paged=paged)
                    if i >= 5:
                        times.append(time.perf_counter() - t0)
                us = statistics.median(times) * 1e6
                row = {"label": args.label, "source": str(args.source or "package"), "commit": commit,
                       "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": str(dtype)[6:],
                       "rows": rows, "keys": keys, "runs_per_row": len(paged[3]) // rows, "threads": 2,
                       "median_us": us, "command": "python experiments/kv_pool/runs.py " + " ".join(sys.argv[1:])}
                with (HERE / "runs.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{args.label:<8} {row['dtype']:<9} {rows} rows x {keys} keys, {row['runs_per_row']:>3} runs "
                      f"each {us:9.1f} us", file=sys.stderr)


if __name__ == "__main__":
    main()
