"""A request's input in the engine's terms: its prompt as token ids (raw, or through the chat template) and its
sampling parameters, checked against the model's positions; anything wrong is an ``ApiError`` naming the field."""

from __future__ import annotations

from kvrunahead.prompt import PromptError, build_prompt
from kvrunahead.serve.http import protocol as p
from kvrunahead.serve.sequence import SamplingParams


class ApiError(Exception):
    """A request refused before it produced anything: the status, OpenAI's error body and its metrics outcome."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, outcome: str = "invalid") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers, self.outcome = headers, outcome


def token_ids(tokenizer, prompt: str | list[int], param: str = "prompt") -> list[int]:
    if isinstance(prompt, list):
        vocab = getattr(tokenizer, "VOCAB_SIZE", None) or len(tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param=param)
        return list(prompt)
    try:
        return build_prompt(tokenizer, None, prompt, chat=False)
    except PromptError as e:
        raise ApiError(400, str(e), param="prompt") from None


def plain_ids(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's tokens as vLLM's /tokenize gives them: as /v1/completions tokenises it, or without the special
    tokens (BOS) where asked."""
    if add_special_tokens:
        return token_ids(tokenizer, prompt)
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def chat_ids(tokenizer, messages: list[p.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    rendered = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    # the template writes the special tokens (BOS) itself
    return tokenizer.encode(rendered, add_special_tokens=False)


def sampling(req: p.CompletionRequest | p.ChatCompletionRequest, n_prompt: int, max_tokens: int | None,
              max_model_len: int) -> SamplingParams:
    """The engine's parameters (vLLM's: penalties, top-k, min-p, min_tokens, stop_token_ids, logit_bias,
    ignore_eos); the prompt and the tokens asked for must fit the model's positions."""
    if n_prompt == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if n_prompt >= max_model_len:
        raise ApiError(400, f"the prompt is {n_prompt} tokens; this model takes at most {max_model_len} "
                       "(prompt and output together)", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_model_len - n_prompt
    elif n_prompt + max_tokens > max_model_len:
        raise ApiError(400, f"this model takes at most {max_model_len} tokens, but {n_prompt + max_tokens} were "
                       f"asked for ({n_prompt} in the prompt, max_tokens {max_tokens})", param="max_tokens",
                       code="context_length_exceeded")
    if req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                       param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=req.sampling_temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, stop=req.stop_list, seed=req.seed,
                          ignore_eos=req.ignore_eos, top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0,
                          presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                          repetition_penalty=req.repetition_penalty or 1.0, min_tokens=req.min_tokens,
                          stop_token_ids=list(req.stop_token_ids or []),
                          logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
                          logprobs=_logprobs(req), prompt_logprobs=_prompt_logprobs(req),
                          skip_special_tokens=req.skip_special_tokens)


def _prompt_logprobs(req) -> int | None:
    """/v1/completions' ``echo`` with ``logprobs``: the prompt's tokens listed with their log-probabilities too (what
    lm-eval's loglikelihood tasks read)."""
    return req.logprobs if isinstance(req, p.CompletionRequest) and req.echo else None


def _logprobs(req) -> int | None:
    """How many alternatives each token's log-probabilities list (None: none asked for): /v1/completions' integer
    ``logprobs``, or /v1/chat/completions' ``logprobs: true`` with its ``top_logprobs``."""
    if isinstance(req, p.CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def check_token_ids(tokenizer, req) -> None:
    """``stop_token_ids`` and ``logit_bias``'s keys must be tokens of the vocabulary."""
    vocab = getattr(tokenizer, "VOCAB_SIZE", None) or len(tokenizer)
    for param, ids in (("stop_token_ids", req.stop_token_ids or []), ("logit_bias", req.logit_bias or {})):
        ids = list(map(int, ids))
        if ids and 0 <= min(ids) and max(ids) < vocab:
            continue
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param=param)
