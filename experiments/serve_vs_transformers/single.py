"""One long request at a time to an OpenAI-compatible server: client-side TTFT (request sent to first streamed
chunk), 1 untimed + N timed, rows appended to a JSONL file. Used by run.sh's single16k part for both servers.
Every request is another document (the shipped text from another offset, about 16k tokens): transformers serve
keeps a prefix cache, and the same prompt twice would measure its cache, not its prefill.

    python single.py BASE_URL LABEL TOKENS OUT.jsonl [REPEATS]
"""

import json
import sys
import time

from openai import OpenAI

from kvrunahead.bench.serve_bench import long_document
from kvrunahead.model.load import load_tokenizer
from kvrunahead.provenance import environment


def main(base_url: str, label: str, tokens: str, out: str, repeats: int = 3) -> None:
    client = OpenAI(base_url=base_url, api_key="none", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    tokenizer = load_tokenizer("smollm2-135m")
    prompts = [long_document(int(tokens), 1 + 997 * i, tokenizer) for i in range(repeats + 1)]
    env = environment("smollm2-135m", label, 0, "loopback")
    env["command"] = " ".join([sys.executable, *sys.argv])
    with open(out, "a") as rows:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            ttft, text = None, ""
            for chunk in client.completions.create(model=model, prompt=prompts[i], max_tokens=8, temperature=0,
                                                   stream=True):
                if ttft is None and chunk.choices:  # the first token's chunk (its text may be empty: EOS)
                    ttft = time.perf_counter() - t0
                if chunk.choices:
                    text += chunk.choices[0].text or ""
            row = {"label": label, "kind": "warmup" if i == 0 else "timed", "index": i, "ttft_s": ttft,
                   "e2e_s": time.perf_counter() - t0, "text": text,
                   "prompt_tokens": len(tokenizer.encode(prompts[i])), **env}
            rows.write(json.dumps(row) + "\n")
            rows.flush()
            print(f"{label} {row['kind']} #{i}: TTFT {ttft:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:6]))
