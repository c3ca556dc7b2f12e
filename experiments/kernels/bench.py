"""The CPU attention kernel alone against torch's, on SmolLM2's layer shape (9 query heads, 3 K,V heads, head size
64), one thread, in interleaved rounds; beside them, the same thread's GEMM rate in each dtype and the memory's read
bandwidth, which the kernel's rates are stated against.

Cases (each through the path the engine takes with ``--attention-kernel ours`` and with ``torch``; ``tiles`` and
``vector`` are ours with its tile path on and off, KVR_ATTENTION_TILES=1 and 0; a row's ``path`` names the one
its prefill rows take by default on this host, the faster as ``kvr-kernels`` timed them):
- causal prefill of 4k and 16k tokens (a chain rank's or one process's attention: ``split_block``);
- a chunk of 128 and 512 queries after 8k and 16k keys (the chunked prefill's attention: ``split_block``);
- decode: 8 rows of 150-1550 keys in one step (the mixed step's rows), and 1 row of 16k keys.

FLOPs count the visible pairs only (4 * heads * head_dim per pair: QK^T and PV); decode rows also report the K,V
bytes they read per second. Appends one JSON row per measurement to rows.jsonl (resumable: a round already written
for this commit and case is skipped), then prints the medians of this commit's rows (report.py writes the table).

    python experiments/kernels/bench.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvrunahead import kernels
from kvrunahead.calibrate.timing import median_time, read_bandwidth
from kvrunahead.kernels import attention as kernel
from kvrunahead.modes.kvr import split_block
from kvrunahead.provenance import environment, machine

HERE = Path(__file__).parent
ROWS = HERE / "rows.jsonl"
HEADS, KV_HEADS, D = 9, 3, 64
SCALE = 1 / math.sqrt(D)
DECODE_ROWS = [150 + 200 * i for i in range(8)]  # 150, 350, ..., 1550


def qkv(n, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HEADS, n, D, generator=g).to(dtype), torch.randn(1, KV_HEADS, m, D, generator=g).to(dtype),
            torch.randn(1, KV_HEADS, m, D, generator=g).to(dtype))


def prefill_case(n_queries: int, n_keys: int, dtype):
    """Queries the last ``n_queries`` positions of ``n_keys`` keys, causal: split_block, as the chain and chunks
    call it."""
    q, k, v = qkv(n_queries, n_keys, dtype)
    prefix = n_keys - n_queries
    pairs = n_queries * prefix + n_queries * (n_queries + 1) / 2
    return (lambda: split_block(q, k, v, SCALE)), 4 * HEADS * D * pairs, 0


def decode_case(lengths: list[int], dtype):
    """One query per row against its own cache: our varlen call; torch's is the mixed step's loop of split_block
    over rows (one kernel call per row)."""
    q = torch.randn(1, HEADS, len(lengths), D).to(dtype)
    caches = [qkv(1, n, dtype, seed=i)[1:] for i, n in enumerate(lengths)]
    rows = [kernel.Row(0, i, i + 1, n - 1, [kernel.Piece(k, v, 0)]) for i, ((k, v), n) in
            enumerate(zip(caches, lengths))]

    def run():
        if kernel.usable(q):
            return kernel.varlen(q, rows, causal=True, scale=SCALE, out_float=False)
        return [split_block(q[:, :, i:i + 1], k, v, SCALE) for i, (k, v) in enumerate(caches)]

    elem = torch.finfo(dtype).bits // 8
    return run, 4 * HEADS * D * sum(lengths), 2 * KV_HEADS * D * elem * sum(lengths)


CASES = {
    "causal-4k": lambda dt: prefill_case(4096, 4096, dt),
    "causal-16k": lambda dt: prefill_case(16384, 16384, dt),
    "chunk-128-after-8k": lambda dt: prefill_case(128, 8192 + 128, dt),
    "chunk-512-after-8k": lambda dt: prefill_case(512, 8192 + 512, dt),
    "chunk-128-after-16k": lambda dt: prefill_case(128, 16384 + 128, dt),
    "chunk-512-after-16k": lambda dt: prefill_case(512, 16384 + 512, dt),
    # the chain's last rank at 16k on the shipped float32 table: its 5776 queries after 10608 prefix keys
    "rank1-16k": lambda dt: prefill_case(5776, 16384, dt),
    "decode-8-rows-150-1550": lambda dt: decode_case(DECODE_ROWS, dt),
    "decode-1-row-16k": lambda dt: decode_case([16384], dt),
}
QUICK = ["causal-4k", "chunk-128-after-8k", "decode-8-rows-150-1550", "decode-1-row-16k"]


@torch.no_grad()
def gemm_rate(dtype) -> float:
    """The thread's GEMM rate in ``dtype``: the best of a SmolLM2 gate/up projection of 4096 rows and a 2048-square
    product, through torch's default path (MKL's sgemm for float32, oneDNN for bfloat16) and oneDNN's own linear
    (which on an AMD host runs float32 at about twice MKL's rate)."""
    import torch.utils.mkldnn

    best = 0.0
    for m, k, n in ((4096, 576, 1536), (2048, 2048, 2048)):
        linear = torch.nn.Linear(k, n, bias=False).to(dtype)
        onednn = torch.utils.mkldnn.to_mkldnn(linear, dtype)
        x = torch.randn(m, k).to(dtype)
        xd = x.to_mkldnn()
        for fn in (lambda linear=linear, x=x: linear(x), lambda onednn=onednn, xd=xd: onednn(xd)):
            best = max(best, 2 * m * k * n / median_time(fn, 5) / 1e9)
    return best


def done(commit: str) -> set:
    if not ROWS.exists():
        return set()
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    return {(r["round"], r["case"], r["dtype"], r["kernel"]) for r in rows if r["commit"] == commit}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the 4k, chunk and decode cases only")
    ap.add_argument("--cases", default=None, help=f"these cases only (comma-separated, of {', '.join(CASES)})")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not kernels.build():
        sys.exit(f"the kernel could not be built: {kernels.why_not_built()}")
    kernels.auto_choice()  # the path each dtype's prefill rows take by default (timed once per build)
    env = environment("smollm2-135m layer shape", "none", 1, "none")
    base = {**env, "machine": machine(), "isa": kernels.isa(), "threads": 1,
            "path": {dt: kernels.path(dt) for dt in kernels.DTYPES},
            "command": "python experiments/kernels/bench.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}
    seen = done(env["commit"])
    names = args.cases.split(",") if args.cases else QUICK if args.quick else list(CASES)
    if not set(names) <= set(CASES):
        ap.error(f"--cases: unknown {sorted(set(names) - set(CASES))}")
    for rnd in range(args.rounds):
        for dtype in (torch.float32, torch.bfloat16):
            dt = str(dtype).removeprefix("torch.")
            if (rnd, "gemm", dt, "-") not in seen:
                write({**base, "round": rnd, "case": "gemm", "dtype": dt, "kernel": "-",
                       "gflops": gemm_rate(dtype)})
            for name in names:
                fn, flops, nbytes = CASES[name](dtype)
                for which in ("tiles", "vector", "torch"):
                    if (rnd, name, dt, which) in seen:
                        continue
                    kernels.set_kernel("torch" if which == "torch" else "ours")
                    os.environ["KVR_ATTENTION_TILES"] = "1" if which == "tiles" else "0"
                    s = median_time(fn, 3 if "16k" in name and "decode" not in name else 5)
                    write({**base, "round": rnd, "case": name, "dtype": dt, "kernel": which, "seconds": s,
                           "gflops": flops / s / 1e9, "gb_per_s": nbytes / s / 1e9 if nbytes else None})
                del fn
        if (rnd, "bandwidth", "float32", "-") not in seen:
            write({**base, "round": rnd, "case": "bandwidth", "dtype": "float32", "kernel": "-",
                   "gb_per_s": read_bandwidth() / 1e9})
    summarise(env["commit"])


def write(row: dict) -> None:
    with ROWS.open("a") as f:
        f.write(json.dumps(row) + "\n")
    what = f"{row['gflops']:.1f} GFLOP/s" if row.get("gflops") else ""
    if row.get("gb_per_s"):
        what += f" {row['gb_per_s']:.1f} GB/s"
    print(f"round {row['round']} {row['case']:<24} {row['dtype']:<9} {row['kernel']:<6} {what}", file=sys.stderr)


def summarise(commit: str) -> None:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["commit"] == commit]
    med = {}
    for key in {(r["case"], r["dtype"], r["kernel"]) for r in rows}:
        group = [r for r in rows if (r["case"], r["dtype"], r["kernel"]) == key]
        med[key] = {f: statistics.median(r[f] for r in group) for f in ("gflops", "gb_per_s", "seconds")
                    if group[0].get(f) is not None}
    for (case, dt, which), m in sorted(med.items()):
        print(case, dt, which, {k: round(v, 4) for k, v in m.items()})


if __name__ == "__main__":
    main()
