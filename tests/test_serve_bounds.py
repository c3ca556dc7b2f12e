"""No request's own fields give a 500: every route of ``kvr-serve`` as a user starts it (the default model, one
rank) takes each of its fields at and past every bound (numbers of thousands of digits, 2**63 and 2**64, NaN and
the infinities, non-ASCII digits, empty, huge and deeply nested strings and lists, the wrong types) and answers a
200 or a 4xx with OpenAI's error body naming the problem; a body over --max-request-bytes is a 413 the client
reads even while it is still sending; the server is healthy at the end. Loopback, one server, bounded."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_serve_cli import serving

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m"
HUGE = "9" * 5000
# raw JSON texts, spliced in as a field's value (the long texts are over any model length: a long prompt that fits
# is served, which on one CPU rank takes minutes)
HOSTILE = [
    "0", "-1", "1", "2", "16", "2147483648", str(2 ** 63 - 1), str(2 ** 63), str(2 ** 64), str(-(2 ** 63) - 1), HUGE,
    "-" + HUGE, "1e308", "-1e308", "1e-320", "NaN", "Infinity", "-Infinity", "0.5", "-0.0", "true", "null", "{}",
    "[]", '""', '"x"', '"²"', '"١٢"', '"\\u0000"', json.dumps("x " * 100_000), json.dumps("日本" * 40_000),
    "[" * 500 + "]" * 500, json.dumps([0] * 100_000), "[" + HUGE + "]", json.dumps([[1, 2], [3]]),
    json.dumps(["a"] * 5000), json.dumps({"²": 1.0}), json.dumps({HUGE: 1.0}), json.dumps({"5": "NaN"}),
    json.dumps({str(i): 1.0 for i in range(50_000)}), json.dumps({"5": 1e300}), json.dumps({"-5": 1.0}),
    json.dumps({"role": "user"}), json.dumps([{"role": "user", "content": None}]),
    json.dumps([{"role": "nobody", "content": "x"}]), json.dumps({"include_usage": HUGE}),
]
COMPLETION_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "logit_bias",
                     "stop_token_ids", "logprobs", "echo", "top_k", "min_p", "min_tokens", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "stream", "stream_options", "ttft_target_s",
                     "best_of", "suffix", "ignore_eos", "user", "model", "no_such_field"]
CHAT_FIELDS = ["messages", "max_tokens", "max_completion_tokens", "seed", "logprobs", "top_logprobs", "logit_bias",
               "stop", "n", "temperature", "stream", "model"]
ROUTES = {
    "/v1/completions": ({"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}, COMPLETION_FIELDS),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "temperature": 0}, CHAT_FIELDS),
    "/tokenize": ({"model": MODEL, "prompt": "Hello"}, ["prompt", "messages", "add_special_tokens", "model"]),
    "/detokenize": ({"model": MODEL, "tokens": [1, 2, 3]}, ["tokens", "model"]),
}


def _with(base: dict, field: str, raw: str) -> str:
    """``base`` as JSON text with ``field`` set to the raw JSON ``raw``."""
    marker = "__FIELD__"
    return json.dumps({**base, field: marker}).replace(json.dumps(marker), raw)


def _sent(http: httpx.Client, route: str, body: str) -> httpx.Response:
    return http.post(route, content=body.encode(), headers={"Content-Type": "application/json"})


def _answered(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], f"{what}: {r.text[:500]}"


@pytest.fixture(scope="module")
def server():
    with serving(model=MODEL, nproc=1) as server:
        yield server, server.url(timeout_s=300)


@pytest.mark.parametrize("route", ROUTES)
def test_every_field_at_and_past_its_bounds_is_a_200_or_a_named_4xx(server, route):
    server, url = server
    base, fields = ROUTES[route]
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=30) as http:
        assert _sent(http, route, json.dumps(base)).status_code == 200
        for field in fields:
            for raw in HOSTILE:
                try:
                    r = _sent(http, route, _with(base, field, raw))
                except httpx.ReadTimeout:  # a valid request that runs long (max_tokens null: to the model's length),
                    statuses[0] = statuses.get(0, 0) + 1  # dropped by its client: the engine cancels it
                    continue
                _answered(r, f"{route} {field}={raw[:40]}")
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert http.get("/health").json()["status"] == "ok", "".join(server.lines)[-3000:]
    assert statuses.get(400, 0) > len(fields) * 10 and statuses.get(0, 0) <= 3, statuses  # mostly refused, by name
    assert not any("Traceback" in line for line in server.lines), "".join(server.lines)[-5000:]


@pytest.mark.parametrize("case", [
    ({"logit_bias": {"²": 1.0}}, "logit_bias"), ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
    ({"seed": 2 ** 64}, "seed"), ({"seed": 2 ** 63}, "seed"), ({"stop": ["x"] * 33}, "stop"),
    ({"stop": ["x" * 257]}, "stop"), ({"logit_bias": {"49152": 1.0}}, "logit_bias"),
])
def test_the_reported_fields_are_400s_naming_them(server, case):
    server, url = server
    extra, param = case
    body = {**ROUTES["/v1/completions"][0], **extra}
    r = httpx.post(f"{url}/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]


def test_seeds_at_vllm_s_bounds_are_taken(server):
    server, url = server
    for seed in (-(2 ** 63), 2 ** 63 - 1, 0):
        body = {**ROUTES["/v1/completions"][0], "seed": seed, "temperature": 1.0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_a_413_the_client_reads_while_still_sending(server, declared):
    """2,000,000 token ids (16 MB against the 4 MiB default): with its length declared, and streamed in chunks
    without it."""
    server, url = server
    body = json.dumps({"model": MODEL, "tokens": [12345] * 2_000_000}).encode()
    content = body if declared else (body[i:i + 65536] for i in range(0, len(body), 65536))
    r = httpx.post(f"{url}/detokenize", content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
