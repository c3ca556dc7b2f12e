"""``kvr-serve`` on real ranks (two gloo ranks of the synthetic tiny-llama on 127.0.0.1): the official ``openai``
client gets what ``kvr-prefill`` prints for the same prompt; SIGTERM drains (the stream in flight completes, a new
request gets 503) and exits 0; under ``--no-recover`` a worker that dies ends the requests in flight with an error,
fails /health and the server exits non-zero (recovery: tests/test_serve_recovery.py); bad input is one line and
exit 2. Every server here is bounded and killed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvrunahead.bench.soak import rank_pids
from tests.helpers import COMPILE_SLOWDOWN

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
# KVR_TEST_COMPILE=1: every kvr-serve here (and in tests/test_clients.py) runs --compile, its waits stretched by
# COMPILE_SLOWDOWN (docs/testing.md)
COMPILED = ("--compile",) if COMPILE_SLOWDOWN > 1 else ()


class Server:
    """A ``kvr-serve --nproc N`` process group (2 ranks unless asked; ``env``: added to the tests' environment);
    its stderr is collected as it comes."""

    def __init__(self, *args: str, model: str = MODEL, nproc: int = 2, env: dict | None = None, port: int = 0
                 ) -> None:
        command = [sys.executable, "-m", "kvrunahead.cli.serve", "--nproc", str(nproc), "--port", str(port), "--model",
                   model, *COMPILED, *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**ENV, **(env or {})}, cwd=ROOT, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def url(self, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s * COMPILE_SLOWDOWN
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(r"serving \S+ on (https?://\S+)/v1", line):
                    return m.group(1)
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.1)
        raise AssertionError(f"no server after {timeout_s} s: {''.join(self.lines)}")

    def ranks(self) -> dict[int, int]:
        """pid by rank of the spawned ranks."""
        return rank_pids(self.proc.pid)

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kvr-serve still running after {timeout_s} s: {''.join(self.lines)}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@contextlib.contextmanager
def serving(*args: str, model: str = MODEL, nproc: int = 2, env: dict | None = None, port: int = 0
            ) -> Iterator[Server]:
    server = Server(*args, model=model, nproc=nproc, env=env, port=port)
    try:
        yield server
    finally:
        server.kill()


def _api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0, timeout=60 * COMPILE_SLOWDOWN)


def _prefill_text(tmp_path: Path, max_new_tokens: int) -> str:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.prefill", "--nproc", "2", "--model", MODEL,
                        "--prompt-file", str(prompt), "--no-chat", "--max-new-tokens", str(max_new_tokens), "--json"],
                       capture_output=True, text=True, timeout=180, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["generated_text"]


def test_served_greedy_text_equals_kvr_prefill_and_sigterm_drains_the_stream_in_flight(tmp_path):
    expected = _prefill_text(tmp_path, 12)
    with serving("--grace", "60") as server:
        url = server.url()
        api = _api(url)
        c = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert c.choices[0].text == expected
        assert c.model_extra["kvrunahead"]["degree"] in (1, 2) and c.usage.completion_tokens == 12
        stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
        chunks = [next(stream)]
        os.kill(server.proc.pid, signal.SIGTERM)  # the launcher forwards it to the ranks: the front drains
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2
        assert server.wait() == 0, "".join(server.lines)


def test_without_recovery_a_worker_that_dies_fails_the_requests_in_flight_and_the_server_exits_nonzero():
    """``--no-recover``: fail-stop, for a supervisor (or ``--restarts``) to start the whole server again."""
    with serving("--timeout", "10", "--no-recover") as server:
        url = server.url()
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", f"{url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            os.kill(server.ranks()[0], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2].removeprefix("data: "))
        assert time.monotonic() - t0 < 10 + 5
        assert server.wait() != 0
        assert any("stopped:" in line for line in server.lines), "".join(server.lines)


def test_bad_flags_and_a_busy_port_are_one_line_and_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "kvrunahead.cli.serve", "--model", MODEL]
    r = subprocess.run([*cmd, "--max-queue", "0"], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["kvr-serve: error: --max-queue must be at "
                                                                   "least 1, got 0"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=120, env=ENV,
                           cwd=ROOT)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    corrupt = tmp_path / "table.json"
    corrupt.write_text('{"meta": {"model": ')  # a table cut short (a full disk, a copy interrupted)
    r = subprocess.run([*cmd, "--nproc", "2", "--table", str(corrupt)], capture_output=True, text=True, timeout=120,
                       env=ENV, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"cannot read partition table {corrupt}" in r.stderr, r.stderr


def _counter(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf'^kvr_requests_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_bad_input_overload_and_a_disconnect_on_real_ranks_leave_the_server_serving():
    with serving("--max-queue", "1", "--max-model-len", "4096", "--timeout", "30") as server:
        url = server.url()
        post = f"{url}/v1/completions"
        good = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        bad = [  # (body as sent, the status, the words its error must name)
            ('{"model": "tiny-llama", "prompt": ', 400, "JSON"),
            (json.dumps({**good, "max_tokens": "four"}), 400, "max_tokens"),
            (json.dumps({**good, "model": "gpt-4"}), 404, "gpt-4"),
            (json.dumps({**good, "prompt": "x" * 5000}), 400, "4096"),
            (json.dumps({**good, "max_tokens": 0}), 400, "max_tokens"),
        ]
        for body, status, words in bad:
            r = httpx.post(post, content=body, headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
        assert httpx.post(post, json=good, timeout=60).status_code == 200  # still serving

        # More waiting requests than --max-queue: 429 with Retry-After at once, the others served.
        with httpx.Client(timeout=120) as client:
            results: list[httpx.Response] = []
            threads = [threading.Thread(target=lambda: results.append(client.post(post, json=good)))
                       for _ in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        codes = sorted(r.status_code for r in results)
        assert len(codes) == 24 and set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
        assert all(r.headers.get("Retry-After") for r in results if r.status_code == 429)

        # A client that leaves mid-stream: its request is cancelled, the server goes on.
        before = _counter(url, "cancelled")
        long = {**good, "prompt": "Hi", "max_tokens": 4000, "stream": True}  # far longer than the test lasts
        with httpx.stream("POST", post, json=long, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.monotonic() + 20
        while _counter(url, "cancelled") <= before:
            assert time.monotonic() < deadline, "the disconnected request was never cancelled"
            time.sleep(0.2)
        assert httpx.post(post, json=good, timeout=60).status_code == 200


def test_chunking_and_lars_flags_that_cannot_run_are_one_line_and_exit_2():
    cmd = [sys.executable, "-m", "kvrunahead.cli.serve"]
    for args, says in ((["--model", "tiny-gemma3", "--step-budget-ms", "500"], "sliding-window layers"),
                       (["--model", MODEL, "--chunk-tokens", "-1"], "--chunk-tokens must be 0 (off) or more"),
                       (["--model", MODEL, "--schedule", "lars", "--ttft-slo-s", "0"], "must be positive")):
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def test_openai_clients_n_logprobs_echo_and_prompt_batches_on_real_ranks():
    """What lm-eval, guidellm and the ``openai`` client send a vLLM server, against two ranks: n choices of one
    prefill (the others take its K,V and first-token logits from the prefix cache), greedy log-probabilities whose
    likeliest token is the one chosen, the prompt echoed (with its own log-probabilities, as lm-eval asks), a list
    of prompts answered one choice each, /tokenize's count as the usage's (chat log-probabilities:
    tests/test_serve_http.py; this model has no chat template)."""
    with serving() as server:
        url = server.url()
        api = _api(url)
        cached_before = _metric(url, "kvr_prefix_cached_tokens_total")
        many = api.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=4, temperature=1.0, seed=11)
        assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 12
        n_prompt = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["count"]
        assert many.usage.prompt_tokens == 3 * n_prompt
        assert _metric(url, "kvr_prefix_cached_tokens_total") - cached_before == 2 * n_prompt  # no prefill at all
        greedy = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                        echo=False)
        lp = greedy.choices[0].logprobs
        assert "".join(lp.tokens) == greedy.choices[0].text and len(lp.token_logprobs) == 5
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert logprob <= 0 and max(top, key=top.get) == token  # greedy: the likeliest is the one chosen
        echoed = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
        assert echoed.choices[0].text == PROMPT + greedy.choices[0].text
        scored = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                        logprobs=1).choices[0]
        lp = scored.logprobs
        assert scored.text == PROMPT + greedy.choices[0].text[:len(lp.tokens[-1])]
        assert len(lp.tokens) == n_prompt + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:]) and len(set(lp.token_logprobs[1:])) > 1
        assert lp.tokens[-1] == greedy.choices[0].logprobs.tokens[0]
        batch = api.completions.create(model=MODEL, prompt=[PROMPT, "Hello there"], max_tokens=5, temperature=0)
        assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == greedy.choices[0].text
        _vllm_names_agree_with_ours(url)


def _vllm_names_agree_with_ours(url: str) -> None:
    """The series vLLM's Grafana dashboard reads, scraped after real requests: labelled with the served model and
    counting what the server's own series count."""
    text = httpx.get(f"{url}/metrics").text
    label = f'{{model_name="{MODEL}"}}'
    for name in ("num_requests_running", "num_requests_waiting"):
        assert f"vllm:{name}{label} 0.0" in text.splitlines()
    pairs = {"vllm:prompt_tokens_total": "kvr_prompt_tokens_total",
             "vllm:generation_tokens_total": "kvr_generation_tokens_total",
             "vllm:time_to_first_token_seconds_count": "kvr_ttft_seconds_count",
             "vllm:e2e_request_latency_seconds_count": "kvr_e2e_request_latency_seconds_count",
             "vllm:time_to_first_token_seconds_sum": "kvr_ttft_seconds_sum"}
    for theirs, ours in pairs.items():
        assert _metric(url, theirs + label) == _metric(url, ours) > 0, (theirs, text)
    gaps = _metric(url, "vllm:time_per_output_token_seconds_count" + label)  # one per token after a request's first
    assert 0 < gaps < _metric(url, "kvr_generation_tokens_total")
    # what chose each prefill's degree: this short prompt's chain is priced far behind one rank, so the prior
    assert _metric(url, 'kvr_layout_choices_total{basis="prior",degree="1"}') > 0


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_restarts_bring_the_whole_server_back_on_its_port_after_a_worker_is_killed(tmp_path):
    """``--restarts 1 --no-recover``: a worker's ``kill -9`` ends the server (its request in flight gets an error),
    and the launcher starts every rank again on the same port, which answers with the same greedy text within
    60 s. (With recovery, the default, only the front's end ends the server.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving("--timeout", "10", "--restarts", "1", "--no-recover", port=port) as server:
        url = server.url()
        assert url == f"http://127.0.0.1:{port}"
        api = _api(url)
        before = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        first = server.ranks()[0]
        t0 = time.monotonic()
        os.kill(first, signal.SIGKILL)
        deadline = t0 + 60 * COMPILE_SLOWDOWN
        while True:
            assert time.monotonic() < deadline, "".join(server.lines)
            ranks = server.ranks()
            if ranks.get(0) not in (None, first):
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        back_s = time.monotonic() - t0
        print(f"serving over both ranks again {back_s:.1f} s after the kill")
        again = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        assert again == before and back_s < 60 * COMPILE_SLOWDOWN
        assert any("starting it again (1 of 1 restarts)" in line for line in server.lines), "".join(server.lines)
        os.kill(server.proc.pid, signal.SIGTERM)  # a drain ends it for good: exit 0, not restarted
        assert server.wait() == 0, "".join(server.lines)


@pytest.mark.parametrize("args,says", [
    (["--restarts", "1"], "--restarts needs a --port of its own"),
    (["--restarts", "-1", "--port", "8123"], "--restarts must be 0 or more"),
])
def test_bad_restarts_are_one_line_and_exit_2(args, says):
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.serve", "--model", MODEL, "--nproc", "2", "--port", "0",
                        *args], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
