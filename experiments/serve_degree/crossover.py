"""Requests of given lengths to a running kvr-serve, one at a time: the server's TTFT and the degree it chose
(both from the response's ``kvrunahead`` field), one JSONL row per request. run.sh starts the servers.

    python crossover.py BASE_URL LABEL ROUND OUT.jsonl LENGTHS [REPEATS]   # LENGTHS: 512,1024,...

Each request is another stretch of the shipped text (a different offset per length, repeat and round), raw
completions, ``max_tokens`` 1: TTFT is the whole request here.
"""

import json
import sys
import time

import httpx

from kvrunahead.bench.serve_bench import long_document
from kvrunahead.model.load import load_tokenizer
from kvrunahead.prompt import shipped_text
from kvrunahead.provenance import environment


def main(base_url: str, label: str, round_: str, out: str, lengths: str, repeats: str = "3") -> None:
    tokenizer = load_tokenizer("smollm2-135m")
    chars = len(shipped_text())
    env = environment("smollm2-135m", label, 0, "loopback")
    env["command"] = " ".join([sys.executable, *sys.argv])
    with httpx.Client(base_url=base_url, timeout=600) as client, open(out, "a") as rows:
        model = client.get("/models").json()["data"][0]["id"]
        client.post("/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1}).raise_for_status()
        for rep in range(int(repeats)):
            for n in map(int, lengths.split(",")):
                prompt = long_document(n, (1 + 7919 * rep + 104729 * int(round_) + n) % chars, tokenizer)
                t0 = time.perf_counter()
                resp = client.post("/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0})
                resp.raise_for_status()
                body = resp.json()
                ext = body["kvrunahead"]
                row = {"label": label, "round": int(round_), "repeat": rep, "length": n,
                       "prompt_tokens": body["usage"]["prompt_tokens"], "ttft_s": ext["ttft_s"],
                       "client_s": time.perf_counter() - t0, "degree": ext["degree"],
                       "degree_source": ext["degree_source"], "layout_basis": ext.get("layout_basis"),
                       "boundaries": ext.get("partition", {}).get("boundaries"), **env}
                rows.write(json.dumps(row) + "\n")
                rows.flush()
                print(f"{label} round {round_} {n}: degree {row['degree']}, TTFT {row['ttft_s']:.3f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
