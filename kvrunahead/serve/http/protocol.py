"""The OpenAI request and response shapes of /v1/completions and /v1/chat/completions, as pydantic models.

Requests are strict: a parameter this server does not know is refused by name (``extra="forbid"``), never
ignored, and a value of the wrong type is refused rather than coerced (``"max_tokens": "16"`` is an error, as it
is at OpenAI). Parameters the server knows but does not implement (``best_of``, ``suffix``) are accepted
only at their neutral value, so a client that spells out the defaults still works; any other value is refused
by name. The official ``openai`` client sends only what its caller passes.

Every response, and the last chunk of a stream, carries the request's own figures in the extension field
``kvrunahead`` (TTFT, the degree and partition chosen and why, per-rank compute and wait).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Known parameters that are accepted only at these values (the API's defaults, which change nothing).
_NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a batch, packed into one prefill)
MAX_N = 16  # choices per prompt
# Stop strings, matched on the engine's thread at every token: bounded, so that no request slows the others' steps
# (OpenAI takes 4, TGI 4 by default, vLLM any number)
MAX_STOPS = 32
MAX_STOP_CHARS = 256
MAX_ID_DIGITS = 10  # a token id as a logit_bias key: a vocabulary of up to 10**10 tokens


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False  # a last chunk of no choices carrying the usage (OpenAI)
    continuous_usage_stats: bool = False  # the usage so far on every chunk (vLLM)


class _Request(BaseModel):
    """What both endpoints share: the model, the sampling parameters, streaming."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)  # vLLM's range: a torch long
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label: recorded nowhere, changes nothing
    n: int | None = Field(default=None, ge=1, le=MAX_N)  # choices per prompt: one prefill, n decodes after it
    # vLLM's sampling parameters (serve/sampling.py)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: every token
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    ttft_target_s: float | None = Field(default=None, gt=0.0)  # the TTFT this request asks for (--schedule lars)
    ignore_eos: bool = False  # vLLM's: generate past the end-of-sequence token, up to max_tokens
    skip_special_tokens: bool = True  # vLLM's: the special tokens left out of the output text

    DEFAULT_TEMPERATURE: ClassVar[float] = 1.0  # OpenAI's (and vLLM's) default: sampling unless asked otherwise

    @field_validator("best_of", "suffix", check_fields=False)
    @classmethod
    def _neutral_only(cls, value: Any, info) -> Any:
        if value not in _NEUTRAL[info.field_name]:
            allowed = " or ".join(repr(v) for v in _NEUTRAL[info.field_name] if v is not None)
            raise ValueError(f"{value!r} is not supported by this server (only {allowed})")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= MAX_ID_DIGITS):
                raise ValueError(f"a logit_bias key is a token id (ASCII digits, at most {MAX_ID_DIGITS}), got "
                                 f"{token[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"a logit_bias value is between -100 and 100, got {bias} for token {token}")
        return value

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters, got {max(map(len, stops))}")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def sampling_temperature(self) -> float:
        return self.DEFAULT_TEMPERATURE if self.temperature is None else self.temperature


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    best_of: int | None = None
    echo: bool = False  # the prompt's text before the completion's
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # per token: its own and this many others'
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
            if any(len(one) == 0 for one in value):
                raise ValueError("a prompt of the list is empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt (a string or token ids) per choice."""
        if isinstance(self.prompt, str) or not isinstance(self.prompt[0], (str, list)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name; wins when both are given
    logprobs: bool = False  # each output token's log-probability
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # and this many alternatives' (logprobs)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses ---------------------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RankFigures(BaseModel):
    rank: int
    compute_s: float
    wait_s: float
    bytes_sent: int


class Partition(BaseModel):
    boundaries: list[int]
    source: str


class ChunkFigures(BaseModel):
    """One chunk of a chunked prefill: its positions, its cuts over the ranks, its time and the cost model's, and
    the factor by which the chunks measured before it corrected the model's predictions when it was sized."""

    start: int
    end: int
    cuts: list[int]
    seconds: float
    predicted_s: float
    correction: float = 1.0
    budget_s: float


class KvrFigures(BaseModel):
    """The extension field: how this request was prefilled."""

    ttft_s: float
    queue_s: float
    degree: int
    degree_source: str
    layout_basis: str = "prior"  # what chose the degree: fixed, forced, prior, exploring or learned
    partition: Partition
    ranks: list[RankFigures]
    packed_with: int = 1  # prompts prefilled in one packed sequence with this one (itself included)
    cached_tokens: int = 0  # the prompt's first tokens found in the prefix cache (only the rest was prefilled)
    decode: str = "gathered"  # or kvp: the cache left on the ranks that made it, attention merged per layer
    chunks: list[ChunkFigures] = Field(default_factory=list)  # a chunked prefill's chunks, in order
    retried: int = 0  # the times it ran again from its prompt after a worker rank was lost


class CompletionLogprobs(BaseModel):
    """/v1/completions' log-probabilities (OpenAI's legacy shape): per token its text, its log-probability, the
    likeliest tokens' (the token itself among them) and where its text starts in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class Reply(BaseModel):
    """What every response body of this server opens with: its id, when it was made, the model that made it."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvrunahead: KvrFigures | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage | None = None
    kvrunahead: KvrFigures | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kvrunahead: KvrFigures | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvrunahead"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages through the model's chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS for a prompt (the chat template writes its own)
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


# --- errors ------------------------------------------------------------------------------------------------------

def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _param(loc: tuple) -> str | None:
    loc = tuple(x for x in loc if x != "body")
    # pydantic names the union member that failed (``stop.str``, ``prompt.list[int]``); the client named a field
    parts = [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool")))]
    return ".".join(parts) or None


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """One message naming the offending parameter (and the parameter's name) from pydantic's errors; the first
    error of each parameter only (a union reports one per member)."""
    seen: dict[str | None, str] = {}
    for e in errors:
        param = _param(tuple(e.get("loc", ())))
        if param in seen:
            continue
        kind = e.get("type", "")
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        if kind == "json_invalid":
            seen[param] = f"malformed JSON body: {e.get('ctx', {}).get('error', msg)}"
        elif kind == "extra_forbidden":
            seen[param] = f"unknown parameter '{param}': not supported by this server"
        elif kind == "missing":
            seen[param] = f"'{param}' is required"
        elif param is None:
            seen[param] = f"the request body must be a JSON object ({msg})"
        else:
            seen[param] = f"'{param}': {msg}"
    first = next(iter(seen), None)
    return "; ".join(seen.values()) or "invalid request", first
