"""One long request at a time against kvr-serve and vLLM CPU, the servers taking turns round by round (one server up
at a time: an idle server beside the other would take CPU). Each round sends both servers the same token ids (a
new window of the shipped text per round and length, so no server's prefix cache sees a prompt twice), greedy,
8 tokens, streamed; TTFT is the client's (request sent to the first chunk with a choice).

Servers, all on both cores of this machine, SmolLM2-135M-Instruct float32 (the folder install.sh prints):
- ``kvr``: ``kvr-serve --nproc 2 --threads 1`` (YaRN x2 only on prompts beyond the 8192 trained positions);
- ``vllm``: vLLM CPU, ``--max-model-len 8448``, no RoPE override (the prompts up to 8k);
- ``vllm-yarn``: vLLM CPU with ``--hf-overrides`` YaRN x2 over 8192 and ``--max-model-len 16640`` (the 16k prompt,
  as kvr-serve extends it).
vLLM runs with ``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (both cores for the model) and
prefix caching off; the family ``vllm-reserved`` (``vllm-reserved``, ``vllm-yarn-reserved``) keeps vLLM's default,
one core kept for its API process.

Resumable: a (round, server, tokens) already in rows.jsonl is skipped; a server with nothing left in a round is not
started. Usage: python experiments/serve_vs_vllm/single.py [--rounds 3] [--lengths 4096,8184,16376]
       [--servers kvr,vllm,vllm-reserved] [--first-round N]   (families; the order rotates round by round)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrunahead.provenance import machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROWS = HERE / "rows.jsonl"
MODEL = "smollm2-135m"
VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/kvrunahead/vllm-venv"))
# The whole rope parameters, rope_theta included: with transformers 5 an override replaces the model's rope
# parameters as one dict, and one without rope_theta leaves it None, which vLLM reads as its default base of
# 10,000 instead of SmolLM2's 100,000 (README: the first 16k rows, server vllm-yarn-notheta).
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "rope_theta": 100000.0}
START_S = 900


def model_dir() -> str:
    from kvrunahead.model.load import default_model_dir

    return str(default_model_dir())


FAMILIES = ("kvr", "vllm", "vllm-reserved")


def server_command(server: str, port: int, kvr_args: tuple[str, ...] = (), dtype: str = "float32"
                   ) -> tuple[list[str], dict]:
    if server == "kvr":
        return (["kvr-serve", "--nproc", "2", "--threads", "1", "--port", str(port), "--model", MODEL,
                 "--dtype", dtype, *kvr_args],
                dict(os.environ, OMP_NUM_THREADS="1"))
    args = [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(),
            "--served-model-name", MODEL, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--no-enable-prefix-caching", "--max-model-len", "16640" if "yarn" in server else "8448"]
    if "yarn" in server:
        args += ["--hf-overrides", json.dumps({"rope_parameters": YARN, "max_position_embeddings": 16640})]
    # The 8k prompt's 8 new tokens run past the 8192 trained positions, as on kvr-serve (which extends the rotary
    # embedding only for prompts beyond them): vLLM asks for that to be said.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    if server.endswith("-tp2"):  # vLLM's own tensor parallelism: two workers of one core each, its shared-memory
        args += ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]  # all-reduce between them
        env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    elif not server.endswith("-reserved"):  # vLLM's default keeps one core for the API process; this gives it both
        env.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return args, env


class Server:
    def __init__(self, server: str, port: int, kvr_args: tuple[str, ...] = (), dtype: str = "float32",
                 env: dict | None = None) -> None:
        """Started and answering /health (``env``: more environment variables for it)."""
        args, base = server_command(server, port, kvr_args, dtype)
        env = {**base, **(env or {})}
        self.command = " ".join(args)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(HERE / f"server_{server}.log", "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd="/tmp",
                                     start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{server} exited {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{server} not up within {START_S} s: see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


def prompt_ids(tokens: int, rnd: int) -> list[int]:
    """A window of the shipped text (repeated), starting further in for each round: the same ids for both servers."""
    from kvrunahead.model.load import load_tokenizer

    text = (ROOT / "kvrunahead/data/declaration.txt").read_text()
    tok = load_tokenizer(MODEL)
    start = 131 * rnd + tokens % 997
    once = len(tok.encode(text, add_special_tokens=False))
    ids = tok.encode(text * (2 + (start + tokens) // once), add_special_tokens=False)[start:start + tokens]
    assert len(ids) == tokens, (len(ids), tokens)
    return ids


def one(url: str, ids: list[int]) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, finish, usage = None, "", None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += chunk["choices"][0].get("text") or ""
                finish = chunk["choices"][0].get("finish_reason") or finish
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "text": text, "finish_reason": finish,
            "completion_tokens": usage["completion_tokens"] if usage else None}


def server_for(tokens: int, family: str) -> str:
    """The server of ``family`` for a prompt of ``tokens``: vLLM's with YaRN beyond the trained positions."""
    if family == "kvr" or tokens <= 8192:
        return family
    return family.replace("vllm", "vllm-yarn")


def run(rounds: int, lengths: list[int], families: list[str], first: int = 1, dtype: str = "float32",
        kvr_args: tuple[str, ...] = ()) -> None:
    rows = map(json.loads, ROWS.read_text().splitlines()) if ROWS.exists() else ()
    done = {(r["round"], r["server"], r["tokens"], r.get("dtype", "float32"), r.get("kvr_args", "")) for r in rows}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for rnd in range(first, rounds + 1):
        shift = (rnd - 1) % len(families)  # the order rotates round by round
        for family in families[shift:] + families[:shift]:
            servers = {}
            for tokens in lengths:
                if (rnd, server_for(tokens, family), tokens, dtype, " ".join(kvr_args) * (family == "kvr")) not in done:
                    servers.setdefault(server_for(tokens, family), []).append(tokens)
            for server, todo in servers.items():
                up = Server(server, 8301, kvr_args if server == "kvr" else (), dtype)
                try:
                    one(up.url, prompt_ids(512, 99))  # warm-up: the first request pays the weights' first touch
                    for tokens in todo:
                        row = {"round": rnd, "server": server, "tokens": tokens, "dtype": dtype,
                               "kvr_args": " ".join(kvr_args) * (server == "kvr"),
                               **one(up.url, prompt_ids(tokens, rnd)), "machine": machine(),
                               "commit": commit,
                               "command": "python experiments/serve_vs_vllm/single.py " + shlex.join(sys.argv[1:]),
                               "date": time.strftime("%Y-%m-%d")}
                        with ROWS.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(json.dumps({k: row[k] for k in ("round", "server", "tokens", "ttft_s", "text")}),
                              flush=True)
                finally:
                    up.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    # 8 tokens short of 8192 and 16384: the 8 new tokens stay within the positions each server's rotary table
    # covers (vLLM CPU's engine dies decoding past them, README)
    parser.add_argument("--lengths", default="4096,8184,16376")
    parser.add_argument("--servers", default="kvr,vllm", help=f"families, of {', '.join(FAMILIES)}")
    parser.add_argument("--first-round", type=int, default=1, help="rounds from this one to --rounds")
    parser.add_argument("--rows", default=str(ROWS), help="the rows file (resumed from)")
    parser.add_argument("--dtype", default="float32", help="both servers' (rows record it)")
    parser.add_argument("--kvr-args", default="", help="more kvr-serve options, e.g. --compile (rows record them)")
    args = parser.parse_args()
    families = args.servers.split(",")
    if not set(families) <= set(FAMILIES):
        parser.error(f"--servers takes {', '.join(FAMILIES)}")
    ROWS = Path(args.rows)
    run(args.rounds, [int(x) for x in args.lengths.split(",")], families, args.first_round, args.dtype,
        tuple(shlex.split(args.kvr_args)))
    sys.exit(0)
