"""The HTTP layer over a fake engine client (no ranks, no torch): bad input is refused by name with OpenAI's error
body, overload and drain answer at once, streams are framed as server-sent events ending in ``data: [DONE]``, a
client that disconnects cancels its request, and the official ``openai`` client works unchanged against a real
uvicorn on 127.0.0.1. The same paths on real ranks are in tests/test_serve_cli.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from kvrunahead.serve.http.app import build_app
from kvrunahead.serve.http.metrics import Metrics
from kvrunahead.serve.http.server import DrainingServer
from kvrunahead.serve.sequence import Finished, QueueFull, RequestFigures, TokenEvent, TokenLogprob

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-model"


class FakeTokenizer:
    """Characters as token ids, a chat template of role tags."""

    chat_template = "tags"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def __len__(self) -> int:
        return 0x110000

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeClient:
    """The ``AsyncEngineClient`` interface: replies ``words`` one per event; ``hold_after`` events, waits until
    cancelled; ``full`` raises QueueFull at the first step, as the real client's generator does."""

    model_id = MODEL
    max_model_len = 64

    def __init__(self, words: tuple[str, ...] = ("Hello", " world", "!"), hold_after: int | None = None,
                 full: bool = False, finish: str | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.words, self.hold_after, self.full, self.finish = words, hold_after, full, finish
        self.healthy, self.draining = True, False
        self.requests: list[tuple[list[int], object, str]] = []
        self.cancelled: list[str] = []
        self.open: set[str] = set()
        self.waiting = self.running = 0

    @property
    def in_flight(self) -> int:
        return len(self.open)

    def begin_drain(self) -> None:
        self.draining = True

    def recovery(self) -> dict:
        return {"restarts": 0}

    down: str | None = None  # why the workers are down past the front's patience
    stuck_for: str | None = None  # why the engine counts as stuck

    def workers_down(self) -> str | None:
        return self.down

    def stuck(self) -> str | None:
        return self.stuck_for

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i > 1)  # 1 is the BOS of FakeTokenizer.encode

    def shutdown(self) -> None:
        self.healthy = False

    async def generate(self, prompt_ids, params, request_id, ttft_target_s=None):
        if self.full:
            raise QueueFull("3 requests are waiting (--max-queue 3)")
        self.requests.append((prompt_ids, params, request_id))
        self.open.add(request_id)
        try:
            words = self.words[:params.max_tokens]
            for i, word in enumerate(words):
                if i == self.hold_after:
                    await asyncio.sleep(3600)  # a long prefill or decode: only a cancel ends it
                token = 65 + i  # "A", "B", ...: the token whose log-probabilities the event carries
                logprob = None if params.logprobs is None else TokenLogprob(
                    token, -0.25 * (i + 1), ((90, -0.1), (token, -0.25 * (i + 1)), (89, -2.0))[:params.logprobs])
                scored = None if params.prompt_logprobs is None or i else [  # the prompt's, on the first event
                    TokenLogprob(t, -0.5, ((t, -0.5), (90, -1.0))[:params.prompt_logprobs]) for t in prompt_ids[1:]]
                yield TokenEvent(request_id, token, word, logprob, scored)
            figures = RequestFigures(0.01, 0.002, 2, [0, 5, len(prompt_ids)], "test table", "forced",
                                     [{"rank": 0, "compute_s": 0.004, "wait_s": 0.0, "bytes_sent": 1000},
                                      {"rank": 1, "compute_s": 0.005, "wait_s": 0.001, "bytes_sent": 0}])
            if self.finish == "bad_input":  # the engine found the request unplannable (a partition it cannot take)
                yield Finished(request_id, "error", len(prompt_ids), 0, None, "--partition 0,9,10 does not fit",
                               bad_input=True)
                return
            reason = self.finish or ("length" if len(words) == params.max_tokens else "stop")
            yield Finished(request_id, reason, len(prompt_ids), len(words), figures,
                           "boom" if reason == "error" else None)
        finally:
            self.open.discard(request_id)


def _app(client: FakeClient):
    metrics = Metrics("tiny-llama")
    metrics.track(lambda: client.waiting, lambda: client.running)
    return build_app(client, metrics)


def _post(client: FakeClient, path: str, body) -> httpx.Response:
    with TestClient(_app(client)) as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return http.post(path, content=content, headers={"Content-Type": "application/json"})


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0}


@pytest.mark.parametrize("body, param, words", [
    (b'{"model": "fake-model", "prompt": ', None, "malformed JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({**COMPLETION, "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({**COMPLETION, "temperature": "hot"}, "temperature", "valid number"),
    ({**COMPLETION, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**COMPLETION, "frobnicate": True}, "frobnicate", "unknown parameter 'frobnicate'"),
    ({**COMPLETION, "n": 17}, "n", "less than or equal to 16"),
    ({**COMPLETION, "n": 0}, "n", "greater than or equal to 1"),
    ({**COMPLETION, "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({**COMPLETION, "prompt_logprobs": 1}, "prompt_logprobs", "unknown parameter"),
    ({**COMPLETION, "prompt": ["a"] * 65}, "prompt", "at most 64 prompts"),
    ({**COMPLETION, "prompt": [[5, 6], []]}, "prompt", "a prompt of the list is empty"),
    ({**COMPLETION, "prompt": [[5, 0x110000]]}, "prompt", "outside the vocabulary"),
    ({**COMPLETION, "response_format": {"type": "json_object"}}, "response_format", "unknown parameter"),
    ({**COMPLETION, "best_of": 2}, "best_of", "not supported"),
    ({**COMPLETION, "prompt": "x" * 70}, "prompt", "at most 64"),
    ({**COMPLETION, "prompt": "x" * 60, "max_tokens": 10}, "max_tokens", "at most 64"),
    ({"prompt": "Hi"}, "model", "'model' is required"),
])
def test_bad_completion_requests_get_400_naming_the_problem(body, param, words):
    client = FakeClient()
    err = _error(_post(client, "/v1/completions", body), 400)
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"
    assert client.requests == []  # nothing reached the engine


def test_a_model_the_server_does_not_serve_is_a_404_model_not_found():
    client = FakeClient()
    for path, body in (("/v1/completions", {**COMPLETION, "model": "gpt-4"}),
                       ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})):
        err = _error(_post(client, path, body), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "unknown model 'gpt-4'" in err["message"]
    assert client.requests == []


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed_or_tokenised():
    client = FakeClient()
    big = json.dumps({**COMPLETION, "prompt": "x" * 5000}).encode()
    with TestClient(build_app(client, Metrics(), max_request_bytes=1000)) as http:
        declared = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        streamed = http.post("/v1/completions", content=iter([big[:600], big[600:]]),
                             headers={"Content-Type": "application/json"})  # chunked: no Content-Length
        small = http.post("/v1/completions", content=json.dumps(COMPLETION).encode(),
                          headers={"Content-Type": "application/json"})
    for r in (declared, streamed):
        err = _error(r, 413)
        assert err["code"] == "request_too_large" and "1000" in err["message"]
    assert small.status_code == 200 and len(client.requests) == 1


def test_a_body_that_is_not_json_is_a_415_and_version_answers():
    client = FakeClient()
    with TestClient(_app(client)) as http:
        r = http.post("/v1/completions", content=json.dumps(COMPLETION).encode(),
                      headers={"Content-Type": "text/plain"})
        with_charset = http.post("/v1/completions", content=json.dumps(COMPLETION).encode(),
                                 headers={"Content-Type": "application/json; charset=utf-8"})
        version = http.get("/version")
    err = _error(r, 415)
    assert "text/plain" in err["message"] and err["code"] == "unsupported_media_type"
    assert with_charset.status_code == 200
    assert version.status_code == 200 and version.json()["version"]


@pytest.mark.parametrize("body, param, words", [
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "Input should be"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", "unknown parameter"),
    ({"model": MODEL, "messages": []}, "messages", "at least 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs: true"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "less than or equal to 20"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", "greater than or equal to 1"),
])
def test_bad_chat_requests_get_400_naming_the_problem(body, param, words):
    err = _error(_post(FakeClient(), "/v1/chat/completions", body), 400)
    assert err["param"] == param and words in err["message"]


def test_neutral_values_of_unimplemented_parameters_are_accepted():
    body = {**COMPLETION, "n": 1, "echo": False, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0.0,
            "logprobs": None, "best_of": 1, "logit_bias": {}, "user": "me", "stream": False}
    assert _post(FakeClient(), "/v1/completions", body).status_code == 200


def test_completion_logprobs_list_each_token_its_likeliest_and_its_offset():
    r = _post(FakeClient(), "/v1/completions", {**COMPLETION, "max_tokens": 2, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["A", "B"] and lp["token_logprobs"] == [-0.25, -0.5]
    assert lp["top_logprobs"] == [{"Z": -0.1, "A": -0.25}, {"Z": -0.1, "B": -0.5}]  # the chosen one among them
    assert lp["text_offset"] == [0, 1]
    plain = _post(FakeClient(), "/v1/completions", {**COMPLETION, "max_tokens": 2})
    assert plain.json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_give_each_token_and_its_top_alternatives_streamed_or_not():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 3}
    r = _post(FakeClient(), "/v1/chat/completions", body)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("A", -0.25, [65]), ("B", -0.5, [66])]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["Z", "A", "Y"]
    chunks = _chunks(_post(FakeClient(), "/v1/chat/completions", {**body, "stream": True}).text)
    streamed = [c for chunk in chunks for choice in chunk["choices"] if choice["logprobs"]
                for c in choice["logprobs"]["content"]]
    assert streamed == content


def _chunks(text: str) -> list[dict]:
    events = _events(text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_list_of_prompts_is_one_choice_each_all_in_the_engine_before_any_is_answered():
    client = FakeClient()
    body = {**COMPLETION, "prompt": ["Hi", "Yo", "Hey"], "max_tokens": 2}
    r = _post(client, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(i, "Hello world") for i in range(3)]
    assert out["usage"] == {"prompt_tokens": 3 + 3 + 4, "completion_tokens": 6, "total_tokens": 16}
    assert [ids for ids, _, _ in client.requests] == [[1, 72, 105], [1, 89, 111], [1, 72, 101, 121]]
    assert len({rid for _, _, rid in client.requests}) == 3
    ids = _post(FakeClient(), "/v1/completions", {**COMPLETION, "prompt": [[5, 6], [7]], "max_tokens": 1}).json()
    assert [c["index"] for c in ids["choices"]] == [0, 1]
    streamed = _chunks(_post(FakeClient(), "/v1/completions", {**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}).text)
    texts = {}
    for chunk in streamed[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "Hello world", 1: "Hello world", 2: "Hello world"}
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["total_tokens"] == 16


def test_n_choices_per_prompt_go_in_after_its_prefill_each_seeded_apart():
    client = FakeClient()
    r = _post(client, "/v1/completions", {**COMPLETION, "prompt": ["Hi", "Yo"], "n": 3, "max_tokens": 1, "seed": 5,
                                          "echo": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "HiHello"), (1, "HiHello"), (2, "HiHello"),
                                                                  (3, "YoHello"), (4, "YoHello"), (5, "YoHello")]
    order = [(ids, params.seed, rid.rsplit("-", 1)[1]) for ids, params, rid in client.requests]
    assert order[:2] == [([1, 72, 105], 5, "0"), ([1, 89, 111], 5, "3")]  # the prompts first, packed together
    assert sorted(order[2:]) == [([1, 72, 105], 6, "1"), ([1, 72, 105], 7, "2"), ([1, 89, 111], 6, "4"),
                                 ([1, 89, 111], 7, "5")]
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["prompt_tokens"] == 18
    chat = _post(FakeClient(), "/v1/chat/completions", {"model": MODEL, "n": 2, "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": "x"}]}).json()
    assert [(c["index"], c["message"]["content"]) for c in chat["choices"]] == [(0, "Hello"), (1, "Hello")]


def test_echo_puts_the_prompt_before_the_completion():
    r = _post(FakeClient(), "/v1/completions", {**COMPLETION, "echo": True, "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "HiHello world"
    ids = _post(FakeClient(), "/v1/completions", {**COMPLETION, "prompt": [72, 105], "echo": True, "max_tokens": 1})
    assert ids.json()["choices"][0]["text"] == "HiHello"
    chunks = _chunks(_post(FakeClient(), "/v1/completions", {**COMPLETION, "echo": True, "max_tokens": 1,
                                                              "stream": True}).text)
    assert [c["choices"][0]["text"] for c in chunks] == ["Hi", "Hello", ""]


def test_echo_with_logprobs_lists_the_prompt_tokens_first_as_vllm_does():
    """lm-eval's loglikelihood request: the prompt's tokens, the first without a log-probability, then the
    completion's; the engine is asked for the prompt's scores with as many alternatives."""
    client = FakeClient()
    body = {**COMPLETION, "prompt": [72, 105], "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0}
    out = _post(client, "/v1/completions", body).json()["choices"][0]
    assert client.requests[0][1].prompt_logprobs == 1 and client.requests[0][1].logprobs == 1
    assert out["text"] == "HiHello"
    lp = out["logprobs"]
    assert lp["tokens"] == ["H", "i", "A"] and lp["token_logprobs"] == [None, -0.5, -0.25]
    assert lp["top_logprobs"] == [None, {"i": -0.5}, {"Z": -0.1, "A": -0.25}] and lp["text_offset"] == [0, 1, 2]
    chunks = _chunks(_post(FakeClient(), "/v1/completions", {**body, "stream": True}).text)
    assert [c["choices"][0]["text"] for c in chunks] == ["Hi", "Hello", ""]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5]
    assert chunks[1]["choices"][0]["logprobs"]["tokens"] == ["A"]
    plain = FakeClient()
    _post(plain, "/v1/completions", {**body, "echo": False})
    assert plain.requests[0][1].prompt_logprobs is None  # no echo: the prompt is not scored


def test_tokenize_and_detokenize_as_vllm_has_them():
    client = FakeClient()
    with TestClient(_app(client)) as http:
        plain = http.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()
        bare = http.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False}).json()
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
        text = http.post("/detokenize", json={"model": MODEL, "tokens": [72, 105]}).json()
        neither = http.post("/tokenize", json={"model": MODEL})
        wrong = http.post("/tokenize", json={"model": "gpt-4", "prompt": "Hi"})
        outside = http.post("/detokenize", json={"tokens": [-1]})
    assert plain == {"count": 3, "max_model_len": 64, "tokens": [1, 72, 105]}
    assert bare["tokens"] == [72, 105]
    assert chat["tokens"] == [ord(c) for c in "<user>x<assistant>"]
    assert text == {"prompt": "Hi"}
    assert _error(neither, 400)["param"] == "prompt" and _error(wrong, 404)["code"] == "model_not_found"
    assert _error(outside, 400)["param"] == "tokens"
    assert client.requests == []


def test_sampling_parameters_reach_the_engine():
    client = FakeClient()
    body = {**COMPLETION, "temperature": 0.7, "top_p": 0.9, "stop": "\n", "seed": 7, "max_tokens": 3}
    r = _post(client, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ids, params, _ = client.requests[0]
    assert ids == [1, ord("H"), ord("i")]
    assert (params.max_tokens, params.temperature, params.top_p, params.stop, params.seed) == (3, 0.7, 0.9, ["\n"], 7)


def test_chat_applies_the_template_and_defaults_max_tokens_to_the_room_left():
    client = FakeClient()
    r = _post(client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!"}
    ids, params, _ = client.requests[0]
    assert "".join(map(chr, ids)) == "<user>Hi<assistant>"
    assert params.max_tokens == 64 - len(ids)
    assert params.temperature == 1.0  # OpenAI's default, as vLLM's


def test_full_queue_is_429_with_retry_after_at_once():
    t0 = time.monotonic()
    r = _post(FakeClient(full=True), "/v1/completions", COMPLETION)
    assert time.monotonic() - t0 < 5
    assert _error(r, 429)["code"] == "queue_full"
    assert int(r.headers["Retry-After"]) >= 1


def test_draining_or_dead_server_is_503_and_health_says_so():
    client = FakeClient()
    with TestClient(_app(client)) as http:
        assert http.get("/health").status_code == 200
        client.begin_drain()
        assert _error(http.post("/v1/completions", json=COMPLETION), 503)["code"] == "draining"
        assert http.get("/health").status_code == 503
        client.draining, client.healthy = False, False
        assert _error(http.post("/v1/completions", json=COMPLETION), 503)["code"] == "engine_dead"
    assert client.requests == []


def test_a_request_the_engine_fails_is_an_error_response():
    err = _error(_post(FakeClient(finish="error"), "/v1/completions", COMPLETION), 500)
    assert "boom" in err["message"] and err["type"] == "server_error"


def _events(text: str) -> list[str]:
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1])
    return [f.removeprefix("data: ") for f in frames[:-1]]


def test_stream_is_server_sent_events_ending_in_done():
    with TestClient(_app(FakeClient())) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 5,
                                                    "messages": [{"role": "user", "content": "Hi"}],
                                                    "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(e) for e in _events(r.text)[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:3]] == ["Hello", " world", "!"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    last, usage = chunks[-2], chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["kvrunahead"]["degree"] == 2
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_streamed_usage_is_on_the_final_chunk_only_or_on_every_chunk_when_asked():
    """OpenAI's: usage only on the extra last chunk (so LangChain's sum of the chunks' usage counts each token
    once); vLLM's ``continuous_usage_stats``: the usage so far on every chunk."""
    with TestClient(_app(FakeClient())) as http:
        plain, counted, continuous = (
            [json.loads(e) for e in _events(http.post("/v1/completions", json={
                **COMPLETION, "stream": True, **({"stream_options": options} if options else {})}).text)[:-1]]
            for options in (None, {"include_usage": True},
                            {"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.get("usage") is None for c in plain)
    assert [c.get("usage") is not None for c in counted] == [False] * (len(counted) - 1) + [True]
    assert sum(c["usage"]["completion_tokens"] for c in counted if c.get("usage")) == 3
    assert [c["usage"]["completion_tokens"] for c in continuous[:3]] == [1, 2, 3]
    final = continuous[-1]["usage"]
    assert continuous[-1]["choices"] == [] and final["completion_tokens"] == 3
    assert final["total_tokens"] == final["prompt_tokens"] + 3 == continuous[0]["usage"]["prompt_tokens"] + 3


def test_vllms_sampling_parameters_reach_the_engine():
    client = FakeClient()
    r = _post(client, "/v1/completions", {
        **COMPLETION, "ignore_eos": True, "top_k": 5, "min_p": 0.05, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [7, 9],
        "logit_bias": {"42": 3.5}, "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    params = client.requests[0][1]
    assert params.skip_special_tokens is False
    assert (params.ignore_eos, params.top_k, params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.min_tokens, params.stop_token_ids, params.logit_bias) == \
        (True, 5, 0.05, 0.5, -0.5, 1.2, 2, [7, 9], {42: 3.5})
    r = _post(client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                               "top_k": -1})
    assert r.status_code == 200 and client.requests[1][1].top_k == 0  # -1: every token, as in vLLM
    assert client.requests[1][1].skip_special_tokens is True  # vLLM's default


@pytest.mark.parametrize("extra, param, words", [
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({"min_tokens": 9, "max_tokens": 5}, "min_tokens", "must not exceed max_tokens"),
])
def test_bad_sampling_parameters_are_400s_naming_them(extra, param, words):
    client = FakeClient()
    err = _error(_post(client, "/v1/completions", {**COMPLETION, **extra}), 400)
    assert err["param"] == param and words in err["message"], err
    assert client.requests == []


def test_an_error_mid_stream_is_an_error_event_then_done():
    with TestClient(_app(FakeClient(finish="error"))) as http:
        r = http.post("/v1/completions", json={**COMPLETION, "stream": True})
    events = _events(r.text)
    assert "boom" in json.loads(events[-2])["error"]["message"]


def test_metrics_count_the_requests_and_their_ttft():
    client = FakeClient()
    with TestClient(_app(client)) as http:
        for _ in range(2):
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        http.post("/v1/completions", json={**COMPLETION, "max_tokens": 0})
        client.waiting = 3
        text = http.get("/metrics").text
    assert "kvr_ttft_seconds_count 2.0" in text
    assert 'kvr_requests_total{outcome="stop"} 2.0' in text
    assert 'kvr_requests_total{outcome="invalid"} 1.0' in text
    assert "kvr_queue_depth 3.0" in text
    assert 'kvr_rank_bytes_sent_total{rank="0"} 2000.0' in text
    assert "kvr_time_per_output_token_seconds_count 2.0" in text
    tokens = int(float(re.search(r"^kvr_generation_tokens_total (\S+)$", text, re.M).group(1)))
    label = '{model_name="tiny-llama"}'
    assert f"vllm:time_to_first_token_seconds_count{label} 2.0" in text  # vLLM's names, as its dashboard reads them
    assert f"vllm:num_requests_waiting{label} 3.0" in text
    assert f"vllm:generation_tokens_total{label} {tokens}.0" in text
    assert f"vllm:time_per_output_token_seconds_count{label} {tokens - 2}.0" in text  # a gap after each first token


# --- a real uvicorn on 127.0.0.1 ---------------------------------------------------------------------------------

@contextlib.contextmanager
def serving(client: FakeClient, grace_s: float = 5.0) -> Iterator[tuple[str, DrainingServer]]:
    """The app under DrainingServer in a thread on an ephemeral port; stopped (and joined) at the end."""
    config = uvicorn.Config(_app(client), host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = DrainingServer(config, client, grace_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.port}", server
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_openai_client_completion_chat_and_stream_against_uvicorn():
    with serving(FakeClient()) as (url, _):
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0, timeout=10)
        assert [m.id for m in api.models.list().data] == [MODEL]
        c = api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
        assert c.choices[0].text == "Hello world" and c.choices[0].finish_reason == "length"
        assert c.usage.prompt_tokens == 3 and c.usage.completion_tokens == 2
        assert c.model_extra["kvrunahead"]["partition"]["boundaries"] == [0, 5, 3]
        chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], seed=1)
        assert chat.choices[0].message.content == "Hello world!" and chat.choices[0].finish_reason == "stop"
        chunks = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, max_completion_tokens=8))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Hello world!"
        assert len(chunks) >= 3 and chunks[-1].choices[0].finish_reason == "stop"
        text = "".join(ch.choices[0].text for ch in api.completions.create(model=MODEL, prompt="Hi", stream=True))
        assert text == "Hello world!"
        with pytest.raises(openai.NotFoundError, match="unknown model"):
            api.completions.create(model="gpt-4", prompt="Hi")
        batch = api.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=2, logprobs=1, echo=False)
        assert [(ch.index, ch.text) for ch in batch.choices] == [(0, "Hello world"), (1, "Hello world")]
        assert batch.choices[1].logprobs.tokens == ["A", "B"] and batch.choices[1].logprobs.token_logprobs[0] == -0.25
        echoed = api.completions.create(model=MODEL, prompt="Hi", max_tokens=1, echo=True)
        assert echoed.choices[0].text == "HiHello"
        chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           logprobs=True, top_logprobs=2)
        assert [(t.token, [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content] == [
            ("A", ["Z", "A"]), ("B", ["Z", "B"])]


def test_langchain_counts_a_streamed_reply_once_as_invoke_does():
    """LangChain's ``ChatOpenAI(stream_usage=True)`` sums the usage of every chunk it gets: the usage must be on
    the final chunk only (OpenAI's), or it is counted twice."""
    from langchain_openai import ChatOpenAI

    with serving(FakeClient()) as (url, _):
        llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="any", temperature=0, max_tokens=3,
                         max_retries=0, timeout=10, stream_usage=True)
        whole = llm.invoke("Hi")
        streamed = None
        for chunk in llm.stream("Hi"):
            streamed = chunk if streamed is None else streamed + chunk
    keys = ("input_tokens", "output_tokens", "total_tokens")
    assert streamed.content == whole.content == "Hello world!"
    assert {k: streamed.usage_metadata[k] for k in keys} == {k: whole.usage_metadata[k] for k in keys} == {
        "input_tokens": len("<user>Hi<assistant>"), "output_tokens": 3, "total_tokens": len("<user>Hi<assistant>") + 3}


@contextlib.contextmanager
def _sent(url: str, body: dict) -> Iterator[socket.socket]:
    """A completion request sent on a raw connection, which is closed at the end without reading the answer."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        yield sock


def test_a_client_that_disconnects_while_waiting_for_its_first_token_cancels_its_request():
    client = FakeClient(hold_after=0)
    with serving(client) as (url, _):
        with _sent(url, COMPLETION):
            _until(lambda: client.requests)
        _until(lambda: client.cancelled)
        assert client.cancelled == [client.requests[0][2]]
        _until(lambda: client.in_flight == 0)


def test_a_client_that_disconnects_mid_stream_cancels_its_request():
    client = FakeClient(hold_after=1)
    with serving(client) as (url, _), httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
        _until(lambda: client.cancelled)
        assert client.cancelled == [client.requests[0][2]]
        _until(lambda: client.in_flight == 0)


def test_drain_refuses_new_requests_finishes_those_in_flight_then_stops():
    client = FakeClient(hold_after=1)
    with serving(client, grace_s=30) as (url, server), httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{url}/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
            server.handle_exit(15, None)  # SIGTERM
            refused = http.post(f"{url}/v1/completions", json=COMPLETION)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert not server.should_exit  # the request in flight keeps the server up
            client.hold_after = None
        _until(lambda: client.in_flight == 0)
    assert server.failure is None


def test_drain_ends_what_outlives_the_grace_period():
    client = FakeClient(hold_after=0)
    with serving(client, grace_s=0.5) as (url, server):
        with _sent(url, COMPLETION):
            _until(lambda: client.requests)
            server.handle_exit(15, None)
            _until(lambda: not client.healthy)  # shutdown() called when the grace ran out
    assert server.failure is None


def test_a_request_the_engine_cannot_plan_is_a_400_naming_why():
    fake = FakeClient(finish="bad_input")
    with TestClient(_app(fake)) as http:
        r = http.post("/v1/completions", json=COMPLETION)
        err = _error(r, 400)
        assert "does not fit" in err["message"] and err["type"] == "invalid_request_error"
        assert 'kvr_requests_total{outcome="invalid"} 1.0' in http.get("/metrics").text
