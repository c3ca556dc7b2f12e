"""Which server's text is the single process's: for every prompt of rows.jsonl (the same ids single.py sent), the
greedy continuation of transformers' own ``generate`` on the converted SmolLM2-135M in one process (float32; beyond
the 8192 trained positions with the rotary embedding extended by the YaRN factor both servers used), against each
server's 8 streamed tokens, as text. Run with no server up (it takes both cores).

Resumable: a (round, tokens) already in exactness.jsonl is skipped.
Usage: python experiments/serve_vs_vllm/exactness.py
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from kvrunahead.model.load import DEFAULT_MODEL, load_model, resolve_config
from kvrunahead.model.rope import plan_extension

HERE = Path(__file__).resolve().parent
OUT = HERE / "exactness.jsonl"


def main() -> None:

    from kvrunahead.bench.peers import prompt_ids  # the ids the servers were sent

    rows = [json.loads(line) for line in (HERE / "rows.jsonl").read_text().splitlines()]
    done = {(r["round"], r["tokens"]) for r in map(json.loads, OUT.read_text().splitlines())} if OUT.exists() else set()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    torch.set_num_threads(2)
    config = resolve_config(DEFAULT_MODEL)
    models = {}
    lengths = {4096, 8184, 16376}  # the first rows' 8192 and 16384 decoded past vLLM's rotary table (README)
    for rnd, tokens in sorted({(r["round"], r["tokens"]) for r in rows if r["tokens"] in lengths} - done):
        rope = plan_extension(config, tokens, False, DEFAULT_MODEL)  # as kvr-serve plans a prompt
        if rope not in models:
            models[rope] = load_model(DEFAULT_MODEL, torch.float32, torch.device("cpu"), rope=rope)
        lm = models[rope]
        ids = prompt_ids(tokens, rnd)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = lm.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        new = out[0, len(ids):].tolist()
        reference = lm.tokenizer.decode(new, skip_special_tokens=True)
        texts = {r["server"]: r["text"] for r in rows if (r["round"], r["tokens"]) == (rnd, tokens)}
        row = {"round": rnd, "tokens": tokens, "reference": reference, "reference_ids": new,
               "rope": None if rope is None else rope.describe(), "seconds": time.perf_counter() - t0,
               **{f"{server}_equal": text == reference for server, text in texts.items()},
               "texts": texts, "commit": commit, "command": "python experiments/serve_vs_vllm/exactness.py"}
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("texts", "reference_ids")}), flush=True)


if __name__ == "__main__":
    main()
