"""``POST /v1/ask``: many questions on one shared context through the real engine and the HTTP app; every answer
equals the standalone prompt's greedy continuation, and bad requests are 400s that name the problem."""

from __future__ import annotations

import json
import random

import pytest
import torch
from starlette.testclient import TestClient
from transformers import DynamicCache

from kvrunahead.config import RunConfig
from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.model.rope import plan_extension
from kvrunahead.prompt import question_prompts
from kvrunahead.ranks.launcher import World
from kvrunahead.serve.asking import asking
from kvrunahead.serve.client import AsyncEngineClient
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.http.app import build_app
from kvrunahead.serve.sequence import Answered, Finished, Request, SamplingParams, TokenEvent

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
    engine, http = served
    r = _ask(http, context="word " * (engine.max_model_len + 10), questions=["a"], max_tokens=4, chat=False)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"], r.text


def _alone(lm, ids: list[int], max_tokens: int) -> list[int]:
    cache = DynamicCache(config=lm.model.config)
    first = int(last_token_logits(lm.model, torch.tensor([ids]), cache=cache).argmax())
    return greedy_decode(lm.model, first, cache, len(ids), max_tokens, lm.eos_token_ids)


def _until_done(engine: Engine, ids: set[str]) -> list:
    events = []
    for _ in range(200):
        events += engine.step()
        if ids <= {e.request_id for e in events if isinstance(e, (Answered, Finished))}:
            return events
    raise AssertionError("the requests did not end in 200 steps")


def test_the_questions_decode_as_rows_beside_other_requests_and_every_answer_is_exact():
    """A shared-context request's questions are decode rows of the engine's steps: another request's prefill and
    decode run beside them (its first token comes before the questions' last), and every answer is still its
    standalone prompt's."""
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1)), World(0, 1, 0, 1, "single"))
    rng = random.Random(3)
    context = [rng.randrange(3, 250) for _ in range(90)]
    questions = [[rng.randrange(3, 250) for _ in range(n)] for n in (4, 11, 1)]
    other = [rng.randrange(3, 250) for _ in range(37)]
    engine.add(asking("ask", context, questions, 8))
    engine.add(Request("other", other, SamplingParams(max_tokens=8)))
    events = _until_done(engine, {"ask", "other"})
    order = [(type(e).__name__, e.request_id) for e in events]
    assert order.index(("TokenEvent", "other")) < order.index(("Answered", "ask"))
    lm = engine.ctx.lm
    answered = next(e for e in events if isinstance(e, Answered))
    assert answered.error is None and answered.figures.decode_s > 0
    assert answered.answers == [_alone(lm, context + q, 8) for q in questions]
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == _alone(lm, other, 8)
    assert not engine.decoder.shared and not engine.scheduler.running  # freed once answered


def test_a_cancelled_ask_frees_its_questions():
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1)), World(0, 1, 0, 1, "single"))
    engine.add(asking("ask", list(range(3, 40)), [[5, 6], [7]], 50))
    engine.step()  # the context and the questions' prefill
    assert "ask" in engine.decoder.shared
    engine.cancel("ask")
    events = engine.step()
    assert [(type(e).__name__, e.error) for e in events] == [("Answered", "cancelled")]
    assert not engine.decoder.shared and not engine.scheduler.running and not engine.has_work()


def test_a_context_beyond_the_trained_positions_runs_with_its_yarn_extension():
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1)), World(0, 1, 0, 1, "single"))
    rng = random.Random(5)
    context = [rng.randrange(3, 250) for _ in range(8190)]  # 8192 trained positions; the questions go beyond
    questions = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 6)]
    engine.add(asking("ask", context, questions, 3))
    answered = next(e for e in _until_done(engine, {"ask"}) if isinstance(e, Answered))
    rope = plan_extension(engine.model_config, len(context) + 6 + 3, False, "tiny-llama")
    assert rope is not None and answered.error is None
    lm = engine.ctx.model(rope)[0]
    assert answered.answers == [_alone(lm, context + q, 3) for q in questions]


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


def test_a_request_carrying_questions_waits_in_the_one_queue_in_arrival_order_and_is_never_packed():
    from kvrunahead.serve.scheduler import Scheduler
    from kvrunahead.serve.sequence import Sequence

    scheduler = Scheduler(8, pack_tokens=1000)
    a, ask, b = (Sequence(Request("a", [5] * 10)), Sequence(asking("ask", [6] * 10, [[7]], 4)),
                 Sequence(Request("b", [8] * 10)))
    for seq in (a, ask, b):
        scheduler.add(seq)
    assert scheduler.schedule(0.0).prefills == [a]  # the packing stops at the request that cannot pack
    scheduler.start_decoding(a)
    step = scheduler.schedule(0.0)
    assert step.prefills == [ask] and step.decodes == [a]
    scheduler.start_decoding(ask)
    step = scheduler.schedule(0.0)
    assert step.prefills == [b] and step.decodes == [a, ask]  # its questions decode as the running requests do
    assert scheduler.remove("ask") is ask and scheduler.in_flight == 1
