"""``POST /v1/ask``: many questions on one shared context through the real engine and the HTTP app; every answer
equals the standalone prompt's greedy continuation, and bad requests are 400s that name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient
from transformers import DynamicCache

from kvrunahead.config import RunConfig
from kvrunahead.launcher import World
from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.prompt import question_prompts
from kvrunahead.serve.app import build_app
from kvrunahead.serve.client import AsyncEngineClient
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine

CONTEXT = "The quick brown fox jumps over the lazy dog. " * 6
QUESTIONS = ["Who jumps?", "What colour is the fox, and what does the dog do all day long?", "Why?"]


@pytest.fixture(scope="module")
def served():
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1)), World(0, 1, 0, 1, "single"))
    client = AsyncEngineClient(engine)
    with TestClient(build_app(client)) as http:
        yield engine, http
    client.shutdown()


def _ask(http, **body):
    return http.post("/v1/ask", content=json.dumps({"model": "tiny-llama", **body}).encode(),
                     headers={"Content-Type": "application/json"})


def test_every_answer_equals_its_standalone_prompt(served):
    engine, http = served
    r = _ask(http, context=CONTEXT, questions=QUESTIONS, max_tokens=8, chat=False)
    assert r.status_code == 200, r.text
    body = r.json()
    lm = engine.ctx.lm
    context, questions = question_prompts(lm.tokenizer, CONTEXT, QUESTIONS, chat=False)
    for got, q in zip(body["answers"], questions):
        ids = context + q
        cache = DynamicCache(config=lm.model.config)
        first = int(last_token_logits(lm.model, torch.tensor([ids]), cache=cache).argmax())
        want = greedy_decode(lm.model, first, cache, len(ids), 8, lm.eos_token_ids)
        assert got["completion_tokens"] == len(want)
        assert got["text"] == lm.decode([t for t in want if t not in lm.eos_token_ids])
    assert [a["question"] for a in body["answers"]] == QUESTIONS
    assert body["usage"]["prompt_tokens"] == len(context) + sum(map(len, questions))
    assert body["kvrunahead"]["degree"] == 1 and body["kvrunahead"]["boundaries"] == [0, len(context)]
    assert b"kvr_ask_questions_total 3.0" in http.get("/metrics").content


@pytest.mark.parametrize("body, words", [
    ({"context": "x", "questions": []}, "questions"),
    ({"context": "", "questions": ["a"]}, "context"),
    ({"context": "x", "questions": ["a", " "]}, "empty"),
    ({"context": "x", "questions": ["a"], "max_tokens": 0}, "max_tokens"),
    ({"context": "x", "questions": ["a"], "temperature": 1.0}, "temperature"),
])
def test_bad_ask_requests_get_400_naming_the_problem(served, body, words):
    _, http = served
    r = _ask(http, **body)
    assert r.status_code == 400, r.text
    assert words in json.dumps(r.json()["error"])


def test_a_context_beyond_the_model_is_refused(served):
    _, http = served
    r = _ask(http, context="word " * 5000, questions=["a"], max_tokens=4, chat=False)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"], r.text


def test_a_sliding_window_model_refuses_the_ask_form():
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-gemma3", threads=1)), World(0, 1, 0, 1, "single"))
    client = AsyncEngineClient(engine)
    try:
        with TestClient(build_app(client)) as http:
            r = http.post("/v1/ask", content=json.dumps({"model": "tiny-gemma3", "context": "x y z",
                                                         "questions": ["a"]}).encode(),
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "sliding" in r.json()["error"]["message"], r.text
    finally:
        client.shutdown()
