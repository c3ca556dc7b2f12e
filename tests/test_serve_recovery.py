"""``kvr-serve`` outlives a worker (serve/recovery.py, ranks/recovery.py): the official ``openai`` client streams
through the loss of a worker rank during a chain prefill, a KV-parallel decode and a chunked prefill, at two and
three ranks, by ``kill -9``, an injected exit and SIGSTOP past ``--timeout``. Every request completes with one
process's greedy text (tests/helpers.greedy_text), the decodes the front holds keep streaming while the rank is
down, the ones that ran again say so (``kvrunahead.retried``), ``/health`` says degraded meanwhile, and the server
answers over every rank again within 60 s (``kvr_rank_restarts_total``)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers import COMPILE_SLOWDOWN, greedy_text
from tests.test_serve_cli import MODEL, _metric, serving

pytestmark = pytest.mark.timeout(300)

BACK_S = 60  # the target: serving over every rank again this soon after the loss
# token ids of tiny-llama's vocabulary: one process's greedy text is known exactly (no tokenizer in the way). LONG's
# greedy tokens lead their runner-up by 0.0029 or more in the logits for 800 tokens: a decode row riding in another
# prompt's forward (a mixed step) rounds differently by ~1e-6, which flips a near-tie, and a random model has many
LONG = (lambda rng: [rng.randrange(4, 500) for _ in range(90)])(random.Random(1))
OTHER = [(11 * i + 5) % 500 + 4 for i in range(70)]
AFTER = [(13 * i + 1) % 500 + 4 for i in range(40)]  # asked once the workers are back (not in the prefix cache)


def _result(future, server):
    """The future's result; where it raises, an assertion naming what the server said."""
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001
        lines = [line for line in server.lines if not line.startswith(("frame #", "Exception raised", "<omitting"))]
        raise AssertionError(f"{type(e).__name__}: {e}\n{''.join(lines)[-6000:]}") from e


class Watch:
    """/health read every 0.1 s in a thread: when it first said degraded, and when ok again after that."""

    def __init__(self, url: str) -> None:
        self.url, self.degraded_at, self.back_at, self.said = url, None, None, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                try:
                    body = http.get(f"{self.url}/health").json()
                except httpx.TransportError:  # the server is gone (the test ended it)
                    return
                now = time.monotonic()
                if body["status"] == "degraded" and self.degraded_at is None:
                    self.degraded_at = now
                    self.said.append(body)
                elif body["status"] == "ok" and self.degraded_at is not None and self.back_at is None:
                    self.back_at = now
                    self.said.append(body)
                time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _stream(api: openai.OpenAI, ids: list[int], k: int, times: list[float] | None = None,
            started: threading.Event | None = None) -> tuple[str, dict]:
    """A streamed greedy completion of the token ids ``ids``: its text and the final chunk's kvrunahead figures;
    ``times``: each text chunk's arrival."""
    text, figures = "", None
    for chunk in api.completions.create(model=MODEL, prompt=ids, max_tokens=k, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            if times is not None:
                times.append(time.monotonic())
            if started is not None:
                started.set()
        figures = (chunk.model_extra or {}).get("kvrunahead") or figures
    return text, figures


def _api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0, timeout=120 * COMPILE_SLOWDOWN)


def _back_over_every_rank(server, url: str, watch: Watch, t0: float, ranks: int) -> float:
    """Seconds from ``t0`` (the loss) until /health said ok again, asserting the target, the restarts counted
    and a prefill over every rank giving one process's greedy text."""
    deadline = t0 + BACK_S * COMPILE_SLOWDOWN
    while watch.back_at is None:
        assert time.monotonic() < deadline, "".join(server.lines)
        time.sleep(0.1)
    back_s = watch.back_at - t0
    print(f"serving over all {ranks} ranks again {back_s:.1f} s after the loss; /health said {watch.said}")
    assert watch.said[0]["degraded"]["seconds"] >= 0 and watch.said[-1]["restarts"] >= 1
    assert _metric(url, "kvr_rank_restarts_total") >= 1 and _metric(url, "kvr_degraded") == 0
    c = _api(url).completions.create(model=MODEL, prompt=AFTER, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert c.choices[0].text == greedy_text(MODEL, AFTER, 8)
    assert c.model_extra["kvrunahead"]["degree"] == ranks and c.model_extra["kvrunahead"]["retried"] == 0
    return back_s


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_worker_lost_in_a_chain_prefill_costs_no_request_and_the_front_decodes_on(nproc):
    """Rank 0 exits in the chain prefill of the second request while the first decodes on the front (its row
    rode in the failed step, cut back): the first streams on through the loss; the second runs again from its
    prompt once the workers are back; both give one process's greedy text."""
    env = {"KVRUNAHEAD_INJECT_FAULT": "0:1:exit:2"}  # rank 0, layer 1, its second chain prefill
    with serving("--timeout", "10", "--degree", str(nproc), "--decode", "gathered", nproc=nproc, env=env) as server:
        url = server.url()
        api = _api(url)
        watch = Watch(url)
        times: list[float] = []
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_stream, api, LONG, 800, times, started)
            assert started.wait(60 * COMPILE_SLOWDOWN), "".join(server.lines)
            t0 = time.monotonic()
            second = pool.submit(_stream, api, OTHER, 24)
            text2, figures2 = _result(second, server)
            back_s = _back_over_every_rank(server, url, watch, t0, nproc)
            text1, figures1 = _result(first, server)
        watch.stop()
        assert any("rank 0 ended" in line for line in server.lines), "".join(server.lines)
        assert text2 == greedy_text(MODEL, OTHER, 24) and figures2["retried"] == 1
        assert text1 == greedy_text(MODEL, LONG, 800) and figures1["retried"] == 0
        down = [t for t in times if watch.degraded_at < t < watch.back_at]
        print(f"{len(down)} tokens of the front's decode streamed while the rank was down ({back_s:.1f} s)")
        assert down, "the front's decode stalled while the worker was down"


def test_a_worker_stopped_past_the_timeout_in_a_kv_parallel_decode_is_replaced_and_the_stream_goes_on():
    """SIGSTOP of rank 0 while a request decodes KV-parallel (its K,V spread over both ranks): after --timeout the
    front drops the generation, the launcher kills the stopped rank and starts another; the request runs again
    from its prompt, its sent tokens fed back, and its stream goes on to one process's greedy text."""
    with serving("--timeout", "4", "--degree", "2", "--decode", "kvp") as server:
        url = server.url()
        watch = Watch(url)
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, _api(url), LONG, 600, None, started)
            assert started.wait(60 * COMPILE_SLOWDOWN), "".join(server.lines)
            stopped = server.ranks()[0]
            t0 = time.monotonic()
            os.kill(stopped, signal.SIGSTOP)
            text, figures = _result(stream, server)
        _back_over_every_rank(server, url, watch, t0, 2)
        watch.stop()
        assert figures["decode"] == "kvp" and figures["retried"] == 1, figures
        assert text == greedy_text(MODEL, LONG, 600)
        assert watch.said[0]["degraded"]["rank"] in (0, None)
        assert server.ranks()[0] != stopped


def test_a_worker_killed_in_a_chunked_prefill_is_replaced_and_the_prompt_runs_again():
    """``kill -9`` of rank 0 between the chunks of a chunked prefill (the worker holds the chunks so far): the
    prompt runs again from its start over the new workers and gives one process's greedy text."""
    env = {"KVRUNAHEAD_INJECT_FAULT": "0:1:stop:3"}  # rank 0 stops in the third chunk; the test kills it
    with serving("--timeout", "30", "--degree", "2", "--chunk-tokens", "16", "--decode", "gathered",
                 env=env) as server:
        url = server.url()
        watch = Watch(url)
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, _api(url), LONG, 16)
            deadline = time.monotonic() + 60 * COMPILE_SLOWDOWN
            while not any("at layer 1 of run 3: stop" in line for line in server.lines):
                assert time.monotonic() < deadline, "".join(server.lines)
                time.sleep(0.05)
            t0 = time.monotonic()
            os.kill(server.ranks()[0], signal.SIGKILL)
            text, figures = _result(stream, server)
        _back_over_every_rank(server, url, watch, t0, 2)
        watch.stop()
        assert text == greedy_text(MODEL, LONG, 16)
        assert figures["retried"] == 1 and len(figures["chunks"]) > 1, figures
