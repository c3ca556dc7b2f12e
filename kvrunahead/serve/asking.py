"""Shared-context requests in the engine (``/v1/ask``, ``kvr-ask``): what is checked before one is queued, the prompt
segment that carries its questions (IPPD: the front prefills them packed behind the context's whole cache, in the
context's step), its questions' decode rows (PAT: one forward for all of them, the context read once) and what each
step gives them. The engine keeps the queue and the ranks' state; this module holds the request's own logic."""

from __future__ import annotations

import dataclasses
import time

from kvrunahead.config import RunConfig
from kvrunahead.model.rope import ContextError, RopeExtension, plan_extension
from kvrunahead.questions import SharedContext, require_full_attention
from kvrunahead.serve.executor import StepOutcome
from kvrunahead.serve.plans import FRONT, Segment, question_id
from kvrunahead.serve.sequence import Answered, Answering, AskFigures, AskRequest


def longest(ask: AskRequest) -> int:
    """The most positions one of its questions reaches: the context, the longest question and max_tokens."""
    return len(ask.context_ids) + max(map(len, ask.question_ids)) + ask.max_tokens


def check_ask(ask: AskRequest, model_config, run: RunConfig, max_model_len: int) -> None:
    """Raise ValueError naming what the engine cannot take of ``ask``."""
    try:
        require_full_attention(model_config)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    if ask.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {ask.max_tokens}")
    if not ask.context_ids or not ask.question_ids or any(not q for q in ask.question_ids):
        raise ValueError("the context and every question need at least one token")
    try:
        ask_rope(ask, model_config, run)
    except ContextError as e:
        raise ValueError(str(e)) from None
    if longest(ask) > max_model_len:
        raise ValueError(f"the context, the longest question and max_tokens come to {longest(ask)} tokens; this "
                         f"server takes {max_model_len}")


def ask_rope(ask: AskRequest, model_config, run: RunConfig) -> RopeExtension | None:
    """The RoPE extension every position of the request needs (its context and questions run on one model)."""
    return plan_extension(model_config, longest(ask), run.allow_long_context, run.model)


def with_questions(seg: Segment, ask: AskRequest) -> Segment:
    """The context's segment carrying the questions, kept whole on the front where they decode."""
    return dataclasses.replace(seg, keep=FRONT, questions=tuple(map(tuple, ask.question_ids)))


def started(ask: AskRequest, outcome: StepOutcome, start_s: float, degree: int, boundaries) -> Answering:
    """The request decoding after its step: each question's first token (greedy) from the step's logits."""
    first_s = time.monotonic()
    firsts = [int(outcome.logits[question_id(ask.request_id, i)].argmax()) for i in range(len(ask.question_ids))]
    return Answering(ask, [[t] for t in firsts], start_s, first_s - start_s - outcome.questions_s,
                     outcome.questions_s, first_s, degree, list(boundaries))


def first_logits(ask: AskRequest, outcome: StepOutcome) -> dict:
    """Each question's first-token logits (float32, CPU), keyed by its ``question_id`` (a one-shot report's)."""
    return {q: outcome.logits[q].float().cpu()
            for q in (question_id(ask.request_id, i) for i in range(len(ask.question_ids)))}


def question_rows(run: Answering, shared: SharedContext, eos_token_ids: set[int]) -> list[Segment]:
    """The unfinished questions' next tokens, as decode rows on the front."""
    return [Segment(question_id(run.request_id, i), (run.answers[i][-1],), shared.position(i, len(run.answers[i]) - 1),
                    held=FRONT, keep=FRONT, decode=True)
            for i in run.going(eos_token_ids)]


def take_tokens(run: Answering, outcome: StepOutcome, eos_token_ids: set[int]) -> None:
    """Each unfinished question takes its next token (greedy) from the step."""
    for i in run.going(eos_token_ids):
        run.answers[i].append(int(outcome.logits[question_id(run.request_id, i)].argmax()))


def answered(run: Answering) -> Answered:
    """The request's answers and figures, every question ended."""
    figures = AskFigures(run.start_s - run.ask.arrival_s, run.context_s, run.questions_s,
                         time.monotonic() - run.first_s, run.degree, run.boundaries)
    return Answered(run.request_id, run.answers, figures)
