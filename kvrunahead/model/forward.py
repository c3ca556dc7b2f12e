"""One rank's forward on a transformers model: the last token's logits, a part without its LM head, greedy
decode from a filled cache."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache

from kvrunahead.model.growing import grow_in_place


@functools.cache
def _keywords(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def forward_takes(module: torch.nn.Module, keyword: str) -> bool:
    """Whether ``module``'s forward takes ``keyword`` (read once per class: decode asks on every token)."""
    return keyword in _keywords(type(module))


def with_cache(module: torch.nn.Module, cache) -> dict:
    """``module``'s forward keyword for the KV cache, under the name its transformers version takes: 5.2x renamed
    ``past_key_values`` to ``cache``, and the old name warns until it is removed."""
    return {"cache" if forward_takes(module, "cache") else "past_key_values": cache}


@torch.no_grad()
def last_token_logits(model: torch.nn.Module, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
    """Run the causal-LM head on the last position only, filling ``cache``; returns ``[vocab]`` logits."""
    if cache is not None:
        kwargs.update(with_cache(model, cache))
    if forward_takes(model, "logits_to_keep"):
        out = model(input_ids=input_ids, logits_to_keep=1, use_cache=True, **kwargs)
    else:
        out = model(input_ids=input_ids, use_cache=True, **kwargs)
    return out.logits[0, -1]


@torch.no_grad()
def forward_part(model: torch.nn.Module, input_ids: torch.Tensor, emit: bool, cache=None,
                 **kwargs) -> torch.Tensor | None:
    """This rank's forward: the last token's logits when it emits the first token, else no LM head at all."""
    if emit:
        return last_token_logits(model, input_ids, cache, **kwargs)
    fill_cache(model, input_ids, cache, **kwargs)
    return None


@torch.no_grad()
def fill_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache, **kwargs) -> None:
    """The decoder layers alone (no LM head), appending the K,V of ``input_ids`` to ``cache``."""
    model.base_model(input_ids=input_ids, use_cache=True, **with_cache(model.base_model, cache), **kwargs)


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    first_token: int,
    cache: DynamicCache,
    position: int,
    max_new_tokens: int,
    eos_token_ids: set[int],
) -> list[int]:
    """Greedy extension phase from a filled cache; ``position`` is the first token's position. The cache's full
    layers grow in place from here on (``grow_in_place``)."""
    tokens = [first_token]
    device = next(model.parameters()).device
    grow_in_place(cache)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids:
        ids = torch.tensor([[tokens[-1]]], device=device)
        pos = torch.tensor([[position + len(tokens) - 1]], device=device)
        logits = last_token_logits(model, ids, position_ids=pos, cache=cache)
        tokens.append(int(logits.argmax()))
    return tokens
