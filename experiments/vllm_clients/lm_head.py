"""What scoring a prompt costs one rank: SmolLM2-135M's LM head (576 -> 49152, float32, tied to the embedding) on
2048 positions in blocks of ``SCORE_ROWS`` as model/forward.py's ``scored_part`` runs it, the matmul alone and with
the log-softmax, the chosen token's gather and the top-1; one thread, median of 5. The weights' values do not move
the time, so they are drawn at random.

Usage: python experiments/vllm_clients/lm_head.py  (prints and appends a row to lm_head.jsonl)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from kvrunahead.model.forward import SCORE_ROWS
from kvrunahead.provenance import machine

HERE = Path(__file__).resolve().parent
VOCAB, HIDDEN, POSITIONS, REPEATS = 49152, 576, 2048, 5


def timed(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(POSITIONS, HIDDEN)
    targets = torch.randint(0, VOCAB, (POSITIONS,))

    @torch.no_grad()
    def matmul() -> None:
        for i in range(0, POSITIONS, SCORE_ROWS):
            head(hidden[i:i + SCORE_ROWS])

    @torch.no_grad()
    def scored() -> None:
        for i in range(0, POSITIONS, SCORE_ROWS):
            logprobs = torch.log_softmax(head(hidden[i:i + SCORE_ROWS]).float(), dim=-1)
            logprobs.gather(1, targets[i:i + SCORE_ROWS, None])
            logprobs.topk(1, dim=-1)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    row = {"positions": POSITIONS, "vocab": VOCAB, "hidden": HIDDEN, "threads": 1, "matmul_s": timed(matmul),
           "scored_s": timed(scored), "machine": machine(), "commit": commit,
           "command": "python experiments/vllm_clients/lm_head.py", "date": time.strftime("%Y-%m-%d")}
    with (HERE / "lm_head.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
