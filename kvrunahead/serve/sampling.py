"""Choosing a token from the logits, as vLLM does: the logits adjusted first (``logit_bias``, the repetition,
frequency and presence penalties, the end-of-sequence tokens masked until ``min_tokens``), then greedy at
temperature 0, else temperature, top-k, min-p and nucleus (top-p) sampling from a per-request generator, so that
the same seed gives the same text. With every parameter at its default the logits pass unchanged: greedy output
is the runner's."""

from __future__ import annotations

import torch

from kvrunahead.serve.sequence import SamplingParams, TokenLogprob

SAMPLING_EPS = 1e-5  # vLLM's: below it a temperature means greedy


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
        self.adjust = Adjustments(params, self.prompt_ids, self.ends) if params.adjusts_logits else None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def retake(self, token: int) -> int:
        """Take ``token`` as if chosen (a request running again after a worker's loss, its stream's tokens fed
        back): the penalties count it, no log-probabilities are reported."""
        self.last = None
        self._took(token)
        return token

    def __call__(self, logits: torch.Tensor) -> int:
        token = self.choose(logits)
        if self.params.logprobs is not None:
            self.last = logprobs_of(logits, token, self.params.logprobs)
        self._took(token)
        return token

    def _took(self, token: int) -> None:
        self.output.append(token)
        if self.adjust is not None:
            self.adjust.took(token)

    def choose(self, logits: torch.Tensor) -> int:
        params = self.params
        if self.adjust is not None:
            logits = self.adjust(logits.detach().float().cpu())
        if params.temperature < SAMPLING_EPS:  # as vLLM: a temperature this small is greedy (1e-320 divides to inf)
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
    adjust = Adjustments(params, prompt_ids, ends)
    for token in output:
        adjust.took(token)
    return adjust(logits)


class Adjustments:
    """One request's logit adjustments, each one tensor operation per token whatever its size: the bias as an
    index-add, the tokens seen (prompt and output) as a mask and the output's counts as a vector, both kept as
    tokens are chosen rather than rebuilt from the token lists at every step."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], ends: set[int]) -> None:
        self.params, self.prompt_ids = params, prompt_ids
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self.bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.ends = torch.tensor(sorted(ends), dtype=torch.long)
        self.output: list[int] = []  # chosen before the vocabulary's size was known (the first logits)
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def took(self, token: int) -> None:
        if self.counts is None:
            self.output.append(token)
        else:
            self.counts[token] += 1
            self.seen[token] = True

    def _start(self, vocab: int) -> None:
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.seen[torch.tensor(self.prompt_ids, dtype=torch.long)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        for token in self.output:
            self.took(token)
        self.output = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        params = self.params
        if self.counts is None:
            self._start(logits.numel())
        logits = logits.clone()
        if self.bias_ids.numel():
            logits.index_add_(0, self.bias_ids, self.bias)
        if params.repetition_penalty != 1.0:
            penalised = torch.where(logits > 0, logits / params.repetition_penalty,
                                    logits * params.repetition_penalty)
            logits = torch.where(self.seen, penalised, logits)
        if params.frequency_penalty or params.presence_penalty:
            logits -= params.frequency_penalty * self.counts + params.presence_penalty * (self.counts > 0).float()
        if self.ends.numel() and int(self.counts.sum()) < params.min_tokens:
            logits[self.ends] = float("-inf")
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
