"""One request's state, its sampling parameters and the events the engine emits for it (torch-free).

Like nano-vllm's ``sequence.py``: what a request asked for and how far it got, nothing about how a step runs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


class QueueFull(RuntimeError):
    """More requests wait than ``max_queue``: refused at once (HTTP 429), never left waiting unbounded."""


class EngineDead(RuntimeError):
    """The engine takes no more requests: a rank died, the loop failed, or the server is draining."""


class WorkersDown(EngineDead):
    """A worker rank was lost and has not come back within the front's patience: no new prompt is taken until it
    has (HTTP 503 with Retry-After)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy (argmax), the setting under which served output equals kvr-prefill's
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # an end-of-sequence token does not end the request (vLLM's ignore_eos)
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    min_p: float = 0.0  # drop the tokens less likely than this share of the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds it
    repetition_penalty: float = 1.0  # divides a positive logit (multiplies a negative) of any token seen so far
    min_tokens: int = 0  # the end tokens are held back until this many were chosen
    stop_token_ids: list[int] = field(default_factory=list)  # more tokens that end the request, as EOS does
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # each chosen token's log-probability and this many alternatives'; None: none
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's prompt_logprobs)
    skip_special_tokens: bool = True  # the special tokens left out of the text (vLLM's default)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.min_tokens)

    def check(self) -> None:
        """Raise ValueError naming the bad field (the HTTP layer turns it into a 400)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        if self.seed is not None and not -(2 ** 63) <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be between -2**63 and 2**63-1 (a torch long, as vLLM takes), got {self.seed}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = field(default_factory=time.monotonic)  # time.monotonic(): TTFT and queue time count from here
    ttft_target_s: float | None = None  # the TTFT this request asks for (LARS's deadline); None: the default by length
    # A shared context's questions (IPPD, /v1/ask): each continues ``prompt_ids`` and is answered greedily, as if
    # alone, up to ``params.max_tokens``; the request decodes them as rows and ends with one Answered
    questions: list[list[int]] = field(default_factory=list)


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


@dataclass
class RequestFigures:
    """What a response reports of its prefill: TTFT, the degree and partition chosen and why, per-rank figures."""

    ttft_s: float  # from arrival to the first token chosen
    queue_s: float  # from arrival to the start of its prefill
    degree: int
    boundaries: list[int]
    partition_source: str
    degree_source: str
    ranks: list[dict] = field(default_factory=list)  # {rank, compute_s, wait_s, bytes_sent}
    packed_with: int = 1  # prompts prefilled in the same packed sequence, this one included
    cached_tokens: int = 0  # the prompt's first tokens taken from the prefix cache, not prefilled
    decode: str = "gathered"  # or kvp: the cache left on the ranks that made it, attention merged per layer
    chunks: list[dict] = field(default_factory=list)  # a chunked prefill's chunks: start, end, ranks, seconds
    layout_basis: str = "prior"  # what chose the degree: fixed, forced, prior, exploring or learned
    retried: int = 0  # the times it ran again from its prompt after a worker rank was lost (serve/recovery.py)


MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (vLLM's default max_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (its raw logits' log-softmax, as vLLM reports it: before
    temperature, penalties or truncation) and the ``top`` most likely tokens' (id, log-probability), likeliest
    first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class TokenEvent:
    request_id: str
    token_id: int
    text: str  # the new text since the last event, stop strings already cut
    logprob: TokenLogprob | None = None  # where the request asked for log-probabilities
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first event: the prompt's tokens after the first


@dataclass
class Finished:
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    figures: RequestFigures | None = None
    error: str | None = None
    bad_input: bool = False  # the error is the request's own (an HTTP 400), not the engine's


@dataclass
class Answers:
    """A request's questions decoding: each question's tokens so far (its first from the questions' packed
    prefill) and the times its figures need."""

    tokens: list[list[int]]
    start_s: float  # when its context's prefill began
    context_s: float
    questions_s: float
    first_s: float  # when every question had its first token
    degree: int
    boundaries: list[int]


@dataclass
class AskFigures:
    queue_s: float
    context_s: float  # the context's prefill (over the chain at degree > 1)
    questions_s: float  # the questions' packed prefill, up to every first token
    decode_s: float
    degree: int
    boundaries: list[int]


@dataclass
class Answered:
    request_id: str
    answers: list[list[int]]  # each question's tokens, its EOS included where it ended so
    figures: AskFigures | None = None
    error: str | None = None  # "cancelled" when it was cancelled before it ran
    bad_input: bool = False

    @property
    def finish_reason(self) -> FinishReason:
        return "stop" if self.error is None else "cancelled" if self.error == "cancelled" else "error"


Event = TokenEvent | Finished | Answered


class StopText:
    """The text a request has shown so far, cut at the first stop string.

    Text that could still turn into a stop string (a suffix that is a prefix of one) or a partial UTF-8 character
    (the decoder's U+FFFD) is held back until the next token decides it, so no client ever sees part of a stop
    string. The work per token is bounded by the stops, not by the text: a stop is looked for only where it could
    end in text not yet shown, and the held-back suffix is found from the stops' positions of its last character.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.longest = max(map(len, self.stop), default=0)
        # per stop, each character's places in it as the lengths of the prefixes ending there (longest first), its
        # whole length left out: the prefixes a text ending in that character may hold back
        self.prefixes: list[dict[str, list[int]]] = []
        for s in self.stop:
            ends: dict[str, list[int]] = {}
            for k in range(len(s) - 1, 0, -1):
                ends.setdefault(s[k - 1], []).append(k)
            self.prefixes.append(ends)
        self.shown = 0  # characters of the decoded text already emitted

    def advance(self, text: str) -> tuple[str, bool]:
        """Given the whole decoded output so far, the new text to show and whether a stop string ended it."""
        start = max(0, self.shown - self.longest - PARTIAL_CHARS)  # what was shown held no stop; a late U+FFFD
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            delta, self.shown = text[self.shown:cut], max(self.shown, cut)
            return delta, True
        safe = len(text) - self._held(text)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        delta = text[self.shown:safe] if safe > self.shown else ""
        self.shown = max(self.shown, safe)
        return delta, False

    def _held(self, text: str) -> int:
        """The longest suffix of ``text`` that begins a stop string (0: none)."""
        if not text:
            return 0
        held = 0
        for s, ends in zip(self.stop, self.prefixes):
            for k in ends.get(text[-1], ()):
                if k <= held:
                    break
                if k <= len(text) and text.endswith(s[:k]):
                    held = k
                    break
        return held

    def flush(self, text: str) -> str:
        """The held-back text when the request ends for another reason (length, EOS)."""
        delta = text[self.shown:]
        self.shown = len(text)
        return delta


PARTIAL_CHARS = 4  # the characters a partial UTF-8 character may decode to before it is whole


@dataclass
class Sequence:
    """A request in the engine: its tokens so far, what it has shown, and where it stands."""

    request: Request
    output_ids: list[int] = field(default_factory=list)
    text: StopText | None = None
    status: Literal["waiting", "running", "finished"] = "waiting"
    figures: RequestFigures | None = None
    prefill_start_s: float | None = None
    rope: object = None  # the RoPE extension its prompt's length needs (a model.rope.RopeExtension), or None
    prefilled: int = 0  # prompt tokens whose K,V the front holds already (the chunks of a chunked prefill so far)
    chunked: bool = False  # its prompt prefills in chunks (serve/chunking.py), one per step
    passed_over: int = 0  # prefill steps in a row that went to another request (the scheduler's starvation bound)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far, where the request asks
    answers: Answers | None = None  # a request carrying questions, once its context and questions are prefilled
    retried: int = 0  # the times it ran again from its prompt after a worker rank was lost
    replay: list[int] = field(default_factory=list)  # its stream's tokens sent before that, to be taken back
    replaying: bool = False  # the token being taken is one of them (taken silently)

    def __post_init__(self) -> None:
        self.text = StopText(self.request.params.stop)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens its prefill runs: its prompt and, running again (preempted, or after a worker's loss), the
        tokens its stream sent already, recomputed in the same prefill (vLLM's recompute preemption). A context's
        questions and a prompt scoring its log-probabilities run their prompt alone, and take those tokens back one a
        step."""
        return self.request.prompt_ids + self.replay if self.recomputes else self.request.prompt_ids

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + len(self.replay) if self.recomputes else self.prompt_len

    @property
    def recomputes(self) -> bool:
        """Whether its prefill covers the tokens its stream sent before it ran again (``prefill_ids``)."""
        return bool(self.replay) and not self.request.questions and self.request.params.prompt_logprobs is None

    @property
    def next_position(self) -> int:
        """The position of the last chosen token, fed at the next decode step."""
        return self.prompt_len + len(self.output_ids) - 1

    def recomputed(self) -> list[int]:
        """After a prefill over ``prefill_ids``: the tokens its stream had sent that the prefill covered, to be taken
        back silently (``replaying``), none left to feed back."""
        if not self.recomputes:
            return []
        sent, self.replay, self.replaying = self.replay, [], True
        return sent

    def next_token(self, sampler, logits) -> int:
        """The next token: ``sampler``'s choice from ``logits``, or, while the request runs again after a worker's
        loss, the next of the tokens its stream has sent (``replaying``: taken silently)."""
        self.replaying = bool(self.replay)
        return sampler.retake(self.replay.pop(0)) if self.replaying else sampler(logits)

    def take(self, token: int, ends: bool, decode) -> tuple[str, FinishReason | None]:
        """Take the chosen ``token`` (``ends``: an end token, which ends the text and is not part of it); the new
        text to show, and why the request ends if it does (an end token, a stop string, max_tokens)."""
        self.output_ids.append(token)
        text = decode(self.output_ids[:-1] if ends else self.output_ids)
        delta, stopped = self.text.advance(text)
        done = len(self.output_ids) >= self.request.params.max_tokens
        reason = "stop" if ends or stopped else "length" if done else None
        if reason is not None and not stopped:
            delta += self.text.flush(text)
        return delta, reason

    def finished(self, reason: FinishReason, error: str | None = None, bad_input: bool = False) -> Finished:
        self.status = "finished"
        if self.figures is not None:
            self.figures.retried = self.retried
        return Finished(self.request_id, reason, self.prompt_len, len(self.output_ids), self.figures, error,
                        bad_input)
