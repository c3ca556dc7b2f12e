"""The README's first command, `torchrun --nproc-per-node 2 --no-python kvr-prefill --ctx 16k`, in float32 and
bfloat16, with the defaults (auto: what this CPU was timed faster on), on our kernels (`--attention-kernel ours
--linears onednn`) and on torch's (`--attention-kernel torch --linears torch`), interleaved.
Each rank's counted FLOPs (its linears: 2 x the decoder's weights x its tokens; its attention: 4 x heads x head
size x the pairs it scores, causal) over its compute time give its rate, stated against the thread's GEMM peak
(experiments/kernels/rows.jsonl's `gemm` rows).

Appends one row per run to default_run.jsonl (resumable per commit, round and setting).

    python experiments/kernels/default_run.py [--rounds 2] [--torch-rounds 1] [--settings auto/auto,ours/onednn]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvrunahead.provenance import environment, machine

HERE = Path(__file__).parent
ROWS_FILE = HERE / "default_run.jsonl"
# SmolLM2-135M: 30 layers of q, k, v, o (576x576, 576x192 twice, 576x576) and gate, up, down (576x1536 x3)
LAYERS, HEADS, HEAD_DIM = 30, 9, 64
LINEAR_WEIGHTS_PER_LAYER = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3


def rank_flops(start: int, end: int) -> dict:
    tokens = end - start
    pairs = tokens * start + tokens * (tokens + 1) / 2  # its queries against the prefix, then causally
    return {"linear": 2.0 * LINEAR_WEIGHTS_PER_LAYER * LAYERS * tokens,
            "attention": 4.0 * HEADS * HEAD_DIM * pairs * LAYERS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--torch-rounds", type=int, default=1)
    ap.add_argument("--settings", default="auto/auto,ours/onednn,torch/torch",
                    help="attention kernel/linears pairs; auto/auto is the README's command as it stands")
    args = ap.parse_args()
    pairs = [tuple(x.split("/")) for x in args.settings.split(",")]
    env = environment("smollm2-135m", "torch", 1, "loopback")
    done = set()
    if ROWS_FILE.exists():
        done = {(r["round"], r["setting"]) for r in map(json.loads, ROWS_FILE.read_text().splitlines())
                if r["commit"] == env["commit"]}
    for rnd in range(args.rounds):
        for dtype in ("float32", "bfloat16"):
            for kernels in pairs:
                if kernels[0] == "torch" and rnd >= args.torch_rounds:
                    continue
                setting = f"{dtype}/{kernels[0]}/{kernels[1]}"
                if (rnd, setting) in done:
                    continue
                cmd = ["torchrun", "--nproc-per-node", "2", "--no-python", "kvr-prefill", "--ctx", "16k",
                       "--dtype", dtype, "--attention-kernel", kernels[0], "--linears", kernels[1], "--json"]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                if out.returncode != 0:
                    sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout[out.stdout.index("{"):])
                ranks = []
                for s, (a, b) in zip(r["ranks"], zip(r["boundaries"], r["boundaries"][1:])):
                    f = rank_flops(a, b)
                    ranks.append({"rank": s["rank"], "tokens": b - a, "compute_s": s["compute_s"],
                                  "wait_s": s["wait_s"], **{f"{k}_flops": v for k, v in f.items()},
                                  "gflops": (f["linear"] + f["attention"]) / s["compute_s"] / 1e9})
                row = {**env, "machine": machine(), "round": rnd, "setting": setting, "dtype": dtype,
                       "attention_kernel": r["attention_kernel"], "linears": r["linears"],
                       "command": " ".join(cmd), "date": time.strftime("%Y-%m-%d"), "ttft_s": r["ttft_s"],
                       "boundaries": r["boundaries"], "first_token_text": r["first_token_text"],
                       "generated_text": r["generated_text"], "ranks": ranks}
                with ROWS_FILE.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"round {rnd} {setting:<24} TTFT {r['ttft_s']:7.2f} s  ranks "
                      + "  ".join(f"{x['gflops']:.0f} GFLOP/s" for x in ranks), file=sys.stderr)


if __name__ == "__main__":
    main()
