"""What the YaRN extension costs the default model in quality, on the shipped text.

Perplexity of the last 2048 tokens of the 16k prompt that `kvr-prefill --ctx 16k` runs: with the extension
(YaRN x2, what kvr-prefill does), without it (`--allow-long-context`), and of the same 2048 tokens at the end
of an 8k window of that prompt, which needs no extension. Then the greedy text after the 16k prompt.

    python experiments/yarn_quality/run.py            # about 8 minutes on 2 cores; writes results.json
"""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.model.load import load_model, resolve_config
from kvrunahead.model.rope import plan_extension
from kvrunahead.prompt import build_prompt
from kvrunahead.provenance import environment

MODEL, CONTEXT, WINDOW, SCORED, NEW_TOKENS = "smollm2-135m", 16384, 8192, 2048, 48
OUT = Path(__file__).parent / "results.json"


@torch.no_grad()
def perplexity(model, ids: list[int], scored: int) -> float:
    """exp of the mean negative log-likelihood of the last ``scored`` tokens, each given all before it."""
    out = model(input_ids=torch.tensor([ids]), logits_to_keep=scored + 1, use_cache=False)
    logits = out.logits[0, :-1].float()
    targets = torch.tensor(ids[-scored:])
    return math.exp(torch.nn.functional.cross_entropy(logits, targets).item())


def main() -> None:
    torch.set_num_threads(2)
    config = resolve_config(MODEL)
    ext = plan_extension(config, CONTEXT)
    extended = load_model(MODEL, torch.float32, torch.device("cpu"), rope=ext)
    plain = load_model(MODEL, torch.float32, torch.device("cpu"))
    ids = build_prompt(extended.tokenizer, CONTEXT)
    rows = {}
    for name, model, window in [("16k, YaRN x2", extended.model, ids), ("16k, no extension", plain.model, ids),
                                ("8k window, no extension", plain.model, ids[-WINDOW:])]:
        t = time.perf_counter()
        rows[name] = perplexity(model, window, SCORED)
        print(f"{name:<26} perplexity of the last {SCORED} tokens {rows[name]:.4f} ({time.perf_counter() - t:.0f} s)",
              file=sys.stderr, flush=True)
    texts = {}
    for name, lm in [("16k, YaRN x2", extended), ("16k, no extension", plain)]:
        cache = DynamicCache()
        first = int(last_token_logits(lm.model, torch.tensor([ids]), past_key_values=cache).argmax())
        tokens = greedy_decode(lm.model, first, cache, len(ids), NEW_TOKENS, lm.eos_token_ids)
        texts[name] = lm.decode(tokens)
        print(f"{name}: {texts[name]!r}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    OUT.write_text(json.dumps({
        "model": MODEL, "context": CONTEXT, "scored_tokens": SCORED, "extension": ext.describe(),
        "perplexity": rows, "greedy_text": texts, "cpu": environment(MODEL, "none", 2, "none")["cpu"],
        "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit,
    }, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
