"""The servers an experiment starts on this machine, one at a time: kvr-serve and vLLM CPU (the virtual
environment ``experiments/serve_vs_vllm/install.sh`` makes, or ``VLLM_VENV``), each answering /health before it is
used and stopped with its process group; the prompts every server is sent (windows of the shipped text, the same
token ids for each) and one streamed greedy request timed from the client.

Servers, all on both cores, SmolLM2-135M-Instruct (the folder ``model_dir`` names):
- ``kvr``: ``kvr-serve --nproc 2 --threads 1`` (YaRN x2 only on prompts beyond the 8192 trained positions);
- ``vllm``: vLLM CPU, ``--max-model-len 8448``, no RoPE override, both cores for the model;
- ``vllm-yarn``: vLLM CPU with ``--hf-overrides`` YaRN x2 over 8192 and ``--max-model-len 16640``;
- ``-reserved`` keeps vLLM's default (one core kept for its API process), ``-tp2`` is vLLM's ``-tp 2``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrunahead.prompt import shipped_text

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
                 env: dict | None = None, log_dir: Path | str = ".", command: tuple[list[str], dict] | None = None
                 ) -> None:
        """Started and answering /health (``env``: more environment variables for it; its output in
        ``log_dir``/server_NAME.log). ``command``: the arguments and environment to start it with instead of
        ``server``'s own (another checkout's kvr-serve, say)."""
        args, base = command or server_command(server, port, kvr_args, dtype)
        env = {**base, **(env or {})}
        self.command = " ".join(args)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(Path(log_dir) / f"server_{server}.log", "w")
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


def checkout_env(tree: Path) -> dict:
    """The environment that runs ``python -m kvrunahead...`` from another checkout ``tree`` (its ranks too)."""
    return dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")


def checkout_commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def checkout_server(tree: Path, name: str, port: int) -> Server:
    """``kvr-serve`` of the default model as a user starts it, from checkout ``tree``, answering /health (its output
    in /tmp/server_kvr-NAME.log)."""
    args = [sys.executable, "-m", "kvrunahead.cli.serve", "--nproc", "2", "--threads", "1", "--model", MODEL,
            "--port", str(port)]
    return Server(f"kvr-{name}", port, log_dir="/tmp", command=(args, checkout_env(tree)))


def before_after(cells: dict) -> list[tuple]:
    """``cells`` keyed ``(*key, "before" | "after")`` -> values: per key with both sides, sorted,
    ``(key, before median, after median, before count, after count)``."""
    out = []
    for key in sorted({k[:-1] for k in cells}):
        before, after = cells.get((*key, "before"), []), cells.get((*key, "after"), [])
        if before and after:
            out.append((key, statistics.median(before), statistics.median(after), len(before), len(after)))
    return out


def prompt_ids(tokens: int, rnd: int) -> list[int]:
    """A window of the shipped text (repeated), starting further in for each round: the same ids for both servers."""
    from kvrunahead.model.load import load_tokenizer

    text = shipped_text()
    tok = load_tokenizer(MODEL)
    start = 131 * rnd + tokens % 997
    once = len(tok.encode(text, add_special_tokens=False))
    ids = tok.encode(text * (2 + (start + tokens) // once), add_special_tokens=False)[start:start + tokens]
    assert len(ids) == tokens, (len(ids), tokens)
    return ids


def one(url: str, ids: list[int], max_tokens: int = 8, **fields) -> dict:
    """A streamed greedy completion of ``ids`` (``fields``: more of the request's, ``ignore_eos`` say): its TTFT,
    end-to-end time, text, finish reason and completion tokens."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
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
