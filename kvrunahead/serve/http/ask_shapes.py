"""``POST /v1/ask``'s request and response shapes (this server's own endpoint: many questions on one context)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvrunahead.serve.http.protocol import Reply, Usage

MAX_QUESTIONS = 256


class AskRequest(BaseModel):
    """``POST /v1/ask`` (this server's own): many questions on one shared context, answered greedily, each as if it
    were alone after the context (IPPD); the context is prefilled once."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    context: str = Field(min_length=1)
    questions: list[str] = Field(min_length=1, max_length=MAX_QUESTIONS)
    max_tokens: int = Field(default=32, ge=1)
    chat: bool = True  # the context and each question in one user turn of the model's chat template

    @field_validator("questions")
    @classmethod
    def _nonempty(cls, value: list[str]) -> list[str]:
        if any(not q.strip() for q in value):
            raise ValueError("a question must not be empty")
        return value


class Answer(BaseModel):
    index: int
    question: str
    text: str
    finish_reason: Literal["stop", "length"]
    completion_tokens: int


class AskFiguresModel(BaseModel):
    queue_s: float
    context_s: float
    questions_s: float
    decode_s: float
    degree: int
    boundaries: list[int]


class AskResponse(Reply):
    object: Literal["kvrunahead.oneshot.ask"] = "kvrunahead.oneshot.ask"
    answers: list[Answer]
    usage: Usage  # the context and every question once (prompt), every answer's tokens (completion)
    kvrunahead: AskFiguresModel

    @classmethod
    def build(cls, rid: str, model: str, questions: list[str], done, eos: frozenset[int], decode,
              prompt_tokens: int) -> AskResponse:
        """From the engine's ``Answered``: each answer's text without its EOS, why it ended, the usage."""
        answers = [Answer(index=i, question=q, text=decode([t for t in tokens if t not in eos]),
                          finish_reason="stop" if tokens and tokens[-1] in eos else "length",
                          completion_tokens=len(tokens))
                   for i, (q, tokens) in enumerate(zip(questions, done.answers))]
        completion = sum(a.completion_tokens for a in answers)
        f = done.figures
        return cls(id=rid, model=model, answers=answers,
                   usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                               total_tokens=prompt_tokens + completion),
                   kvrunahead=AskFiguresModel(queue_s=f.queue_s, context_s=f.context_s, questions_s=f.questions_s,
                                              decode_s=f.decode_s, degree=f.degree, boundaries=f.boundaries))
