"""``kvr-ask``'s job and its report: a shared context prefilled once (over the KV chain when there are several
ranks), then many questions answered after it on the last rank (decode/shared_prefix.py), each checked on request
against its standalone prompt. The job runs as one request to the serving engine (oneshot/on_engine.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvrunahead.model.reference import check_alone


@dataclass(frozen=True)
class AskJob:
    context_ids: list[int]
    questions: list[list[int]]  # each question's ids after the context
    question_texts: list[str]
    max_new_tokens: int


@dataclass
class QuestionResult:
    question: str
    tokens: list[int]
    text: str
    matches: bool | None = None  # --verify: the tokens and first logits equal the standalone prompt's
    first_logit_diff: float | None = None
    reference_text: str | None = None


@dataclass
class AskResult:
    model: str
    world_size: int
    context_tokens: int
    boundaries: list[int]
    context_s: float  # the context's prefill (the chain's TTFT where there are several ranks)
    questions_s: float  # the questions' packed prefill, up to every first token
    decode_s: float
    decode_steps: int
    answers: list[QuestionResult] = field(default_factory=list)
    atol: float | None = None

    @property
    def total_s(self) -> float:
        return self.context_s + self.questions_s + self.decode_s

    @property
    def verified(self) -> bool | None:
        return None if self.atol is None else all(a.matches for a in self.answers)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s, "verified": self.verified,
                "answers_per_s": len(self.answers) / self.total_s}


def verify_answers(lm, job: AskJob, first_logits: list[torch.Tensor], result: AskResult, dtype: torch.dtype) -> None:
    """Each question's standalone prompt, context + question, prefilled and decoded on its own in this process,
    against the answer's tokens and first-token logits."""
    atols = []
    for question, logits, row in zip(job.questions, first_logits, result.answers):
        check = check_alone(lm, job.context_ids + question, row.tokens, logits, dtype, job.max_new_tokens)
        row.first_logit_diff, row.matches = check.first_logit_diff, check.matches
        row.reference_text = check.reference_text
        atols.append(check.atol)
    result.atol = max(atols)
