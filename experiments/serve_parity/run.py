"""kvr-serve against kvr-prefill on the same prompt: the same text at temperature 0, and the server's TTFT beside
the one-shot run's, interleaved (issue 26's "Done when" and its first target).

    python experiments/serve_parity/run.py --ctx 1k,16k --repeats 3 --out experiments/serve_parity
    python experiments/serve_parity/run.py --ctx 16k --repeats 1 --serve-args "--decode kvp" \
        --out experiments/serve_parity/kvp16k      # the server decoding KV-cache parallel

For each length: a plain-text prompt file of that many tokens (the shipped text, repeated), `kvr-prefill --nproc 2
--no-chat --prompt-file F --json` and one `/v1/completions` request to a `kvr-serve --nproc 2` started once, the two
alternating run by run. Both at 1 thread per rank; while kvr-prefill runs, the server's two ranks sit idle beside it
(4 processes on 2 cores, the idle two asleep but for the front's heartbeat each second). Rows to runs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

from kvrunahead.model.load import DEFAULT_MODEL, load_tokenizer
from kvrunahead.prompt import parse_tokens, shipped_text
from kvrunahead.provenance import environment
from kvrunahead.ranks.launcher import free_port

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def prompt_text(tokenizer, n: int) -> str:
    """Plain text that the server and kvr-prefill both tokenise to ``n`` tokens (BOS included)."""
    words = shipped_text().split(" ")
    text, k = "", 0
    while True:
        text = " ".join((words * 64)[:k])
        if len(tokenizer.encode(text)) >= n:
            break
        k += max(1, (n - len(tokenizer.encode(text))) // 2)
    while len(tokenizer.encode(text)) > n:
        text = text.rsplit(" ", 1)[0]
    return text


def one_shot(path: Path, new_tokens: int) -> dict:
    cmd = ["kvr-prefill", "--nproc", "2", "--threads", "1", "--no-chat", "--prompt-file", str(path),
           "--max-new-tokens", str(new_tokens), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"ttft_s": r["ttft_s"], "text": r["generated_text"], "tokens": r["context_len"],
            "boundaries": r["boundaries"], "command": " ".join(cmd)}


def served(client: OpenAI, text: str, new_tokens: int) -> dict:
    t0 = time.perf_counter()
    resp = client.completions.create(model=DEFAULT_MODEL, prompt=text, max_tokens=new_tokens, temperature=0)
    figures = resp.model_extra["kvrunahead"]
    return {"ttft_s": figures["ttft_s"], "client_e2e_s": time.perf_counter() - t0, "text": resp.choices[0].text,
            "tokens": resp.usage.prompt_tokens, "boundaries": figures["partition"], "degree": figures["degree"],
            "degree_source": figures["degree_source"], "decode": figures.get("decode")}


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(["kvr-serve", "--nproc", "2", "--threads", "1", "--port", str(port), *extra], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"kvr-serve ended: {proc.stderr.read()}") from None
            time.sleep(1)
    raise RuntimeError("kvr-serve did not come up in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="1k,16k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default="experiments/serve_parity")
    ap.add_argument("--serve-args", default="", help="more kvr-serve flags, e.g. '--decode kvp'")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    env = environment(DEFAULT_MODEL, "torch", 1, "loopback")
    env["command"] = " ".join([sys.executable, *sys.argv])
    port = free_port()
    server = start_server(port, args.serve_args.split())
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900)
    try:
        with open(out / "runs.jsonl", "a") as rows:
            for ctx in [parse_tokens(c) for c in args.ctx.split(",")]:
                path = out / f"prompt_{ctx}.txt"
                path.write_text(prompt_text(tokenizer, ctx))
                for i in range(args.repeats):
                    for kind in ("kvr-prefill", "kvr-serve"):
                        r = one_shot(path, args.new_tokens) if kind == "kvr-prefill" else \
                            served(client, path.read_text(), args.new_tokens)
                        row = {"ctx": ctx, "kind": kind, "index": i, **r, **env, "serve_args": args.serve_args}
                        rows.write(json.dumps(row) + "\n")
                        rows.flush()
                        print(f"{ctx} {kind} #{i}: TTFT {r['ttft_s']:.3f} s {r['text']!r}", flush=True)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        (out / "metrics.txt").write_text(metrics)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)


if __name__ == "__main__":
    main()
