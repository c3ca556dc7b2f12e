"""One 16k request at a time to an OpenAI-compatible server: client-side TTFT (request sent to first streamed
content), 1 untimed + N timed, rows appended to a JSONL file. Used by run.sh's single16k part for both servers.

    python single.py BASE_URL LABEL PROMPT_FILE OUT.jsonl [REPEATS]
"""

import json
import sys
import time

from openai import OpenAI

from kvrunahead.provenance import environment


def main(base_url: str, label: str, prompt_file: str, out: str, repeats: int = 3) -> None:
    client = OpenAI(base_url=base_url, api_key="none", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    prompt = open(prompt_file).read()
    env = environment("smollm2-135m", label, 0, "loopback")
    env["command"] = " ".join([sys.executable, *sys.argv])
    with open(out, "a") as rows:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            ttft = None
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                   stream=True):
                if ttft is None and chunk.choices and chunk.choices[0].text:
                    ttft = time.perf_counter() - t0
            row = {"label": label, "kind": "warmup" if i == 0 else "timed", "index": i, "ttft_s": ttft,
                   "e2e_s": time.perf_counter() - t0, "prompt_file": prompt_file, **env}
            rows.write(json.dumps(row) + "\n")
            rows.flush()
            print(f"{label} {row['kind']} #{i}: TTFT {ttft:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:6]))
