"""The one-process reference a parallel run is checked against: the same prompt prefilled and greedily decoded
in one process, and the tolerance its first-token logits are held to."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrunahead.model.compiled import eager
from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.model.load import LoadedModel

ATOL_ULPS = 32  # logits may differ by this many roundings at the scale of the largest logit


def default_atol(dtype: torch.dtype, reference_logits: torch.Tensor) -> float:
    """The logit tolerance of a run in ``dtype``: 32 units of its rounding (eps) at the scale of the largest
    reference logit. A chain or gather changes only the order of sums (and, in half precision, where they are
    rounded), so its logits differ from one full forward by a few roundings: on SmolLM2 at 2k over 2 ranks 2.7 in
    bfloat16, 1.8 in float16 and 8.1 in float32 (where many more sums differ before one rounding shows)."""
    scale = max(1.0, float(reference_logits.float().abs().max()))
    return ATOL_ULPS * torch.finfo(dtype).eps * scale


@dataclass
class AloneCheck:
    """One prompt's tokens and first-token logits from a chained, packed or shared-context run, against the same
    prompt prefilled and greedily decoded alone in one process."""

    first_logit_diff: float
    atol: float
    matches: bool  # the greedy tokens equal and the first-token logits within ``atol``
    reference_text: str | None  # what the prompt alone gives, where the tokens differ


@torch.no_grad()
@eager()  # the reference is the eager model, compiled or not
def check_alone(lm: LoadedModel, ids: list[int], tokens: list[int], first_logits: torch.Tensor, dtype: torch.dtype,
                max_new_tokens: int) -> AloneCheck:
    device = next(lm.model.parameters()).device
    cache = DynamicCache(config=lm.model.config)
    logits = last_token_logits(lm.model, torch.tensor([ids], device=device), cache=cache)
    reference = greedy_decode(lm.model, int(logits.argmax()), cache, len(ids), max_new_tokens, lm.eos_token_ids)
    atol = default_atol(dtype, logits)
    diff = float((logits.float().cpu() - first_logits).abs().max())
    return AloneCheck(diff, atol, reference == tokens and diff <= atol,
                      None if reference == tokens else lm.decode(reference))


@torch.no_grad()
@eager()
def where_parted(model: torch.nn.Module, ids: list[int], reference: list[int], tokens: list[int]) -> tuple[int, float]:
    """The first step where two greedy continuations of ``ids`` differ, and the gap between the two tokens'
    logits there, from one reference forward over the prompt and the tokens both chose before it."""
    pairs = list(zip(reference, tokens))
    step = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    if step == len(pairs):  # one ended (an end token) where the other went on
        return step, float("inf")
    device = next(model.parameters()).device
    logits = last_token_logits(model, torch.tensor([ids + reference[:step]], device=device),
                               cache=DynamicCache(config=model.config)).float()
    return step, float((logits[reference[step]] - logits[tokens[step]]).abs())
