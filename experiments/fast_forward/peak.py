"""The machine's GEMM peak on the shapes a SmolLM2-135M prefill runs: every linear layer of a decoder layer (q, k,
v, o, gate, up, down) on 2048 and 8192 rows, through torch's default path (MKL's sgemm for float32, oneDNN for
bfloat16) and through oneDNN's own linear (torch.utils.mkldnn), at 1 thread (one rank) and 2 threads (one process
on both cores). The peak of a dtype and thread count is the best any shape reaches on either path: the reference
report.py divides a run's counted FLOP/s by. Writes peak.jsonl (one row per measurement) beside this file.

    python experiments/fast_forward/peak.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.utils.mkldnn

from kvrunahead.calibrate.timing import median_time
from kvrunahead.provenance import environment, machine

HERE = Path(__file__).parent
SHAPES = {"q": (576, 576), "kv": (576, 192), "o": (576, 576), "gate/up": (576, 1536), "down": (1536, 576)}
ROWS = (2048, 8192)
REPEATS = 5


@torch.no_grad()
def main() -> None:
    env = environment("smollm2-135m", "none", 0, "none")
    out = HERE / "peak.jsonl"
    out.unlink(missing_ok=True)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for name, (k, n) in SHAPES.items():
                linear = torch.nn.Linear(k, n, bias=False).to(dtype)
                onednn = torch.utils.mkldnn.to_mkldnn(linear, dtype)
                for rows in ROWS:
                    x = torch.randn(rows, k).to(dtype)
                    xd = x.to_mkldnn()
                    flops = 2.0 * rows * k * n
                    for path, fn in (("default", lambda x=x, m=linear: m(x)),
                                     ("onednn", lambda x=xd, m=onednn: m(x))):
                        s = median_time(fn, REPEATS)
                        row = {**env, "machine": machine(), "threads": threads, "dtype": str(dtype)[6:],
                               "shape": name, "rows": rows, "k": k, "n": n, "path": path, "seconds": s,
                               "gflops": flops / s / 1e9, "command": "python experiments/fast_forward/peak.py",
                               "date": time.strftime("%Y-%m-%d")}
                        with out.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(f"{threads}t {row['dtype']:<9} {name:<8} {rows:>5} rows {path:<8} "
                              f"{row['gflops']:7.1f} GFLOP/s", file=sys.stderr)


if __name__ == "__main__":
    main()
