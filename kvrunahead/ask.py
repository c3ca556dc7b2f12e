"""``kvr-ask``'s job: a shared context prefilled once (over the KV chain when there are several ranks), then many
questions answered after it on the last rank (kvrunahead/questions.py), each checked on request against its
standalone prompt."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import prepare
from kvrunahead.launcher import World
from kvrunahead.model.load import resolve_config
from kvrunahead.model.rope import plan_extension
from kvrunahead.modes import MODES, Step
from kvrunahead.questions import answer, context_prefixes, require_full_attention
from kvrunahead.rank_setup import set_up_rank
from kvrunahead.runner import check_alone, timed_prefill


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


def ask_on_world(cfg: RunConfig, world: World, job: AskJob, verify: bool = False) -> AskResult | None:
    """The job on ranks that have joined: the last rank returns the result, the others None."""
    config = resolve_config(cfg.model)
    require_full_attention(config)
    prepared = prepare(dataclasses.replace(cfg, context_len=len(job.context_ids), prompt_text=None),
                       world.world_size, world.local_world_size)  # the partition and attention for this length
    total = len(job.context_ids) + max(len(q) for q in job.questions) + job.max_new_tokens
    rope = plan_extension(config, total, cfg.allow_long_context, cfg.model)
    rs = set_up_rank(cfg, world, rope)
    device, dtype, lm = rs.device, rs.dtype, rs.lm
    rank, p = world.rank, world.world_size
    if p == 1:
        t0 = time.perf_counter()
        prefixes = context_prefixes(lm.model, job.context_ids)
        context_s = time.perf_counter() - t0
    else:
        mode = MODES["kvr"]
        transport = rs.transport
        ranges = mode.token_ranges(prepared.partition)
        mine = torch.tensor([[t for a, e in ranges[rank] for t in job.context_ids[a:e]]], device=device)
        step = Step(lm.model, mine, job.context_ids, ranges, transport, rs.layout,
                    len(job.context_ids), prepared.kvr_attention)
        _, cache, _, context_s = timed_prefill(mode, step, mode.setup(step), device, rank == p - 1)
        if rank != p - 1:
            return None
        prefixes = [torch.stack((layer.keys, layer.values)) for layer in cache.layers]
    t0 = time.perf_counter()
    first: list[float] = []
    answers = answer(lm.model, prefixes, job.questions, job.max_new_tokens, lm.eos_token_ids,
                     on_first_tokens=lambda: first.append(time.perf_counter()))
    questions_s, decode_s = first[0] - t0, time.perf_counter() - first[0]
    result = AskResult(cfg.model, p, len(job.context_ids), list(prepared.partition.boundaries), context_s,
                       questions_s, decode_s, max(len(a.tokens) for a in answers) - 1)
    for text, got in zip(job.question_texts, answers):
        result.answers.append(QuestionResult(text, got.tokens, lm.decode(got.tokens)))
    if verify:
        _verify(lm, job, answers, result, dtype)
    return result


def _verify(lm, job: AskJob, answers, result: AskResult, dtype: torch.dtype) -> None:
    """Each question's standalone prompt, context + question, prefilled and decoded on its own."""
    atols = []
    for question, got, row in zip(job.questions, answers, result.answers):
        check = check_alone(lm, job.context_ids + question, got.tokens, got.first_logits, dtype, job.max_new_tokens)
        row.first_logit_diff, row.matches = check.first_logit_diff, check.matches
        row.reference_text = check.reference_text
        atols.append(check.atol)
    result.atol = max(atols)
