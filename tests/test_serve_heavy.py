"""No request's fields slow the others' streams: a greedy stream of 80 tokens beside 3 requests at the bounds of
their per-token work (32 stop strings of 256 characters, a ``logit_bias`` over the whole vocabulary, a repetition
penalty) keeps its median gap between tokens within 1.5x of its gap beside 3 plain requests. ``kvr-serve
--nproc 2`` with its defaults, SmolLM2-135M, on loopback; the two loads interleaved, twice."""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.test_serve_cli import serving

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m"
VOCAB = 49152
PROMPT = "Write a long story about a lighthouse keeper and the ships that pass in the night."


def _heavy(rng: random.Random) -> dict:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return {"stop": ["".join(rng.choice(letters) for _ in range(256)) for _ in range(32)],
            "logit_bias": {str(t): 0.0 for t in range(VOCAB)}, "repetition_penalty": 1.0001,
            "frequency_penalty": 0.0001}


def _gaps(url: str, beside: list[dict]) -> list[float]:
    """The stream's gaps between text chunks while ``beside`` run alongside it."""
    arrivals: list[float] = []
    go = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=300) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            go.set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())

    def other(extra: dict) -> int:
        go.wait(120)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True, **extra}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code

    with ThreadPoolExecutor(1 + len(beside)) as pool:
        main = pool.submit(stream)
        others = [pool.submit(other, extra) for extra in beside]
        main.result()
        assert [f.result() for f in others] == [200] * len(beside)
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]


def test_a_stream_beside_heavy_requests_keeps_its_pace():
    rng = random.Random(0)
    plain, heavy = [], []
    with serving(model=MODEL) as server:
        url = server.url(timeout_s=300)
        _gaps(url, [{}])  # warm
        for _ in range(2):
            plain += _gaps(url, [{}, {}, {}])
            heavy += _gaps(url, [_heavy(rng) for _ in range(3)])
    ratio = statistics.median(heavy) / statistics.median(plain)
    print(f"median gap beside 3 plain: {statistics.median(plain) * 1e3:.1f} ms, beside 3 heavy: "
          f"{statistics.median(heavy) * 1e3:.1f} ms ({ratio:.2f}x)")
    assert ratio <= 1.5, (statistics.median(plain), statistics.median(heavy))
