"""Choosing a token from the logits, as vLLM does: the logits adjusted first (``logit_bias``, the repetition,
frequency and presence penalties, the end-of-sequence tokens masked until ``min_tokens``), then greedy at
temperature 0, else temperature, top-k, min-p and nucleus (top-p) sampling from a per-request generator, so that
the same seed gives the same text. With every parameter at its default the logits pass unchanged: greedy output
is the runner's."""

from __future__ import annotations

import torch

from kvrunahead.serve.sequence import SamplingParams, TokenLogprob


class Sampler:
    """One request's token choice; it remembers the tokens it chose (the penalties count them). Sampling runs on
    the CPU in float32 whatever the model's device and dtype, so a seed gives the same tokens on any device."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int] | None = None,
                 eos_token_ids: set[int] | None = None) -> None:
        self.params = params
        self.prompt_ids = list(prompt_ids or [])
        self.ends = set(eos_token_ids or ()) | set(params.stop_token_ids)  # what min_tokens holds back
        self.output: list[int] = []
        self.last: TokenLogprob | None = None  # the last token's log-probabilities, where the request asks for them
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def retake(self, token: int) -> int:
        """Take ``token`` as if chosen (a request running again after a worker's loss, its stream's tokens fed
        back): the penalties count it, no log-probabilities are reported."""
        self.last = None
        self.output.append(token)
        return token

    def __call__(self, logits: torch.Tensor) -> int:
        token = self.choose(logits)
        if self.params.logprobs is not None:
            self.last = logprobs_of(logits, token, self.params.logprobs)
        self.output.append(token)
        return token

    def choose(self, logits: torch.Tensor) -> int:
        params = self.params
        if params.adjusts_logits:
            logits = adjusted(logits.detach().float().cpu(), params, self.prompt_ids, self.output, self.ends)
        if params.temperature == 0:
            return int(logits.argmax())  # as the runner's greedy decode: the served text equals kvr-prefill's
        logits = logits.detach().float().cpu() / params.temperature
        if params.top_k > 0:
            logits = top_k(logits, params.top_k)
        probs = torch.softmax(logits, dim=-1)
        if params.min_p > 0:
            probs = min_p(probs, params.min_p)
        if params.top_p < 1:
            probs = nucleus(probs, params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under the raw ``logits`` (float32 log-softmax) and the ``top`` likeliest tokens'."""
    logprobs = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    best = logprobs.topk(top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)


def adjusted(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output: list[int],
             ends: set[int]) -> torch.Tensor:
    """The logits with vLLM's adjustments, in its order: the bias, the repetition penalty over the prompt's and
    the output's tokens (a positive logit divided by it, a negative one multiplied), the frequency and presence
    penalties over the output's, and the end tokens masked while fewer than ``min_tokens`` were chosen."""
    logits = logits.clone()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output)), dtype=torch.long, device=logits.device)
        if seen.numel():
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=logits.device),
                                minlength=logits.numel()).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if len(output) < params.min_tokens and ends:
        logits[torch.tensor(sorted(ends), dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Only the ``k`` largest logits keep their value (ties at the k-th kept too); the rest can never be drawn."""
    if k >= logits.numel():
        return logits
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the tokens at least ``p`` times as likely as the most likely one, renormalised."""
    kept = probs.masked_fill(probs < p * probs.max(), 0.0)
    return kept / kept.sum()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose mass reaches ``top_p`` (Holtzman et al., 2020), renormalised; the most
    likely token is always kept."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the tokens more likely than this one
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
