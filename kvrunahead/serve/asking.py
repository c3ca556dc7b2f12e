"""Requests carrying questions on a shared context (``/v1/ask``, ``kvr-ask``): a request like any other whose prompt
is the context, with ``Request.questions``. What is checked before one is queued, the prompt segment that carries its
questions (IPPD: the front prefills them packed behind the context's whole cache, in the context's step), its
questions' decode rows (PAT: one forward for all of them, the context read once) and what each step gives them. The
engine keeps the queue and the ranks' state; this module holds the questions' own logic."""

from __future__ import annotations

import dataclasses
import time

from kvrunahead.config import RunConfig
from kvrunahead.decode.shared_prefix import SharedContext, require_full_attention
from kvrunahead.model.rope import ContextError, RopeExtension, plan_extension
from kvrunahead.serve.sequence import Answered, Answers, AskFigures, Request, SamplingParams, Sequence
from kvrunahead.serve.step.executor import StepOutcome
from kvrunahead.serve.step.plans import FRONT, DecodeRow, Prompt, question_id


def asking(request_id: str, context_ids: list[int], question_ids: list[list[int]], max_tokens: int) -> Request:
    """A request of ``question_ids`` on the context ``context_ids``, each answered greedily up to ``max_tokens``."""
    return Request(request_id, list(context_ids), SamplingParams(max_tokens=max_tokens),
                   questions=[list(q) for q in question_ids])


def longest(ask: Request) -> int:
    """The most positions one of its questions reaches: the context, the longest question and max_tokens."""
    return len(ask.prompt_ids) + max(map(len, ask.questions)) + ask.params.max_tokens


def check_ask(ask: Request, model_config, run: RunConfig, max_model_len: int) -> None:
    """Raise ValueError naming what the engine cannot take of a request carrying questions."""
    try:
        require_full_attention(model_config)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    if ask.params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {ask.params.max_tokens}")
    if not ask.prompt_ids or any(not q for q in ask.questions):
        raise ValueError("the context and every question need at least one token")
    try:
        ask_rope(ask, model_config, run)
    except ContextError as e:
        raise ValueError(str(e)) from None
    if longest(ask) > max_model_len:
        raise ValueError(f"the context, the longest question and max_tokens come to {longest(ask)} tokens; this "
                         f"server takes {max_model_len}")


def ask_rope(ask: Request, model_config, run: RunConfig) -> RopeExtension | None:
    """The RoPE extension every position of the request needs (its context and questions run on one model)."""
    return plan_extension(model_config, longest(ask), run.allow_long_context, run.model)


def with_questions(seg: Prompt, ask: Request) -> Prompt:
    """The context's segment carrying the questions, kept whole on the front where they decode."""
    return dataclasses.replace(seg, keep=FRONT, questions=tuple(map(tuple, ask.questions)))


def started(seq: Sequence, outcome: StepOutcome, start_s: float, degree: int, boundaries) -> None:
    """The request decoding after its step: each question's first token (greedy) from the step's logits."""
    first_s = time.monotonic()
    ids = [question_id(seq.request_id, i) for i in range(len(seq.request.questions))]
    seq.answers = Answers([[int(outcome.logits[q].argmax())] for q in ids], start_s,
                          first_s - start_s - outcome.questions_s, outcome.questions_s, first_s, degree,
                          list(boundaries))


def first_logits(ask: Request, outcome: StepOutcome) -> dict:
    """Each question's first-token logits (float32, CPU), keyed by its ``question_id`` (a one-shot report's)."""
    return {q: outcome.logits[q].float().cpu()
            for q in (question_id(ask.request_id, i) for i in range(len(ask.questions)))}


def going(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """The questions still answering: below max_tokens and not ended by an EOS."""
    return [i for i, a in enumerate(seq.answers.tokens)
            if len(a) < seq.request.params.max_tokens and a[-1] not in eos_token_ids]


def question_rows(seq: Sequence, shared: SharedContext, eos_token_ids: set[int]) -> list[DecodeRow]:
    """The unfinished questions' next tokens, as decode rows on the front."""
    tokens = seq.answers.tokens
    return [DecodeRow(question_id(seq.request_id, i), (tokens[i][-1],), shared.position(i, len(tokens[i]) - 1))
            for i in going(seq, eos_token_ids)]


def take_tokens(seq: Sequence, outcome: StepOutcome, eos_token_ids: set[int]) -> None:
    """Each unfinished question takes its next token (greedy) from the step."""
    for i in going(seq, eos_token_ids):
        seq.answers.tokens[i].append(int(outcome.logits[question_id(seq.request_id, i)].argmax()))


def answered(seq: Sequence, error: str | None = None, bad_input: bool = False) -> Answered:
    """The request's answers and figures, every question ended (or its error: no answers)."""
    a = seq.answers
    if error is not None or a is None:
        return Answered(seq.request_id, [], error=error, bad_input=bad_input)
    figures = AskFigures(a.start_s - seq.request.arrival_s, a.context_s, a.questions_s,
                         time.monotonic() - a.first_s, a.degree, a.boundaries)
    return Answered(seq.request_id, a.tokens, figures)
