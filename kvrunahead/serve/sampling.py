"""Choosing a token from the logits: greedy at temperature 0, else temperature and nucleus (top-p) sampling
from a per-request generator, so that the same seed gives the same text."""

from __future__ import annotations

import torch

from kvrunahead.serve.sequence import SamplingParams


class Sampler:
    """One request's token choice. Sampling runs on the CPU in float32 whatever the model's device and dtype,
    so a seed gives the same tokens on any device."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.temperature == 0:
            return int(logits.argmax())  # as the runner's greedy decode: the served text equals kvr-prefill's
        probs = torch.softmax(logits.detach().float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            probs = nucleus(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose mass reaches ``top_p`` (Holtzman et al., 2020), renormalised; the most
    likely token is always kept."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the tokens more likely than this one
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
